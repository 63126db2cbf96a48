"""Fault-injection points for tests: MEMSNAP_FAILPOINTS=name[,name] makes the daemon die there like kill -9
(hit), or slows it down there (delay)."""

from __future__ import annotations

import os


def hit(name: str) -> None:
    """Exits the process at once (no cleanup, as a crash would) when the failpoint is armed."""
    armed = os.environ.get("MEMSNAP_FAILPOINTS", "")
    if armed and name in armed.split(","):
        os._exit(137)


def delay(name: str, seconds: float = 0.05) -> None:
    """Sleeps when the failpoint is armed: makes a transfer slow enough to interrupt in a test."""
    armed = os.environ.get("MEMSNAP_FAILPOINTS", "")
    if armed and name in armed.split(","):
        import time

        time.sleep(seconds)


def armed(name: str) -> bool:
    """Whether a failpoint is armed, for the few that do something other than die or wait."""
    return name in os.environ.get("MEMSNAP_FAILPOINTS", "").split(",")
