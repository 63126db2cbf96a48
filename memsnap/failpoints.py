"""Fault-injection points for tests: MEMSNAP_FAILPOINTS=name[,name] makes the daemon die there like kill -9
(hit), or slows it down there (delay)."""

from __future__ import annotations

import logging
import os

from memsnap import knobs

# Every environment knob meant for tests and benchmarks only; memsnapd warns at start when one is set.
TEST_KNOBS = {
    "MEMSNAP_FAILPOINTS": "name[,name]: die (exit 137) or slow down at these points (memsnap/failpoints.py)",
    "MEMSNAP_TUNNEL_STALL_S": "seconds a lazy move's page tunnel may stall before the target gives up "
                              "(default 30)",
    "MEMSNAP_CRIU_STALL_S": "seconds a criu restore or lazy-pages may make no progress before it is killed "
                            "(default 30)",
    "MEMSNAP_MIGRATE_SERIAL": "any value: a move dumps, then sends, then restores, with no pipelining "
                              "(the benchmark's baseline)",
    "MEMSNAP_MIGRATE_GRPC": "any value: a move sends the image inside the gRPC call, not over the target's image "
                            "channel (the benchmark's comparison)",
    "MEMSNAP_KEEP_LOGS": "any value: keep CRIU's work dirs and logs instead of removing them (debugging)",
}


def warn_if_set(log: logging.Logger) -> list[str]:
    """Logs a warning for each test-only knob set in this process's environment; returns their names."""
    found = [k for k in TEST_KNOBS if os.environ.get(k)]
    for k in found:
        log.warning("test-only knob %s=%r is set: %s; never set it in production", k, os.environ[k], TEST_KNOBS[k])
    return found


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
