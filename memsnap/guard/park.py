"""Parking a guarded job: checkpoint --stop into the tier (or the guard's spill tier), then, once the drain made
the image durable, dropping the copy a RAM tier holds."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from memsnap import background, jobs, lifecycle
from memsnap.catalog import DURABLE, FAILED, now_ms
from memsnap.errors import NotFound
from memsnap.guard import psi
from memsnap.guard.cgroups import CgroupError, wait_stopped
from memsnap.guard.parts import Part, Parts
from memsnap.guard.table import PARKED, RUNNING, GuardedJob

log = logging.getLogger("memsnap.guard")


def stop_top_down(root: int, tree: list[tuple[int, int]], stop: Callable[[int], None],
                  stopped: Callable[[list[int], float], bool], after_first: Callable[[], None],
                  timeout: float) -> bool:
    """Stops a tree (pid, ppid pairs) one generation at a time: each generation is stopped whole (every thread)
    before its children are sent SIGSTOP, so a child's SIGCHLD finds its parent stopped, where it waits (the
    restored job takes it once it runs on). after_first runs once the first generation was signalled (the
    headroom that lets a task at its limit leave the kernel and stop). False if some generation did not stop
    within timeout (the rest are stopped anyway)."""
    kids: dict[int, list[int]] = {}
    for pid, ppid in tree:
        kids.setdefault(ppid, []).append(pid)
    generation, seen, ok, first = [root], {root}, True, True
    deadline = time.monotonic() + timeout
    while generation:
        for pid in generation:
            stop(pid)
        if first:
            after_first()
            first = False
        ok = stopped(generation, max(0.0, deadline - time.monotonic())) and ok
        nxt = [c for pid in generation for c in kids.get(pid, []) if c not in seen]
        seen.update(nxt)
        generation = nxt
    return ok


def _sigstop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        pass


class Parker(Part):
    """Parks jobs: into the memory tier, or the spill tier (guard.spill_dir) when there is one."""

    def __init__(self, parts: Parts) -> None:
        super().__init__(parts)
        # A spill tier in RAM (tmpfs, ramfs) is evicted once durable, like the memory tier; one on disk or DAX keeps
        # its copy (it costs no RAM, and a resume reads it without a fetch).
        self.spill_in_ram = self.spill is not None and self.spill.in_ram()
        self._backoff: dict[str, float] = {}  # job -> monotonic time before which a failed park is not retried

    def backing_off(self, job_id: str) -> bool:
        """Whether a park of the job failed lately (it is retried 30 s after)."""
        return self._backoff.get(job_id, 0) > time.monotonic()

    def retry_due(self, job_id: str) -> bool:
        """Whether a failed park of the job waits for its retry, and the 30 s are over. The retry needs no new
        event: a watcher fires once, and a job that stays just under its limit would never be parked again."""
        return job_id in self._backoff and not self.backing_off(job_id)

    def park_async(self, job_id: str, reason: str, t_event: float) -> None:
        """Parks the job in a thread of its own, unless something works on it already."""
        if not self.table.claim(job_id):
            return
        g = self.table.get(job_id)
        if g is None or g.state != RUNNING:  # (parked, or ended, since the caller read the table)
            self.table.release(job_id)
            return
        threading.Thread(target=self._park_thread, args=(job_id, reason, t_event), name=f"park-{job_id}",
                         daemon=True).start()

    def _park_thread(self, job_id: str, reason: str, t_event: float) -> None:
        try:
            self.park(job_id, reason, t_event)
            self._backoff.pop(job_id, None)
        except Exception as exc:
            self._backoff[job_id] = time.monotonic() + 30
            log.error("could not park %s (retrying in 30 s): %s", job_id, exc, extra={"job": job_id})
            if self.metrics is not None:
                self.metrics.guard_parks.labels(result="error").inc()
        finally:
            self.table.release(job_id)

    def park(self, job_id: str, reason: str, t_event: float | None = None) -> GuardedJob:
        """Checkpoints the job with --stop (to the spill tier when configured) and records it parked.

        A job waiting at its limit cannot be frozen (it sleeps in the kernel): it is sent SIGSTOP first,
        then given just enough headroom to leave the kernel, where it stops; CRIU dumps it stopped, and the
        resume sends SIGCONT once it is restored. Parents stop before their children (stop_top_down): a child
        that stops sends its parent SIGCHLD, and a parent thread that took it at the limit would need a signal
        frame on a stack page the cgroup cannot charge, which the kernel answers with SIGSEGV (it killed a
        PyTorch DataLoader job so). Foreground work: drains step aside (memsnap.background)."""
        with background.gate().foreground("guard park"):
            return self._park(job_id, reason, t_event)

    def _park(self, job_id: str, reason: str, t_event: float | None) -> GuardedJob:
        t0 = t_event if t_event is not None else time.monotonic()
        g = self.table.get(job_id)
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
        sampler = PeakSampler()
        sampler.start()
        frozen_ms = 0.0
        headroom_to = 0
        pids: list[int] = []
        try:
            at_trigger = None
            # only the job's own tree: its launcher (unshare, in the cgroup too) must stay free to exit
            tree = [(p.pid, p.ppid()) for p in jobs.tree(job.pid)]
            pids = [pid for pid, _ in tree]

            def headroom() -> None:  # (once the top of the tree has SIGSTOP pending: it stops as it leaves the kernel)
                nonlocal at_trigger, headroom_to
                if g.cgroup and self.cg is not None:
                    cg = Path(g.cgroup)
                    at_trigger = self.cg.sample(cg)
                    headroom_to = self.cg.give_headroom(cg, self.cfg.headroom or (16 << 20) + g.limit // 20)
            if not stop_top_down(job.pid, tree, _sigstop, wait_stopped, headroom, 10.0):
                log.warning("%s: not every task stopped within 10 s; dumping anyway", job_id)
            frozen_ms = (time.monotonic() - t0) * 1000
            from memsnap.engine import ROOT, DumpExtras
            from memsnap.tiers import MEMORY, SPILL
            # signed into the manifest: a restore anywhere (memsnapctl restore, a Slurm requeue on another
            # node) knows the job was dumped stopped, and why
            extras = DumpExtras(manifest={"parked": {"reason": reason, "at_ms": now_ms(), "job": job_id,
                                                   "limit": g.limit, "priority": g.priority}},
                                into=SPILL if self.spill is not None else MEMORY)
            rec = self.engine.checkpoint(ROOT, job_id, stop=True, name=job.name, extras=extras)
        except BaseException:
            if headroom_to and g.cgroup and self.cg is not None:
                try:  # the headroom was for the dump only: the job's own limit again (or each failed park adds it)
                    self.cg.set_limit(Path(g.cgroup), g.limit)
                except CgroupError as exc:
                    log.warning("%s keeps %d MiB of headroom after its failed park: %s", job_id, headroom_to >> 20,
                                exc, extra={"job": job_id})
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
        self.watchers.unwatch(job_id)
        parked = {"reason": reason, "at_ms": now_ms(), "job": job_id}
        if self.spill is not None:
            parked["spill"] = str(self.spill.root)
        lifecycle.mark(self.engine.catalog, rec.id, parked=parked, **({"spill": True} if self.spill else {}))
        stats = {"trigger_to_frozen_ms": round(frozen_ms, 1), "park_ms": round(park_ms, 1),
                 "image_bytes": rec.size_bytes, "headroom_limit": headroom_to, "dump_ms": rec.dump_ms,
                 "frozen_ms": rec.frozen_ms, "peak_node_used_bytes": 0,
                 "at_limit_at_trigger": bool(at_trigger and at_trigger.at_limit),
                 "usage_at_trigger": at_trigger.usage if at_trigger else 0,
                 "oom_kills": self.cg.sample(Path(g.cgroup)).oom_kills if g.cgroup and self.cg else 0}
        self.table.update(job_id, state=PARKED, reason=reason, parked_ms=parked["at_ms"], checkpoint=rec.id,
                          stats=stats)
        log.warning("parked %s into %s (%s): %d MiB image, trigger-to-frozen %.0f ms, park %.0f ms", job_id, rec.id,
                    reason, rec.size_bytes >> 20, frozen_ms, park_ms, extra={"job": job_id, "checkpoint_id": rec.id})
        if self.metrics is not None:
            self.metrics.guard_parks.labels(result="ok").inc()
            self.metrics.guard_park_seconds.observe(park_ms / 1000)
        if self.engine.drain is not None and (self.spill is None or self.spill_in_ram):
            self._evict_when_durable(rec.id, job_id, sampler)
        else:
            self._finish_peak(job_id, sampler)
        g2 = self.table.get(job_id)
        assert g2 is not None
        return g2

    def _finish_peak(self, job_id: str, sampler: PeakSampler) -> None:
        peak = sampler.stop()
        self.table.add_stats(job_id, peak_node_used_bytes=peak, node_used_at_park_start_bytes=sampler.first,
                             node_used_after_park_bytes=psi.read_node("/nonexistent").used)
        if self.metrics is not None:
            self.metrics.guard_peak_node_bytes.set(peak)
        log.info("peak node memory in use during the park of %s: %d MiB", job_id, peak >> 20,
                 extra={"job": job_id})

    # -- the RAM copy, once durable --------------------------------------------------------
    def _evict_when_durable(self, ckpt_id: str, job_id: str, sampler: PeakSampler) -> None:
        """Drops the copy in its RAM tier (the memory tier, or a tmpfs spill tier) once the drain made the image
        durable and no restore reads it (in the background, for up to guard.durable_wait_s)."""
        def wait() -> None:
            deadline = time.monotonic() + self.cfg.durable_wait_s
            try:
                while time.monotonic() < deadline and not self.stopping.is_set():
                    if self.evict_step(ckpt_id, job_id):
                        return
                    time.sleep(0.1)
                log.warning("parked image %s not durable, or still read by a restore, after %.0f s: the tier copy "
                            "stays", ckpt_id, self.cfg.durable_wait_s)
            except Exception as exc:
                log.warning("could not evict parked image %s: %s", ckpt_id, exc)
            finally:
                self._finish_peak(job_id, sampler)
        threading.Thread(target=wait, name=f"evict-{ckpt_id}", daemon=True).start()

    def evict_step(self, ckpt_id: str, job_id: str) -> bool:
        """One try at dropping a parked image's tier copy. True when nothing is left to do (dropped, the
        image failed, or the job is not parked any more); False to try again shortly (not durable yet, or a resume
        or restore reads that copy)."""
        rec = self.engine.catalog.get_checkpoint(ckpt_id)
        if rec is None or rec.state == FAILED:
            return True
        if rec.state != DURABLE or not rec.in_store:
            return False
        if not self.table.claim(job_id):  # never under the guard's own resume
            return False
        try:
            cur = self.table.get(job_id)
            if cur is None or cur.state != PARKED:  # (a restore brought it back: the copy is no longer ours)
                return True
            with self.engine.checkpoint_lock(ckpt_id):
                # The engine counts the restores reading a tier copy (CRIU, a lazy restore's pager), and marks one
                # under the checkpoint's lock before CRIU reads: under that lock the count is exact.
                if self.engine.tier_copy_in_use(ckpt_id):
                    return False
                from memsnap.engine import ROOT
                self.engine.evict(ROOT, ckpt_id)  # (which refuses a copy in use too, under the same lock)
            log.info("parked image %s is durable: tier copy evicted", ckpt_id, extra={"checkpoint_id": ckpt_id})
            return True
        finally:
            self.table.release(job_id)


class PeakSampler:
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
