"""What the guard's parts (park: memsnap.guard.park, resume: .resume, the loop: .loop) share, made once by the
Guard (memsnap.guard.service)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from memsnap.config import GuardConfig
from memsnap.drain import DrainService
from memsnap.engine import Engine
from memsnap.guard.cgroups import MemoryCgroups
from memsnap.guard.table import JobTable
from memsnap.guard.watch import Watchers
from memsnap.metrics import Metrics


@dataclass(frozen=True)
class Parts:
    engine: Engine  # the main engine (its catalog is the spill engine's too)
    spill: Engine | None  # the engine over guard.spill_dir, or None
    spill_drain: DrainService | None  # the spill engine's drain, the guard's to start and stop
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
        self.engine, self.spill, self.spill_drain = parts.engine, parts.spill, parts.spill_drain
        self.cfg, self.cg, self.cg_error = parts.cfg, parts.cg, parts.cg_error
        self.table, self.watchers, self.metrics, self.stopping = (parts.table, parts.watchers, parts.metrics,
                                                                  parts.stopping)
