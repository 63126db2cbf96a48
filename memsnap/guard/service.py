"""The guard service in memsnapd: per-job memory cgroups, the watcher loop, park and resume."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memsnap import background, jobs
from memsnap.catalog import DRAINING, DURABLE, FAILED, STAGED, now_ms
from memsnap.errors import FailedPrecondition, InvalidArgument, NotFound
from memsnap.guard import psi
from memsnap.guard.cgroups import CgroupError, MemoryCgroups, detect, poll_fds, wait_stopped
from memsnap.guard.policy import CRITICAL, Candidate, NodePolicy, Parked, Thresholds

log = logging.getLogger("memsnap.guard")

RUNNING, PARKED, RESUMED, ENDED, KILLED = "running", "parked", "resumed", "ended", "killed"


@dataclass
class GuardedJob:
    """What the guard knows of a job (kept in the catalog's guard_jobs table, beside the checkpoints)."""

    job_id: str
    owner_uid: int
    priority: int = 0
    limit: int = 0  # bytes; 0 = no cgroup limit (the node policy may still park it)
    on_limit: str = "park"
    cgroup: str = ""  # absolute path of its memory cgroup, "" = none
    state: str = RUNNING
    reason: str = ""
    parked_ms: int = 0
    checkpoint: str = ""
    resumed_as: str = ""
    oom_kills_at_start: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


class Guard:
    """Watches limited jobs and node pressure; parks (checkpoint --stop) and resumes jobs."""

    def __init__(self, engine: Any, cfg: Any, state_dir: Path, metrics: Any = None,
                 spill_engine: Any = None) -> None:
        self.engine = engine
        self.cfg = cfg
        self.metrics = metrics
        self.spill = spill_engine
        # A spill tier in RAM (tmpfs, ramfs) is evicted once durable, like the memory tier; one on disk or DAX keeps
        # its copy (it costs no RAM, and a resume reads it without a fetch).
        self.spill_in_ram = spill_engine is not None and spill_engine.tier.in_ram()
        if spill_engine is not None and spill_engine.drain is not None:
            # its own drain (the memory tier's reads another dir), started idle now, before the daemon starts the
            # main drain: each start clears the store's interrupted uploads, which must not hit live ones
            spill_engine.drain.start([])
        self.dir = Path(state_dir) / "guard"
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self._lock = threading.RLock()
        self._jobs: dict[str, GuardedJob] = self._load()
        self._fds: dict[int, str] = {}  # watcher fd -> job id
        self._pressure_fds: set[int] = set()  # those of them that watch memory.pressure_level (v1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._busy: set[str] = set()
        self._backoff: dict[str, float] = {}  # job -> monotonic time before which a failed park is not retried
        self.cg: MemoryCgroups | None = None
        self.cg_error = ""
        try:
            self.cg = detect(cfg.cgroup_root, cfg.cgroup_parent)
            if self.cg is None:
                self.cg_error = "no memory cgroup controller found"
            else:
                self.cg.setup()
        except CgroupError as exc:
            self.cg, self.cg_error = None, str(exc)
        th = Thresholds(some_avg10=cfg.psi_some_avg10, full_avg10=cfg.psi_full_avg10,
                        mem_available_min=cfg.mem_available_min or 0, sustain_s=cfg.sustain_s,
                        cooldown_s=cfg.cooldown_s, resume_below_some=cfg.resume_below_some_avg10,
                        resume_below_full=cfg.resume_below_full_avg10, resume_sustain_s=cfg.resume_sustain_s,
                        resume_margin=cfg.resume_margin if cfg.resume_margin is not None else 1 << 30)
        self.policy = NodePolicy(th, time.monotonic)
        self.would_park: list[str] = []  # observe mode: what it would have parked (also logged)

    # -- persistence ------------------------------------------------------------------
    def _load(self) -> dict[str, GuardedJob]:
        """The guard's table from the catalog. A table an older memsnapd kept in <state>/guard/jobs.json (replaced
        without fsync, outside the journal) moves into the catalog once."""
        raw = self.engine.catalog.guard_jobs()
        legacy = self.dir / "jobs.json"
        if not raw and legacy.exists():
            try:
                raw = json.loads(legacy.read_text())
                if not isinstance(raw, dict):
                    raise ValueError("not a table")
                self.engine.catalog.save_guard_jobs(raw)
            except (OSError, ValueError) as exc:
                log.warning("guard: ignoring %s (%s)", legacy, exc)
                raw = {}
            legacy.unlink(missing_ok=True)
        jobs: dict[str, GuardedJob] = {}
        for k, v in raw.items():
            try:
                jobs[k] = GuardedJob(**v)
            except TypeError as exc:
                log.warning("guard: forgetting job %s, whose row does not parse: %s", k, exc)
        return jobs

    def _save(self) -> None:
        self.engine.catalog.save_guard_jobs({k: asdict(v) for k, v in self._jobs.items()})

    def get(self, job_id: str) -> GuardedJob | None:
        with self._lock:
            return self._jobs.get(job_id)

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
        with self._lock:
            parked = sum(1 for j in self._jobs.values() if j.state == PARKED)
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
            self._watch(job_id, Path(cgroup))
        with self._lock:
            self._jobs[job_id] = g
            self._save()
        log.info("guarding %s: limit %d MiB, priority %s, on limit %s", job_id, limit >> 20,
                 "critical" if priority >= CRITICAL else priority, on_limit, extra={"job": job_id})
        return g

    def settings_of(self, job_id: str) -> dict[str, Any] | None:
        """What a checkpoint of a guarded job carries wherever it is restored (its manifest's "guard")."""
        g = self._jobs.get(job_id)
        if g is None:
            return None
        return {"limit": g.limit, "priority": g.priority, "on_limit": g.on_limit}

    def restored(self, job: Any, rec: Any, man: dict[str, Any]) -> None:
        """A guarded job came back, from any restore here or a move to this node: the new job is guarded as it
        was, in the memory cgroup CRIU put it into (recreated without a limit if it was gone: its limit is set
        first) or a new one. A parked job restored this way counts as resumed. The guard's own resume does its
        own bookkeeping."""
        with self._lock:
            src = self._jobs.get(rec.job) if rec.job else None
            if job.id in self._jobs or (src is not None and src.job_id in self._busy):
                return
        s = self.settings_of(src.job_id) if src is not None else man.get("guard")
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
            self._set(src.job_id, state=RESUMED, resumed_as=job.id)

    def forget_cgroup(self, cgroup: str) -> None:
        """Removes a cgroup that a failed launch left empty."""
        if self.cg is not None and cgroup:
            self.cg.remove(Path(cgroup))

    def _watch(self, job_id: str, cg: Path) -> None:
        assert self.cg is not None
        try:
            fd = self.cg.watch(cg)
        except (CgroupError, OSError) as exc:
            log.warning("no limit watcher for %s (%s); polling its usage instead", job_id, exc)
            return
        with self._lock:
            self._fds[fd] = job_id
        level = self.cfg.pressure_level
        if self.cg.version != 1 or level == "off":
            return
        try:  # the kernel's reclaim warning for the cgroup (low/medium: reclaim against the limit, before it)
            pfd = self.cg.watch_pressure(cg, level)  # type: ignore[attr-defined]
        except (CgroupError, OSError) as exc:
            log.warning("no memory.pressure_level watcher for %s (%s)", job_id, exc)
            return
        with self._lock:
            self._fds[pfd] = job_id
            self._pressure_fds.add(pfd)

    def _unwatch(self, job_id: str) -> None:
        with self._lock:
            for fd, j in list(self._fds.items()):
                if j == job_id:
                    del self._fds[fd]
                    self._pressure_fds.discard(fd)
                    os.close(fd)

    # -- the loop ---------------------------------------------------------------------
    def start(self) -> None:
        """Re-watches guarded jobs that still run, then starts the watcher thread."""
        if not self.cfg.enabled:
            return
        with self._lock:
            for g in self._jobs.values():
                if g.state == RUNNING and g.cgroup and self.cg is not None and Path(g.cgroup).is_dir():
                    self._watch(g.job_id, Path(g.cgroup))
        self._sweep()
        if self.spill is not None and self.spill.drain is not None:
            for rec in self.engine.catalog.checkpoints(states=(STAGED, DRAINING)):
                if rec.in_tier and rec.meta.get("spill"):
                    self.spill.drain.enqueue(rec.id)
        self._thread = threading.Thread(target=self._run, name="guard", daemon=True)
        self._thread.start()

    def _sweep(self, min_age_s: float = 300.0) -> None:
        """Removes empty job cgroups that no job of ours needs and that nobody touched for min_age_s (another
        daemon sharing the parent may have just made one for a launch; a parked job's cgroup is made again on
        resume anyway)."""
        if self.cg is None:
            return
        with self._lock:
            keep = {g.cgroup for g in self._jobs.values() if g.state in (RUNNING, PARKED)}
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
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self.spill is not None and self.spill.drain is not None:
            self.spill.drain.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    fds = dict(self._fds)
                fired = poll_fds(list(fds), self.cfg.poll_interval_s)
                t_event = time.monotonic()
                for fd in fired:
                    try:
                        self.cg.ack(fd)  # type: ignore[union-attr]
                    except OSError:
                        pass
                with self._lock:
                    pressured = {fds[fd] for fd in fired if fd in self._pressure_fds}
                self._check_limits({fds[fd] for fd in fired if fd in fds}, t_event, pressured)
                self._check_node()
            except Exception:  # the guard must keep watching whatever one step did
                log.exception("guard step failed")
                self._stop.wait(1.0)

    def _running(self) -> list[tuple[GuardedJob, Any]]:
        out = []
        with self._lock:
            gs = [g for g in self._jobs.values() if g.state == RUNNING]
        for g in gs:
            job = self.engine.catalog.get_job(g.job_id)
            if job is None or job.ended or not jobs.alive(job.pid, job.pid_start):
                if g.job_id not in self._busy:
                    self._set(g.job_id, state=ENDED)
                    self._unwatch(g.job_id)
                    self.forget_cgroup(g.cgroup)
                continue
            out.append((g, job))
        return out

    def _check_limits(self, fired: set[str], t_event: float, pressured: frozenset[str] | set[str] = frozenset()
                      ) -> None:
        """Parks (or kills, or in observe mode logs) each guarded job at its limit, or whose watcher fired:
        memory.oom_control (v1: its tasks wait at the limit), memory.events (v2), or memory.pressure_level (v1:
        the kernel's reclaim warning, the ids in pressured)."""
        if self.cg is None:
            return
        for g, _job in self._running():
            if not g.cgroup or g.job_id in self._busy or self._backoff.get(g.job_id, 0) > time.monotonic():
                continue
            try:
                s = self.cg.sample(Path(g.cgroup))
            except CgroupError:
                continue
            if not (s.at_limit or g.job_id in fired):
                continue
            if s.at_limit or g.job_id not in pressured:
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
            self._park_async(g.job_id, reason, t_event)

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
        self._unwatch(g.job_id)
        self._set(g.job_id, state=KILLED, reason="killed at its memory limit (on-limit kill)")
        if job is not None:
            jobs.wait_gone(job.pid, 5)
        self.forget_cgroup(g.cgroup)

    def _check_node(self) -> None:
        th = self.policy.th
        if not th.active:
            return
        sample = psi.read_node(self.cfg.psi_path)
        running = [Candidate(g.job_id, g.priority, started_ms=job.started_ms) for g, job in self._running()
                   if g.job_id not in self._busy]
        with self._lock:
            parked = [Parked(g.job_id, g.priority, int(g.stats.get("image_bytes", 0)), g.parked_ms)
                      for g in self._jobs.values() if g.state == PARKED and g.job_id not in self._busy]
        if not self.cfg.auto_resume:
            parked = []
        d = self.policy.decide(sample, running, parked, tier_ram_bytes=self._tier_inflight())
        if d is None:
            return
        if self.metrics is not None:
            self.metrics.guard_events.labels(kind="node").inc()
        if d.action == "park":
            if self.cfg.mode == "observe":
                self._would(d.job_id, d.reason)
                return
            self._park_async(d.job_id, d.reason, time.monotonic())
        elif d.action == "resume" and self.cfg.mode != "observe":
            def resume() -> None:
                try:
                    self.resume(d.job_id, auto=d.reason)
                except Exception as exc:
                    log.warning("auto-resume of %s failed: %s", d.job_id, exc, extra={"job": d.job_id})
            threading.Thread(target=resume, name=f"resume-{d.job_id}", daemon=True).start()

    def _tier_inflight(self) -> int:
        """RAM a tmpfs tier is promised for dumps in flight (already counted in MemAvailable once written)."""
        tier = self.engine.tier
        if getattr(tier, "kind", "tmpfs") == "devdax":
            return 0
        return int(tier.reserved_bytes())

    # -- park ---------------------------------------------------------------------------
    def _park_async(self, job_id: str, reason: str, t_event: float) -> None:
        with self._lock:
            if job_id in self._busy:
                return
            self._busy.add(job_id)
        threading.Thread(target=self._park_thread, args=(job_id, reason, t_event), name=f"park-{job_id}",
                         daemon=True).start()

    def _park_thread(self, job_id: str, reason: str, t_event: float) -> None:
        try:
            self.park(job_id, reason, t_event)
        except Exception as exc:
            self._backoff[job_id] = time.monotonic() + 30
            log.error("could not park %s (retrying in 30 s): %s", job_id, exc, extra={"job": job_id})
            if self.metrics is not None:
                self.metrics.guard_parks.labels(result="error").inc()
        finally:
            with self._lock:
                self._busy.discard(job_id)

    def park(self, job_id: str, reason: str, t_event: float | None = None) -> GuardedJob:
        """Checkpoints the job with --stop (to the spill tier when configured) and records it parked.

        A job waiting at its limit cannot be frozen (it sleeps in the kernel): it is sent SIGSTOP first,
        then given just enough headroom to leave the kernel, where it stops; CRIU dumps it stopped, and the
        resume sends SIGCONT once it is restored. Foreground work: drains step aside (memsnap.background)."""
        with background.gate().foreground("guard park"):
            return self._park(job_id, reason, t_event)

    def _park(self, job_id: str, reason: str, t_event: float | None) -> GuardedJob:
        t0 = t_event if t_event is not None else time.monotonic()
        g = self.get(job_id)
        job = self.engine.catalog.get_job(job_id)
        if g is None or job is None:
            raise NotFound(f"job {job_id} is not guarded")
        if self.spill is None and getattr(self.engine.tier, "kind", "tmpfs") != "devdax":
            try:
                rss = jobs.tree_rss(job.pid)
            except jobs.ProcessNotFound:
                rss = 0
            avail = psi.read_node(self.cfg.psi_path).mem_available
            if rss > avail - (256 << 20):
                log.warning("parking %s puts %d MiB into the memory tier with %d MiB available: the dump may push "
                            "the node into the OOM killer; set guard.spill_dir to a disk directory", job_id,
                            rss >> 20, avail >> 20, extra={"job": job_id})
        sampler = _PeakSampler()
        sampler.start()
        frozen_ms = 0.0
        headroom_to = 0
        pids: list[int] = []
        try:
            at_trigger = None
            # only the job's own tree: its launcher (unshare, in the cgroup too) must stay free to exit
            pids = [p.pid for p in jobs.tree(job.pid)]
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    pass
            if g.cgroup and self.cg is not None:
                cg = Path(g.cgroup)
                at_trigger = self.cg.sample(cg)
                extra = self.cfg.headroom or (16 << 20) + g.limit // 20
                headroom_to = self.cg.give_headroom(cg, extra)
                if not wait_stopped(pids, 10.0):
                    log.warning("%s: not every task stopped within 10 s; dumping anyway", job_id)
            else:
                wait_stopped(pids, 10.0)
            frozen_ms = (time.monotonic() - t0) * 1000
            eng = self.spill or self.engine
            from memsnap.engine import ROOT, DumpHooks
            # signed into the manifest: a restore anywhere (memsnapctl restore, a Slurm requeue on another
            # node) knows the job was dumped stopped, and why
            hooks = DumpHooks(manifest={"parked": {"reason": reason, "at_ms": now_ms(), "job": job_id,
                                                   "limit": g.limit, "priority": g.priority}})
            rec = eng.checkpoint(ROOT, job_id, stop=True, name=job.name, hooks=hooks)
        except BaseException:
            for pid in pids:  # never leave the job stopped
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            sampler.stop()
            raise
        park_ms = (time.monotonic() - t0) * 1000
        if g.cgroup and self.cg is not None:
            try:  # the cgroup is empty now: back to the job's own limit, for its resume
                self.cg.set_limit(Path(g.cgroup), g.limit)
            except CgroupError:
                pass
        self._unwatch(job_id)
        parked = {"reason": reason, "at_ms": now_ms(), "job": job_id}
        if self.spill is not None:
            parked["spill"] = str(self.spill.tier.root)
        cur = self.engine.catalog.get_checkpoint(rec.id)
        self.engine.catalog.update_checkpoint(rec.id, meta={**cur.meta, "parked": parked,
                                                            **({"spill": True} if self.spill else {})})
        stats = {"trigger_to_frozen_ms": round(frozen_ms, 1), "park_ms": round(park_ms, 1),
                 "image_bytes": rec.size_bytes, "headroom_limit": headroom_to, "dump_ms": rec.dump_ms,
                 "frozen_ms": rec.frozen_ms, "peak_node_used_bytes": 0,
                 "at_limit_at_trigger": bool(at_trigger and at_trigger.at_limit),
                 "usage_at_trigger": at_trigger.usage if at_trigger else 0,
                 "oom_kills": self.cg.sample(Path(g.cgroup)).oom_kills if g.cgroup and self.cg else 0}
        self._set(job_id, state=PARKED, reason=reason, parked_ms=parked["at_ms"], checkpoint=rec.id, stats=stats)
        log.warning("parked %s into %s (%s): %d MiB image, trigger-to-frozen %.0f ms, park %.0f ms", job_id, rec.id,
                    reason, rec.size_bytes >> 20, frozen_ms, park_ms, extra={"job": job_id, "checkpoint_id": rec.id})
        if self.metrics is not None:
            self.metrics.guard_parks.labels(result="ok").inc()
            self.metrics.guard_park_seconds.observe(park_ms / 1000)
        eng = self.spill or self.engine
        if eng.drain is not None and (self.spill is None or self.spill_in_ram):
            self._evict_when_durable(eng, rec.id, job_id, sampler)
        else:
            self._finish_peak(job_id, sampler)
        g2 = self.get(job_id)
        assert g2 is not None
        return g2

    def _finish_peak(self, job_id: str, sampler: _PeakSampler) -> None:
        peak = sampler.stop()
        with self._lock:
            g = self._jobs.get(job_id)
            if g is not None:
                g.stats["peak_node_used_bytes"] = peak
                g.stats["node_used_at_park_start_bytes"] = sampler.first
                g.stats["node_used_after_park_bytes"] = psi.read_node("/nonexistent").used
                self._save()
        if self.metrics is not None:
            self.metrics.guard_peak_node_bytes.set(peak)
        log.info("peak node memory in use during the park of %s: %d MiB", job_id, peak >> 20,
                 extra={"job": job_id})

    def _evict_when_durable(self, eng: Any, ckpt_id: str, job_id: str, sampler: _PeakSampler) -> None:
        """Drops the copy in eng's RAM tier (the memory tier, or a tmpfs spill tier) once the drain made the image
        durable (in the background)."""
        def wait() -> None:
            deadline = time.monotonic() + self.cfg.durable_wait_s
            try:
                while time.monotonic() < deadline and not self._stop.is_set():
                    rec = self.engine.catalog.get_checkpoint(ckpt_id)
                    if rec is None or rec.state == FAILED:
                        return
                    if rec.state == DURABLE and rec.in_store:
                        # never under a resume that reads the tier copy (CRIU reads it without a lock)
                        with self._lock:
                            if job_id in self._busy:
                                time.sleep(0.1)
                                continue
                            self._busy.add(job_id)
                        try:
                            cur = self.get(job_id)
                            # under the checkpoint's lock, and not while a plain restore reads the tier copy
                            # (CRIU reads it after the engine let go of that lock; its work dir marks it)
                            with eng.checkpoint_lock(ckpt_id):
                                restoring = self._being_restored(ckpt_id)
                                if not restoring and cur is not None and cur.state == PARKED:
                                    from memsnap.engine import ROOT
                                    eng.evict(ROOT, ckpt_id)
                                    log.info("parked image %s is durable: tier copy evicted", ckpt_id,
                                             extra={"checkpoint_id": ckpt_id})
                        finally:
                            with self._lock:
                                self._busy.discard(job_id)
                        if not restoring:
                            return
                    time.sleep(0.1)
                log.warning("parked image %s not durable after %.0f s: the tier copy stays", ckpt_id,
                            self.cfg.durable_wait_s)
            except Exception as exc:
                log.warning("could not evict parked image %s: %s", ckpt_id, exc)
            finally:
                self._finish_peak(job_id, sampler)
        threading.Thread(target=wait, name=f"evict-{ckpt_id}", daemon=True).start()

    def _being_restored(self, ckpt_id: str) -> bool:
        """Whether a restore of ckpt_id is under way (its work dir exists and its log moved in the last 60 s)."""
        now = time.time()
        for work in self.engine.work_root.glob(f"{ckpt_id}.restore-*"):
            try:
                log_file = work / "restore.log"
                if now - (log_file if log_file.exists() else work).stat().st_mtime < 60:
                    return True
            except OSError:
                continue
        return False

    # -- resume ---------------------------------------------------------------------------
    def find_parked(self, caller: Any, key: str) -> GuardedJob:
        """A parked job by id or name, that the caller may act on."""
        with self._lock:
            cands = [g for g in self._jobs.values() if g.job_id == key]
            if not cands:
                named = {j.id for j in self.engine.catalog.jobs() if j.name == key and
                         (caller.is_root or j.owner_uid == caller.uid)}
                cands = [g for g in self._jobs.values() if g.job_id in named]
        if not cands:
            raise NotFound(f"no guarded job {key[:200]!r}; 'memsnapctl jobs' lists parked jobs")
        if not caller.is_root and all(g.owner_uid != caller.uid for g in cands):  # (before its state is told)
            from memsnap.errors import PermissionDenied
            raise PermissionDenied(f"uid {caller.uid} may not resume job {cands[-1].job_id} of uid "
                                   f"{cands[-1].owner_uid}; run as its owner or as root")
        cands = [g for g in cands if caller.is_root or g.owner_uid == caller.uid]
        parked = [g for g in cands if g.state == PARKED]
        if not parked:
            g = cands[-1]
            raise FailedPrecondition(f"job {g.job_id} is {g.state}, not parked"
                                     + (f" (resumed as {g.resumed_as})" if g.resumed_as else ""))
        return max(parked, key=lambda x: x.parked_ms)

    def resume(self, key: str, caller: Any = None, new_limit: int = 0, auto: str = "") -> Any:
        """Restores a parked job into its memory cgroup (with new_limit if given) and lets it run on."""
        from memsnap.engine import ROOT
        caller = caller or ROOT
        g = self.find_parked(caller, key)
        deadline = time.monotonic() + 60
        while True:  # a tier eviction of its image may be under way: it is short
            with self._lock:
                if g.job_id not in self._busy:
                    self._busy.add(g.job_id)
                    busy_id = g.job_id
                    break
            if time.monotonic() > deadline:
                raise FailedPrecondition(f"job {g.job_id} is being parked or resumed already")
            time.sleep(0.05)
        try:
            g = self.find_parked(caller, busy_id)  # still parked (not resumed by someone else meanwhile)?
            limit = new_limit or g.limit
            image = int(g.stats.get("image_bytes", 0))
            if g.cgroup:
                if self.cg is None:
                    raise FailedPrecondition(f"job {g.job_id} had a memory cgroup, and this node has none: "
                                             f"{self.cg_error}")
                need = image + (16 << 20)
                if limit < need:
                    raise InvalidArgument(f"job {g.job_id}'s image holds {image >> 20} MiB: a memory limit of "
                                          f"{limit >> 20} MiB cannot hold it; give --memory-limit of at least "
                                          f"{(need >> 20) + 1}M")
                cg = Path(g.cgroup)
                try:
                    cg.mkdir(exist_ok=True)  # CRIU restores the tree into the cgroup it was dumped from
                    self.cg.set_limit(cg, limit)
                except (OSError, CgroupError) as exc:
                    raise FailedPrecondition(f"cannot prepare the memory cgroup of {g.job_id}: {exc}") from exc
            rec = self.engine.catalog.get_checkpoint(g.checkpoint)
            eng = self.spill if (rec is not None and rec.meta.get("spill") and self.spill is not None) \
                else self.engine
            t0 = time.monotonic()
            res = eng.restore(caller, g.checkpoint)  # (the engine sends SIGCONT: the manifest says parked)
            resume_ms = (time.monotonic() - t0) * 1000
            ng = self.adopt(res.job.id, g.owner_uid, limit, g.priority, g.on_limit, g.cgroup)
            with self._lock:
                ng.stats = {"resumed_from": g.job_id, "resume_ms": round(resume_ms, 1)}
                self._save()
            self._set(g.job_id, state=RESUMED, resumed_as=res.job.id)  # (after: resumed_as names a guarded job)
            log.warning("resumed %s as %s from %s%s (limit %d MiB, %.0f ms)", g.job_id, res.job.id, g.checkpoint,
                        f": {auto}" if auto else "", limit >> 20, resume_ms, extra={"job": res.job.id})
            if self.metrics is not None:
                self.metrics.guard_resumes.labels(trigger="auto" if auto else "manual").inc()
            return res
        finally:
            with self._lock:
                self._busy.discard(busy_id)

    def _set(self, job_id: str, **changes: Any) -> None:
        with self._lock:
            g = self._jobs.get(job_id)
            if g is None:
                return
            for k, v in changes.items():
                setattr(g, k, v)
            self._save()


class _PeakSampler:
    """Samples the node's used memory (MemTotal - MemAvailable) every 20 ms until stopped; stop() -> peak."""

    def __init__(self) -> None:
        self.peak = 0
        self.first = 0  # at the start of the park
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="peak", daemon=True)

    def start(self) -> None:
        self._t.start()

    def _run(self) -> None:
        while True:
            used = psi.read_node("/nonexistent").used
            self.first = self.first or used
            self.peak = max(self.peak, used)
            if self._stop.wait(0.02):
                return

    def stop(self) -> int:
        self._stop.set()
        self._t.join(2)
        return self.peak
