"""Crash recovery: after an unclean stop, memsnapd reconciles the catalog with the tier and with the processes.

A dump cut short is rolled back (FAILED, its staging removed, a tree it left stopped resumed); a --stop whose
image was published is finished (the job ends); a move in flight is handed to the move code (MoveRecovery); a
tier copy lost with the machine's memory leaves only its stored copy (or FAILED, when there was none); CUDA
state and quiesce hooks left half-way are brought back. Engine.recover calls recover() once, at start.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from memsnap import lifecycle, proc
from memsnap.caller import ROOT, Caller
from memsnap.catalog import DRAINING, DUMPING, FAILED, RESTORABLE, STAGED, Catalog, CheckpointRecord
from memsnap.collaborators import GpuAdapter
from memsnap.errors import MemsnapError
from memsnap.quiesce.notifier import Quiescer
from memsnap.tiers import Tiers

log = logging.getLogger("memsnap.engine")


class MoveRecovery(Protocol):
    """What Engine.recover hands to the move code (memsnap.move.Mover) after a crash."""

    def in_doubt(self, rec: CheckpointRecord) -> None:
        """The source died while asking the target to keep the job: ask again (the copy stays stopped)."""

    def abandon(self, rec: CheckpointRecord) -> None:
        """Target: a move restored here that the source never committed (the source runs the job)."""

    def lazy_target_interrupted(self, rec: CheckpointRecord) -> None:
        """Target: the first half of a lazy move that was in flight."""


class RecoveryHost(Protocol):
    """What recovery uses of the engine (memsnap.engine.Engine)."""

    catalog: Catalog
    tier: Tiers
    work_root: Path
    gpu: GpuAdapter | None
    quiesce: Quiescer

    def end_held(self, pid: int, job_id: str = "", ckpt_id: str = "") -> None: ...

    def resume_held(self, pid: int, ckpt_id: str = "") -> None: ...

    def delete(self, caller: Caller, ckpt_id: str) -> None: ...

    def journal(self, rec: CheckpointRecord, key: str) -> Callable[[Any], None]: ...


def recover(host: RecoveryHost, moves: MoveRecovery | None = None) -> dict[str, int]:
    """Reconciles the catalog with the tier after a (possibly unclean) stop.

    Checkpoints with move marks (catalog.MoveMarks) go to moves (memsnap.move.Mover): a commit in doubt
    on the source, or a restored move the source never committed on the target. Without moves, held
    copies in doubt stay stopped and restored moves stay as they are.
    """
    fixed = {"failed_dumps": 0, "stray_staging": 0, "stray_tier": 0, "lost_tier": 0}
    for stale in host.work_root.glob("*.lazystore-*"):  # a lazy restore from the store ends with its daemon
        shutil.rmtree(stale, ignore_errors=True)
    in_doubt: set[str] = set()
    unasked: list[str] = []  # images of moves that did not happen (the job runs on here): they go, as in rollback

    def doubt(rec: CheckpointRecord) -> None:
        in_doubt.add(rec.id)  # the mover asks the target; the copy here stays stopped meanwhile
        if moves is not None:
            moves.in_doubt(rec)

    for rec in host.catalog.checkpoints(states=(DUMPING,)):
        # A dump was cut short: roll back. CRIU unfreezes on its own failure, but a --stop dump that
        # had finished left the tree stopped: never leave a job frozen.
        host.tier.discard_staging(rec.id)
        lifecycle.advance(host.catalog, rec.id, FAILED, last_error="daemon stopped during the dump")
        marks = rec.marks
        if (rec.meta.get("stop") or marks.hold) and \
                proc.alive(rec.pid, float(rec.meta.get("pid_start", 0.0))):
            if marks.moved_to:
                # A lazy move the target had confirmed complete: the job runs there now.
                host.end_held(rec.pid, rec.job, rec.id)
            elif marks.committing_to:
                doubt(rec)
            else:
                # A lazy dump's CRIU may still hold the tree for a moment after we died; SIGCONT
                # only helps once it let go.
                _wait_untraced(rec.pid, 30)
                proc.resume_stopped(rec.pid)
        fixed["failed_dumps"] += 1
    for rec in host.catalog.checkpoints(states=RESTORABLE):
        marks = rec.marks
        if marks.pages_remote:
            if moves is not None:
                moves.lazy_target_interrupted(rec)
            continue
        if marks.move_pending or marks.move_incoming:
            # Restored (or only received) here for a move that the source never committed: it runs the
            # job itself, and the image goes.
            if moves is not None:
                moves.abandon(rec)
            continue
        if marks.hold:
            # A move was in flight: the target confirmed it (moved_to) or the job runs on here.
            if proc.alive(rec.pid, float(rec.meta.get("pid_start", 0.0))):
                if marks.moved_to:
                    host.end_held(rec.pid, rec.job, rec.id)
                elif marks.committing_to:
                    # We died while telling the target to keep the job: whether it runs there is
                    # the target's to say.
                    doubt(rec)
                else:
                    host.resume_held(rec.pid, rec.id)
                    unasked.append(rec.id)
            continue
        # Published, but the daemon died before ending a --stop job: finish what was asked.
        if rec.meta.get("stop") and rec.in_tier and host.tier.has(rec.id) and \
                proc.alive(rec.pid, float(rec.meta.get("pid_start", 0.0))):
            proc.kill_tree(rec.pid)
            if rec.job:
                host.catalog.update_job(rec.job, ended=True)
    for rec in host.catalog.checkpoints():
        if isinstance(rec.meta.get("placeholder"), dict):
            # A restore into a container that never recorded its job, or a move's that was never committed: the
            # placeholder goes, and what CRIU had put in it (rolled back; the checkpoint stays restorable).
            from memsnap import containers

            containers.drop_journaled(host.catalog, rec.id)
            fixed["placeholders"] = fixed.get("placeholders", 0) + 1
    for ckpt_id in unasked:
        try:
            host.delete(ROOT, ckpt_id)
            fixed["moves_rolled_back"] = fixed.get("moves_rolled_back", 0) + 1
        except MemsnapError as exc:
            log.warning("could not drop %s, the image of a move that did not happen: %s", ckpt_id, exc)
    for ckpt_id in list(host.tier.staging_ids()):
        host.tier.discard_staging(ckpt_id)
        fixed["stray_staging"] += 1
    known = set(host.catalog.iter_ids())
    for ckpt_id in host.tier.published_ids():
        found = host.catalog.get_checkpoint(ckpt_id) if ckpt_id in known else None
        if found is None or not found.in_tier:
            host.tier.remove(ckpt_id)
            fixed["stray_tier"] += 1
    for rec in host.catalog.checkpoints():
        if rec.in_tier and not host.tier.has(rec.id):
            # The tier is memory: a reboot empties it. Only the stored copy remains, if any.
            host.catalog.update_checkpoint(rec.id, in_tier=False)
            if not rec.in_store and rec.state in (STAGED, DRAINING):
                lifecycle.advance(host.catalog, rec.id, FAILED,
                                  last_error="tier copy lost before it became durable")
            fixed["lost_tier"] += 1
    # CUDA state a killed daemon left locked or checkpointed (journaled before the GPU step): jobs that
    # run on by now (SIGCONT above) must get it back, or they hang in their next CUDA call forever.
    for rec in host.catalog.checkpoints():
        if rec.meta.get("gpu") and host.gpu is not None and rec.id not in in_doubt:
            log.warning("CUDA recovery for %s: %s", rec.id, host.gpu.recover(rec.meta["gpu"]))
            lifecycle.mark(host.catalog, rec.id, gpu=None)
        if rec.meta.get("quiesce") and rec.id not in in_doubt:  # (a job that was asked to quiesce: resume it)
            if proc.alive(rec.pid, float(rec.meta.get("pid_start", 0.0))):
                host.quiesce.resume(rec.pid, rec.id, restored=False)
            host.journal(rec, "quiesce")(None)
    for job in host.catalog.jobs():
        if not job.ended and not proc.alive(job.pid, job.pid_start):
            host.catalog.update_job(job.id, ended=True)
    return fixed


def _wait_untraced(pid: int, timeout: float) -> None:
    """Waits until no tracer (a CRIU that outlived us) holds pid, or timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return
        tracer = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("TracerPid:")), "0")
        if tracer == "0":
            return
        time.sleep(0.05)
