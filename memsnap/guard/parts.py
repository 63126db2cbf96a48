"""What the guard's parts (park: memsnap.guard.park, resume: .resume, the loop: .loop) share, made once by the
Guard (memsnap.guard.service)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from memsnap.config import GuardConfig
from memsnap.engine import Engine
from memsnap.guard.cgroups import MemoryCgroups
from memsnap.guard.table import JobTable
from memsnap.guard.watch import Watchers
from memsnap.metrics import Metrics


@dataclass(frozen=True)
class Parts:
    engine: Engine  # its tiers hold the park images (engine.tier.spill, guard.spill_dir, when set)
    cfg: GuardConfig
    cg: MemoryCgroups | None  # the node's memory cgroups; None when none is usable
    cg_error: str  # why none is
    table: JobTable
    watchers: Watchers
    metrics: Metrics | None
    stopping: threading.Event  # set when the guard stops


class Part:
    """A part of the guard, with the shared pieces as its own attributes."""

    def __init__(self, parts: Parts) -> None:
        self.engine = parts.engine
        self.spill = parts.engine.tier.spill  # the spill tier (guard.spill_dir), or None: park images in memory
        self.cfg, self.cg, self.cg_error = parts.cfg, parts.cg, parts.cg_error
        self.table, self.watchers, self.metrics, self.stopping = (parts.table, parts.watchers, parts.metrics,
                                                                  parts.stopping)
