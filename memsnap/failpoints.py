"""Fault-injection points for tests: MEMSNAP_FAILPOINTS=name[,name] makes the daemon die there like kill -9
(hit), or slows it down there (delay)."""

from __future__ import annotations

import os

from memsnap import knobs


def hit(name: str) -> None:
    """Exits the process at once (no cleanup, as a crash would) when the failpoint is armed."""
    if name in knobs.failpoints():
        os._exit(137)


def delay(name: str, seconds: float = 0.05) -> None:
    """Sleeps when the failpoint is armed: makes a transfer slow enough to interrupt in a test."""
    if name in knobs.failpoints():
        import time

        time.sleep(seconds)


def armed(name: str) -> bool:
    """Whether a failpoint is armed, for the few that do something other than die or wait."""
    return name in knobs.failpoints()
