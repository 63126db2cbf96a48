"""The job table: the jobs memsnapctl runs, and their lifecycle (run, list, stop, kill, rm, prune, logs).

A job is a process tree memsnapd started under its tiny init (memsnap.jobinit), recorded in the catalog with its
owner, command and log. Restores and moves add jobs too (memsnap.restorer); this module only starts, finds, stops
and forgets them. It reaches the engine through JobHost.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from memsnap import jobinit, jobs, proc, resolve
from memsnap.caller import Caller
from memsnap.catalog import FAILED, RESTORABLE, Catalog, CheckpointRecord, JobRecord, now_ms
from memsnap.collaborators import EngineConfig
from memsnap.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound
from memsnap.validate import shorten

log = logging.getLogger("memsnap.engine")


class JobHost(Protocol):
    """What the job table uses of the engine (memsnap.engine.Engine)."""

    catalog: Catalog
    cfg: EngineConfig
    launcher: jobs.Launcher
    work_root: Path

    def checkpointing(self, pid: int) -> bool: ...

    def delete(self, caller: Caller, ckpt_id: str) -> None: ...


class JobTable:
    """Runs, finds, stops and forgets jobs (see the module's doc)."""

    def __init__(self, host: JobHost) -> None:
        self.host = host

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
            private_tmp = self.host.cfg.private_tmp
        job_id = "job-" + secrets.token_hex(4)
        if name:
            self._refuse_live_duplicate(caller.uid, name)
        # The job gets the caller's supplementary groups too, as its shell would (read from the caller's
        # process; none if that process is gone or its ids changed).
        groups = proc.caller_groups(caller.pid, caller.uid, caller.gid) if caller.uid else None
        try:
            launched, log_path = self.host.launcher.launch(job_id, argv, caller.uid, caller.gid, cwd or None, env,
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
        self.host.catalog.add_job(rec)
        log.info("job started", extra={"job": job_id, "pid": launched.pid})
        return rec

    def list_jobs(self, caller: Caller) -> list[tuple[JobRecord, bool]]:
        """Jobs the caller may see, with whether each still runs."""
        out = []
        for j in self.host.catalog.jobs():
            if caller.is_root or caller.uid == j.owner_uid:
                out.append((j, not j.ended and proc.alive(j.pid, j.pid_start)))
        return out

    def _refuse_live_duplicate(self, owner: int, name: str) -> None:
        for j in self.host.catalog.jobs_named(name, owner):
            if not j.ended and proc.alive(j.pid, j.pid_start):
                raise FailedPrecondition(f"uid {owner} already runs a job named {shorten(name)!r} ({j.id}); pick "
                                         "another name, or stop that job first")

    def find_job(self, caller: Caller, key: str) -> JobRecord:
        """A job the caller may see, by id, name or root pid: an id wins, then a running job, then the
        newest. Another uid's jobs are invisible here (NotFound), so names never leak across users."""
        key = (key or "").strip()
        if not key:
            raise InvalidArgument("no job given; pass a job id, name or pid ('memsnapctl jobs' lists them)")
        cands = [j for j in self.host.catalog.jobs() if key in (j.id, j.name, str(j.pid))
                 and (caller.is_root or j.owner_uid == caller.uid)]
        if not cands and key.isascii() and key.isdigit() and int(key) < 1 << 22:  # a pid inside a job: the job
            inside = resolve.job_containing(self.host.catalog.jobs(), int(key))
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


        job = self.find_job(caller, key)
        t0 = time.monotonic()
        if not self._job_running(job):
            self.host.catalog.update_job(job.id, ended=True)
            return job, False, 0.0
        if self.host.checkpointing(job.pid):
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
        self.host.catalog.update_job(job.id, ended=True)
        log.info("job %s", "killed" if killed else "stopped", extra={"job": job.id, "pid": job.pid,
                                                                     "uid": caller.uid})
        job.ended = True
        return job, killed, (time.monotonic() - t0) * 1000

    def _log_in_use(self, job: JobRecord) -> bool:
        """Whether another job or a restorable checkpoint still needs this job's log file (a restore
        reopens it)."""
        if any(j.id != job.id and j.log_path == job.log_path for j in self.host.catalog.jobs()):
            return True
        return any(r.meta.get("log_path") == job.log_path for r in self.host.catalog.checkpoints(states=RESTORABLE))

    def _remove_job(self, job: JobRecord) -> int:
        """Forgets an ended job; removes its log files when nothing else needs them. Returns bytes freed."""
        freed = 0
        if job.log_path and not self._log_in_use(job):
            log_dir = self.host.launcher.log_dir.resolve()
            for path in (Path(job.log_path), Path(job.log_path).with_suffix(".launcher.log")):
                try:
                    if path.resolve().parent == log_dir:
                        freed += path.stat().st_size
                        path.unlink()
                except OSError:
                    pass
        self.host.catalog.delete_job(job.id)
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
        mine = [j for j in self.host.catalog.jobs() if caller.is_root or j.owner_uid == caller.uid]
        ended = [j for j in mine if not self._job_running(j)]
        failed = [r for r in self.host.catalog.checkpoints(states=(FAILED,))
                  if (caller.is_root or r.owner_uid == caller.uid) and not r.meta.get("hold")]
        if dry_run:
            return ended, failed, sum(_file_size(j.log_path) for j in ended if not self._log_in_use(j))
        freed = 0
        for r in failed:
            try:
                self.host.delete(caller, r.id)
            except NotFound:
                pass
            if not os.environ.get("MEMSNAP_KEEP_LOGS"):
                shutil.rmtree(self.host.work_root / r.id, ignore_errors=True)
        for j in ended:
            self.host.catalog.update_job(j.id, ended=True)
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
                if not self._job_running(self.host.catalog.get_job(job.id) or job):
                    data = f.read(1 << 16)
                    if data:
                        yield job, data
                        continue
                    return
                time.sleep(0.2)


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size if path else 0
    except OSError:
        return 0
