"""The engine: checkpoint, restore and the checkpoint state machine. Usable without gRPC."""

from __future__ import annotations

import logging
import platform
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from memsnap import (
    __version__,
    background,
    containers,
    jobs,
    lifecycle,
    proc,
    recovery,
    resolve,
)
from memsnap.caller import ROOT as ROOT  # (re-exported: callers import them from here)
from memsnap.caller import Caller as Caller
from memsnap.caller import scoped_name as scoped_name  # (re-exported)
from memsnap.catalog import (
    DRAINING,
    DUMPING,
    DURABLE,
    RESTORABLE,
    STAGED,
    Catalog,
    CheckpointRecord,
    JobRecord,
)
from memsnap.checkpointer import Checkpointer
from memsnap.checkpointer import DumpExtras as DumpExtras  # (re-exported)
from memsnap.collaborators import EngineConfig as EngineConfig  # (re-exported)
from memsnap.collaborators import GpuAdapter, JobGuard, Uploads
from memsnap.copies import TierCopies
from memsnap.criu import (
    CriuApi,
    NotifyCallback,
)
from memsnap.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from memsnap.jobtable import JobTable
from memsnap.lazyguard import LazyGuard
from memsnap.manifest import Manifest
from memsnap.pageserver.restore import restore_from_store
from memsnap.phases import PhaseClock
from memsnap.quiesce.notifier import Quiescer
from memsnap.recovery import MoveRecovery as MoveRecovery  # (re-exported)
from memsnap.repository import Repository, adopted_record
from memsnap.restorer import Restorer, RestoreRequest
from memsnap.restorer import RestoreResult as RestoreResult
from memsnap.retention import not_ours
from memsnap.tier import MemoryTier, TierReservation
from memsnap.tiers import MEMORY, Tiers
from memsnap.validate import shorten

log = logging.getLogger("memsnap.engine")


class Engine:
    """Checkpoint, restore and catalog operations with authorization and crash-safe ordering."""

    def __init__(self, cfg: EngineConfig, catalog: Catalog, tier: Tiers | MemoryTier, criu: CriuApi, hmac_key: bytes,
                 drain: Uploads | None = None, gpu: GpuAdapter | None = None, repo: Repository | None = None,
                 observe: Callable[[str, str, float], None] | None = None) -> None:
        self.cfg = cfg
        self.catalog = catalog
        # the memory tier and the guard's spill tier, when it has one (a bare MemoryTier: the memory tier alone)
        self.tier = tier if isinstance(tier, Tiers) else Tiers(tier)
        self.criu = criu
        self.key = hmac_key
        self.drain = drain
        self.repo = repo  # the store (None without one): fetch, find, delete (memsnap.repository)
        self.gpu = gpu
        # observe(kind, result, seconds): metrics callback ("checkpoint", "ok", 1.2), or a phase ("phase:freeze", ...)
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
        self.restorer = Restorer(self, from_store=restore_from_store)  # every restore (memsnap.restorer)
        self.copies = TierCopies(catalog, self.tier, self.restorer.tier_copy_in_use)  # locks, room, eviction
        self.jobtable = JobTable(self)  # jobs: run, stop, rm, prune, logs (memsnap.jobtable)
        self.checkpointer = Checkpointer(self)  # every dump (memsnap.checkpointer)
        self.quiesce = Quiescer()  # the jobs' quiesce hooks (memsnap.quiesce)
        self.guard: JobGuard | None = None  # memsnap.guard.service.Guard, set by the daemon

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

    def authorize_uid(self, caller: Caller, owner: int, what: str) -> None:
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
                raise InvalidArgument(f"{shorten(target)!r} is not a valid PID")
            if not proc.alive(pid):
                raise NotFound(f"no process with pid {pid}; check the pid with 'ps' or 'memsnapctl jobs'")
            resolve.refuse_uncheckpointable(pid)
            job = self.catalog.job_by_pid(pid) or resolve.job_containing(self.catalog.jobs(), pid)
            if job is not None:  # (a pid inside a job: the whole job, its root, once the caller may act on it)
                self.authorize_uid(caller, job.owner_uid, f"pid {pid}")
                if job.pid != pid:
                    log.info("pid %d is in job %s: acting on the whole job", pid, job.id, extra={"job": job.id})
                return job.pid, job
            return pid, None
        if target.lstrip("-").isdigit():
            raise InvalidArgument(f"{shorten(target)!r} is not a valid PID")
        job = self.catalog.get_job(target)
        if job is None:
            job = self._job_by_name(caller, target)
        self.authorize_uid(caller, job.owner_uid, f"job {job.id}")  # before its pid or state is told
        if job.ended or not proc.alive(job.pid, job.pid_start):
            raise NotFound(f"job {job.id} is not running; restore one of its checkpoints instead")
        resolve.refuse_uncheckpointable(job.pid)
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
                raise InvalidArgument(f"root has no job named {shorten(name)!r}; uid {', '.join(map(str, others))} "
                                      f"has one: name it as UID:NAME, e.g. {others[0]}:{shorten(name)}")
        raise InvalidArgument(f"{shorten(target)!r} is neither a PID nor a known job; pass a numeric PID or a job "
                              "id (names are looked up among your own jobs)")

    def get(self, caller: Caller, ckpt_id: str) -> CheckpointRecord:
        """A checkpoint the caller may see, or NotFound/PermissionDenied."""
        if not ckpt_id or "/" in ckpt_id or ckpt_id.startswith("."):
            raise InvalidArgument(f"{ckpt_id!r} is not a checkpoint id")
        rec = self.catalog.get_checkpoint(ckpt_id)
        if rec is None:
            raise NotFound(f"no checkpoint {ckpt_id!r}; 'memsnapctl list' shows the checkpoints")
        self.authorize_uid(caller, rec.owner_uid, f"checkpoint {ckpt_id}")
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

    # -- jobs (memsnap.jobtable) --------------------------------------------------------
    def run_job(self, caller: Caller, argv: list[str], name: str = "", cwd: str = "",
                env: dict[str, str] | None = None, own_proc: bool | None = None,
                cgroup_procs: str = "", private_tmp: bool | None = None) -> JobRecord:
        """Starts argv as a managed job in its own PID namespace, as the caller's uid."""
        return self.jobtable.run_job(caller, argv, name, cwd, env, own_proc, cgroup_procs, private_tmp)

    def list_jobs(self, caller: Caller) -> list[tuple[JobRecord, bool]]:
        """Jobs the caller may see, with whether each still runs."""
        return self.jobtable.list_jobs(caller)

    def find_job(self, caller: Caller, key: str) -> JobRecord:
        """A job the caller may see, by id, name or root pid (JobTable.find_job)."""
        return self.jobtable.find_job(caller, key)

    def stop_job(self, caller: Caller, key: str, timeout_s: float = 10.0,
                 kill: bool = False) -> tuple[JobRecord, bool, float]:
        """Ends a job: SIGTERM (passed on by the job's init), then SIGKILL to the tree after timeout_s."""
        return self.jobtable.stop_job(caller, key, timeout_s, kill)

    def delete_job(self, caller: Caller, key: str, force: bool = False) -> JobRecord:
        """Forgets an ended job (force: kills a running one first)."""
        return self.jobtable.delete_job(caller, key, force)

    def prune(self, caller: Caller, dry_run: bool = False) -> tuple[list[JobRecord], list[CheckpointRecord], int]:
        """Removes the caller's ended jobs and failed checkpoints (all of them for root)."""
        return self.jobtable.prune(caller, dry_run)

    def job_log(self, caller: Caller, key: str, follow: bool = False, tail_bytes: int = 0,
                active: Callable[[], bool] = lambda: True) -> Iterator[tuple[JobRecord, bytes]]:
        """A job's output in chunks (JobTable.job_log)."""
        return self.jobtable.job_log(caller, key, follow, tail_bytes, active)

    def checkpointing(self, pid: int) -> bool:
        """Whether a checkpoint of pid runs now (see exclusive())."""
        with self._busy_lock:
            return pid in self._busy

    # -- checkpoint (memsnap.checkpointer) ----------------------------------------------
    def checkpoint(self, caller: Caller, target: str, stop: bool = False, tcp_established: bool = False,
                   name: str = "", extras: DumpExtras | None = None) -> CheckpointRecord:
        """Dumps a process tree into the tier and publishes it atomically; the job runs on unless stop."""
        return self.checkpointer.checkpoint(caller, target, stop, tcp_established, name, extras)

    def dump_estimate(self, pid: int) -> int:
        """The tier room a dump of pid's tree reserves: its resident memory and its CUDA processes' device memory."""
        return self.checkpointer.dump_estimate(pid)

    def new_manifest(self, rec: CheckpointRecord, argv: list[str], own_ns: bool, job: JobRecord | None,
                     files: dict[str, dict[str, Any]], **fields: Any) -> Manifest:
        """The manifest of an image dumped here (fields: frozen_ms, dump_ms, gpus, pages_remote, ...)."""
        return self.checkpointer.new_manifest(rec, argv, own_ns, job, files, **fields)

    def reserve(self, nbytes: int, into: str = MEMORY) -> TierReservation:
        """Reserves room in a tier, evicting durable memory-tier copies least-recently-used first if needed
        (TierCopies)."""
        return self.copies.reserve(nbytes, into)

    def checkpoint_lock(self, ckpt_id: str) -> AbstractContextManager[None]:
        """Serialises fetch, publish, evict and delete of one checkpoint's tier and store copies."""
        return self.copies.checkpoint_lock(ckpt_id)

    def journal(self, rec: CheckpointRecord, key: str) -> Callable[[Any], None]:
        """write(entry) keeps a step recover() must undo in the record's meta[key] (None or False: done)."""
        def write(entry: Any) -> None:
            value = None if entry is None or entry is False else entry
            if value is None:
                rec.meta.pop(key, None)
            else:
                rec.meta[key] = value
            lifecycle.mark(self.catalog, rec.id, **{key: value})
        return write

    def note_phases(self, ckpt_id: str, key: str, clock: PhaseClock) -> None:
        """An operation's phases into the checkpoint's record (memsnapctl show) and the phase histogram."""
        lifecycle.mark(self.catalog, ckpt_id, **{key: clock.rounded()})
        clock.observe(self.observe)

    # -- restore --------------------------------------------------------------------
    def latest_restorable(self, caller: Caller, key: str) -> CheckpointRecord:
        """A checkpoint id, or a job id/name -> the checkpoint to restore.

        Names are looked up among the caller's own checkpoints ('UID:NAME' for root to name another
        owner's); the shared store is searched, by name and owner, only when the catalog has none.
        """
        rec = self.catalog.get_checkpoint(key)
        if rec is not None:
            self.authorize_uid(caller, rec.owner_uid, f"checkpoint {key}")
            return rec
        restorable = self.catalog.checkpoints(states=RESTORABLE)
        if containers.parse_target(key) is not None:  # a container's newest checkpoint (memsnap.containers)
            cands = [r for r in restorable if containers.is_of(r.meta, key) and (caller.is_root or
                                                                               r.owner_uid == caller.uid)]
            if not cands:
                raise NotFound(f"no restorable checkpoint of container {shorten(key)!r}; 'memsnapctl list --job "
                               f"{shorten(key)}' shows its checkpoints")
            return max(cands, key=lambda r: (r.created_ms, r.id))
        job = self.catalog.get_job(key)
        if job is not None:
            self.authorize_uid(caller, job.owner_uid, f"job {job.id}")
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
                    raise InvalidArgument(f"root has no checkpoint named {shorten(name)!r}; uid "
                                          f"{', '.join(map(str, others))} has: name it as UID:NAME, "
                                          f"e.g. {others[0]}:{shorten(name)}")
            adopted = self._catalog_from_store(name, owner)
            if adopted is None:
                raise NotFound(f"no checkpoint {shorten(key)!r}; 'memsnapctl list' shows the checkpoints")
            cands = [adopted]
        rec = max(cands, key=lambda r: (r.created_ms, r.id))
        self.authorize_uid(caller, rec.owner_uid, f"checkpoint {rec.id}")
        return rec

    def _catalog_from_store(self, name: str, owner: int) -> CheckpointRecord | None:
        """Catalogs the newest durable checkpoint another node stored under this job name (shared store and
        key). The store's name index is only a hint: the signed manifest must carry this name and owner."""
        if self.repo is None:
            return None
        for stored in self.repo.find(name):
            m = stored.man
            if self.catalog.get_checkpoint(m.id) is not None:
                continue
            if m.name != name or m.uid != owner:
                log.warning("store index %r lists %s, whose signed manifest names %r of uid %s: not adopted",
                            name, m.id, m.name, m.uid)
                continue
            home = str(m.extra.get("node") or m.host or "?")  # its stored copy is that node's to delete
            rec = adopted_record(stored, home if home != self.node else "")
            lifecycle.begin(self.catalog, rec)
            log.info("adopted %s of %r from the shared store (written by %s)", rec.id, name, m.host)
            return rec
        return None

    def restore(self, caller: Caller, key: str, lazy: bool = False, gpu_map: dict[str, str] | None = None,
                tcp_established: bool = False, notify: NotifyCallback | None = None,
                restore_opts: dict[str, Any] | None = None, lazy_ps_socket: int = -1,
                lazy_guard: LazyGuard | None = None, into: str = "") -> RestoreResult:
        """Verifies a checkpoint against its signed manifest, then restores it detached.

        notify gets CRIU's callbacks (post-restore, ...); restore_opts adds RestoreOptions fields.
        lazy_ps_socket (a lazy move, memsnap.move.lazy): the pages come from the source over that socket, and
        lazy_guard (the move's) kills the tasks first when they cannot come. into: a container's checkpoint goes into
        a new placeholder container of that name ("podman:NAME", memsnap.containers).
        """
        if not key:
            raise InvalidArgument("no checkpoint id given; usage: memsnapctl restore ID")
        if lazy and not self.criu.lazy_pages_supported():
            raise FailedPrecondition("CRIU cannot restore lazily on this node (no userfaultfd; see 'criu check "
                                     "--feature lazy_pages'); restore without --lazy")
        with background.gate().foreground("restore"):
            return self.restorer.restore(caller, key, RestoreRequest(lazy, gpu_map, tcp_established, notify,
                                                                     restore_opts, lazy_ps_socket, lazy_guard, into))

    def restore_own_log(self, caller: Caller, key: str, moved: bool = False, **kw: Any) -> RestoreResult:
        """restore(), the restored job writing to a log of its own (Restorer.restore_own_log)."""
        return self.restorer.restore_own_log(caller, key, moved, **kw)

    def tier_copy_in_use(self, ckpt_id: str) -> bool:
        """Whether a restore still reads this checkpoint's tier copy (Restorer.tier_copy_in_use)."""
        return self.restorer.tier_copy_in_use(ckpt_id)

    def lazy_in_use(self, ckpt_id: str) -> bool:
        """Whether a lazy restore still pages from this checkpoint's tier copy."""
        return self.restorer.lazy_in_use(ckpt_id)

    def reap_lazy(self) -> None:
        """Forgets lazy-pages servers that have served every page."""
        self.restorer.reap_lazy()

    # -- catalog operations ---------------------------------------------------------
    def list_checkpoints(self, caller: Caller, job: str = "") -> list[CheckpointRecord]:
        """Checkpoints the caller may see (of one job, or of one container: RUNTIME:NAME)."""
        if containers.parse_target(job) is not None:
            recs = [r for r in self.catalog.checkpoints() if containers.is_of(r.meta, job)]
        else:
            recs = self.catalog.checkpoints(job=job)
        return [r for r in recs if caller.is_root or r.owner_uid == caller.uid]

    def delete(self, caller: Caller, ckpt_id: str) -> None:
        """Removes a checkpoint everywhere: tier, store and catalog (a stored copy another node owns stays, only
        the row here goes: retention.not_ours)."""
        rec = self.get(caller, ckpt_id)
        if rec.state == DUMPING:
            raise FailedPrecondition(f"checkpoint {ckpt_id} is still being dumped; try again in a moment")
        with self.checkpoint_lock(ckpt_id):
            self.copies.refuse_in_use(ckpt_id)
            self._delete_copies(rec)

    def _delete_copies(self, rec: CheckpointRecord) -> None:
        """Store copy (when this node owns it: retention.not_ours), tier copy (in whichever tier it lies), then the
        catalog row; the caller holds checkpoint_lock(rec.id)."""
        if rec.in_store and self.repo is not None and not not_ours(rec, self.node):
            self.repo.delete(rec)
        self.tier.remove(rec.id)
        lifecycle.forget(self.catalog, rec.id)

    def try_delete(self, ckpt_id: str, veto: Callable[[CheckpointRecord], str]) -> str:
        """Deletes a checkpoint (memsnap.gc) unless someone holds its lock (a fetch, restore, evict or
        delete: never waited for) or veto(its current record) names a reason. "" once deleted, else why not."""
        lock = self.copies.lock_for(ckpt_id)
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
            self.copies.refuse_in_use(ckpt_id)
            self.copies.drop(rec)
        out = self.catalog.get_checkpoint(ckpt_id)
        assert out is not None
        return out

    # -- held trees (a move in progress) ------------------------------------------------
    def end_held(self, pid: int, job_id: str = "", ckpt_id: str = "") -> None:
        """Ends a tree held stopped by checkpoint(extras=DumpExtras(hold=True)) once it runs elsewhere."""
        proc.kill_tree(pid)
        if job_id:
            self.catalog.update_job(job_id, ended=True)
        self._release_hold(ckpt_id, done=("gpu", "quiesce"))  # (its processes are gone: nothing to undo)

    def resume_held(self, pid: int, ckpt_id: str = "") -> None:
        """Lets a held tree run on (SIGCONT), after a move that did not happen: the CUDA state its dump left
        checkpointed (journaled in the record) is restored and unlocked, then its quiesce hooks hear resume."""
        proc.resume_stopped(pid)  # (first: the driver's restore needs the process's CUDA restore thread to run)
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
            lifecycle.mark(self.catalog, ckpt_id, hold=False, **{k: None for k in done})

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
        """Reconciles the catalog with the tier and the processes after a (possibly unclean) stop (recovery.py)."""
        return recovery.recover(self, moves)

    def live_jobs_restored_from(self, ckpt_id: str) -> list[JobRecord]:
        """The jobs restored here from ckpt_id that still run."""
        return [j for j in self.catalog.jobs()
                if j.restored_from == ckpt_id and not j.ended and proc.alive(j.pid, j.pid_start)]

    def pending_drains(self) -> list[str]:
        """Staged or draining checkpoints that still need to reach the store."""
        return [r.id for r in self.catalog.checkpoints(states=(STAGED, DRAINING)) if r.in_tier]


def _below_tmp(path: Path) -> bool:
    return path.resolve().is_relative_to("/tmp")
