"""The guard's watchers of its job cgroups: one fd a job for its limit (memory.oom_control on v1, memory.events on
v2), and on v1 another for memory.pressure_level when guard.pressure_level asks for it."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from memsnap.guard.cgroups import CgroupError, MemoryCgroups

log = logging.getLogger("memsnap.guard")


class Watchers:
    """fd -> guarded job id, for the loop's poll."""

    def __init__(self, cg: MemoryCgroups | None, pressure_level: str) -> None:
        self.cg = cg
        self.pressure_level = pressure_level
        self._lock = threading.Lock()
        self._fds: dict[int, str] = {}  # watcher fd -> job id
        self._pressure_fds: set[int] = set()  # those of them that watch memory.pressure_level (v1)

    def watch(self, job_id: str, cg: Path) -> None:
        """Watches the job's cgroup (a job without a watcher is still sampled at each poll)."""
        assert self.cg is not None
        try:
            fd = self.cg.watch(cg)
        except (CgroupError, OSError) as exc:
            log.warning("no limit watcher for %s (%s); polling its usage instead", job_id, exc)
            return
        with self._lock:
            self._fds[fd] = job_id
        level = self.pressure_level
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

    def unwatch(self, job_id: str) -> None:
        """Closes the job's watchers."""
        with self._lock:
            for fd, j in list(self._fds.items()):
                if j == job_id:
                    del self._fds[fd]
                    self._pressure_fds.discard(fd)
                    os.close(fd)

    def by_fd(self) -> dict[int, str]:
        """fd -> job id, now."""
        with self._lock:
            return dict(self._fds)

    def pressured(self, fds: list[int]) -> set[str]:
        """The jobs whose memory.pressure_level watcher is among fds."""
        with self._lock:
            return {self._fds[fd] for fd in fds if fd in self._pressure_fds}
