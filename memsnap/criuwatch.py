"""Is CRIU still getting somewhere? A progress deadline for `criu restore`, not a wall clock.

    criu swrk ──forks──> the tasks it restores        sampled every 0.5 s while memsnap waits for CRIU:
         │                                            CPU time, context switches, how many tasks
         └── RPC messages (notify callbacks) ──────>  a message resets the clock (time in our callback
                                                      is ours, not CRIU's)

A restore that blocks (a file lock another process holds, a lazy page that never arrives, a task killed
under a CRIU that waits for it as a zombie) shows none of these. After stall_s it is killed, its tasks
first (a half-restored tree must not run on), and the error says what it waited for when that can be
told: a file lock and the process holding it.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable

import psutil

_CTXT = re.compile(rb"^(?:non)?voluntary_ctxt_switches:\s+(\d+)", re.M)


def descendants(pid: int) -> list[int]:
    """pid's descendants, children before their children's children (empty when pid is gone)."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _sample_one(pid: int) -> tuple[int, int, int]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/status", "rb") as f:
            ctxt = sum(int(m) for m in _CTXT.findall(f.read()))
    except (OSError, IndexError, ValueError):
        return (pid, -1, -1)
    return (pid, int(fields[11]) + int(fields[12]), ctxt)  # utime + stime (ticks), context switches


def sample(pid: int) -> tuple[tuple[int, int, int], ...]:
    """What moves while CRIU works: (pid, CPU ticks, context switches) of pid and each descendant."""
    return tuple(_sample_one(p) for p in [pid, *descendants(pid)])


class ProgressWatch:
    """Tells when pid's tree has shown no progress (see sample) for stall_s seconds."""

    def __init__(self, pid: int, stall_s: float, clock: Callable[[], float] = time.monotonic,
                 probe: Callable[[int], object] = sample) -> None:
        self.pid, self.stall_s, self._clock, self._probe = pid, stall_s, clock, probe
        self._last = probe(pid)
        self._since = clock()

    def reset(self) -> None:
        """Progress seen from the outside (an RPC message): the clock starts again."""
        self._last = self._probe(self.pid)
        self._since = self._clock()

    def idle_s(self) -> float:
        return self._clock() - self._since

    def stalled(self) -> bool:
        """Samples once; True once nothing moved for stall_s."""
        now = self._probe(self.pid)
        if now != self._last:
            self._last, self._since = now, self._clock()
            return False
        return self.idle_s() >= self.stall_s


def kill_with_tasks(pid: int) -> None:
    """SIGKILLs pid's descendants (the tasks CRIU restores), then pid (criu itself)."""
    for p in descendants(pid):
        _kill(p)
    _kill(pid)


def kill_tasks(pid: int) -> list[int]:
    """SIGKILLs pid's descendants only (CRIU notices, fails its restore and returns); the pids killed."""
    pids = descendants(pid)
    for p in pids:
        _kill(p)
    return pids


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def lock_waits(pids: set[int], locks: str | None = None) -> list[str]:
    """What the given tasks wait for in /proc/locks: 'pid W waits for a POSIX WRITE lock on PATH held by pid
    H (COMM, STATE)' per blocked task."""
    if locks is None:
        try:
            with open("/proc/locks") as lf:
                locks = lf.read()
        except OSError:
            return []
    holders: dict[str, tuple[str, str, int, str]] = {}  # lock number -> (kind, mode, pid, dev:ino)
    out = []
    for line in locks.splitlines():
        cols = line.split()
        if len(cols) < 6:
            continue
        num, waiting = cols[0].rstrip(":"), cols[1] == "->"
        cols = cols[2:] if waiting else cols[1:]
        try:
            kind, mode, pid, where = cols[0], cols[2], int(cols[3]), cols[4]
        except (IndexError, ValueError):
            continue
        if not waiting:
            holders[num] = (kind, mode, pid, where)
        elif pid in pids and num in holders:
            h_pid = holders[num][2]
            out.append(f"pid {pid} waits for a {kind} {mode.lower()} lock on {_path_of(pid, where)} held by "
                       f"{_describe(h_pid)}")
    return out


def _describe(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        state = p.status()
        what = f"pid {pid} ({p.name()}, {state})"
    except psutil.Error:
        return f"pid {pid}"
    if state in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        what += ", which cannot let go while it is stopped (the frozen copy of a job being moved?)"
    return what


def _path_of(pid: int, where: str) -> str:
    """The path of the file that pid has open as dev:ino (maj:min:ino, hex), or where itself."""
    try:
        ino = int(where.rsplit(":", 1)[1])
        for fd in os.listdir(f"/proc/{pid}/fd"):
            link = f"/proc/{pid}/fd/{fd}"
            try:
                if os.stat(link).st_ino == ino:
                    return os.readlink(link)
            except OSError:
                continue
    except (OSError, ValueError, IndexError):
        pass
    return f"inode {where}"


__all__ = ["ProgressWatch", "descendants", "kill_tasks", "kill_with_tasks", "lock_waits", "sample"]
