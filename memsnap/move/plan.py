"""A move's record and its protocol on the source: phases, rollback, commit, moves in doubt.

    source                                              target
    Move(pid, job) + Phases; dump with the tree held
    ... image crosses (stream / lazy / via store) ...
    restore on the target  ---------------------------> restored, journaled move_pending
    confirm it runs (target_job)
    journal committing_to, then commit  ---------------> CommitMove: move_pending cleared (idempotent)
    journal moved_to, end the held copy here
    any failure before the commit answered: rollback() resumes the job here and names the step

An unanswered commit leaves the move in doubt (Commitments): the held copy stays stopped while the
source asks again with backoff, for at most daemon.move_in_doubt_s. Both sides journal their marks
(catalog.MoveMarks) so that recovery after a crash settles the move the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

import grpc

from memsnap import containers, failpoints, lifecycle, net
from memsnap.backoff import Backoff, retrying
from memsnap.catalog import FAILED, Catalog, CheckpointRecord, JobRecord
from memsnap.client import ClientError
from memsnap.collaborators import GpuAdapter, Uploads
from memsnap.config import Config
from memsnap.criu import CriuApi, NotifyCallback
from memsnap.engine import ROOT, Caller, DumpExtras, RestoreResult
from memsnap.errors import MemsnapError
from memsnap.manifest import Manifest
from memsnap.move import network
from memsnap.move.peer import PeerClient
from memsnap.repository import Repository
from memsnap.tier import TierReservation
from memsnap.tiers import MEMORY, Tiers
from memsnap.v1 import memsnap_pb2 as pb

log = logging.getLogger("memsnap.move")

# How long a restored job must stay alive on the target before the source lets go of its copy.
CONFIRM_S = 0.2
# Codes that say the link broke, not that the target refused: what happened there must be asked.
TRANSPORT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
TARGET_JOB_RETRY_S = 1.0  # between the tries at asking the target for a job
IN_DOUBT_RETRY = Backoff(0.5, 1.5, 30.0)  # between the tries at an unanswered commit (cut to move_in_doubt_s)


class MoveHost(Protocol):
    """What moves need from the engine (memsnap.engine.Engine implements it); nothing private."""

    catalog: Catalog
    tier: Tiers
    criu: CriuApi
    drain: Uploads | None  # the upload scheduler (memsnap.drain)
    repo: Repository | None  # the store (memsnap.repository)
    gpu: GpuAdapter | None
    hostname: str
    key: bytes
    work_root: Path
    observe: Callable[[str, str, float], None]

    def resolve_pid(self, target: str, caller: Caller = ROOT) -> tuple[int, JobRecord | None]:
        """A pid, job id or name -> (live pid, job record)."""

    def checkpoint(self, caller: Caller, target: str, stop: bool = False, tcp_established: bool = False,
                   name: str = "", extras: DumpExtras | None = None) -> CheckpointRecord:
        """Dumps into the tier (extras: hold the tree, watch staging, answer CRIU's callbacks)."""

    def restore(self, caller: Caller, key: str, lazy: bool = False, gpu_map: dict[str, str] | None = None,
                tcp_established: bool = False, notify: NotifyCallback | None = None,
                restore_opts: dict[str, Any] | None = None, lazy_ps_socket: int = -1) -> RestoreResult:
        """Verifies and restores a checkpoint; a RestoreResult."""

    def restore_own_log(self, caller: Caller, key: str, moved: bool = False, **kw: Any) -> RestoreResult:
        """restore(), the restored job writing to a log of its own (moved: in this node's log dir, moved_from set)."""

    def delete(self, caller: Caller, ckpt_id: str) -> None:
        """Removes a checkpoint everywhere."""

    def end_held(self, pid: int, job_id: str = "", ckpt_id: str = "") -> None:
        """Kills a held tree (it runs elsewhere now)."""

    def resume_held(self, pid: int, ckpt_id: str = "") -> None:
        """SIGCONTs a held tree (the move did not happen)."""

    def reserve(self, nbytes: int, into: str = MEMORY) -> TierReservation:
        """Tier room (evicting durable copies if needed); release() it."""

    def exclusive(self, pid: int) -> AbstractContextManager[None]:
        """No other checkpoint of pid meanwhile."""

    def new_manifest(self, rec: CheckpointRecord, argv: list[str], own_ns: bool, job: JobRecord | None,
                     files: dict[str, dict[str, Any]], **fields: Any) -> Manifest:
        """The manifest of an image dumped here."""

    def extra_dump_opts(self) -> dict[str, Any]:
        """DumpOptions fields from the daemon's configuration."""

    def reap_lazy(self) -> None:
        """Forgets lazy-pages servers that are done."""

    def live_jobs_restored_from(self, ckpt_id: str) -> list[JobRecord]:
        """Running jobs restored here from ckpt_id."""

    def tier_copy_in_use(self, ckpt_id: str) -> bool:
        """Whether a restore still reads this checkpoint's tier copy."""


def move_error(code: str, message: str) -> MemsnapError:
    """A MemsnapError with any gRPC status name (e.g. the one the target answered with)."""
    exc = MemsnapError(message)
    exc.code = code
    return exc


@dataclass(frozen=True)
class MoveRequest:
    """What a caller asks of a move (the move code never sees the protobuf)."""

    target: str  # pid, job id or name on this node
    to: str  # a configured peer's name or HOST:PORT
    via_store: bool = False
    lazy: bool = False
    move_ip: str = ""  # ADDR/PREFIX that moves with the job
    tcp_established: bool = False
    move_ip_dev_source: str = ""
    move_ip_dev_target: str = ""
    to_token: str = ""  # root only: a credential for a target that is not a peer
    plain_restore: bool = False  # streamed moves: no early resume
    fail_on_in_flight: bool = False  # fail on a connection in a listener's accept queue (else left out)
    into: str = ""  # a container's move (target podman:NAME): the placeholder to start on the target


@dataclass
class MoveResult:
    """A finished move."""

    target_pid: int
    checkpoint_id: str
    phases: list[tuple[str, float]]  # (name, ms), in order
    downtime_ms: int  # the job's freeze here until it runs on the target
    bytes_sent: int
    target_job: str  # job id on the target


class Phases:
    """Named durations, in order."""

    def __init__(self) -> None:
        self.items: list[tuple[str, float]] = []
        self._t = time.monotonic()

    def mark(self, name: str, now: float = 0.0) -> float:
        """Ends phase `name` now (or at `now`); the next phase starts there."""
        now = now or time.monotonic()
        # A phase ended at a time taken on another thread (the last page can land before the resume is
        # heard) would be negative; a duration is never below 0 (and the wire field is unsigned).
        self.items.append((name, max(0.0, (now - self._t) * 1000)))
        self._t = now
        return now



@dataclass
class Move:
    """What a move on the source holds, so that a rollback can undo it."""

    pid: int
    job_id: str
    ckpt_id: str = ""
    lock: net.ConnectionLock | None = None
    moved_ip: net.IfAddr | None = None
    ip_removed_from: str = ""
    container: containers.DumpPlan | None = None  # a container's workload (memsnap.containers)

    @property
    def label(self) -> str:
        """The job id, or the pid of an unmanaged process (for messages)."""
        return self.job_id or str(self.pid)


# -- journal marks ------------------------------------------------------------------------------------
def set_mark(catalog: Catalog, ckpt_id: str, **marks: str | None) -> None:
    """Sets (a string) or clears (None) move marks in a checkpoint's meta."""
    lifecycle.mark(catalog, ckpt_id, **marks)


def mark_moved(catalog: Catalog, ckpt_id: str, to: str, target_job: str = "") -> None:
    """Journals that the target keeps the job: from here on, recovery ends the held copy here."""
    set_mark(catalog, ckpt_id, committing_to=None, moved_to=to, **({"moved_job": target_job} if target_job else {}))


# -- rollback ---------------------------------------------------------------------------------------
def give_address_back(move: Move) -> None:
    """Puts a moved address back on the source interface it left (raises NetError when it cannot)."""
    if move.ip_removed_from and move.moved_ip is not None:
        net.add_address(move.moved_ip, move.ip_removed_from)
        move.ip_removed_from = ""


def restore_network(move: Move) -> None:
    """After a failed dump: the address back where it was, the connections unlocked (best effort)."""
    try:
        give_address_back(move)
    except net.NetError as exc:
        log.error("could not give %s back to %s: %s", move.moved_ip, move.ip_removed_from, exc)
    if move.lock is not None:
        move.lock.release()


def rollback(host: MoveHost, move: Move, step: str, why: str, code: str) -> NoReturn:
    """Runs the job here again, then raises an error that names the failed step."""
    log.warning("migration failed at %s: %s; resuming the job here", step, why)
    try:
        where = _resume_here(host, move)
    except Exception as exc:
        log.exception("rollback failed")
        raise move_error("INTERNAL", f"migration failed at {step}: {why}; resuming the job here failed too "
                         f"({exc}); its image is checkpoint {move.ckpt_id}") from exc
    _drop_own_image(host, move.ckpt_id)
    raise move_error(code, f"migration failed at {step}: {why}; the job was resumed on this node{where}")


def _drop_own_image(host: MoveHost, ckpt_id: str) -> None:
    """A move that did not happen leaves no image behind here either: the job runs on, and nobody asked for a
    checkpoint. That holds for the durable image a --via-store move made (its stored copy too: the target said
    it failed, or does not run the job, and a target never deletes a stored copy it only cataloged); a failed
    lazy dump's record stays FAILED with its logs (end_lazy_dump)."""
    rec = host.catalog.get_checkpoint(ckpt_id) if ckpt_id else None
    if rec is None or rec.state == FAILED or rec.marks.lazy_move:
        return
    try:
        host.delete(ROOT, ckpt_id)
    except MemsnapError as exc:
        log.warning("could not drop %s, the image of a move that did not happen: %s", ckpt_id, exc)


def _resume_here(host: MoveHost, move: Move) -> str:
    give_address_back(move)
    if move.lock is None:
        host.resume_held(move.pid, move.ckpt_id)
        return ""
    # Its sockets stay in repair mode after the dump, so SIGCONT would leave the connections dead:
    # restore the image here instead (the stopped copy goes first, its sockets close silently).
    host.end_held(move.pid, move.job_id, move.ckpt_id)
    lock = move.lock
    try:
        res = host.restore(ROOT, move.ckpt_id, tcp_established=True, notify=network.unlock_after_restore(lock),
                           restore_opts={"network_lock_skip": True})
    finally:
        lock.release()
    return f" from its image, as {res.job.id} (pid {res.pid})"


# -- asking the target ----------------------------------------------------------------------------------
def target_job(client: PeerClient, ckpt_id: str, tries: int = 3) -> pb.Job | None:
    """The running job restored from ckpt_id on the target, or None (a lost link is retried)."""
    def find() -> pb.Job | None:
        return next((j for j in client.jobs(timeout=10) if j.restored_from == ckpt_id and j.running), None)

    try:
        return retrying(find, _lost_link, (TARGET_JOB_RETRY_S,) * (tries - 1))
    except ClientError as exc:
        log.warning("cannot ask the target about %s: %s", ckpt_id, exc)
        return None


def _lost_link(exc: Exception) -> bool:
    """Whether exc is a call that did not reach the peer or got no answer (asking again is worth it)."""
    return isinstance(exc, ClientError) and exc.code in TRANSPORT_CODES


def _why(exc: Exception) -> str:
    return f"{exc.code.name}: {exc.message}" if isinstance(exc, ClientError) else str(exc)


class Commitments:
    """The commit step on the source, and the moves whose commit is unanswered (in doubt)."""

    def __init__(self, host: MoveHost, cfg: Config) -> None:
        self.host = host
        self.cfg = cfg
        self._in_doubt: dict[str, str] = {}  # ckpt id -> "JOB -> HOST:PORT"

    def moves_in_doubt(self) -> list[str]:
        """"JOB -> HOST:PORT" for every outgoing move whose commit is unanswered (status, metrics)."""
        return sorted(self._in_doubt.values())

    def commit_on(self, client: PeerClient, move: Move, ckpt_id: str, to: str) -> None:
        """Tells the target to keep the job. Refused: the job runs on here (and dies there). Unanswered:
        the move is in doubt (see ask); past daemon.move_in_doubt_s it runs on here too."""
        failpoints.hit("before-commit-sent")  # (tests: the target's copy then expires)
        # A crash from here until moved_to is journaled leaves the question to the target (recovery).
        set_mark(self.host.catalog, ckpt_id, committing_to=to)
        kept, why, code = self.ask(client, ckpt_id, to, move.label)
        if not kept:
            rollback(self.host, move, "commit", why, code)
        failpoints.hit("after-commit")

    def ask(self, client: PeerClient, ckpt_id: str, to: str, job: str) -> tuple[bool, str, str]:
        """Asks the target to keep the job restored from ckpt_id until it answers; (kept, why, code).

        The commit is idempotent and the target remembers it across its own restart, so asking again is
        always safe. While the target cannot be reached the move is in doubt: it may have applied the
        commit and run the job, so the copy here stays stopped and the question is repeated with backoff,
        for at most daemon.move_in_doubt_s (0 = until it answers).
        """
        try:
            return self._ask_until_answered(client, ckpt_id, to, job)
        finally:
            self._in_doubt.pop(ckpt_id, None)

    def _ask_until_answered(self, client: PeerClient, ckpt_id: str, to: str, job: str) -> tuple[bool, str, str]:
        limit = self.cfg.daemon.move_in_doubt_s

        def in_doubt(attempt: int, exc: Exception) -> None:
            if attempt == 2:  # (a blip is retried quietly)
                self._in_doubt[ckpt_id] = f"{job} -> {to}"
                log.warning("the move of %s to %s is in doubt: the target cannot be reached (%s); the job stays "
                            "stopped here and memsnapd keeps asking (daemon.move_in_doubt_s)", job, to,
                            _why(exc), extra={"checkpoint_id": ckpt_id})

        delays = IN_DOUBT_RETRY.delays(time.monotonic() + limit if limit > 0 else None, least_s=0.1)
        try:
            retrying(lambda: client.commit_move(ckpt_id, timeout=10), _lost_link, delays, on_retry=in_doubt)
            return True, "", "OK"
        except ClientError as exc:
            if exc.code not in TRANSPORT_CODES:
                return False, _why(exc), exc.code.name  # the target answered: it does not keep the job
            return False, (f"{to} gave no answer for {limit:.0f} s ({_why(exc)}); if it runs the job, it now "
                           "runs on both nodes: stop one copy"), "UNAVAILABLE"

    # -- after a crash mid-commit ------------------------------------------------------------------
    def settle(self, ckpt_ids: list[str], connect: Callable[[str], AbstractContextManager[PeerClient]]) -> None:
        """After a crash mid-commit: asks each target again whether it keeps the job (ask: while it
        cannot be reached, the copy here stays stopped). Kept there -> the stopped copy here ends;
        refused, or no answer within daemon.move_in_doubt_s -> it runs on here. A thread per move.
        connect(to) opens a client to a move's target (MemsnapError when it cannot)."""
        for ckpt_id in ckpt_ids:
            threading.Thread(target=self._settle, args=(ckpt_id, connect), name=f"settle-{ckpt_id}",
                             daemon=True).start()

    def _settle(self, ckpt_id: str, connect: Callable[[str], AbstractContextManager[PeerClient]]) -> None:
        host = self.host
        rec = host.catalog.get_checkpoint(ckpt_id)
        if rec is None:
            return
        to = rec.marks.committing_to
        kept, why = False, "no target recorded"
        try:
            with connect(to) as client:
                kept, why, _ = self.ask(client, ckpt_id, to, rec.job)
        except MemsnapError as exc:
            why = str(exc)
            if to and self.cfg.peer(to) is None:
                # Moved with root's own credential to an address that is not a peer: that credential was
                # not kept, so nothing can ask it again. It is in doubt as if unreachable: the copy here stays
                # stopped for daemon.move_in_doubt_s (0 = until an operator resumes or ends it).
                self._in_doubt[ckpt_id] = f"{rec.job} -> {to}"
                limit = self.cfg.daemon.move_in_doubt_s
                log.warning("the interrupted move of %s to %s is in doubt: %s is not a configured peer, so it "
                            "cannot be asked; the job stays stopped here%s", rec.job, to, to,
                            f" for {limit:.0f} s" if limit > 0 else "", extra={"checkpoint_id": ckpt_id})
                if limit <= 0:
                    return
                time.sleep(limit)
                self._in_doubt.pop(ckpt_id, None)
        if kept:
            mark_moved(host.catalog, ckpt_id, to)
            host.end_held(rec.pid, rec.job, ckpt_id)
            log.info("the interrupted move of %s to %s was committed there; the copy here ended", rec.job,
                     to, extra={"checkpoint_id": ckpt_id})
        else:
            set_mark(host.catalog, ckpt_id, committing_to=None)
            host.resume_held(rec.pid, ckpt_id)
            log.warning("the interrupted move of %s to %s is not kept there (%s); the job runs on here",
                        rec.job, to, why, extra={"checkpoint_id": ckpt_id})
        if rec.marks.lazy_move:
            host.tier.discard_staging(ckpt_id)


def chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    """first, then the rest of a stream."""
    yield first
    yield from rest


__all__ = ["CONFIRM_S", "TRANSPORT_CODES", "Commitments", "Move", "MoveHost", "MoveRequest", "MoveResult", "Phases",
           "mark_moved", "move_error",
           "restore_network", "rollback", "set_mark", "target_job"]
