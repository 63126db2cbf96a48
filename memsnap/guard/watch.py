"""The guard's watchers of its job cgroups: one fd a job for its limit (memory.oom_control on v1, memory.events on
v2), and on v1 another for memory.pressure_level when guard.pressure_level asks for it."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from memsnap.guard.cgroups import CgroupError, MemoryCgroups, poll_fds

log = logging.getLogger("memsnap.guard")


class Watchers:
    """fd -> guarded job id, for the loop's poll.

    A watcher fd is closed only while no poll holds its number: a park or a resume unwatches its job from another
    thread, and an fd closed under the loop's poll is a number the next accept() may reuse, whose bytes the loop's
    ack would then read (it once ate a client's connection on the daemon's socket)."""

    def __init__(self, cg: MemoryCgroups | None, pressure_level: str) -> None:
        self.cg = cg
        self.pressure_level = pressure_level
        self._lock = threading.Lock()
        self._fds: dict[int, str] = {}  # watcher fd -> job id
        self._pressure_fds: set[int] = set()  # those of them that watch memory.pressure_level (v1)
        self._polling = False  # wait() holds the numbers it polls
        self._retired: list[int] = []  # unwatched while a wait() held them: closed when it ends

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
                    if self._polling:
                        self._retired.append(fd)
                    else:
                        os.close(fd)

    def wait(self, timeout: float) -> tuple[set[str], set[str]]:
        """Polls the watchers for up to timeout seconds and acknowledges those that fired: (the jobs whose watcher
        fired, those of them whose memory.pressure_level watcher did). One thread at a time (the guard's loop)."""
        with self._lock:
            fds = dict(self._fds)
            pressure = self._pressure_fds & set(fds)
            self._polling = True
        try:
            fired = poll_fds(list(fds), timeout)
            for fd in fired:
                try:
                    self.cg.ack(fd)  # type: ignore[union-attr]
                except OSError:
                    pass
        finally:
            with self._lock:
                self._polling = False
                retired, self._retired = self._retired, []
            for fd in retired:
                os.close(fd)
        return {fds[fd] for fd in fired}, {fds[fd] for fd in fired if fd in pressure}

