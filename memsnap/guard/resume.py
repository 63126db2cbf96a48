"""Resuming a parked job: its image restored into its memory cgroup (with a new limit if given), and the restored
job guarded as it was."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memsnap.caller import Caller
from memsnap.errors import FailedPrecondition, InvalidArgument, NotFound
from memsnap.guard.cgroups import CgroupError
from memsnap.guard.parts import Part, Parts
from memsnap.guard.table import PARKED, RESUMED, GuardedJob
from memsnap.restorer import RestoreResult

log = logging.getLogger("memsnap.guard")


class Resumer(Part):
    """Finds parked jobs and resumes them (from whichever tier holds the image, or from the store)."""

    def __init__(self, parts: Parts, adopt: Callable[..., GuardedJob]) -> None:
        super().__init__(parts)
        self.adopt = adopt  # Guard.adopt: the resumed job is guarded, and watched

    def find_parked(self, caller: Any, key: str) -> GuardedJob:
        """A parked job by id or name, that the caller may act on."""
        every = self.table.jobs()
        cands = [g for g in every if g.job_id == key]
        if not cands:
            named = {j.id for j in self.engine.catalog.jobs() if j.name == key and
                     (caller.is_root or j.owner_uid == caller.uid)}
            cands = [g for g in every if g.job_id in named]
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

    def resume(self, key: str, caller: Caller | None = None, new_limit: int = 0, auto: str = "") -> RestoreResult:
        """Restores a parked job into its memory cgroup (with new_limit if given) and lets it run on."""
        from memsnap.engine import ROOT
        caller = caller or ROOT
        g = self.find_parked(caller, key)
        deadline = time.monotonic() + 60
        while not self.table.claim(g.job_id):  # a tier eviction of its image may be under way: it is short
            if time.monotonic() > deadline:
                raise FailedPrecondition(f"job {g.job_id} is being parked or resumed already")
            time.sleep(0.05)
        busy_id = g.job_id
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
            t0 = time.monotonic()
            res = self.engine.restore(caller, g.checkpoint)  # (the engine sends SIGCONT: the manifest says parked)
            resume_ms = (time.monotonic() - t0) * 1000
            ng = self.adopt(res.job.id, g.owner_uid, limit, g.priority, g.on_limit, g.cgroup)
            self.table.update(ng.job_id, stats={"resumed_from": g.job_id, "resume_ms": round(resume_ms, 1)})
            # (after: resumed_as names a guarded job)
            self.table.update(g.job_id, state=RESUMED, resumed_as=res.job.id)
            log.warning("resumed %s as %s from %s%s (limit %d MiB, %.0f ms)", g.job_id, res.job.id, g.checkpoint,
                        f": {auto}" if auto else "", limit >> 20, resume_ms, extra={"job": res.job.id})
            if self.metrics is not None:
                self.metrics.guard_resumes.labels(trigger="auto" if auto else "manual").inc()
            return res
        finally:
            self.table.release(busy_id)
