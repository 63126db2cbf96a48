"""What the guard's parts (park: memsnap.guard.park, resume: .resume, the loop: .loop) share, made once by the
Guard (memsnap.guard.service)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from memsnap.guard.cgroups import MemoryCgroups
from memsnap.guard.table import JobTable
from memsnap.guard.watch import Watchers


@dataclass(frozen=True)
class Parts:
    engine: Any  # the main Engine (its catalog is the spill engine's too)
    spill: Any  # the Engine over guard.spill_dir, or None
    cfg: Any  # GuardConfig
    cg: MemoryCgroups | None  # the node's memory cgroups; None when none is usable
    cg_error: str  # why none is
    table: JobTable
    watchers: Watchers
    metrics: Any  # or None
    stopping: threading.Event  # set when the guard stops


class Part:
    """A part of the guard, with the shared pieces as its own attributes."""

    def __init__(self, parts: Parts) -> None:
        self.engine, self.spill, self.cfg, self.cg, self.cg_error = (parts.engine, parts.spill, parts.cfg, parts.cg,
                                                                     parts.cg_error)
        self.table, self.watchers, self.metrics, self.stopping = (parts.table, parts.watchers, parts.metrics,
                                                                  parts.stopping)
