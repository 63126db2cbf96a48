"""The engine: checkpoint, restore and the checkpoint state machine. Usable without gRPC."""

from __future__ import annotations

import logging
import os
import platform
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from memsnap import (
    __version__,
    background,
    failpoints,
    jobinit,
    jobs,
    knobs,
    lifecycle,
    manifest,
    mounts,
    proc,
    progress,
    resolve,
)
from memsnap.catalog import (
    DRAINING,
    DUMPING,
    DURABLE,
    FAILED,
    RESTORABLE,
    STAGED,
    Catalog,
    CheckpointRecord,
    JobRecord,
    now_ms,
)
from memsnap.criu import (
    CriuApi,
    CriuError,
    DumpOptions,
    NotifyCallback,
    RestoreOptions,
    guard_lazy_restore,
    own_mount_ns,
)
from memsnap.errors import (
    Aborted,
    FailedPrecondition,
    IntegrityFailure,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    TierExhausted,
)
from memsnap.lazyguard import LazyGuard
from memsnap.manifest import Manifest
from memsnap.phases import PhaseClock
from memsnap.quiesce.notifier import Quiescer
from memsnap.retention import not_ours
from memsnap.tier import MemoryTier, TierFull, publish_image

log = logging.getLogger("memsnap.engine")

# Reservation = resident memory * (1 + margin) + this, for CRIU's small images and page alignment.
_RESERVE_SLACK = 16 << 20


@dataclass(frozen=True)
class Caller:
    """Who is asking, from SO_PEERCRED on the Unix socket (uid 0 for authenticated TCP peers)."""

    uid: int
    gid: int = 0
    pid: int = 0

    @property
    def is_root(self) -> bool:
        """Root may act on anything."""
        return self.uid == 0


ROOT = Caller(0, 0, 0)


class DrainHook(Protocol):
    """What the engine needs from the drain service (memsnap.drain)."""

    def enqueue(self, ckpt_id: str) -> None:
        """Queues a staged checkpoint for draining."""

    def fetch(self, rec: CheckpointRecord, dest: Path) -> None:
        """Copies a durable checkpoint from the store into dest, verifying as it goes."""

    def delete(self, rec: CheckpointRecord) -> None:
        """Removes the stored copy."""

    def describe(self) -> str:
        """Where checkpoints go (one line)."""

    def store_id(self) -> str:
        """The store's random id ("" when unreachable): equal on daemons that share the store."""


class GpuHook(Protocol):
    """What the engine needs from memsnap.gpu around CRIU."""

    def suspend(self, root_pid: int, timeout_ms: int,
                journal: Callable[[dict[str, Any] | None], None] | None = None) -> Any:
        """Locks and checkpoints the CUDA processes of a tree; returns a handle with resume()/release().
        journal(entry) runs before the first lock, journal(None) once all is resumed or released."""

    def restore(self, root_pid: int, gpu_map: dict[str, str] | None,
                checkpointed: list[dict[str, Any]] | None = None) -> dict[str, float] | None:
        """Restores and unlocks CUDA state after CRIU restored the tree (checkpointed: the manifest's gpus);
        the wall time of each stage ({"restore": s, "unlock": s})."""

    def recover(self, entry: dict[str, Any]) -> dict[int, str]:
        """Restores and unlocks the pids of a journal entry that a killed daemon left suspended."""

    def describe(self, root_pid: int) -> list[dict[str, Any]]:
        """GPU model/uuid/driver/device bytes per CUDA process of the tree."""

    def device_bytes(self, root_pid: int) -> int:
        """Device memory the tree's CUDA processes use: what their checkpoint moves into the image."""


class MoveRecovery(Protocol):
    """What Engine.recover hands to the move code (memsnap.move.Mover) after a crash."""

    def in_doubt(self, rec: CheckpointRecord) -> None:
        """The source died while asking the target to keep the job: ask again (the copy stays stopped)."""

    def abandon(self, rec: CheckpointRecord) -> None:
        """Target: a move restored here that the source never committed (the source runs the job)."""

    def lazy_target_interrupted(self, rec: CheckpointRecord) -> None:
        """Target: the first half of a lazy move that was in flight."""


@dataclass
class RestoreResult:
    """A restored job and what the restore cost."""

    pid: int
    job: JobRecord
    restore_ms: float
    verify_ms: float
    fetch_ms: float = 0.0
    from_store: bool = False
    lazy_server: Any = None  # the lazy-pages process of a lazy restore
    work_dir: Path | None = None
    phases: dict[str, float] = field(default_factory=dict)  # memsnap.phases.RESTORE: seconds each


@dataclass
class DumpHooks:
    """Extras for a dump that feeds a move to another node (memsnap.move); all optional."""

    hold: bool = False  # leave the tree stopped after staging; end_held() or resume_held() decides
    before_dump: Callable[[Path], None] | None = None  # gets the staging dir just before CRIU starts
    file_table: Callable[[], dict[str, dict[str, Any]] | None] | None = None  # {name: {size, blake3}}
    notify: NotifyCallback | None = None  # CRIU notify callbacks (post-dump, ...)
    dump_opts: dict[str, Any] = field(default_factory=dict)  # extra DumpOptions fields
    manifest: dict[str, Any] = field(default_factory=dict)  # extra signed manifest fields (memsnap.guard: parked)


@dataclass
class EngineConfig:
    """Where things live and how to size reservations."""

    state_dir: Path
    reserve_margin: float = 0.10
    gpu_lock_timeout_ms: int = 10_000
    extra_dump_opts: dict[str, Any] = field(default_factory=dict)
    # Jobs get a /tmp of their own unless they ask for the host's (memsnap.mounts; README "Private /tmp").
    private_tmp: bool = True
    node_name: str = ""  # daemon.node_name: who made a stored copy (retention.not_ours); "" = the host name


class Engine:
    """Checkpoint, restore and catalog operations with authorization and crash-safe ordering."""

    def __init__(self, cfg: EngineConfig, catalog: Catalog, tier: MemoryTier, criu: CriuApi, hmac_key: bytes,
                 drain: DrainHook | None = None, gpu: GpuHook | None = None,
                 observe: Callable[[str, str, float], None] | None = None) -> None:
        self.cfg = cfg
        self.catalog = catalog
        self.tier = tier
        self.criu = criu
        self.key = hmac_key
        self.drain = drain
        self.gpu = gpu
        # observe(kind, result, seconds): metrics hook ("checkpoint", "ok", 1.2), or a phase ("phase:freeze", ...)
        self.observe = observe or (lambda kind, result, seconds: None)
        self.hostname = socket.gethostname()
        self.node = cfg.node_name or self.hostname
        self.launcher = jobs.Launcher(cfg.state_dir / "jobs")
        if cfg.private_tmp and _below_tmp(self.launcher.log_dir):
            # (a job's log must stay reachable by path in its own mount namespace, for CRIU)
            log.warning("jobs get the host's /tmp: the state dir %s lies below /tmp, so a private /tmp would hide "
                        "their logs; put the state dir elsewhere", cfg.state_dir)
            cfg.private_tmp = False
        self.work_root = cfg.state_dir / "work"
        self.work_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._busy: set[int] = set()
        self._busy_lock = threading.Lock()
        self._evict_lock = threading.Lock()
        self._ckpt_locks: dict[str, threading.RLock] = {}
        self._ckpt_locks_lock = threading.Lock()
        # Restores whose CRIU still reads a tier copy, by checkpoint id: evict and delete must wait for them.
        self._reading: dict[str, int] = {}
        self._lazy: list[tuple[str, Any, Path]] = []
        self._lazy_lock = threading.Lock()
        # Work dirs of lazy restores whose job.pid is not written yet: their lazy-pages may have served
        # every page already (small jobs), but reap_lazy must not remove the dir under the restore.
        self._restoring: set[Path] = set()
        self.quiesce = Quiescer()  # the jobs' quiesce hooks (memsnap.quiesce)
        self.guard: Any = None  # memsnap.guard.service.Guard, set by the daemon
        self.gc: Any = None  # memsnap.gc.Collector, set by the daemon

    # -- helpers ------------------------------------------------------------------
    @contextmanager
    def exclusive(self, pid: int) -> Iterator[None]:
        """No other checkpoint of pid meanwhile (Aborted if one runs)."""
        with self._busy_lock:
            if pid in self._busy:
                raise Aborted(f"pid {pid} is already being checkpointed; wait for that to finish")
            self._busy.add(pid)
        try:
            yield
        finally:
            with self._busy_lock:
                self._busy.discard(pid)

    def extra_dump_opts(self) -> dict[str, Any]:
        """DumpOptions fields from the daemon's configuration (for dumps the engine does not run itself)."""
        return dict(self.cfg.extra_dump_opts)

    def _authorize_uid(self, caller: Caller, owner: int, what: str) -> None:
        if not caller.is_root and caller.uid != owner:
            raise PermissionDenied(f"uid {caller.uid} may not act on {what} owned by uid {owner}; "
                                   "run as its owner or as root")

    def resolve_pid(self, target: str, caller: Caller = ROOT) -> tuple[int, JobRecord | None]:
        """A pid, job id or job name -> (live pid, job record if managed).

        A name resolves among the caller's own jobs only; 'UID:NAME' names another owner's job (root only).
        Refuses PID 1, kernel threads, this daemon and its ancestors before anything else happens.
        """
        target = (target or "").strip()
        if not target:
            raise InvalidArgument("no target given; pass a PID or a job id/name")
        if target.isascii() and target.isdigit():
            pid = int(target)
            if pid <= 0 or pid > 1 << 22:
                raise InvalidArgument(f"{_clip(target)!r} is not a valid PID")
            if not proc.alive(pid):
                raise NotFound(f"no process with pid {pid}; check the pid with 'ps' or 'memsnapctl jobs'")
            refuse_uncheckpointable(pid)
            job = self.catalog.job_by_pid(pid) or resolve.job_containing(self.catalog.jobs(), pid)
            if job is not None:  # (a pid inside a job: the whole job, its root, once the caller may act on it)
                self._authorize_uid(caller, job.owner_uid, f"pid {pid}")
                if job.pid != pid:
                    log.info("pid %d is in job %s: acting on the whole job", pid, job.id, extra={"job": job.id})
                return job.pid, job
            return pid, None
        if target.lstrip("-").isdigit():
            raise InvalidArgument(f"{_clip(target)!r} is not a valid PID")
        job = self.catalog.get_job(target)
        if job is None:
            job = self._job_by_name(caller, target)
        self._authorize_uid(caller, job.owner_uid, f"job {job.id}")  # before its pid or state is told
        if job.ended or not proc.alive(job.pid, job.pid_start):
            raise NotFound(f"job {job.id} is not running; restore one of its checkpoints instead")
        refuse_uncheckpointable(job.pid)
        return job.pid, job

    def _job_by_name(self, caller: Caller, target: str) -> JobRecord:
        """The caller's job called target (a running one first, newest first), or 'UID:NAME' for root."""
        owner, name, explicit = scoped_name(caller, target)
        named = self.catalog.jobs_named(name, owner)
        if named:
            running = [j for j in named if not j.ended and proc.alive(j.pid, j.pid_start)]
            return max(running or named, key=lambda j: (j.started_ms, j.id))
        if caller.is_root and not explicit:
            others = sorted({j.owner_uid for j in self.catalog.jobs_named(name)})
            if others:
                raise InvalidArgument(f"root has no job named {_clip(name)!r}; uid {', '.join(map(str, others))} "
                                      f"has one: name it as UID:NAME, e.g. {others[0]}:{_clip(name)}")
        raise InvalidArgument(f"{_clip(target)!r} is neither a PID nor a known job; pass a numeric PID or a job "
                              "id (names are looked up among your own jobs)")

    def _refuse_live_duplicate(self, owner: int, name: str) -> None:
        for j in self.catalog.jobs_named(name, owner):
            if not j.ended and proc.alive(j.pid, j.pid_start):
                raise FailedPrecondition(f"uid {owner} already runs a job named {_clip(name)!r} ({j.id}); pick "
                                         "another name, or stop that job first")

    def get(self, caller: Caller, ckpt_id: str) -> CheckpointRecord:
        """A checkpoint the caller may see, or NotFound/PermissionDenied."""
        if not ckpt_id or "/" in ckpt_id or ckpt_id.startswith("."):
            raise InvalidArgument(f"{ckpt_id!r} is not a checkpoint id")
        rec = self.catalog.get_checkpoint(ckpt_id)
        if rec is None:
            raise NotFound(f"no checkpoint {ckpt_id!r}; 'memsnapctl list' shows the checkpoints")
        self._authorize_uid(caller, rec.owner_uid, f"checkpoint {ckpt_id}")
        return rec

    def wait_settled(self, caller: Caller, ckpt_id: str, active: Callable[[], bool]) -> CheckpointRecord:
        """Waits until a checkpoint is durable or failed (or active() turns false); its latest record."""
        if self.drain is None:
            raise InvalidArgument("this daemon has no store configured, so nothing becomes durable")
        self.get(caller, ckpt_id)
        with background.gate().urgent(ckpt_id):  # a waiter: its drain does not step aside (docs/background.md)
            lifecycle.wait(self.catalog, ckpt_id, lambda r: r is None or r.state in lifecycle.SETTLED,
                           float("inf"), active)
        return self.get(caller, ckpt_id)

    def watch(self, caller: Caller, ckpt_id: str, active: Callable[[], bool]) -> Iterator[CheckpointRecord]:
        """A checkpoint's record at every change of its progress, until durable or failed (or active()
        turns false). Authorization happens before the first record."""
        rec = self.get(caller, ckpt_id)

        def key(r: CheckpointRecord) -> tuple[Any, ...]:
            return r.state, r.drained_bytes, r.stored_bytes, r.last_error, r.in_tier

        def changed_from(seen: tuple[Any, ...]) -> Callable[[CheckpointRecord | None], bool]:
            return lambda r: r is None or key(r) != seen

        def changes(rec: CheckpointRecord) -> Iterator[CheckpointRecord]:
            last: tuple[Any, ...] = ()
            while active():
                if key(rec) != last:
                    yield rec
                    last = key(rec)
                if rec.state in lifecycle.SETTLED:
                    return
                found = lifecycle.wait(self.catalog, rec.id, changed_from(last), float("inf"), active)
                if found is None:
                    return
                rec = found

        return changes(rec)

    # -- jobs ---------------------------------------------------------------------
    def run_job(self, caller: Caller, argv: list[str], name: str = "", cwd: str = "",
                env: dict[str, str] | None = None, own_proc: bool | None = None,
                cgroup_procs: str = "", private_tmp: bool | None = None) -> JobRecord:
        """Starts argv as a managed job in its own PID namespace, as the caller's uid.

        own_proc gives it its own /proc too (a mount namespace); None: only on a node with an NVIDIA GPU,
        because CUDA fails to initialise in a PID namespace that sees the host's /proc.
        """
        if not argv:
            raise InvalidArgument("no command given; usage: memsnapctl run -- CMD ARGS...")
        if own_proc is None:
            own_proc = os.path.exists("/dev/nvidiactl")
        if private_tmp is None:
            private_tmp = self.cfg.private_tmp
        job_id = "job-" + secrets.token_hex(4)
        if name:
            self._refuse_live_duplicate(caller.uid, name)
        # The job gets the caller's supplementary groups too, as its shell would (read from the caller's
        # process; none if that process is gone or its ids changed).
        groups = proc.caller_groups(caller.pid, caller.uid, caller.gid) if caller.uid else None
        try:
            launched, log_path = self.launcher.launch(job_id, argv, caller.uid, caller.gid, cwd or None, env,
                                                      groups=groups, own_proc=own_proc,
                                                      cgroup_procs=cgroup_procs, private_tmp=private_tmp)
        except jobs.LaunchError as exc:
            hint = ""
            if private_tmp and any(a == "/tmp" or a.startswith("/tmp/") for a in (cwd, *argv)):
                hint = ("; the job has a /tmp of its own, so it does not see the host's: run it with --shared-tmp, "
                        "or from and with files outside /tmp")
            raise FailedPrecondition(f"{exc}{hint}") from exc
        rec = JobRecord(id=job_id, name=name or job_id, pid=launched.pid, pid_start=launched.pid_start,
                        owner_uid=caller.uid, argv=list(argv), log_path=str(log_path), started_ms=now_ms())
        self.catalog.add_job(rec)
        log.info("job started", extra={"job": job_id, "pid": launched.pid})
        return rec

    def list_jobs(self, caller: Caller) -> list[tuple[JobRecord, bool]]:
        """Jobs the caller may see, with whether each still runs."""
        out = []
        for j in self.catalog.jobs():
            if caller.is_root or caller.uid == j.owner_uid:
                out.append((j, not j.ended and proc.alive(j.pid, j.pid_start)))
        return out

    # -- checkpoint -----------------------------------------------------------------
    def checkpoint(self, caller: Caller, target: str, stop: bool = False, tcp_established: bool = False,
                   name: str = "", hooks: DumpHooks | None = None) -> CheckpointRecord:
        """Dumps a process tree into the tier and publishes it atomically; the job runs on unless stop.

        hooks (memsnap.move) can hold the tree stopped instead, watch the staging dir while CRIU
        writes it, supply the file hashes it computed on the way, and answer CRIU's notify callbacks.
        """
        pid, job = self.resolve_pid(target, caller)
        try:
            owner = proc.owner_uid(pid)
        except proc.ProcessNotFound as exc:
            raise NotFound(str(exc)) from exc
        self._authorize_uid(caller, owner, f"pid {pid}")
        t_start = time.monotonic()
        with self.exclusive(pid), background.gate().foreground("dump"):
            reservation = self.reserve(self.dump_estimate(pid))
            try:
                rec = self._checkpoint_reserved(pid, job, owner, stop, tcp_established, name, hooks)
            except Exception:
                self.observe("checkpoint", "error", time.monotonic() - t_start)
                raise
            finally:
                reservation.release()
        self.observe("checkpoint", "ok", time.monotonic() - t_start)
        if self.drain is not None:
            self.drain.enqueue(rec.id)
        return rec

    def dump_estimate(self, pid: int) -> int:
        """The tier room a dump of pid's tree reserves: its resident memory and its CUDA processes' device memory
        (which their GPU checkpoint moves into host memory, so into the image), plus a margin."""
        try:  # (a private /tmp's files go into the image too)
            host = proc.tree_rss(pid) + proc.private_tmp_bytes(pid)
        except proc.ProcessNotFound as exc:
            raise NotFound(str(exc)) from exc
        device = self.gpu.device_bytes(pid) if self.gpu is not None else 0
        return int((host + device) * (1 + self.cfg.reserve_margin)) + _RESERVE_SLACK

    def reserve(self, nbytes: int) -> Any:
        """Reserves tier room, evicting durable tier copies least-recently-used first if needed.

        A checkpoint whose lock someone holds (a fetch, restore, delete) is skipped, never waited for: the
        caller may hold another checkpoint's lock, and waiting could deadlock.
        """
        with self._evict_lock:
            skipped: set[str] = set()
            while True:
                try:
                    return self.tier.reserve(nbytes)
                except TierFull as exc:
                    victim = self._lru_evictable(skipped)
                    if victim is None or not self._fits_after_evicting(nbytes):
                        raise TierExhausted(str(exc)) from exc
                    lock = self._lock_for(victim.id)
                    if not lock.acquire(blocking=False):
                        skipped.add(victim.id)
                        continue
                    try:
                        cur = self.catalog.get_checkpoint(victim.id)
                        if cur is not None and cur.in_tier and not self.tier_copy_in_use(cur.id):
                            log.info("evicting durable tier copy to make room", extra={"checkpoint_id": victim.id})
                            self._evict(cur)
                    finally:
                        lock.release()

    def _fits_after_evicting(self, nbytes: int) -> bool:
        """Whether evicting every evictable tier copy would make room for nbytes (else evict nothing)."""
        evictable = sum(r.size_bytes for r in self.catalog.checkpoints(states=(DURABLE,))
                        if r.in_tier and r.in_store and not self.tier_copy_in_use(r.id))
        return self.tier.free_bytes() + evictable >= nbytes

    def _lru_evictable(self, skip: set[str] | None = None) -> CheckpointRecord | None:
        durable = [r for r in self.catalog.checkpoints(states=(DURABLE,))
                   if r.in_tier and r.in_store and r.id not in (skip or ()) and not self.tier_copy_in_use(r.id)]
        return min(durable, key=lambda r: (r.last_used_ms or r.created_ms)) if durable else None

    def _lock_for(self, ckpt_id: str) -> threading.RLock:
        with self._ckpt_locks_lock:
            return self._ckpt_locks.setdefault(ckpt_id, threading.RLock())

    @contextmanager
    def checkpoint_lock(self, ckpt_id: str) -> Iterator[None]:
        """Serialises fetch, publish, evict and delete of one checkpoint's tier and store copies."""
        with self._lock_for(ckpt_id):
            yield

    def _checkpoint_reserved(self, pid: int, job: JobRecord | None, owner: int, stop: bool,
                             tcp_established: bool, name: str,
                             hooks: DumpHooks | None = None) -> CheckpointRecord:
        hooks = hooks or DumpHooks()
        ckpt_id = "ck-" + time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
        argv = proc.cmdline(pid)
        own_ns = proc.in_own_pidns(pid)
        own_mnt = own_mount_ns(pid)
        # The intent (stop or not) and the process identity are journaled too, so that recovery after a
        # crash can finish or roll back a --stop whose job CRIU left stopped.
        rec = CheckpointRecord(id=ckpt_id, state=DUMPING, pid=pid, owner_uid=owner, created_ms=now_ms(),
                               job=job.id if job else "", name=name or (job.name if job else ""),
                               meta={"stop": stop, "pid_start": _start_or_zero(pid), "hold": hooks.hold})
        # Journal first: after a crash, recovery finds this row and removes the half-written image.
        lifecycle.begin(self.catalog, rec)
        clog = logging.LoggerAdapter(log, {"checkpoint_id": ckpt_id})
        staging = self.tier.new_staging(ckpt_id)
        work = self.work_root / ckpt_id
        work.mkdir(parents=True, exist_ok=True, mode=0o700)
        frozen_after = stop or hooks.hold
        opts = DumpOptions(leave_running=not frozen_after, leave_stopped=frozen_after,
                           tcp_established=tcp_established, shell_job=not proc.is_session_leader(pid),
                           own_mntns=own_mnt, **{**self.cfg.extra_dump_opts, **hooks.dump_opts})
        gpu_info: list[dict[str, Any]] = []
        suspension = quiet = None
        clock = PhaseClock()

        def tell() -> None:  # the job's quiesce hooks: resume (the same processes run on)
            self.quiesce.resume(pid, ckpt_id, False, self._journal(rec, "quiesce"))
        try:
            # The job's own quiesce hooks first (memsnap.quiesce: NCCL suspended, caches dropped), then its GPU.
            quiet = self.quiesce.quiesce(pid, ckpt_id, journal=self._journal(rec, "quiesce"))
            clock.add("quiesce", quiet.seconds) if quiet is not None else None
            if self.gpu is not None:
                with clock.timed("gpu_describe"):  # (finding the CUDA processes; nvidia-smi for their GPUs)
                    gpu_info = self.gpu.describe(pid)
                if gpu_info:
                    suspension = self.gpu.suspend(pid, self.cfg.gpu_lock_timeout_ms, journal=self._journal(rec, "gpu"))
                    clock.gpu(suspension.seconds)
            if hooks.before_dump is not None:
                hooks.before_dump(staging)
            stats = self.criu.dump(pid, staging, work, opts, notify=hooks.notify)
        except Exception as exc:
            if suspension is not None:
                try:
                    suspension.resume()
                except Exception as gpu_exc:  # keep CRIU's reason as the error; log the GPU one
                    clog.error("could not resume CUDA state after a failed dump: %s", gpu_exc)
            tell() if quiet is not None else None
            self.tier.discard_staging(ckpt_id)
            reason = exc.reason if isinstance(exc, CriuError) else str(exc)
            lifecycle.advance(self.catalog, ckpt_id, FAILED, last_error=reason)
            clog.warning("dump failed: %s", reason)
            if isinstance(exc, CriuError):
                raise FailedPrecondition(f"checkpoint of pid {pid} failed, the process was left running: "
                                         f"{reason} (log: {exc.log_path})") from exc
            raise
        clock.add("freeze", stats.frozen_ms / 1000)  # (CRIU's own stats: how long the tree was frozen, the dump)
        clock.add("dump", stats.wall_ms / 1000)
        t_publish = time.monotonic()
        try:
            man = self.new_manifest(rec, argv, own_ns, job,
                                    (hooks.file_table() if hooks.file_table else None)
                                    or manifest.describe_files(staging),
                                    frozen_ms=stats.frozen_ms, freezing_ms=stats.freezing_ms,
                                    dump_ms=stats.wall_ms, gpus=gpu_info, own_mntns=own_mnt,
                                    tcp_close=not opts.tcp_established, phases=clock.rounded())
            man.extra.update(hooks.manifest)  # signed too (memsnap.guard: parked)
            size = publish_image(self.tier, self.catalog, self.key, staging, man, keep_meta=rec.meta,
                                 failpoint="before-publish", frozen_ms=int(stats.frozen_ms),
                                 dump_ms=int(stats.wall_ms))
        except Exception as exc:
            # The dump worked but the image is not safely staged: the job must go on.
            if frozen_after:
                _resume_stopped(pid)
            if suspension is not None:
                suspension.resume()
            tell() if quiet is not None else None
            self.tier.discard_staging(ckpt_id)
            lifecycle.advance(self.catalog, ckpt_id, FAILED, last_error=f"publish failed: {exc}")
            raise FailedPrecondition(f"could not stage the image ({exc}); the process was left running") from exc
        clock.add("publish", time.monotonic() - t_publish)
        failpoints.hit("after-publish")
        if hooks.hold:
            pass  # stays stopped: the caller ends it (end_held) or resumes it (resume_held)
        elif stop:
            # The image is safely staged: now the job may end.
            if suspension is not None:
                suspension.release()
            proc.kill_tree(pid)
            self._journal(rec, "quiesce")(None)  # (nobody left to tell)
            if job is not None:
                self.catalog.update_job(job.id, ended=True)
        else:
            if suspension is not None:
                suspension.resume()
                clock.gpu({k: v for k, v in suspension.seconds.items() if k in ("restore", "unlock")})
            if quiet is not None:
                with clock.timed("quiesce_resume"):
                    tell()
        self._note_phases(ckpt_id, "phases", clock)
        shutil.rmtree(work, ignore_errors=True) if not knobs.keep_logs() else None
        clog.info("checkpoint staged: %d bytes, frozen %.0f ms, dump %.0f ms", size, stats.frozen_ms,
                  stats.wall_ms)
        out = self.catalog.get_checkpoint(ckpt_id)
        assert out is not None
        return out

    def _journal(self, rec: CheckpointRecord, key: str) -> Callable[[Any], None]:
        """write(entry) keeps a step recover() must undo in the record's meta[key] (None or False: done)."""
        def write(entry: Any) -> None:
            cur = self.catalog.get_checkpoint(rec.id)
            meta = dict(cur.meta if cur is not None else rec.meta)
            for m in (meta, rec.meta):
                if entry is None or entry is False:
                    m.pop(key, None)
                else:
                    m[key] = entry
            self.catalog.update_checkpoint(rec.id, meta=meta)
        return write

    def _note_phases(self, ckpt_id: str, key: str, clock: PhaseClock) -> None:
        """An operation's phases into the checkpoint's record (memsnapctl show) and the phase histogram."""
        cur = self.catalog.get_checkpoint(ckpt_id)
        if cur is not None:
            self.catalog.update_checkpoint(ckpt_id, meta={**cur.meta, key: clock.rounded()})
        clock.observe(self.observe)

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
            guarded = self.guard.settings_of(job.id) if self.guard is not None else None
            if guarded:  # (a restore, here or on another node, guards it the same way: Guard.restored)
                fields["extra"]["guard"] = guarded
        if "log_mount" not in fields and fields.get("own_mntns") and mounts.has_job_log(rec.pid):
            fields["log_mount"] = mounts.LOG_MOUNT_KEY  # (Criu.dump made it external under that key)
        fields.setdefault("extra", {})["node"] = self.node  # (signed: the node that may delete its stored copy)
        return Manifest(id=rec.id, pid=rec.pid, job=rec.job, name=rec.name, uid=rec.owner_uid, files=files,
                        argv=argv, host=self.hostname, kernel=platform.release(),
                        criu_version=self.criu.version(), memsnap_version=__version__, created_ms=rec.created_ms,
                        own_pidns=own_ns, log_path=job.log_path if job else "", **fields)

    # -- restore --------------------------------------------------------------------
    def latest_restorable(self, caller: Caller, key: str) -> CheckpointRecord:
        """A checkpoint id, or a job id/name -> the checkpoint to restore.

        Names are looked up among the caller's own checkpoints ('UID:NAME' for root to name another
        owner's); the shared store is searched, by name and owner, only when the catalog has none.
        """
        rec = self.catalog.get_checkpoint(key)
        if rec is not None:
            self._authorize_uid(caller, rec.owner_uid, f"checkpoint {key}")
            return rec
        restorable = self.catalog.checkpoints(states=RESTORABLE)
        job = self.catalog.get_job(key)
        if job is not None:
            self._authorize_uid(caller, job.owner_uid, f"job {job.id}")
            cands = [r for r in restorable if r.owner_uid == job.owner_uid and r.job == job.id]
            owner, name, explicit = job.owner_uid, job.name, True
        else:
            owner, name, explicit = scoped_name(caller, key)
            ids = {j.id for j in self.catalog.jobs_named(name, owner)}
            cands = [r for r in restorable if r.owner_uid == owner and (r.name == name or r.job in ids)]
        if not cands:
            if caller.is_root and not explicit:
                others = sorted({r.owner_uid for r in restorable if r.name == name and r.owner_uid != owner})
                if others:
                    raise InvalidArgument(f"root has no checkpoint named {_clip(name)!r}; uid "
                                          f"{', '.join(map(str, others))} has: name it as UID:NAME, "
                                          f"e.g. {others[0]}:{_clip(name)}")
            adopted = self._catalog_from_store(name, owner)
            if adopted is None:
                raise NotFound(f"no checkpoint {_clip(key)!r}; 'memsnapctl list' shows the checkpoints")
            cands = [adopted]
        rec = max(cands, key=lambda r: (r.created_ms, r.id))
        self._authorize_uid(caller, rec.owner_uid, f"checkpoint {rec.id}")
        return rec

    def _catalog_from_store(self, name: str, owner: int) -> CheckpointRecord | None:
        """Catalogs the newest durable checkpoint another node stored under this job name (shared store and
        key). The store's name index is only a hint: the signed manifest must carry this name and owner."""
        find = getattr(self.drain, "find_stored", None)
        if find is None:
            return None
        for m in find(name):
            if self.catalog.get_checkpoint(m["id"]) is not None:
                continue
            try:
                m_owner = int(m.get("uid", -1))
            except (TypeError, ValueError):
                m_owner = -1
            if m.get("name") != name or m_owner != owner:
                log.warning("store index %r lists %s, whose signed manifest names %r of uid %s: not adopted",
                            name, m.get("id"), m.get("name"), m.get("uid"))
                continue
            man = Manifest.from_dict(m)
            home = str(man.extra.get("node") or man.host or "?")  # its stored copy is that node's to delete
            rec = CheckpointRecord(id=man.id, state=DURABLE, pid=int(man.pid), owner_uid=m_owner,
                                   created_ms=int(man.created_ms), job=str(man.job), name=name,
                                   size_bytes=man.size_bytes, frozen_ms=int(man.frozen_ms),
                                   dump_ms=int(man.dump_ms), in_tier=False, in_store=True, durable_ms=now_ms(),
                                   meta={**man.catalog_meta(), **({"home": home} if home != self.node else {})})
            lifecycle.begin(self.catalog, rec)
            log.info("adopted %s of %r from the shared store (written by %s)", rec.id, name, m.get("host"))
            return rec
        return None

    def restore(self, caller: Caller, key: str, lazy: bool = False, gpu_map: dict[str, str] | None = None,
                tcp_established: bool = False, notify: NotifyCallback | None = None,
                restore_opts: dict[str, Any] | None = None, lazy_ps_socket: int = -1,
                lazy_guard: LazyGuard | None = None) -> RestoreResult:
        """Verifies a checkpoint against its signed manifest, then restores it detached.

        notify gets CRIU's callbacks (post-restore, ...); restore_opts adds RestoreOptions fields.
        lazy_ps_socket (a lazy move, memsnap.move.lazy): the pages come from the source over that socket, and
        lazy_guard (the move's) kills the tasks first when they cannot come.
        """
        if not key:
            raise InvalidArgument("no checkpoint id given; usage: memsnapctl restore ID")
        if lazy and not self.criu.lazy_pages_supported():
            raise FailedPrecondition("CRIU cannot restore lazily on this node (no userfaultfd; see 'criu check "
                                     "--feature lazy_pages'); restore without --lazy")
        with background.gate().foreground("restore"):
            return self._restore(caller, key, lazy, gpu_map, tcp_established, notify, restore_opts,
                                 lazy_ps_socket, lazy_guard)

    def _restore(self, caller: Caller, key: str, lazy: bool, gpu_map: dict[str, str] | None,
                 tcp_established: bool, notify: NotifyCallback | None, restore_opts: dict[str, Any] | None,
                 lazy_ps_socket: int, lazy_guard: LazyGuard | None) -> RestoreResult:
        rec = self.latest_restorable(caller, key)
        if rec.state not in RESTORABLE:
            why = f": {rec.last_error}" if rec.last_error else ""
            raise FailedPrecondition(f"checkpoint {rec.id} is {rec.state} and cannot be restored{why}")
        t0 = time.monotonic()
        if lazy and lazy_ps_socket < 0 and not rec.in_tier and rec.in_store and self.drain is not None and \
                getattr(self.drain, "store", None) is not None:
            # No tier copy: page it in from the store while the job runs (memsnap.pageserver).
            from memsnap.pageserver.restore import restore_from_store

            res = restore_from_store(self, rec, t0, gpu_map, tcp_established, notify, restore_opts)
            if res is not None:
                return res
        with self.checkpoint_lock(rec.id):
            images, fetch_ms, from_store = self._local_copy(rec)
            t1 = time.monotonic()
            try:
                # A copy fetched from the store was hashed while it streamed in; a tier copy is hashed now.
                # The signed manifest must be this record's: (checkpoint id, job, owner uid).
                man = manifest.verify_dir(images, self.key, trusted=rec.meta.get("fingerprint"),
                                          bound_to=(rec.id, rec.job, rec.owner_uid))
            except manifest.IntegrityError as exc:
                self.observe("restore", "integrity", time.monotonic() - t0)
                raise IntegrityFailure(f"{exc}; checkpoint {rec.id} was not restored") from exc
            self._mark_reading(rec.id, +1)  # until CRIU is done with the tier copy (evict/delete refuse)
        try:
            return self._restore_verified(rec, man, images, t0, t1, fetch_ms, from_store, lazy, gpu_map,
                                          tcp_established, notify, restore_opts, lazy_ps_socket, lazy_guard)
        finally:
            self._mark_reading(rec.id, -1)

    def _mark_reading(self, ckpt_id: str, delta: int) -> None:
        with self._ckpt_locks_lock:
            n = self._reading.get(ckpt_id, 0) + delta
            if n > 0:
                self._reading[ckpt_id] = n
            else:
                self._reading.pop(ckpt_id, None)

    def tier_copy_in_use(self, ckpt_id: str) -> bool:
        """Whether a restore (CRIU, or a lazy restore's pager) still reads this checkpoint's tier copy."""
        with self._ckpt_locks_lock:
            if self._reading.get(ckpt_id):
                return True
        return self.lazy_in_use(ckpt_id)

    def _restore_verified(self, rec: CheckpointRecord, man: dict[str, Any], images: Path, t0: float, t1: float,
                          fetch_ms: float, from_store: bool, lazy: bool, gpu_map: dict[str, str] | None,
                          tcp_established: bool, notify: NotifyCallback | None,
                          restore_opts: dict[str, Any] | None, lazy_ps_socket: int,
                          guard: LazyGuard | None = None) -> RestoreResult:
        """restore() once the image is verified: CRIU puts the tree back, then it is recorded as a job. A lazy
        restore's guard (made here unless given) kills its tasks before lazy-pages when its pages cannot come."""
        verify_ms = (time.monotonic() - t1) * 1000
        if man.get("pages_remote") and lazy_ps_socket < 0:
            raise FailedPrecondition(f"checkpoint {rec.id} is the first half of a lazy move: its memory stayed "
                                     "on the source node, so it cannot be restored on its own")
        if not man.get("own_pidns", False) and proc.alive(rec.pid):
            raise FailedPrecondition(
                f"pid {rec.pid} is in use, and this checkpoint needs it back: stop that process first, "
                "or start jobs with 'memsnapctl run' (own PID namespace) so that restores never collide")
        if not man.get("own_pidns", False):
            proc.wait_pid_free(rec.pid, 10)
        work = self.work_root / f"{rec.id}.restore-{secrets.token_hex(3)}"
        work.mkdir(parents=True, mode=0o700)
        restore_opts, new_log = self._log_for_mount(rec, man, dict(restore_opts or {}))
        failpoints.delay("slow-restore", 3.0)  # (tests: an evict or delete arrives while CRIU would read)
        failpoints.delay("slow-restore-10s", 10.0)  # (tests: several calls meet a restore in flight)
        t2 = time.monotonic()
        guard = (guard or LazyGuard(rec.id)) if lazy else None
        server = self._start_lazy_server(rec.id, images, work, lazy_ps_socket, guard) if guard else None
        new_pid = 0
        try:
            try:
                opts = dict(restore_opts or {})
                if guard is not None:
                    opts["on_criu"], notify = guard.on_criu, guard.notify(notify)
                new_pid = self.criu.restore(images, work, RestoreOptions(
                    tcp_established=tcp_established, shell_job=False, lazy_pages=lazy,
                    tcp_close=not tcp_established or bool(man.get("tcp_close")),
                    own_mntns=bool(man.get("own_mntns", False)), **opts), notify=notify)
            except CriuError as exc:
                if server is not None:
                    _kill_group(server.pid)
                self.observe("restore", "error", time.monotonic() - t0)
                why = guard.why if guard is not None and guard.why else exc.reason
                kept = self._keep_failure(work)
                raise FailedPrecondition(f"restore of {rec.id} failed: {why} (log: {kept / Path(exc.log_path).name})") \
                    from exc
            if guard is not None and (why := guard.restored(new_pid)):
                self.observe("restore", "error", time.monotonic() - t0)
                raise FailedPrecondition(f"paging in {rec.id} failed: {why}; the restored copy was killed (logs: "
                                         f"{self._keep_failure(work)})")
            if server is not None:
                failpoints.delay("slow-restore-bookkeeping", 2.5)  # (the daemon's reaper ticks meanwhile)
                rc = guard_lazy_restore(work, new_pid)  # from here, its supervisor kills it if paging fails
                if rc:  # (the tree is killed below)
                    self.observe("restore", "error", time.monotonic() - t0)
                    kept = self._keep_failure(work)
                    raise FailedPrecondition(f"paging in {rec.id} failed (lazy-pages exit {rc}, see "
                                             f"{kept}/lazy-pages.log); the restored copy was killed")
        except BaseException:
            if new_pid:
                proc.kill_tree(new_pid)  # restored, but the restore fails: never leave it running unrecorded
            if new_log:
                Path(new_log).unlink(missing_ok=True)
            raise
        finally:
            with self._lazy_lock:
                self._restoring.discard(work)
        restore_ms = (time.monotonic() - t2) * 1000
        if man.get("parked"):
            _resume_stopped(new_pid)  # memsnap.guard dumps a parked job stopped: any restore lets it run on
        clock = PhaseClock()
        for name, ms in (("fetch", fetch_ms), ("verify", verify_ms), ("criu_restore", restore_ms)):
            clock.add(name, ms / 1000) if ms else None
        try:
            job = self._record_restored(rec, man, new_pid, server, work, gpu_map, new_log, clock)
        except BaseException:
            proc.kill_tree(new_pid)
            self.observe("restore", "error", time.monotonic() - t0)
            raise
        self._note_phases(rec.id, "restore_phases", clock)
        self.observe("restore", "ok", time.monotonic() - t0)
        log.info("restored as pid %d", new_pid, extra={"checkpoint_id": rec.id, "job": job.id})
        return RestoreResult(pid=new_pid, job=job, restore_ms=restore_ms, verify_ms=verify_ms,
                             fetch_ms=fetch_ms, from_store=from_store, lazy_server=server, work_dir=work,
                             phases=clock.rounded())

    def _keep_failure(self, work: Path) -> Path:
        """A failed restore's work dir (CRIU's logs) moves to <work>/failed, where no cleanup of its checkpoint
        (a move's target drops what it received) takes it away; the newest 32 stay. Its new place."""
        failed = self.work_root / "failed"
        try:
            failed.mkdir(mode=0o700, exist_ok=True)
            dest = failed / work.name
            work.rename(dest)
        except OSError:
            return work
        for old in sorted(failed.iterdir(), key=lambda p: p.stat().st_mtime)[:-32]:
            shutil.rmtree(old, ignore_errors=True)
        return dest

    def _record_restored(self, rec: CheckpointRecord, man: dict[str, Any], new_pid: int, server: Any, work: Path,
                         gpu_map: Any, log_path: str = "", clock: PhaseClock | None = None) -> JobRecord:
        """Brings a restored tree's GPU state back, tells its quiesce hooks to resume, and records it as a job
        (the caller kills it on error)."""
        clock = clock or PhaseClock()
        if failpoints.armed("record-restored-fails"):
            raise OSError("failpoint record-restored-fails: the catalog could not be written")
        if server is not None and failpoints.armed("kill-lazy-pages"):
            _kill_lazy_pages(server.pid)
        if self.gpu is not None and man.get("gpus"):
            try:
                clock.gpu(self.gpu.restore(new_pid, gpu_map, man.get("gpus")))
            except Exception as exc:
                # A restored tree whose CUDA state cannot come back would stay locked forever.
                raise FailedPrecondition(f"GPU state of {rec.id} could not be restored: {exc}") from exc
        t_tell = time.monotonic()
        if self.quiesce.resume(new_pid, rec.id, restored=True):  # (its quiesce hooks, if it has any)
            clock.add("quiesce_resume", time.monotonic() - t_tell)
        if server is None and not knobs.keep_logs():
            shutil.rmtree(work, ignore_errors=True)
        job = JobRecord(id="job-" + secrets.token_hex(4), name=restored_job_name(rec, man), pid=new_pid,
                        pid_start=_start_or_zero(new_pid), owner_uid=rec.owner_uid,
                        argv=list(man.get("argv", [])), log_path=log_path or str(man.get("log_path", "")),
                        started_ms=now_ms(), restored_from=rec.id)
        self.catalog.add_job(job)
        self.catalog.update_checkpoint(rec.id, last_used_ms=now_ms())
        if self.guard is not None:  # a guarded job stays guarded, here or on the node it moved to
            try:
                self.guard.restored(job, rec, man)
            except Exception as exc:
                log.warning("could not guard restored job %s again: %s", job.id, exc, extra={"job": job.id})
        return job

    def _start_lazy_server(self, ckpt_id: str, images: Path, work: Path, ps_socket: int, guard: LazyGuard) -> Any:
        """Starts `criu lazy-pages` on the tier copy (or the source's, over ps_socket); it serves faults
        and pushes the rest, then exits. guard learns of it."""
        if guard.why:  # (the pages' source failed already)
            raise FailedPrecondition(f"lazy restore of {ckpt_id} failed before it started: {guard.why}")
        server = guard.server = self.criu.start_lazy_pages(images, work, ps_socket)
        sock = work / "lazy-pages.socket"
        deadline = time.monotonic() + 10
        while not sock.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise FailedPrecondition(f"lazy-pages server for {ckpt_id} did not start; see {work}/lazy-pages.log")
            time.sleep(0.002)
        with self._lazy_lock:
            self._lazy.append((ckpt_id, server, work))
            self._restoring.add(work)
        # Serving pages is foreground work until lazy-pages exits: drains step aside (memsnap.background).
        background.gate().hold_while("lazy pages", lambda: server.poll() is None)
        return server

    def lazy_in_use(self, ckpt_id: str) -> bool:
        """Whether a lazy restore still pages from this checkpoint's tier copy (so it must stay)."""
        self.reap_lazy()
        with self._lazy_lock:
            return any(c == ckpt_id for c, _, _ in self._lazy)

    def reap_lazy(self) -> None:
        """Forgets lazy-pages servers that have served every page."""
        with self._lazy_lock:
            alive = []
            for ckpt_id, server, work in self._lazy:
                if server.poll() is None or work in self._restoring:
                    alive.append((ckpt_id, server, work))
                elif not knobs.keep_logs():
                    shutil.rmtree(work, ignore_errors=True)
            self._lazy = alive

    def _local_copy(self, rec: CheckpointRecord) -> tuple[Path, float, bool]:
        """The tier copy, fetched from the store first when it was evicted (caller holds checkpoint_lock)."""
        cur = self.catalog.get_checkpoint(rec.id)  # another restore may have fetched it while we waited
        if cur is not None:
            rec.in_tier, rec.in_store, rec.meta = cur.in_tier, cur.in_store, cur.meta
        if rec.in_tier and self.tier.has(rec.id):
            return self.tier.path(rec.id), 0.0, False
        if not rec.in_store or self.drain is None:
            raise FailedPrecondition(f"checkpoint {rec.id} has no tier copy and no stored copy; it is lost")
        t0 = time.monotonic()
        reservation = self.reserve(rec.size_bytes + _RESERVE_SLACK)
        try:
            staging = self.tier.new_staging(rec.id, unique=True)  # never shared with another fetch
            progress.phase("fetch", rec.size_bytes, progress.dir_bytes(staging, (manifest.MANIFEST,)))  # (its bar)
            try:
                self.drain.fetch(rec, staging)
                failpoints.delay("slow-fetch", 3.0)  # (tests: a client polls the fetch's progress meanwhile)
                self.tier.remove(rec.id)  # a stray copy left by a crash (the catalog says not in tier)
                self.tier.publish(staging, rec.id)
            except BaseException:
                self.tier.discard(staging)
                raise
        finally:
            reservation.release()
        # The fetch hashed every byte as it streamed in: remember that, so verification need not re-read.
        rec.meta["fingerprint"] = manifest.fingerprint(self.tier.path(rec.id))
        self.catalog.update_checkpoint(rec.id, in_tier=True, meta=rec.meta)
        progress.phase("restore")
        return self.tier.path(rec.id), (time.monotonic() - t0) * 1000, True

    # -- catalog operations ---------------------------------------------------------
    def list_checkpoints(self, caller: Caller, job: str = "") -> list[CheckpointRecord]:
        """Checkpoints the caller may see."""
        return [r for r in self.catalog.checkpoints(job=job) if caller.is_root or r.owner_uid == caller.uid]

    def delete(self, caller: Caller, ckpt_id: str) -> None:
        """Removes a checkpoint everywhere: tier, store and catalog (a stored copy another node owns stays, only
        the row here goes: retention.not_ours)."""
        rec = self.get(caller, ckpt_id)
        if rec.state == DUMPING:
            raise FailedPrecondition(f"checkpoint {ckpt_id} is still being dumped; try again in a moment")
        with self.checkpoint_lock(ckpt_id):
            self._refuse_in_use(ckpt_id)
            self._delete_copies(rec)

    def _delete_copies(self, rec: CheckpointRecord) -> None:
        """Store copy (when this node owns it: retention.not_ours), tier copy (and a park image's spill copy),
        then the catalog row; the caller holds checkpoint_lock(rec.id)."""
        if rec.in_store and self.drain is not None and not not_ours(rec, self.node):
            self.drain.delete(rec)
        self.tier.remove(rec.id)
        spill = getattr(self.guard, "spill", None)  # a park image in guard.spill_dir lives in that tier
        if rec.meta.get("spill") and spill is not None and spill is not self:
            spill.tier.remove(rec.id)
        lifecycle.forget(self.catalog, rec.id)

    def try_delete(self, ckpt_id: str, veto: Callable[[CheckpointRecord], str]) -> str:
        """Deletes a checkpoint (memsnap.gc) unless someone holds its lock (a fetch, restore, evict or
        delete: never waited for) or veto(its current record) names a reason. "" once deleted, else why not."""
        lock = self._lock_for(ckpt_id)
        if not lock.acquire(blocking=False):
            return "busy: a fetch, restore or delete holds it"
        try:
            rec = self.catalog.get_checkpoint(ckpt_id)
            if rec is None:
                return "already deleted"
            why = veto(rec)
            if why:
                return why
            self._delete_copies(rec)
            return ""
        finally:
            lock.release()

    def evict(self, caller: Caller, ckpt_id: str) -> CheckpointRecord:
        """Drops the tier copy of a durable checkpoint; staged-only ones are never evicted."""
        rec = self.get(caller, ckpt_id)
        if rec.state != DURABLE or not rec.in_store:
            raise FailedPrecondition(f"checkpoint {ckpt_id} is {rec.state}, not durable: evicting its tier copy "
                                     "would lose it; wait for the drain ('memsnapctl watch')")
        with self.checkpoint_lock(ckpt_id):
            self._refuse_in_use(ckpt_id)
            self._evict(rec)
        out = self.catalog.get_checkpoint(ckpt_id)
        assert out is not None
        return out

    def _refuse_in_use(self, ckpt_id: str) -> None:
        """Refuses to drop a tier copy that a restore still reads (the caller holds checkpoint_lock)."""
        if self.tier_copy_in_use(ckpt_id):
            raise FailedPrecondition(f"a restore is still reading the tier copy of {ckpt_id}; try again when it "
                                     "is done")

    def _evict(self, rec: CheckpointRecord) -> None:
        """Drops a tier copy; the caller holds checkpoint_lock(rec.id)."""
        # Journal first: a crash after this leaves a stray dir that recovery removes.
        self.catalog.update_checkpoint(rec.id, in_tier=False)
        self.tier.remove(rec.id)

    # -- held trees (a move in progress) ------------------------------------------------
    def end_held(self, pid: int, job_id: str = "", ckpt_id: str = "") -> None:
        """Ends a tree held stopped by checkpoint(hooks=DumpHooks(hold=True)) once it runs elsewhere."""
        proc.kill_tree(pid)
        if job_id:
            self.catalog.update_job(job_id, ended=True)
        self._release_hold(ckpt_id, done=("gpu", "quiesce"))  # (its processes are gone: nothing to undo)

    def resume_held(self, pid: int, ckpt_id: str = "") -> None:
        """Lets a held tree run on (SIGCONT), after a move that did not happen: the CUDA state its dump left
        checkpointed (journaled in the record) is restored and unlocked, then its quiesce hooks hear resume."""
        _resume_stopped(pid)  # (first: the driver's restore needs the process's CUDA restore thread to run)
        rec = self.catalog.get_checkpoint(ckpt_id) if ckpt_id else None
        meta = rec.meta if rec is not None else {}
        done = ["quiesce"]
        if meta.get("gpu") and self.gpu is not None:
            back = self.gpu.recover(meta["gpu"])
            ok = not any(str(v).startswith("error") for v in back.values())  # (else a restart tries again)
            done += ["gpu"] if ok else []
            (log.info if ok else log.error)("CUDA state of held pid %d: %s", pid, back,
                                            extra={"checkpoint_id": ckpt_id})
        if meta.get("quiesce"):
            self.quiesce.resume(pid, ckpt_id, restored=False)
        self._release_hold(ckpt_id, done=tuple(done))

    def _release_hold(self, ckpt_id: str, done: tuple[str, ...] = ()) -> None:
        """The hold is over; done: journaled steps (meta keys) nothing is left to undo for."""
        rec = self.catalog.get_checkpoint(ckpt_id) if ckpt_id else None
        if rec is not None and (rec.meta.get("hold") or any(k in rec.meta for k in done)):
            meta = {k: v for k, v in rec.meta.items() if k not in done}
            self.catalog.update_checkpoint(ckpt_id, meta={**meta, "hold": False})

    def status(self, caller: Caller = ROOT) -> dict[str, Any]:
        """Numbers for `memsnapctl status`: daemon-wide for root, the caller's own jobs and checkpoints else."""
        if caller.is_root:
            counts = self.catalog.counts_by_state()
        else:
            counts = {}
            for r in self.catalog.checkpoints():
                if r.owner_uid == caller.uid:
                    counts[r.state] = counts.get(r.state, 0) + 1
        running = sum(1 for j in self.catalog.jobs() if (caller.is_root or j.owner_uid == caller.uid)
                      and not j.ended and proc.alive(j.pid, j.pid_start))
        extra = background.gate().snapshot() if caller.is_root else {}  # drains paused, and why
        return {
            **extra,
            "version": __version__, "criu_version": self.criu.version(), "hostname": self.hostname,
            "kernel": platform.release(), "tier_dir": str(self.tier.root),
            "tier_used_bytes": self.tier.used_bytes(), "tier_free_bytes": self.tier.free_bytes(),
            "tier_capacity_bytes": self.tier.capacity_bytes(), "jobs_running": running, "net_ns": proc.net_ns_id(),
            "checkpoints": sum(counts.values()), "checkpoints_by_state": counts,
        }

    # -- crash recovery ---------------------------------------------------------------
    def recover(self, moves: MoveRecovery | None = None) -> dict[str, int]:
        """Reconciles the catalog with the tier after a (possibly unclean) stop.

        Checkpoints with move marks (catalog.MoveMarks) go to moves (memsnap.move.Mover): a commit in doubt
        on the source, or a restored move the source never committed on the target. Without moves, held
        copies in doubt stay stopped and restored moves stay as they are.
        """
        fixed = {"failed_dumps": 0, "stray_staging": 0, "stray_tier": 0, "lost_tier": 0}
        for stale in self.work_root.glob("*.lazystore-*"):  # a lazy restore from the store ends with its daemon
            shutil.rmtree(stale, ignore_errors=True)
        in_doubt: set[str] = set()

        def doubt(rec: CheckpointRecord) -> None:
            in_doubt.add(rec.id)  # the mover asks the target; the copy here stays stopped meanwhile
            if moves is not None:
                moves.in_doubt(rec)

        for rec in self.catalog.checkpoints(states=(DUMPING,)):
            # A dump was cut short: roll back. CRIU unfreezes on its own failure, but a --stop dump that
            # had finished left the tree stopped: never leave a job frozen.
            self.tier.discard_staging(rec.id)
            lifecycle.advance(self.catalog, rec.id, FAILED, last_error="daemon stopped during the dump")
            marks = rec.marks
            if (rec.meta.get("stop") or marks.hold) and \
                    proc.alive(rec.pid, float(rec.meta.get("pid_start", 0.0))):
                if marks.moved_to:
                    # A lazy move the target had confirmed complete: the job runs there now.
                    self.end_held(rec.pid, rec.job, rec.id)
                elif marks.committing_to:
                    doubt(rec)
                else:
                    # A lazy dump's CRIU may still hold the tree for a moment after we died; SIGCONT
                    # only helps once it let go.
                    _wait_untraced(rec.pid, 30)
                    _resume_stopped(rec.pid)
            fixed["failed_dumps"] += 1
        for rec in self.catalog.checkpoints(states=RESTORABLE):
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
                        self.end_held(rec.pid, rec.job, rec.id)
                    elif marks.committing_to:
                        # We died while telling the target to keep the job: whether it runs there is
                        # the target's to say.
                        doubt(rec)
                    else:
                        self.resume_held(rec.pid, rec.id)
                continue
            # Published, but the daemon died before ending a --stop job: finish what was asked.
            if rec.meta.get("stop") and rec.in_tier and self.tier.has(rec.id) and \
                    proc.alive(rec.pid, float(rec.meta.get("pid_start", 0.0))):
                proc.kill_tree(rec.pid)
                if rec.job:
                    self.catalog.update_job(rec.job, ended=True)
        for ckpt_id in list(self.tier.staging_ids()):
            self.tier.discard_staging(ckpt_id)
            fixed["stray_staging"] += 1
        known = set(self.catalog.iter_ids())
        for ckpt_id in self.tier.published_ids():
            found = self.catalog.get_checkpoint(ckpt_id) if ckpt_id in known else None
            if found is None or not found.in_tier:
                self.tier.remove(ckpt_id)
                fixed["stray_tier"] += 1
        for rec in self.catalog.checkpoints():
            if rec.in_tier and not self.tier.has(rec.id) and not rec.meta.get("spill"):  # (guard's spill tier)
                # The tier is memory: a reboot empties it. Only the stored copy remains, if any.
                self.catalog.update_checkpoint(rec.id, in_tier=False)
                if not rec.in_store and rec.state in (STAGED, DRAINING):
                    lifecycle.advance(self.catalog, rec.id, FAILED,
                                      last_error="tier copy lost before it became durable")
                fixed["lost_tier"] += 1
        # CUDA state a killed daemon left locked or checkpointed (journaled before the GPU step): jobs that
        # run on by now (SIGCONT above) must get it back, or they hang in their next CUDA call forever.
        for rec in self.catalog.checkpoints():
            if rec.meta.get("gpu") and self.gpu is not None and rec.id not in in_doubt:
                log.warning("CUDA recovery for %s: %s", rec.id, self.gpu.recover(rec.meta["gpu"]))
                self.catalog.update_checkpoint(rec.id, meta={k: v for k, v in rec.meta.items() if k != "gpu"})
            if rec.meta.get("quiesce") and rec.id not in in_doubt:  # (a job that was asked to quiesce: resume it)
                if proc.alive(rec.pid, float(rec.meta.get("pid_start", 0.0))):
                    self.quiesce.resume(rec.pid, rec.id, restored=False)
                self._journal(rec, "quiesce")(None)
        for job in self.catalog.jobs():
            if not job.ended and not proc.alive(job.pid, job.pid_start):
                self.catalog.update_job(job.id, ended=True)
        return fixed

    def live_jobs_restored_from(self, ckpt_id: str) -> list[JobRecord]:
        """The jobs restored here from ckpt_id that still run."""
        return [j for j in self.catalog.jobs()
                if j.restored_from == ckpt_id and not j.ended and proc.alive(j.pid, j.pid_start)]

    def pending_drains(self) -> list[str]:
        """Staged or draining checkpoints that still need to reach the store."""
        return [r.id for r in self.catalog.checkpoints(states=(STAGED, DRAINING))
                if r.in_tier and not r.meta.get("spill")]

    # -- job lifecycle: memsnapctl stop, kill, rm, prune, logs ----------------------------
    def find_job(self, caller: Caller, key: str) -> JobRecord:
        """A job the caller may see, by id, name or root pid: an id wins, then a running job, then the
        newest. Another uid's jobs are invisible here (NotFound), so names never leak across users."""
        key = (key or "").strip()
        if not key:
            raise InvalidArgument("no job given; pass a job id, name or pid ('memsnapctl jobs' lists them)")
        cands = [j for j in self.catalog.jobs() if key in (j.id, j.name, str(j.pid))
                 and (caller.is_root or j.owner_uid == caller.uid)]
        if not cands and key.isascii() and key.isdigit() and int(key) < 1 << 22:  # a pid inside a job: the job
            inside = resolve.job_containing(self.catalog.jobs(), int(key))
            cands = [inside] if inside and (caller.is_root or inside.owner_uid == caller.uid) else []
        if not cands:
            raise NotFound(f"no job {key!r}; 'memsnapctl jobs' lists the jobs")
        return max(cands, key=lambda j: (j.id == key, self._job_running(j), j.started_ms))

    @staticmethod
    def _job_running(j: JobRecord) -> bool:
        return not j.ended and jobs.alive(j.pid, j.pid_start)

    def stop_job(self, caller: Caller, key: str, timeout_s: float = 10.0,
                 kill: bool = False) -> tuple[JobRecord, bool, float]:
        """Ends a job: SIGTERM (passed on by the job's init), then SIGKILL to the tree after timeout_s.
        Returns the job, whether SIGKILL was needed, and how long it took (ms). An ended job is left as is."""
        import signal

        from memsnap import jobinit

        job = self.find_job(caller, key)
        t0 = time.monotonic()
        if not self._job_running(job):
            self.catalog.update_job(job.id, ended=True)
            return job, False, 0.0
        with self._busy_lock:
            if job.pid in self._busy:
                raise Aborted(f"job {job.id} is being checkpointed; stop it when that is done")
        killed = kill
        if kill:
            jobs.kill_tree(job.pid)
        else:
            for p in jobinit.signal_targets(job.pid):
                try:
                    p.send_signal(signal.SIGTERM)
                except Exception:  # gone meanwhile
                    pass
            if not jobs.wait_gone(job.pid, timeout_s if timeout_s > 0 else 10.0):
                killed = True
                jobs.kill_tree(job.pid)
        self.catalog.update_job(job.id, ended=True)
        log.info("job %s", "killed" if killed else "stopped", extra={"job": job.id, "pid": job.pid,
                                                                     "uid": caller.uid})
        job.ended = True
        return job, killed, (time.monotonic() - t0) * 1000

    def _log_in_use(self, job: JobRecord) -> bool:
        """Whether another job or a restorable checkpoint still needs this job's log file (a restore
        reopens it)."""
        if any(j.id != job.id and j.log_path == job.log_path for j in self.catalog.jobs()):
            return True
        return any(r.meta.get("log_path") == job.log_path for r in self.catalog.checkpoints(states=RESTORABLE))

    def _remove_job(self, job: JobRecord) -> int:
        """Forgets an ended job; removes its log files when nothing else needs them. Returns bytes freed."""
        freed = 0
        if job.log_path and not self._log_in_use(job):
            log_dir = self.launcher.log_dir.resolve()
            for path in (Path(job.log_path), Path(job.log_path).with_suffix(".launcher.log")):
                try:
                    if path.resolve().parent == log_dir:
                        freed += path.stat().st_size
                        path.unlink()
                except OSError:
                    pass
        self.catalog.delete_job(job.id)
        return freed

    def delete_job(self, caller: Caller, key: str, force: bool = False) -> JobRecord:
        """Forgets an ended job (force: kills a running one first)."""
        job = self.find_job(caller, key)
        if self._job_running(job):
            if not force:
                raise FailedPrecondition(f"job {job.id} is running; stop it first ('memsnapctl stop "
                                         f"{job.id}') or pass --force")
            self.stop_job(caller, job.id, kill=True)
        self._remove_job(job)
        log.info("job removed", extra={"job": job.id, "uid": caller.uid})
        return job

    def prune(self, caller: Caller, dry_run: bool = False) -> tuple[list[JobRecord], list[CheckpointRecord], int]:
        """Removes the caller's ended jobs and failed checkpoints (all of them for root)."""
        mine = [j for j in self.catalog.jobs() if caller.is_root or j.owner_uid == caller.uid]
        ended = [j for j in mine if not self._job_running(j)]
        failed = [r for r in self.catalog.checkpoints(states=(FAILED,))
                  if (caller.is_root or r.owner_uid == caller.uid) and not r.meta.get("hold")]
        if dry_run:
            return ended, failed, sum(_file_size(j.log_path) for j in ended if not self._log_in_use(j))
        freed = 0
        for r in failed:
            try:
                self.delete(caller, r.id)
            except NotFound:
                pass
            if not os.environ.get("MEMSNAP_KEEP_LOGS"):
                shutil.rmtree(self.work_root / r.id, ignore_errors=True)
        for j in ended:
            self.catalog.update_job(j.id, ended=True)
            freed += self._remove_job(j)
        log.info("pruned %d jobs and %d failed checkpoints", len(ended), len(failed), extra={"uid": caller.uid})
        return ended, failed, freed

    def job_log(self, caller: Caller, key: str, follow: bool = False, tail_bytes: int = 0,
                active: Callable[[], bool] = lambda: True) -> Iterator[tuple[JobRecord, bytes]]:
        """A job's output in chunks: the log as it is (or its last tail_bytes), then, with follow, what
        the job writes until it ends and its last output is read, or active() turns false."""
        job = self.find_job(caller, key)
        path = Path(job.log_path)
        try:
            f = open(path, "rb")  # noqa: SIM115 (read across yields)
        except OSError as exc:
            raise NotFound(f"the log of job {job.id} is gone ({path}: {exc.strerror})") from exc
        with f:
            if tail_bytes:
                size = os.fstat(f.fileno()).st_size
                f.seek(max(0, size - tail_bytes))
            yield job, b""
            while True:
                data = f.read(1 << 16)
                if data:
                    yield job, data
                    continue
                if not follow or not active():
                    return
                if not self._job_running(self.catalog.get_job(job.id) or job):
                    data = f.read(1 << 16)
                    if data:
                        yield job, data
                        continue
                    return
                time.sleep(0.2)

    def restore_own_log(self, caller: Caller, key: str, moved: bool = False, **kw: Any) -> RestoreResult:
        """restore(), with the restored job's output going to a log of its own: <first job's log stem>.restore-
        <checkpoint>-<token>.log next to the parent's, which starts with a line naming the checkpoint and
        the parent log. Two restores of one checkpoint never write into one file; the old log stays as it
        was. Images whose job had no log (not started by memsnap) restore as before.

        A job with a private /tmp writes its log through a bind mount in its own mount namespace (log_mount):
        the restore binds its new log there (_log_for_mount). Any other job gets its new log as the file
        every fd of the old one reopens (CRIU's inherit_fd); one in its own mount namespace without that mount
        keeps its log (an fd handed in from the daemon's namespace would sit on a mount the job's namespace
        does not own, and CRIU could not dump the job again).

        moved: a job that moved here (RestoreReceived). Its log was the source's, in another daemon's state dir (on
        another node it need not even exist): it gets one in this daemon's log dir, under the same name, and the
        job records where it came from (moved_from: SOURCE_HOST/SOURCE_JOB)."""
        rec = self.latest_restorable(caller, key)
        parent = str(rec.meta.get("log_path") or "")
        log_dir = self.launcher.log_dir.resolve()
        moved_from = f"{rec.meta.get('host') or '?'}/{rec.job or rec.id}" if moved else ""
        if not parent or (Path(parent).resolve().parent != log_dir and not moved) or rec.meta.get("own_mntns") \
                or rec.meta.get("log_mount"):
            res = self.restore(caller, key, **kw)
            if moved_from:
                self.catalog.update_job(res.job.id, moved_from=moved_from)
                res.job.moved_from = moved_from
            return res
        path, fd = self._open_new_log(rec, parent, moved_from)
        try:
            opts = dict(kw.pop("restore_opts", None) or {})
            # CRIU names a regular file by its path without the leading '/'; every fd the job had on its
            # log (stdout and stderr) gets the new file instead.
            opts["inherit_fds"] = {**opts.get("inherit_fds", {}), parent.lstrip("/"): fd}
            res = self.restore(caller, rec.id, restore_opts=opts, **kw)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.catalog.update_job(res.job.id, log_path=str(path), **({"moved_from": moved_from} if moved else {}))
        res.job.log_path, res.job.moved_from = str(path), moved_from
        return res

    def _open_new_log(self, rec: CheckpointRecord, parent: str, moved_from: str = "") -> tuple[Path, int]:
        """A new log for a restored (or moved) copy of rec, in this node's log dir, owned by the job's uid, that
        starts with a line naming where it came from; its path and an open fd."""
        # Named after the first job of the chain, not the parent: the name stays the same length however many
        # generations a job lives through (a name that grew by one parent per restore hit ENAMETOOLONG at the 6th).
        root = Path(parent).stem.split(".restore-", 1)[0] if parent else (rec.job or rec.id)
        path = self.launcher.log_dir.resolve() / f"{root}.restore-{rec.id}-{secrets.token_hex(3)}.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            if rec.owner_uid:
                os.fchown(fd, rec.owner_uid, -1)
            came = f"moved here from {moved_from} ({rec.id})" if moved_from else f"restored from {rec.id}"
            os.write(fd, f"# memsnap: {came}; earlier output: {parent or '-'}\n".encode())
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return path, fd

    def _log_for_mount(self, rec: CheckpointRecord, man: dict[str, Any],
                       opts: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """For an image whose job log is a bind mount (its private /tmp): a new log of this node's own, bound
        there by CRIU (opts["external"]); the options and the new log's path ("" for any other image)."""
        key = str(man.get("log_mount") or "")
        if not key:
            return opts, ""
        if key != mounts.LOG_MOUNT_KEY:
            raise FailedPrecondition(f"checkpoint {rec.id} names a job log mount {_clip(key, 40)!r} this memsnap "
                                     "does not know; restore it with the memsnap version that made it")
        moved_from = f"{man.get('host') or '?'}/{rec.job or rec.id}" if rec.marks.move_incoming else ""
        path, fd = self._open_new_log(rec, str(man.get("log_path") or ""), moved_from)
        os.close(fd)
        opts["external"] = [*opts.get("external", []), f"mnt[{key}]:{path}"]
        return opts, str(path)


def restored_job_name(rec: CheckpointRecord, man: dict[str, Any]) -> str:
    """What a restored job is called: the job it was (not the checkpoint's own --name), else, for a process
    memsnap did not start, its command's name; a checkpoint from before job names were signed: its name."""
    if man.get("job_name"):
        return str(man["job_name"])
    if rec.job:
        return rec.name or rec.job
    argv = [str(a) for a in man.get("argv") or []]
    argv = argv[4:] if jobinit.is_init(argv) else argv
    return os.path.basename(argv[0])[:64] if argv and argv[0] else rec.name or rec.id


def _below_tmp(path: Path) -> bool:
    return path.resolve().is_relative_to("/tmp")


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size if path else 0
    except OSError:
        return 0


def _resume_stopped(pid: int) -> None:
    import signal

    for p in proc.tree(pid):
        try:
            p.send_signal(signal.SIGCONT)
        except Exception:  # the process may be gone already
            pass


def _kill_group(pgid: int) -> None:
    import signal

    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


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


def _clip(text: str, n: int = 200) -> str:
    """At most n characters of caller input, for error messages."""
    return text if len(text) <= n else text[:n] + "..."


def scoped_name(caller: Caller, key: str) -> tuple[int, str, bool]:
    """'NAME' -> (caller's uid, NAME, False); 'UID:NAME' -> (UID, NAME, True), which only root may use for
    another uid."""
    uid_s, sep, rest = key.partition(":")
    if sep and uid_s.isascii() and uid_s.isdigit() and len(uid_s) <= 10:
        uid = int(uid_s)
        if uid != caller.uid and not caller.is_root:
            raise PermissionDenied(f"uid {caller.uid} may not name uid {uid}'s jobs or checkpoints")
        return uid, rest, True
    return caller.uid, key, False


# PF_KTHREAD in /proc/PID/stat's flags field.
_PF_KTHREAD = 0x00200000


def refuse_uncheckpointable(pid: int) -> None:
    """Refuses, before any work, what memsnap must never dump: PID 1, kernel threads, this daemon and its
    ancestors (dumping one would freeze the daemon itself, or the whole system)."""
    if pid == 1:
        raise InvalidArgument("pid 1 is the system's init: memsnap never checkpoints it")
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        flags = int(stat.rsplit(")", 1)[1].split()[6])
    except (OSError, IndexError, ValueError):
        flags = 0
    if pid == 2 or flags & _PF_KTHREAD:
        raise InvalidArgument(f"pid {pid} is a kernel thread: memsnap cannot checkpoint it")
    try:
        tgid = next((int(ln.split()[1]) for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if ln.startswith("Tgid:")), pid)
    except (OSError, ValueError, IndexError):
        tgid = pid
    if tgid != pid:
        raise InvalidArgument(f"{pid} is a thread of process {tgid}: pass the process id")
    me = os.getpid()
    ancestors = set()
    p = me
    while p > 1 and p not in ancestors:
        ancestors.add(p)
        try:
            p = os.getppid() if p == me else int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    if pid in ancestors:
        what = "memsnapd itself" if pid == me else "an ancestor of memsnapd"
        raise InvalidArgument(f"pid {pid} is {what}: memsnap never checkpoints the daemon's own tree")


def _start_or_zero(pid: int) -> float:
    try:
        return proc.start_time(pid)
    except proc.ProcessNotFound:
        return 0.0



def _kill_lazy_pages(supervisor_pid: int) -> None:
    """Kills lazy-pages itself, not its supervisor shell (failpoint kill-lazy-pages)."""
    import psutil

    for child in psutil.Process(supervisor_pid).children():
        child.kill()
