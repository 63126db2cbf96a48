"""The guard service in memsnapd: per-job memory cgroups, the watcher loop, park and resume.

Guard is what the daemon, the engine and the API hold; it owns the job table (memsnap.guard.table) and the
launch and adoption of guarded jobs, and hands the rest to its parts: the loop over the cgroup watchers and the
node policy (memsnap.guard.loop), park (memsnap.guard.park) and resume (memsnap.guard.resume)."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from memsnap import jobs
from memsnap.caller import Caller
from memsnap.catalog import CheckpointRecord, JobRecord
from memsnap.config import GuardConfig
from memsnap.engine import Engine
from memsnap.errors import FailedPrecondition
from memsnap.guard.cgroups import CgroupError, MemoryCgroups, detect
from memsnap.guard.loop import Loop
from memsnap.guard.park import Parker
from memsnap.guard.parts import Parts
from memsnap.guard.policy import CRITICAL, NodePolicy, Thresholds
from memsnap.guard.resume import Resumer
from memsnap.guard.table import ENDED, KILLED, PARKED, RESUMED, RUNNING, GuardedJob, JobTable
from memsnap.guard.watch import Watchers
from memsnap.manifest import Manifest
from memsnap.metrics import Metrics
from memsnap.restorer import RestoreResult

log = logging.getLogger("memsnap.guard")

__all__ = ["ENDED", "KILLED", "PARKED", "RESUMED", "RUNNING", "Guard", "GuardedJob"]


class Guard:
    """Watches limited jobs and node pressure; parks (checkpoint --stop) and resumes jobs."""

    def __init__(self, engine: Engine, cfg: GuardConfig, state_dir: Path, metrics: Metrics | None = None) -> None:
        # Park images go to the engine's spill tier (engine.tier.spill: guard.spill_dir) when it has one.
        self.engine = engine
        self.cfg = cfg
        self.metrics = metrics
        self.dir = Path(state_dir) / "guard"
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self.table = JobTable(engine.catalog, self.dir / "jobs.json")
        self.cg, self.cg_error = _cgroups(cfg)
        self.policy = NodePolicy(_thresholds(cfg), time.monotonic)
        self.watchers = Watchers(self.cg, cfg.pressure_level)
        parts = Parts(engine, cfg, self.cg, self.cg_error, self.table, self.watchers,
                      metrics, threading.Event())
        self.parker = Parker(parts)
        self.resumer = Resumer(parts, self.adopt)
        self.loop = Loop(parts, self.policy, self.parker, self.resumer.resume)

    @property
    def spill_in_ram(self) -> bool:
        """Whether the spill tier is RAM (its copy of a parked image is evicted once durable)."""
        return self.parker.spill_in_ram

    @property
    def would_park(self) -> list[str]:
        """Observe mode: the jobs it would have parked (also logged)."""
        return self.loop.would_park

    def get(self, job_id: str) -> GuardedJob | None:
        return self.table.get(job_id)

    # -- status -----------------------------------------------------------------------
    def describe(self) -> str:
        """For `memsnapctl status`: cgroup version, watchers and mode."""
        if not self.cfg.enabled:
            return "off ([guard] enabled = false)"
        cg = self.cg.describe() if self.cg else f"no job limits ({self.cg_error})"
        if self.cg is not None and self.cg.version == 1:
            level = self.cfg.pressure_level
            cg += f", memory.pressure_level {level})" if level != "off" else ")"
        node = "node policy off (no [guard] threshold set)"
        if self.policy.th.active:
            node = f"node policy on ({self.cfg.psi_path} PSI, /proc/meminfo MemAvailable)"
        parked = len(self.table.jobs(PARKED))
        return f"{self.cfg.mode}; {cg}; {node}; {parked} parked"

    # -- launch -----------------------------------------------------------------------
    def prepare(self, limit: int) -> tuple[str, str]:
        """A new job cgroup with the limit: (its path, its cgroup.procs file for the launcher)."""
        if self.cg is None:
            raise FailedPrecondition(f"--memory-limit needs a memory cgroup, and this node has none usable: "
                                     f"{self.cg_error}")
        try:
            cg = self.cg.create("j-" + secrets.token_hex(6), limit)
        except CgroupError as exc:
            raise FailedPrecondition(f"cannot set up the job's memory cgroup: {exc}") from exc
        return str(cg), str(cg / "cgroup.procs")

    def adopt(self, job_id: str, owner: int, limit: int, priority: int, on_limit: str, cgroup: str) -> GuardedJob:
        """Records a launched (or resumed) job and starts watching its cgroup."""
        g = GuardedJob(job_id=job_id, owner_uid=owner, priority=priority, limit=limit, on_limit=on_limit,
                       cgroup=cgroup)
        if cgroup and self.cg is not None:
            g.oom_kills_at_start = self.cg.sample(Path(cgroup)).oom_kills
            self.watchers.watch(job_id, Path(cgroup))
        self.table.put(g)
        log.info("guarding %s: limit %d MiB, priority %s, on limit %s", job_id, limit >> 20,
                 "critical" if priority >= CRITICAL else priority, on_limit, extra={"job": job_id})
        return g

    def settings_of(self, job_id: str) -> dict[str, Any] | None:
        """What a checkpoint of a guarded job carries wherever it is restored (its manifest's "guard")."""
        g = self.table.get(job_id)
        if g is None:
            return None
        return {"limit": g.limit, "priority": g.priority, "on_limit": g.on_limit}

    def restored(self, job: JobRecord, rec: CheckpointRecord, man: Manifest) -> None:
        """A guarded job came back, from any restore here or a move to this node: the new job is guarded as it
        was, in the memory cgroup CRIU put it into (recreated without a limit if it was gone: its limit is set
        first) or a new one. A parked job restored this way counts as resumed. The guard's own resume does its
        own bookkeeping."""
        src = self.table.get(rec.job) if rec.job else None
        if self.table.get(job.id) is not None or (src is not None and self.table.busy(src.job_id)):
            return
        s = self.settings_of(src.job_id) if src is not None else man.extra.get("guard")
        if not isinstance(s, dict):
            return
        try:
            limit, priority = int(s.get("limit", 0)), int(s.get("priority", 0))
            on_limit = str(s.get("on_limit", "park")) if s.get("on_limit") in ("park", "kill") else "park"
        except (TypeError, ValueError):
            log.warning("%s: its checkpoint's guard settings do not read (%r); not guarded", job.id, s)
            return
        cgroup = ""
        if limit and self.cg is not None:
            try:
                cg = self.cg.of_pid(job.pid)
                if cg is None:  # (not in a job cgroup of ours: a new one, and the tree moves in)
                    cg = self.cg.create("j-" + secrets.token_hex(6), limit)
                    self.cg.enter(cg, [p.pid for p in jobs.tree(job.pid)])
                else:
                    now = self.cg.sample(cg).limit
                    if now < limit or now >= 1 << 60:  # (recreated without one; never lowered: an admin raised it)
                        self.cg.set_limit(cg, limit)
                    else:
                        limit = now
                cgroup = str(cg)
            except (CgroupError, jobs.ProcessNotFound) as exc:
                log.warning("%s: cannot put it in a memory cgroup with its limit (%s); guarded without one",
                            job.id, exc, extra={"job": job.id})
        self.adopt(job.id, job.owner_uid, limit, priority, on_limit, cgroup)
        if src is not None and src.state == PARKED and src.checkpoint == rec.id:
            self.table.update(src.job_id, state=RESUMED, resumed_as=job.id)

    def forget_cgroup(self, cgroup: str) -> None:
        """Removes a cgroup that a failed launch left empty."""
        if self.cg is not None and cgroup:
            self.cg.remove(Path(cgroup))

    # -- the loop, park and resume ----------------------------------------------------------
    def start(self) -> None:
        """Re-watches guarded jobs that still run, then starts the watcher thread."""
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()

    def park(self, job_id: str, reason: str, t_event: float | None = None) -> GuardedJob:
        """Checkpoints the job with --stop (to the spill tier when configured) and records it parked."""
        return self.parker.park(job_id, reason, t_event)

    def find_parked(self, caller: Any, key: str) -> GuardedJob:
        """A parked job by id or name, that the caller may act on."""
        return self.resumer.find_parked(caller, key)

    def resume(self, key: str, caller: Caller | None = None, new_limit: int = 0, auto: str = "") -> RestoreResult:
        """Restores a parked job into its memory cgroup (with new_limit if given) and lets it run on."""
        return self.resumer.resume(key, caller, new_limit, auto)


def _cgroups(cfg: GuardConfig) -> tuple[MemoryCgroups | None, str]:
    """The node's memory cgroups, set up for job cgroups under cfg.cgroup_parent, or (None, why not)."""
    try:
        cg = detect(cfg.cgroup_root, cfg.cgroup_parent)
        if cg is None:
            return None, "no memory cgroup controller found"
        cg.setup()
        return cg, ""
    except CgroupError as exc:
        return None, str(exc)


def _thresholds(cfg: GuardConfig) -> Thresholds:
    return Thresholds(some_avg10=cfg.psi_some_avg10, full_avg10=cfg.psi_full_avg10,
                      mem_available_min=cfg.mem_available_min or 0, sustain_s=cfg.sustain_s,
                      cooldown_s=cfg.cooldown_s, resume_below_some=cfg.resume_below_some_avg10,
                      resume_below_full=cfg.resume_below_full_avg10, resume_sustain_s=cfg.resume_sustain_s,
                      resume_margin=cfg.resume_margin if cfg.resume_margin is not None else 1 << 30)
