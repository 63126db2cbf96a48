"""Where a checkpoint's or a restore's time goes, phase by phase: kept in the manifest (the phases up to the
dump, signed with it), the catalog (all of them; `memsnapctl show`) and the memsnap_phase_seconds histogram.

    checkpoint: quiesce -> gpu_describe (finding the CUDA processes) -> gpu_lock -> gpu_checkpoint (device -> host)
                -> dump (CRIU; freeze: how long of it the tree was frozen) -> publish
                -> [leave-running: gpu_restore -> gpu_unlock -> quiesce_resume]
    restore:    fetch (from the store) -> verify -> placeholder (a container's: started) -> criu_restore
                -> gpu_restore (host -> device) -> gpu_unlock -> quiesce_resume
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

CHECKPOINT = ("quiesce", "gpu_describe", "gpu_lock", "gpu_checkpoint", "freeze", "dump", "publish", "gpu_restore",
              "gpu_unlock", "quiesce_resume")
RESTORE = ("fetch", "verify", "placeholder", "criu_restore", "gpu_restore", "gpu_unlock", "quiesce_resume")
ALL = tuple(dict.fromkeys(CHECKPOINT + RESTORE))
# Observed into the histogram by their own code already (memsnap.drain times the fetch).
OBSERVED_ELSEWHERE = frozenset({"fetch"})


class PhaseClock:
    """Seconds per phase of one operation, in the order they first ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        """Adds seconds to a phase (a phase that runs twice, e.g. a retried resume, adds up)."""
        if name not in ALL:
            raise ValueError(f"unknown phase {name!r}")
        self.seconds[name] = self.seconds.get(name, 0.0) + max(0.0, seconds)

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Times the block as the phase name (also when it raises)."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - t0)

    def gpu(self, stages: Mapping[str, float] | None) -> None:
        """The GPU stages' wall times (GpuSuspension.seconds, GpuCheckpointer.restore): lock, checkpoint, ..."""
        for op, s in (stages or {}).items():
            if f"gpu_{op}" in ALL:
                self.add(f"gpu_{op}", s)

    def rounded(self) -> dict[str, float]:
        """{phase: seconds} rounded to microseconds, for JSON."""
        return {k: round(v, 6) for k, v in self.seconds.items()}

    def observe(self, observe: Callable[[str, str, float], None], since: Mapping[str, float] | None = None) -> None:
        """Feeds the histogram (Engine.observe "phase:NAME"), each phase once: less what since already fed."""
        for k, v in self.seconds.items():
            if k not in OBSERVED_ELSEWHERE:
                observe(f"phase:{k}", "ok", v - (since or {}).get(k, 0.0))
