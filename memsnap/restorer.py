"""The Restorer: every restore of this node ends in one public entry, restore_image().

A restore has two halves. The first prepares an image and proves it is the one that was signed: a tier copy
(hashed now, or spared by its fingerprint), a copy fetched from the store into the tier (hashed as it streamed
in), a lazy restore's image from the store (memsnap.pageserver: small files now, pages verified as they are
served), or a lazy move's first half (its pages come from the source over a socket). The second half,
restore_image(), is the same for all of them: CRIU puts the tree back, the job's GPU state and quiesce hooks
come back, and the tree is recorded as a job (or killed, never left running unrecorded).

The Restorer also knows who still reads a tier copy (mark_reading, lazy_in_use): evict and delete ask it
(tier_copy_in_use). It reaches the rest of the engine only through RestoreHost.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from memsnap import (
    background,
    containers,
    failpoints,
    jobinit,
    jobs,
    knobs,
    lifecycle,
    manifest,
    mounts,
    proc,
    progress,
)
from memsnap.caller import Caller
from memsnap.catalog import RESTORABLE, Catalog, CheckpointRecord, JobRecord, now_ms
from memsnap.collaborators import GpuAdapter, JobGuard
from memsnap.criu import CriuApi, CriuError, NotifyCallback, RestoreOptions, guard_lazy_restore
from memsnap.errors import FailedPrecondition, IntegrityFailure, PermissionDenied
from memsnap.lazyguard import LazyGuard
from memsnap.manifest import Manifest
from memsnap.phases import PhaseClock
from memsnap.quiesce.notifier import Quiescer
from memsnap.repository import Repository
from memsnap.tier import TierReservation
from memsnap.tiers import MEMORY, Tiers
from memsnap.validate import clip

log = logging.getLogger("memsnap.engine")

# Reservation = resident memory * (1 + margin) + this, for CRIU's small images and page alignment.
RESERVE_SLACK = 16 << 20


@dataclass
class RestoreResult:
    """A restored job and what the restore cost."""

    pid: int
    job: JobRecord
    restore_ms: float
    verify_ms: float
    fetch_ms: float = 0.0
    from_store: bool = False
    lazy_server: subprocess.Popen[bytes] | None = None  # the lazy-pages process of a lazy restore
    work_dir: Path | None = None
    phases: dict[str, float] = field(default_factory=dict)  # memsnap.phases.RESTORE: seconds each


@dataclass
class RestoreRequest:
    """How to restore, whatever the image's source."""

    lazy: bool = False  # pages come after the tree runs (from the tier copy, the store, or a moving source)
    gpu_map: dict[str, str] | None = None  # GPU UUID of the image -> GPU UUID here
    tcp_established: bool = False
    notify: NotifyCallback | None = None  # CRIU's callbacks (post-restore, ...)
    restore_opts: dict[str, Any] | None = None  # more RestoreOptions fields
    lazy_ps_socket: int = -1  # a lazy move's or a store's page stream (else lazy-pages reads the tier copy)
    lazy_guard: LazyGuard | None = None  # kills the tasks first when their pages cannot come (made if None)
    into: str = ""  # a container's checkpoint: the placeholder to create and restore into ("podman:NAME")


@dataclass
class PreparedImage:
    """An image ready for CRIU, proved to be the signed one (or proved as its pages arrive)."""

    man: Manifest  # its verified manifest
    path: Path  # the directory CRIU reads
    started: float  # time.monotonic() when the restore began
    verified_from: float  # time.monotonic() when its verification began (verify_ms is measured from it)
    fetch_ms: float = 0.0
    from_store: bool = False


class RestoreHost(Protocol):
    """What the Restorer uses of the engine (memsnap.engine.Engine)."""

    catalog: Catalog
    tier: Tiers
    criu: CriuApi
    key: bytes
    work_root: Path
    launcher: jobs.Launcher
    repo: Repository | None  # the store (memsnap.repository)
    gpu: GpuAdapter | None
    guard: JobGuard | None
    quiesce: Quiescer
    observe: Callable[[str, str, float], None]

    def checkpoint_lock(self, ckpt_id: str) -> AbstractContextManager[None]: ...

    def latest_restorable(self, caller: Caller, key: str) -> CheckpointRecord: ...

    def reserve(self, nbytes: int, into: str = MEMORY) -> TierReservation: ...

    def restore(self, caller: Caller, key: str, lazy: bool = False, gpu_map: dict[str, str] | None = None,
                tcp_established: bool = False, notify: NotifyCallback | None = None,
                restore_opts: dict[str, Any] | None = None, lazy_ps_socket: int = -1,
                lazy_guard: LazyGuard | None = None) -> RestoreResult: ...

    def note_phases(self, ckpt_id: str, key: str, clock: PhaseClock) -> None: ...

    def journal(self, rec: CheckpointRecord, key: str) -> Callable[[Any], None]: ...


# (restorer, rec, t0, req): a lazy restore with no tier copy, paging in from the store; None when it cannot (the
# caller restores from a fetched copy instead).
FromStore = Callable[["Restorer", CheckpointRecord, float, RestoreRequest], "RestoreResult | None"]


class Restorer:
    """Restores checkpoints for one engine (see the module's doc)."""

    def __init__(self, host: RestoreHost, from_store: FromStore | None = None) -> None:
        self.host = host
        self.from_store = from_store  # a lazy restore from the store (memsnap.pageserver.restore_from_store)
        # Restores whose CRIU still reads a tier copy, by checkpoint id: evict and delete must wait for them.
        self._reading: dict[str, int] = {}
        self._reading_lock = threading.Lock()
        self._lazy: list[tuple[str, Any, Path]] = []
        self._lazy_lock = threading.Lock()
        # Work dirs of lazy restores whose job.pid is not written yet: their lazy-pages may have served
        # every page already (small jobs), but reap_lazy must not remove the dir under the restore.
        self._restoring: set[Path] = set()

    def restore(self, caller: Caller, key: str, req: RestoreRequest) -> RestoreResult:
        """Restores the caller's checkpoint (or its job's latest) from the tier, a fetched copy or, lazily, the
        store (engine.restore checked the request and holds the foreground gate)."""
        if req.into:
            containers.parse_into(req.into)
            if caller.uid != 0:  # (a placeholder is a new container: only root starts one)
                raise PermissionDenied("only root may restore into a new container")  # (containers.authorize)
        rec = self.host.latest_restorable(caller, key)
        if rec.state not in RESTORABLE:
            why = f": {rec.last_error}" if rec.last_error else ""
            raise FailedPrecondition(f"checkpoint {rec.id} is {rec.state} and cannot be restored{why}")
        t0 = time.monotonic()
        if self.pages_from_store(rec, req):
            res = self.from_store(self, rec, t0, req) if self.from_store is not None else None
            if res is not None:
                return res
        with self.host.checkpoint_lock(rec.id):
            images, fetch_ms, from_store = self._local_copy(rec)
            t1 = time.monotonic()
            try:
                # A copy fetched from the store was hashed while it streamed in; a tier copy is hashed now.
                # The signed manifest must be this record's: (checkpoint id, job, owner uid).
                man = manifest.verify_dir(images, self.host.key, trusted=rec.meta.get("fingerprint"),
                                          bound_to=(rec.id, rec.job, rec.owner_uid))
            except manifest.IntegrityError as exc:
                self.host.observe("restore", "integrity", time.monotonic() - t0)
                raise IntegrityFailure(f"{exc}; checkpoint {rec.id} was not restored") from exc
            self.mark_reading(rec.id, +1)  # until CRIU is done with the tier copy (evict/delete refuse)
        try:
            return self.restore_image(rec, PreparedImage(man, images, t0, t1, fetch_ms, from_store), req)
        finally:
            self.mark_reading(rec.id, -1)

    def pages_from_store(self, rec: CheckpointRecord, req: RestoreRequest) -> bool:
        """Which of the three lazy restores this is. --lazy means: the tree runs first and its pages follow,
        from (1) the source node of a lazy move, over req.lazy_ps_socket (memsnap.move.lazy); (2) this node's tier
        copy, served by CRIU's lazy-pages; or (3), with no tier copy but a stored one, the store, served by
        memsnap.pageserver. True for (3); (1) and (2) go through the tier path and restore_image."""
        return req.lazy and req.lazy_ps_socket < 0 and not rec.in_tier and rec.in_store and \
            self.host.repo is not None

    def mark_reading(self, ckpt_id: str, delta: int) -> None:
        with self._reading_lock:
            n = self._reading.get(ckpt_id, 0) + delta
            if n > 0:
                self._reading[ckpt_id] = n
            else:
                self._reading.pop(ckpt_id, None)

    def tier_copy_in_use(self, ckpt_id: str) -> bool:
        """Whether a restore (CRIU, or a lazy restore's pager) still reads this checkpoint's tier copy."""
        with self._reading_lock:
            if self._reading.get(ckpt_id):
                return True
        return self.lazy_in_use(ckpt_id)

    def restore_image(self, rec: CheckpointRecord, image: PreparedImage, req: RestoreRequest) -> RestoreResult:
        """The one entry every restore ends in, once its image is prepared: CRIU puts the tree back, then it is
        recorded as a job. A lazy restore's guard (made here unless given) kills its tasks before lazy-pages
        when its pages cannot come."""
        man, images, t0, t1, fetch_ms = image.man, image.path, image.started, image.verified_from, image.fetch_ms
        lazy, gpu_map, tcp_established, notify = req.lazy, req.gpu_map, req.tcp_established, req.notify
        restore_opts, lazy_ps_socket, guard = req.restore_opts, req.lazy_ps_socket, req.lazy_guard
        verify_ms = (time.monotonic() - t1) * 1000
        if man.pages_remote and lazy_ps_socket < 0:
            raise FailedPrecondition(f"checkpoint {rec.id} is the first half of a lazy move: its memory stayed "
                                     "on the source node, so it cannot be restored on its own")
        facts = containers.ContainerFacts.from_manifest(man.extra["container"]) if "container" in man.extra else None
        if facts is None and req.into:
            raise FailedPrecondition(f"checkpoint {rec.id} is not of a container: restore it without --into")
        if facts is not None and not req.into:
            raise FailedPrecondition(f"checkpoint {rec.id} is of {facts.runtime} container {clip(facts.name, 64)}: "
                                     f"restore it --into {facts.runtime}:NEWNAME (a placeholder from its image)")
        if not man.own_pidns and proc.alive(rec.pid):
            raise FailedPrecondition(
                f"pid {rec.pid} is in use, and this checkpoint needs it back: stop that process first, "
                "or start jobs with 'memsnapctl run' (own PID namespace) so that restores never collide")
        if not man.own_pidns:
            proc.wait_pid_free(rec.pid, 10)
        work = self.host.work_root / f"{rec.id}.restore-{secrets.token_hex(3)}"
        work.mkdir(parents=True, mode=0o700)
        restore_opts, new_log = self._log_for_mount(rec, man, dict(restore_opts or {}))
        failpoints.delay("slow-restore", 3.0)  # (tests: an evict or delete arrives while CRIU would read)
        failpoints.delay("slow-restore-10s", 10.0)  # (tests: several calls meet a restore in flight)
        t_place = time.monotonic()
        placement = self._place(rec, facts, req.into) if facts is not None else None  # (the placeholder runs)
        place_ms = (time.monotonic() - t_place) * 1000 if placement is not None else 0.0
        t2 = time.monotonic()
        guard = (guard or LazyGuard(rec.id)) if lazy else None
        try:
            failpoints.delay("slow-placeholder", 3.0) if placement else None  # (tests: the placeholder dies now)
            server = self._start_lazy_server(rec.id, images, work, lazy_ps_socket, guard) if guard else None
        except BaseException:
            self._drop_placement(rec, placement, failed=True)
            raise
        new_pid = 0
        try:
            try:
                opts = dict(restore_opts or {})
                if placement is not None:
                    opts = {**opts, **placement.restore_opts,
                            "external": [*opts.get("external", []), *placement.restore_opts["external"]],
                            "inherit_fds": {**opts.get("inherit_fds", {}), **placement.restore_opts["inherit_fds"]}}
                if guard is not None:
                    opts["on_criu"], notify = guard.on_criu, guard.notify(notify)
                new_pid = self.host.criu.restore(images, work, RestoreOptions(
                    tcp_established=tcp_established, shell_job=False, lazy_pages=lazy,
                    tcp_close=not tcp_established or man.tcp_close, own_mntns=man.own_mntns, **opts),
                    notify=notify)
            except CriuError as exc:
                if server is not None:
                    _kill_group(server.pid)
                self.host.observe("restore", "error", time.monotonic() - t0)
                why = guard.why if guard is not None and guard.why else exc.reason
                kept = self._keep_failure(work)
                raise FailedPrecondition(f"restore of {rec.id} failed: {why} (log: {kept / Path(exc.log_path).name})") \
                    from exc
            if guard is not None and (why := guard.restored(new_pid)):
                self.host.observe("restore", "error", time.monotonic() - t0)
                raise FailedPrecondition(f"paging in {rec.id} failed: {why}; the restored copy was killed (logs: "
                                         f"{self._keep_failure(work)})")
            if server is not None:
                failpoints.delay("slow-restore-bookkeeping", 2.5)  # (the daemon's reaper ticks meanwhile)
                rc = guard_lazy_restore(work, new_pid)  # from here, its supervisor kills it if paging fails
                if rc:  # (the tree is killed below)
                    self.host.observe("restore", "error", time.monotonic() - t0)
                    kept = self._keep_failure(work)
                    raise FailedPrecondition(f"paging in {rec.id} failed (lazy-pages exit {rc}, see "
                                             f"{kept}/lazy-pages.log); the restored copy was killed")
        except BaseException:
            if new_pid:
                proc.kill_tree(new_pid)  # restored, but the restore fails: never leave it running unrecorded
            if new_log:
                Path(new_log).unlink(missing_ok=True)
            self._drop_placement(rec, placement, failed=True)
            raise
        finally:
            with self._lazy_lock:
                self._restoring.discard(work)
        failpoints.hit("restored-into-placeholder") if placement is not None else None
        self._drop_placement(rec, placement, failed=False)
        restore_ms = (time.monotonic() - t2) * 1000
        if man.extra.get("parked"):
            proc.resume_stopped(new_pid)  # memsnap.guard dumps a parked job stopped: any restore lets it run on
        clock = PhaseClock()
        for name, ms in (("fetch", fetch_ms), ("verify", verify_ms), ("placeholder", place_ms),
                         ("criu_restore", restore_ms)):
            clock.add(name, ms / 1000) if ms else None
        try:
            job = self._record_restored(rec, man, new_pid, server, work, gpu_map, new_log, clock)
            if placement is not None:  # (the job is the placeholder's: named after it; the placeholder is its own)
                self.host.catalog.update_job(job.id, name=placement.name)
                job.name = placement.name
                if not (rec.marks.move_incoming or rec.marks.pages_remote):  # (a move's: until its commit)
                    self.host.journal(rec, "placeholder")(None)
        except BaseException:
            proc.kill_tree(new_pid)
            self._drop_placement(rec, placement, failed=True)
            self.host.observe("restore", "error", time.monotonic() - t0)
            raise
        self.host.note_phases(rec.id, "restore_phases", clock)
        self.host.observe("restore", "ok", time.monotonic() - t0)
        log.info("restored as pid %d", new_pid, extra={"checkpoint_id": rec.id, "job": job.id})
        return RestoreResult(pid=new_pid, job=job, restore_ms=restore_ms, verify_ms=verify_ms,
                             fetch_ms=fetch_ms, from_store=image.from_store, lazy_server=server, work_dir=work,
                             phases=clock.rounded())

    def _place(self, rec: CheckpointRecord, facts: containers.ContainerFacts, into: str) -> containers.Placement:
        """Starts the placeholder `into` names, journaled first (meta "placeholder"): a daemon killed before the
        restored job is recorded leaves no placeholder behind, because its restart removes it
        (containers.drop_journaled). The job's record ends the journal entry; a move's image keeps it until the
        source commits (memsnap.move.target: a move that does not happen takes its placeholder away too)."""
        runtime, name = containers.parse_into(into)
        journal = self.host.journal(rec, "placeholder")
        journal({"runtime": runtime, "name": name})
        try:  # (an image a peer sent, for a move, never names host paths to bind here)
            placement = containers.place(facts, into, binds_allowed=not (rec.marks.move_incoming or
                                                                         rec.marks.pages_remote))
        except BaseException:
            journal(None)  # (place() removed what it started)
            raise
        journal({"runtime": runtime, "name": name, "handle": placement.running.handle})
        failpoints.hit("placeholder-started")
        return placement

    def _drop_placement(self, rec: CheckpointRecord, placement: containers.Placement | None, failed: bool) -> None:
        """Closes a placeholder's fds; removes the placeholder too when the restore into it failed."""
        if placement is None:
            return
        placement.close()
        if failed:
            containers.remove(placement.runtime, placement.running.handle)
            self.host.journal(rec, "placeholder")(None)

    def _keep_failure(self, work: Path) -> Path:
        """A failed restore's work dir (CRIU's logs) moves to <work>/failed, where no cleanup of its checkpoint
        (a move's target drops what it received) takes it away; the newest 32 stay. Its new place."""
        failed = self.host.work_root / "failed"
        try:
            failed.mkdir(mode=0o700, exist_ok=True)
            dest = failed / work.name
            work.rename(dest)
        except OSError:
            return work
        for old in sorted(failed.iterdir(), key=lambda p: p.stat().st_mtime)[:-32]:
            shutil.rmtree(old, ignore_errors=True)
        return dest

    def _record_restored(self, rec: CheckpointRecord, man: Manifest, new_pid: int,
                         server: subprocess.Popen[bytes] | None, work: Path,
                         gpu_map: Any, log_path: str = "", clock: PhaseClock | None = None) -> JobRecord:
        """Brings a restored tree's GPU state back, tells its quiesce hooks to resume, and records it as a job
        (the caller kills it on error)."""
        clock = clock or PhaseClock()
        if failpoints.armed("record-restored-fails"):
            raise OSError("failpoint record-restored-fails: the catalog could not be written")
        if server is not None and failpoints.armed("kill-lazy-pages"):
            _kill_lazy_pages(server.pid)
        if self.host.gpu is not None and man.gpus:
            try:
                clock.gpu(self.host.gpu.restore(new_pid, gpu_map, man.gpus))
            except Exception as exc:
                # A restored tree whose CUDA state cannot come back would stay locked forever.
                raise FailedPrecondition(f"GPU state of {rec.id} could not be restored: {exc}") from exc
        t_tell = time.monotonic()
        if self.host.quiesce.resume(new_pid, rec.id, restored=True):  # (its quiesce hooks, if it has any)
            clock.add("quiesce_resume", time.monotonic() - t_tell)
        if server is None and not knobs.keep_logs():
            shutil.rmtree(work, ignore_errors=True)
        job = JobRecord(id="job-" + secrets.token_hex(4), name=restored_job_name(rec, man), pid=new_pid,
                        pid_start=proc.start_time_or_zero(new_pid), owner_uid=rec.owner_uid,
                        argv=list(man.argv), log_path=log_path or man.log_path,
                        started_ms=now_ms(), restored_from=rec.id)
        self.host.catalog.add_job(job)
        self.host.catalog.update_checkpoint(rec.id, last_used_ms=now_ms())
        if self.host.guard is not None:  # a guarded job stays guarded, here or on the node it moved to
            try:
                self.host.guard.restored(job, rec, man)
            except Exception as exc:
                log.warning("could not guard restored job %s again: %s", job.id, exc, extra={"job": job.id})
        return job

    def _start_lazy_server(self, ckpt_id: str, images: Path, work: Path, ps_socket: int,
                           guard: LazyGuard) -> subprocess.Popen[bytes]:
        """Starts `criu lazy-pages` on the tier copy (or the source's, over ps_socket); it serves faults
        and pushes the rest, then exits. guard learns of it."""
        if guard.why:  # (the pages' source failed already)
            raise FailedPrecondition(f"lazy restore of {ckpt_id} failed before it started: {guard.why}")
        server = guard.server = self.host.criu.start_lazy_pages(images, work, ps_socket)
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
        cur = self.host.catalog.get_checkpoint(rec.id)  # another restore may have fetched it while we waited
        if cur is not None:
            rec.in_tier, rec.in_store, rec.meta = cur.in_tier, cur.in_store, cur.meta
        if rec.in_tier and self.host.tier.has(rec.id):
            return self.host.tier.path(rec.id), 0.0, False
        if not rec.in_store or self.host.repo is None:
            raise FailedPrecondition(f"checkpoint {rec.id} has no tier copy and no stored copy; it is lost")
        t0 = time.monotonic()
        reservation = self.host.reserve(rec.size_bytes + RESERVE_SLACK)
        try:
            staging = self.host.tier.new_staging(rec.id, unique=True)  # never shared with another fetch
            progress.phase("fetch", rec.size_bytes, progress.dir_bytes(staging, (manifest.MANIFEST,)))  # (its bar)
            try:
                self.host.repo.fetch(rec, staging)
                failpoints.delay("slow-fetch", 3.0)  # (tests: a client polls the fetch's progress meanwhile)
                self.host.tier.remove(rec.id)  # a stray copy left by a crash (the catalog says not in tier)
                self.host.tier.publish(staging, rec.id)
            except BaseException:
                self.host.tier.discard(staging)
                raise
        finally:
            reservation.release()
        # The fetch hashed every byte as it streamed in: remember that, so verification need not re-read.
        rec.meta["fingerprint"] = manifest.fingerprint(self.host.tier.path(rec.id))
        lifecycle.mark(self.host.catalog, rec.id, fingerprint=rec.meta["fingerprint"])
        self.host.catalog.update_checkpoint(rec.id, in_tier=True)
        progress.phase("restore")
        return self.host.tier.path(rec.id), (time.monotonic() - t0) * 1000, True

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
        rec = self.host.latest_restorable(caller, key)
        parent = str(rec.meta.get("log_path") or "")
        log_dir = self.host.launcher.log_dir.resolve()
        moved_from = f"{rec.meta.get('host') or '?'}/{rec.job or rec.id}" if moved else ""
        if not parent or (Path(parent).resolve().parent != log_dir and not moved) or rec.meta.get("own_mntns") \
                or rec.meta.get("log_mount"):
            res = self.host.restore(caller, key, **kw)
            if moved_from:
                self.host.catalog.update_job(res.job.id, moved_from=moved_from)
                res.job.moved_from = moved_from
            return res
        path, fd = self._open_new_log(rec, parent, moved_from)
        try:
            opts = dict(kw.pop("restore_opts", None) or {})
            # CRIU names a regular file by its path without the leading '/'; every fd the job had on its
            # log (stdout and stderr) gets the new file instead.
            opts["inherit_fds"] = {**opts.get("inherit_fds", {}), parent.lstrip("/"): fd}
            res = self.host.restore(caller, rec.id, restore_opts=opts, **kw)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.host.catalog.update_job(res.job.id, log_path=str(path), **({"moved_from": moved_from} if moved else {}))
        res.job.log_path, res.job.moved_from = str(path), moved_from
        return res

    def _open_new_log(self, rec: CheckpointRecord, parent: str, moved_from: str = "") -> tuple[Path, int]:
        """A new log for a restored (or moved) copy of rec, in this node's log dir, owned by the job's uid, that
        starts with a line naming where it came from; its path and an open fd."""
        # Named after the first job of the chain, not the parent: the name stays the same length however many
        # generations a job lives through (a name that grew by one parent per restore hit ENAMETOOLONG at the 6th).
        root = Path(parent).stem.split(".restore-", 1)[0] if parent else (rec.job or rec.id)
        path = self.host.launcher.log_dir.resolve() / f"{root}.restore-{rec.id}-{secrets.token_hex(3)}.log"
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

    def _log_for_mount(self, rec: CheckpointRecord, man: Manifest,
                       opts: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """For an image whose job log is a bind mount (its private /tmp): a new log of this node's own, bound
        there by CRIU (opts["external"]); the options and the new log's path ("" for any other image)."""
        key = man.log_mount
        if not key:
            return opts, ""
        if key != mounts.LOG_MOUNT_KEY:
            raise FailedPrecondition(f"checkpoint {rec.id} names a job log mount {clip(key, 40)} this memsnap "
                                     "does not know; restore it with the memsnap version that made it")
        moved_from = f"{man.host or '?'}/{rec.job or rec.id}" if rec.marks.move_incoming else ""
        path, fd = self._open_new_log(rec, man.log_path, moved_from)
        os.close(fd)
        opts["external"] = [*opts.get("external", []), f"mnt[{key}]:{path}"]
        return opts, str(path)


def restored_job_name(rec: CheckpointRecord, man: Manifest) -> str:
    """What a restored job is called: the job it was (not the checkpoint's own --name), else, for a process
    memsnap did not start, its command's name; a checkpoint from before job names were signed: its name."""
    job_name = man.extra.get("job_name")
    if job_name and isinstance(job_name, str):
        return job_name
    if rec.job:
        return rec.name or rec.job
    argv = man.argv
    argv = argv[4:] if jobinit.is_init(argv) else argv
    return os.path.basename(argv[0])[:64] if argv and argv[0] else rec.name or rec.id


def _kill_group(pgid: int) -> None:
    import signal

    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _kill_lazy_pages(supervisor_pid: int) -> None:
    """Kills lazy-pages itself, not its supervisor shell (failpoint kill-lazy-pages)."""
    import psutil

    for child in psutil.Process(supervisor_pid).children():
        child.kill()
