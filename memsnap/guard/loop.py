"""The guard's loop: it polls the job cgroups' watchers, parks (or kills) a job at its limit, and applies the node
policy (memsnap.guard.policy) to node pressure: park the least important job, resume a parked one when memory is
back."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memsnap import jobs
from memsnap.guard import psi
from memsnap.guard.cgroups import CgroupError
from memsnap.guard.park import Parker
from memsnap.guard.parts import Part, Parts
from memsnap.guard.policy import Candidate, NodePolicy, Parked
from memsnap.guard.table import ENDED, KILLED, PARKED, RUNNING, GuardedJob

log = logging.getLogger("memsnap.guard")


class Loop(Part):
    """The watcher thread (start/stop) and what each of its steps decides."""

    def __init__(self, parts: Parts, policy: NodePolicy, parker: Parker, resume: Callable[..., Any]) -> None:
        super().__init__(parts)
        self.policy = policy
        self.parker = parker
        self.resume = resume  # Resumer.resume
        self._thread: threading.Thread | None = None
        self.would_park: list[str] = []  # observe mode: what it would have parked (also logged)

    def start(self) -> None:
        """Re-watches guarded jobs that still run, then starts the watcher thread."""
        if not self.cfg.enabled:
            return
        for g in self.table.jobs(RUNNING):
            if g.cgroup and self.cg is not None and Path(g.cgroup).is_dir():
                self.watchers.watch(g.job_id, Path(g.cgroup))
        self.sweep()
        self._thread = threading.Thread(target=self._run, name="guard", daemon=True)
        self._thread.start()

    def sweep(self, min_age_s: float = 300.0) -> None:
        """Removes empty job cgroups that no job of ours needs and that nobody touched for min_age_s (another
        daemon sharing the parent may have just made one for a launch; a parked job's cgroup is made again on
        resume anyway)."""
        if self.cg is None:
            return
        keep = {g.cgroup for g in self.table.jobs(RUNNING, PARKED)}
        now = time.time()
        try:
            entries = list(self.cg.parent.iterdir())
        except OSError:
            return
        for cg in entries:
            try:
                if not cg.is_dir() or str(cg) in keep or now - cg.stat().st_mtime < min_age_s:
                    continue
            except OSError:
                continue
            if not self.cg.procs(cg):
                self.cg.remove(cg)

    def stop(self) -> None:
        self.stopping.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                fired, pressured = self.watchers.wait(self.cfg.poll_interval_s)
                self.check_limits(fired, time.monotonic(), pressured)
                self.check_node()
            except Exception:  # the guard must keep watching whatever one step did
                log.exception("guard step failed")
                self.stopping.wait(1.0)

    def _forget_cgroup(self, cgroup: str) -> None:
        if self.cg is not None and cgroup:
            self.cg.remove(Path(cgroup))

    def running(self) -> list[tuple[GuardedJob, Any]]:
        """The guarded jobs that still run, with their job rows; those that ended are recorded so."""
        out = []
        for g in self.table.jobs(RUNNING):
            job = self.engine.catalog.get_job(g.job_id)
            if job is None or job.ended or not jobs.alive(job.pid, job.pid_start):
                # (a park ends its job's process: one that finished since jobs() was read has its row parked)
                if self.table.update_if_running(g.job_id, state=ENDED):
                    log.info("no longer guarding %s: %s", g.job_id, "its job row says it ended" if job and job.ended
                             else f"its process {job.pid if job else '?'} is gone", extra={"job": g.job_id})
                    self.watchers.unwatch(g.job_id)
                    self._forget_cgroup(g.cgroup)
                continue
            out.append((g, job))
        return out

    def check_limits(self, fired: set[str], t_event: float, pressured: frozenset[str] | set[str] = frozenset()
                     ) -> None:
        """Parks (or kills, or in observe mode logs) each guarded job at its limit, or whose watcher fired:
        memory.oom_control (v1: its tasks wait at the limit), memory.events (v2), or memory.pressure_level (v1:
        the kernel's reclaim warning, the ids in pressured)."""
        if self.cg is None:
            return
        for g, _job in self.running():
            if not g.cgroup or self.table.busy(g.job_id) or self.parker.backing_off(g.job_id):
                continue
            try:
                s = self.cg.sample(Path(g.cgroup))
            except CgroupError:
                continue
            retry = self.parker.retry_due(g.job_id)
            if not (s.at_limit or g.job_id in fired or retry):
                continue
            if retry and not s.at_limit and g.job_id not in fired:
                reason = f"a park that failed 30 s ago, retried (usage {s.usage >> 20} of {g.limit >> 20} MiB)"
            elif s.at_limit or g.job_id not in pressured:
                reason = f"reached its memory limit ({g.limit >> 20} MiB; usage {s.usage >> 20} MiB)"
            else:
                reason = (f"memory pressure in its cgroup (memory.pressure_level {self.cfg.pressure_level}; "
                          f"usage {s.usage >> 20} of {g.limit >> 20} MiB)")
            if self.metrics is not None:
                self.metrics.guard_events.labels(kind="limit").inc()  # (a job cgroup's event, either watcher)
            if self.cfg.mode == "observe":
                self._would(g.job_id, reason)
                continue
            if g.on_limit == "kill":
                log.warning("killing %s: it %s (on-limit kill)", g.job_id, reason, extra={"job": g.job_id})
                self._kill(g)
                continue
            self.parker.park_async(g.job_id, reason, t_event)

    def _would(self, job_id: str, reason: str) -> None:
        if job_id not in self.would_park:
            self.would_park.append(job_id)
        log.warning("observe mode: would park %s: %s", job_id, reason, extra={"job": job_id})
        if self.metrics is not None:
            self.metrics.guard_parks.labels(result="observed").inc()

    def _kill(self, g: GuardedJob) -> None:
        job = self.engine.catalog.get_job(g.job_id)
        if g.cgroup and self.cg is not None:  # let it leave the kernel, then end it
            for pid in self.cg.procs(Path(g.cgroup)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if job is not None:
            jobs.kill_tree(job.pid)
            self.engine.catalog.update_job(job.id, ended=True)
        self.watchers.unwatch(g.job_id)
        self.table.update(g.job_id, state=KILLED, reason="killed at its memory limit (on-limit kill)")
        if job is not None:
            jobs.wait_gone(job.pid, 5)
        self._forget_cgroup(g.cgroup)

    def check_node(self) -> None:
        """One decision of the node policy: park a running job, resume a parked one, or nothing."""
        th = self.policy.th
        if not th.active:
            return
        sample = psi.read_node(self.cfg.psi_path)
        running = [Candidate(g.job_id, g.priority, started_ms=job.started_ms) for g, job in self.running()
                   if not self.table.busy(g.job_id)]
        parked = [Parked(g.job_id, g.priority, int(g.stats.get("image_bytes", 0)), g.parked_ms)
                  for g in self.table.jobs(PARKED) if not self.table.busy(g.job_id)]
        if not self.cfg.auto_resume:
            parked = []
        d = self.policy.decide(sample, running, parked, tier_ram_bytes=self.tier_inflight())
        if d is None:
            return
        if self.metrics is not None:
            self.metrics.guard_events.labels(kind="node").inc()
        if d.action == "park":
            if self.cfg.mode == "observe":
                self._would(d.job_id, d.reason)
                return
            self.parker.park_async(d.job_id, d.reason, time.monotonic())
        elif d.action == "resume" and self.cfg.mode != "observe":
            def resume() -> None:
                try:
                    self.resume(d.job_id, auto=d.reason)
                except Exception as exc:
                    log.warning("auto-resume of %s failed: %s", d.job_id, exc, extra={"job": d.job_id})
            threading.Thread(target=resume, name=f"resume-{d.job_id}", daemon=True).start()

    def tier_inflight(self) -> int:
        """RAM a tmpfs tier is promised for dumps in flight (already counted in MemAvailable once written)."""
        tier = self.engine.tier
        if getattr(tier, "kind", "tmpfs") == "devdax":
            return 0
        return int(tier.reserved_bytes())
