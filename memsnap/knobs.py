"""Environment knobs, read in one place. They are for tests, benchmarks and debugging, never for
configuration (that is memsnap.toml): each one is named here with what it changes.

    MEMSNAP_KEEP_LOGS=1          keep CRIU's work dirs (dump.log, restore.log, lazy-pages.log) after success
    MEMSNAP_MIGRATE_SERIAL=1     a move sends the image only after CRIU finished, and restores plainly:
                                 the benchmark's baseline (scripts/bench/bench_migrate.py)
    MEMSNAP_TUNNEL_STALL_S=N     seconds without page traffic before a lazy move gives up (default 30)
    MEMSNAP_CRIU_STALL_S=N       seconds a `criu restore` or lazy-pages may make no progress before it is
                                 killed, with the tasks it holds (default 30; memsnap.criuwatch)
    MEMSNAP_FAILPOINTS=a,b       failpoints armed in this daemon (memsnap.failpoints; tests only)
    MEMSNAP_CRIU=PATH            the criu binary (memsnap.criu.find_binary)
    MEMSNAP_SOCKET=PATH          the daemon socket a client talks to (memsnap.client)
"""

from __future__ import annotations

import os


def keep_logs() -> bool:
    """MEMSNAP_KEEP_LOGS: keep CRIU's work dirs after success."""
    return bool(os.environ.get("MEMSNAP_KEEP_LOGS"))


def migrate_serial() -> bool:
    """MEMSNAP_MIGRATE_SERIAL: moves without pipelining or early resume (the benchmark's baseline)."""
    return bool(os.environ.get("MEMSNAP_MIGRATE_SERIAL"))


def migrate_grpc() -> bool:
    """MEMSNAP_MIGRATE_GRPC: moves send the image inside the gRPC call even to a target with an image channel
    (the benchmark's comparison)."""
    return bool(os.environ.get("MEMSNAP_MIGRATE_GRPC"))


def tunnel_stall_s(default: float = 30.0) -> float:
    """MEMSNAP_TUNNEL_STALL_S: seconds of page-tunnel silence before a lazy move gives up."""
    try:
        return float(os.environ.get("MEMSNAP_TUNNEL_STALL_S", str(default)))
    except ValueError:
        return default


def criu_stall_s(default: float = 30.0) -> float:
    """MEMSNAP_CRIU_STALL_S: seconds without progress before a `criu restore` or lazy-pages is killed."""
    try:
        return float(os.environ.get("MEMSNAP_CRIU_STALL_S", str(default)))
    except ValueError:
        return default


def failpoints() -> list[str]:
    """MEMSNAP_FAILPOINTS: the failpoints armed in this process."""
    return [n for n in os.environ.get("MEMSNAP_FAILPOINTS", "").split(",") if n]


def criu_binary() -> str:
    """MEMSNAP_CRIU: an explicit criu binary, or ""."""
    return os.environ.get("MEMSNAP_CRIU", "")
