"""Node memory readings: PSI (/proc/pressure/memory, or a cgroup's memory.pressure) and /proc/meminfo."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class NodeSample:
    """One reading of the node's memory state."""

    some_avg10: float = 0.0
    full_avg10: float = 0.0
    mem_available: int = 0
    mem_total: int = 0

    @property
    def used(self) -> int:
        """Bytes in use (MemTotal - MemAvailable)."""
        return max(0, self.mem_total - self.mem_available)


def parse_psi(text: str) -> tuple[float, float]:
    """(some avg10, full avg10) from a PSI file's text."""
    some = full = 0.0
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        vals = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        if parts[0] == "some":
            some = float(vals.get("avg10", 0.0))
        elif parts[0] == "full":
            full = float(vals.get("avg10", 0.0))
    return some, full


def parse_meminfo(text: str) -> tuple[int, int]:
    """(MemAvailable, MemTotal) in bytes."""
    vals = {}
    for line in text.splitlines():
        k, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            vals[k] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return vals.get("MemAvailable", 0), vals.get("MemTotal", 0)


def read_node(psi_path: str = "/proc/pressure/memory", meminfo: str = "/proc/meminfo") -> NodeSample:
    """PSI and MemAvailable now (zeros where a file is missing)."""
    some = full = 0.0
    try:
        some, full = parse_psi(Path(psi_path).read_text())
    except OSError:
        pass
    avail = total = 0
    try:
        avail, total = parse_meminfo(Path(meminfo).read_text())
    except OSError:
        pass
    return NodeSample(some_avg10=some, full_avg10=full, mem_available=avail, mem_total=total)
