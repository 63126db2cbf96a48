"""The Checkpointer: a checkpoint's dump, from the request to the image published in the tier.

Admission first (the caller may act on the pid, nothing else checkpoints it, the tier has room for its memory and
its GPU memory), then the journal (DUMPING, before anything is touched: recovery rolls back from it), the job's
quiesce hooks, the GPU suspend, CRIU's dump into the tier's staging area, the signed manifest, and publish_image()
(STAGED). Whatever fails on the way leaves the job running and the checkpoint FAILED with its reason. It reaches
the engine through CheckpointHost.
"""

from __future__ import annotations

import logging
import platform
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from memsnap import __version__, background, containers, failpoints, knobs, lifecycle, manifest, mounts, proc
from memsnap.caller import Caller
from memsnap.catalog import DUMPING, FAILED, Catalog, CheckpointRecord, JobRecord, now_ms
from memsnap.collaborators import EngineConfig, GpuAdapter, JobGuard, Uploads
from memsnap.criu import CriuApi, CriuError, DumpOptions, NotifyCallback, own_mount_ns
from memsnap.dumphash import DumpHasher
from memsnap.errors import FailedPrecondition, NotFound
from memsnap.manifest import Manifest
from memsnap.phases import PhaseClock
from memsnap.quiesce.notifier import Quiescer
from memsnap.restorer import RESERVE_SLACK
from memsnap.tier import TierReservation
from memsnap.tiers import MEMORY, Tiers, publish_image

log = logging.getLogger("memsnap.engine")


@dataclass
class DumpExtras:
    """Extras for a dump that feeds a move to another node (memsnap.move) or parks a job (memsnap.guard); all
    optional."""

    hold: bool = False  # leave the tree stopped after staging; end_held() or resume_held() decides
    before_dump: Callable[[Path], None] | None = None  # gets the staging dir just before CRIU starts
    file_table: Callable[[], dict[str, dict[str, Any]] | None] | None = None  # {name: {size, blake3}}
    notify: NotifyCallback | None = None  # CRIU notify callbacks (post-dump, ...)
    dump_opts: dict[str, Any] = field(default_factory=dict)  # extra DumpOptions fields
    manifest: dict[str, Any] = field(default_factory=dict)  # extra signed manifest fields (memsnap.guard: parked)
    into: str = MEMORY  # the tier it goes to: SPILL for the guard's park images when guard.spill_dir is set
    container: containers.ContainerFacts | None = None  # a container's workload (memsnap.containers)


class CheckpointHost(Protocol):
    """What the Checkpointer uses of the engine (memsnap.engine.Engine)."""

    catalog: Catalog
    tier: Tiers
    criu: CriuApi
    cfg: EngineConfig
    key: bytes
    work_root: Path
    hostname: str
    node: str
    drain: Uploads | None
    gpu: GpuAdapter | None
    guard: JobGuard | None
    quiesce: Quiescer
    observe: Callable[[str, str, float], None]

    def exclusive(self, pid: int) -> AbstractContextManager[None]: ...

    def reserve(self, nbytes: int, into: str = MEMORY) -> TierReservation: ...

    def resolve_pid(self, target: str, caller: Caller = ...) -> tuple[int, JobRecord | None]: ...

    def journal(self, rec: CheckpointRecord, key: str) -> Callable[[Any], None]: ...

    def note_phases(self, ckpt_id: str, key: str, clock: PhaseClock) -> None: ...

    def authorize_uid(self, caller: Caller, owner: int, what: str) -> None: ...


class Checkpointer:
    """Dumps checkpoints for one engine (see the module's doc)."""

    def __init__(self, host: CheckpointHost) -> None:
        self.host = host

    def checkpoint(self, caller: Caller, target: str, stop: bool = False, tcp_established: bool = False,
                   name: str = "", extras: DumpExtras | None = None) -> CheckpointRecord:
        """Dumps a process tree into the tier and publishes it atomically; the job runs on unless stop.

        extras (memsnap.move) can hold the tree stopped instead, watch the staging dir while CRIU
        writes it, supply the file hashes it computed on the way, and answer CRIU's notify callbacks.
        """
        plan = containers.plan_for(target, caller.is_root)
        if plan is not None:  # "podman:NAME", "cri:ID": the container's workload, dumped from the host
            pid, job = plan.pid, None
            extras = extras or DumpExtras()
            extras.container, extras.dump_opts = plan.facts, {**plan.dump_opts, **extras.dump_opts}
            name = name or plan.facts.name
        else:
            pid, job = self.host.resolve_pid(target, caller)
        try:
            owner = proc.owner_uid(pid)
        except proc.ProcessNotFound as exc:
            raise NotFound(str(exc)) from exc
        self.host.authorize_uid(caller, owner, f"pid {pid}" if plan is None else f"container {target}")
        t_start = time.monotonic()
        with self.host.exclusive(pid), background.gate().foreground("dump"):
            reservation = self.host.reserve(self.dump_estimate(pid), extras.into if extras else MEMORY)
            try:
                rec = self._checkpoint_reserved(pid, job, owner, stop, tcp_established, name, extras)
            except Exception:
                self.host.observe("checkpoint", "error", time.monotonic() - t_start)
                raise
            finally:
                reservation.release()
        self.host.observe("checkpoint", "ok", time.monotonic() - t_start)
        if self.host.drain is not None:
            self.host.drain.enqueue(rec.id)
        return rec

    def dump_estimate(self, pid: int) -> int:
        """The tier room a dump of pid's tree reserves: its resident memory and its CUDA processes' device memory
        (which their GPU checkpoint moves into host memory, so into the image), plus a margin."""
        try:  # (a private /tmp's files go into the image too)
            host = proc.tree_rss(pid) + proc.private_tmp_bytes(pid)
        except proc.ProcessNotFound as exc:
            raise NotFound(str(exc)) from exc
        device = self.host.gpu.device_bytes(pid) if self.host.gpu is not None else 0
        return int((host + device) * (1 + self.host.cfg.reserve_margin)) + RESERVE_SLACK

    def _checkpoint_reserved(self, pid: int, job: JobRecord | None, owner: int, stop: bool,
                             tcp_established: bool, name: str,
                             extras: DumpExtras | None = None) -> CheckpointRecord:
        extras = extras or DumpExtras()
        ckpt_id = lifecycle.new_id()
        argv = proc.cmdline(pid)
        own_ns = proc.in_own_pidns(pid) or extras.container is not None  # (its pids are the container's)
        # (a container's mount namespace is rebuilt on its placeholder's root, never as a job's own: containers)
        own_mnt = own_mount_ns(pid) if extras.container is None else False
        # The intent (stop or not) and the process identity are journaled too, so that recovery after a
        # crash can finish or roll back a --stop whose job CRIU left stopped.
        rec = CheckpointRecord(id=ckpt_id, state=DUMPING, pid=pid, owner_uid=owner, created_ms=now_ms(),
                               job=job.id if job else "", name=name or (job.name if job else ""),
                               meta={"stop": stop, "pid_start": proc.start_time_or_zero(pid), "hold": extras.hold})
        # Journal first: after a crash, recovery finds this row and removes the half-written image.
        lifecycle.begin(self.host.catalog, rec)
        clog = logging.LoggerAdapter(log, {"checkpoint_id": ckpt_id})
        staging = self.host.tier.new_staging(ckpt_id, into=extras.into)
        work = self.host.work_root / ckpt_id
        work.mkdir(parents=True, exist_ok=True, mode=0o700)
        frozen_after = stop or extras.hold
        opts = DumpOptions(**{"leave_running": not frozen_after, "leave_stopped": frozen_after,
                              "tcp_established": tcp_established, "shell_job": not proc.is_session_leader(pid),
                              "own_mntns": own_mnt, **self.host.cfg.extra_dump_opts, **extras.dump_opts})
        gpu_info: list[dict[str, Any]] = []
        suspension = quiet = None
        hasher: DumpHasher | None = None
        clock = PhaseClock()

        def tell() -> None:  # the job's quiesce hooks: resume (the same processes run on)
            self.host.quiesce.resume(pid, ckpt_id, False, self.host.journal(rec, "quiesce"))
        try:
            # The job's own quiesce hooks first (memsnap.quiesce: NCCL suspended, caches dropped), then its GPU.
            quiet = self.host.quiesce.quiesce(pid, ckpt_id, journal=self.host.journal(rec, "quiesce"))
            clock.add("quiesce", quiet.seconds) if quiet is not None else None
            if self.host.gpu is not None:
                with clock.timed("gpu_describe"):  # (finding the CUDA processes; nvidia-smi for their GPUs)
                    gpu_info = self.host.gpu.describe(pid)
                if gpu_info:
                    suspension = self.host.gpu.suspend(pid, self.host.cfg.gpu_lock_timeout_ms,
                                                       journal=self.host.journal(rec, "gpu"))
                    clock.gpu(suspension.seconds)
            if extras.before_dump is not None:
                extras.before_dump(staging)
            hasher = _start_hasher(staging) if extras.file_table is None else None
            try:
                stats = self.host.criu.dump(pid, staging, work, opts, notify=extras.notify)
            except BaseException:
                hasher.close() if hasher is not None else None
                raise
        except Exception as exc:
            if suspension is not None:
                try:
                    suspension.resume()
                except Exception as gpu_exc:  # keep CRIU's reason as the error; log the GPU one
                    clog.error("could not resume CUDA state after a failed dump: %s", gpu_exc)
            tell() if quiet is not None else None
            self.host.tier.discard_staging(ckpt_id)
            reason = exc.reason if isinstance(exc, CriuError) else str(exc)
            lifecycle.advance(self.host.catalog, ckpt_id, FAILED, last_error=reason)
            clog.warning("dump failed: %s", reason)
            if isinstance(exc, CriuError):
                raise FailedPrecondition(f"checkpoint of pid {pid} failed, the process was left running: "
                                         f"{reason} (log: {exc.log_path})") from exc
            raise
        clock.add("freeze", stats.frozen_ms / 1000)  # (CRIU's own stats: how long the tree was frozen, the dump)
        clock.add("dump", stats.wall_ms / 1000)
        t_publish = time.monotonic()
        try:
            known = hasher.finish() if hasher is not None else None
            man = self.new_manifest(rec, argv, own_ns, job,
                                    (extras.file_table() if extras.file_table else None)
                                    or manifest.describe_files(staging, known),
                                    frozen_ms=stats.frozen_ms, freezing_ms=stats.freezing_ms,
                                    dump_ms=stats.wall_ms, gpus=gpu_info, own_mntns=own_mnt,
                                    tcp_close=not opts.tcp_established, phases=clock.rounded())
            man.extra.update(extras.manifest)  # signed too (memsnap.guard: parked)
            if extras.container is not None:
                man.extra["container"] = extras.container.to_dict()
            size = publish_image(self.host.tier, self.host.catalog, self.host.key, staging, man, keep_meta=rec.meta,
                                 failpoint="before-publish", frozen_ms=int(stats.frozen_ms),
                                 dump_ms=int(stats.wall_ms))
        except Exception as exc:
            hasher.close() if hasher is not None else None
            # The dump worked but the image is not safely staged: the job must go on.
            if frozen_after:
                proc.resume_stopped(pid)
            if suspension is not None:
                suspension.resume()
            tell() if quiet is not None else None
            self.host.tier.discard_staging(ckpt_id)
            lifecycle.advance(self.host.catalog, ckpt_id, FAILED, last_error=f"publish failed: {exc}")
            raise FailedPrecondition(f"could not stage the image ({exc}); the process was left running") from exc
        clock.add("publish", time.monotonic() - t_publish)
        failpoints.hit("after-publish")
        if extras.hold:
            pass  # stays stopped: the caller ends it (end_held) or resumes it (resume_held)
        elif stop:
            # The image is safely staged: now the job may end.
            if suspension is not None:
                suspension.release()
            proc.kill_tree(pid)
            self.host.journal(rec, "quiesce")(None)  # (nobody left to tell)
            if job is not None:
                self.host.catalog.update_job(job.id, ended=True)
        else:
            if suspension is not None:
                suspension.resume()
                clock.gpu({k: v for k, v in suspension.seconds.items() if k in ("restore", "unlock")})
            if quiet is not None:
                with clock.timed("quiesce_resume"):
                    tell()
        self.host.note_phases(ckpt_id, "phases", clock)
        shutil.rmtree(work, ignore_errors=True) if not knobs.keep_logs() else None
        clog.info("checkpoint staged: %d bytes, frozen %.0f ms, dump %.0f ms, %d bytes hashed while CRIU dumped",
                  size, stats.frozen_ms, stats.wall_ms, hasher.hashed_while_dumping if hasher is not None else 0)
        out = self.host.catalog.get_checkpoint(ckpt_id)
        assert out is not None
        return out

    def new_manifest(self, rec: CheckpointRecord, argv: list[str], own_ns: bool, job: JobRecord | None,
                     files: dict[str, dict[str, Any]], **fields: Any) -> Manifest:
        """The manifest of an image dumped here (fields: frozen_ms, dump_ms, gpus, pages_remote, ...).

        own_mntns (the tree has its own mount namespace) tells every later restore, here or on another
        node, to restore that namespace; unless given, it is read from the (still frozen) tree.
        """
        if "own_mntns" not in fields:
            fields["own_mntns"] = own_mount_ns(rec.pid)
        if job is not None:  # (signed: a restore names its job after this, not after the checkpoint's --name)
            fields.setdefault("extra", {})["job_name"] = job.name
            guarded = self.host.guard.settings_of(job.id) if self.host.guard is not None else None
            if guarded:  # (a restore, here or on another node, guards it the same way: Guard.restored)
                fields["extra"]["guard"] = guarded
        if "log_mount" not in fields and fields.get("own_mntns") and mounts.has_job_log(rec.pid):
            fields["log_mount"] = mounts.LOG_MOUNT_KEY  # (Criu.dump made it external under that key)
        fields.setdefault("extra", {})["node"] = self.host.node  # (signed: the node that may delete its stored copy)
        return Manifest(id=rec.id, pid=rec.pid, job=rec.job, name=rec.name, uid=rec.owner_uid, files=files,
                        argv=argv, host=self.host.hostname, kernel=platform.release(),
                        criu_version=self.host.criu.version(), memsnap_version=__version__, created_ms=rec.created_ms,
                        own_pidns=own_ns, log_path=job.log_path if job else "", **fields)


def _start_hasher(staging: Path) -> DumpHasher | None:
    """A DumpHasher on staging, or None where inotify is refused (describe_files then hashes it all)."""
    try:
        return DumpHasher(staging)
    except OSError as exc:
        log.info("not hashing while dumping: %s", exc)
        return None
