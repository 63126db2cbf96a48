"""The node pressure policy: when to park which job, and when to resume which, with hysteresis.

Pure logic over samples and an injected clock, so that it can be tested without memory pressure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memsnap.guard.psi import NodeSample

CRITICAL = 1 << 30  # the priority of a job started with --priority critical: never parked by the node policy


@dataclass
class Thresholds:
    """[guard] thresholds (0 / 0 bytes = that signal is off)."""

    some_avg10: float = 0.0
    full_avg10: float = 0.0
    mem_available_min: int = 0
    sustain_s: float = 10.0
    cooldown_s: float = 10.0
    resume_below_some: float = 5.0
    resume_below_full: float = 1.0
    resume_sustain_s: float = 30.0
    resume_margin: int = 1 << 30

    @property
    def active(self) -> bool:
        """Whether any node signal is configured."""
        return bool(self.some_avg10 or self.full_avg10 or self.mem_available_min)


@dataclass
class Candidate:
    """A running job the policy may park."""

    job_id: str
    priority: int
    rss: int = 0
    started_ms: int = 0


@dataclass
class Parked:
    """A parked job the policy may resume."""

    job_id: str
    priority: int
    image_bytes: int
    parked_ms: int = 0


@dataclass
class Decision:
    """What to do now: ("park" | "resume", job id, why)."""

    action: str
    job_id: str
    reason: str


class NodePolicy:
    """Park the lowest-priority job while pressure lasts (one at a time, cooldown between parks); resume the
    highest-priority parked job once pressure has stayed low for resume_sustain_s and its image fits."""

    def __init__(self, th: Thresholds, clock: Callable[[], float]) -> None:
        self.th = th
        self.clock = clock
        self._high_since: float | None = None
        self._low_since: float | None = None
        self._last_park = -1e18
        self._last_resume = -1e18

    def pressure(self, s: NodeSample, tier_ram_bytes: int = 0) -> str:
        """Why the node is under pressure, or "" (tier_ram_bytes: bytes a RAM tier is about to take)."""
        th = self.th
        why = []
        if th.some_avg10 and s.some_avg10 >= th.some_avg10:
            why.append(f"PSI some avg10 {s.some_avg10:.1f} >= {th.some_avg10:g}")
        if th.full_avg10 and s.full_avg10 >= th.full_avg10:
            why.append(f"PSI full avg10 {s.full_avg10:.1f} >= {th.full_avg10:g}")
        if th.mem_available_min and s.mem_available - tier_ram_bytes < th.mem_available_min:
            why.append(f"MemAvailable {s.mem_available >> 20} MiB < {th.mem_available_min >> 20} MiB")
        return "; ".join(why)

    def calm(self, s: NodeSample) -> bool:
        """Whether pressure is below the (lower) resume thresholds."""
        th = self.th
        if th.some_avg10 and s.some_avg10 >= th.resume_below_some:
            return False
        if th.full_avg10 and s.full_avg10 >= th.resume_below_full:
            return False
        return not (th.mem_available_min and s.mem_available < th.mem_available_min)

    def decide(self, s: NodeSample, running: list[Candidate], parked: list[Parked],
               tier_ram_bytes: int = 0) -> Decision | None:
        """One step: at most one park or one resume."""
        if not self.th.active:
            return None
        now = self.clock()
        why = self.pressure(s, tier_ram_bytes)
        if why:
            self._low_since = None
            if self._high_since is None:
                self._high_since = now
            if now - self._high_since < self.th.sustain_s or now - self._last_park < self.th.cooldown_s:
                return None
            victims = [c for c in running if c.priority < CRITICAL]
            if not victims:
                return None
            # lowest priority first; among equals the youngest (least work lost), then the largest
            v = min(victims, key=lambda c: (c.priority, -c.started_ms, -c.rss, c.job_id))
            self._last_park = now
            return Decision("park", v.job_id, f"node memory pressure: {why} for {self.th.sustain_s:g} s")
        self._high_since = None
        if not self.calm(s):
            self._low_since = None
            return None
        if self._low_since is None:
            self._low_since = now
        if not parked or now - self._low_since < self.th.resume_sustain_s:
            return None
        if now - self._last_park < self.th.resume_sustain_s or now - self._last_resume < self.th.resume_sustain_s:
            return None
        for p in sorted(parked, key=lambda p: (-p.priority, p.parked_ms, p.job_id)):
            need = p.image_bytes + self.th.mem_available_min + self.th.resume_margin
            if s.mem_available - tier_ram_bytes >= need:
                self._last_resume = now
                self._low_since = now  # the next resume waits for a fresh calm period (no flapping)
                return Decision("resume", p.job_id, f"pressure low for {self.th.resume_sustain_s:g} s and "
                                f"{p.image_bytes >> 20} MiB fits in {s.mem_available >> 20} MiB available")
            break  # never resume a lower priority job ahead of a higher one that does not fit yet
        return None
