"""The quiesce protocol's names, limits and messages, shared by memsnapd and the job's helper (stdlib only)."""

from __future__ import annotations

import json
import math
import socket
import time
from dataclasses import dataclass
from typing import Any

VERSION = 1
ENV_DIR = "MEMSNAP_QUIESCE_DIR"  # where the job's processes listen (<dir>/<name>.sock); absolute
ENV_TIMEOUT = "MEMSNAP_QUIESCE_TIMEOUT_S"  # how long memsnapd waits for the answers
ENV_ON_TIMEOUT = "MEMSNAP_QUIESCE_ON_TIMEOUT"  # refuse (default) | proceed
DEFAULT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 600.0  # a job cannot make memsnapd wait longer
SUFFIX = ".sock"
MAX_LINE = 64 << 10
REFUSE, PROCEED = "refuse", "proceed"


def default_dir(job_id: str, private_tmp: bool) -> str:
    """Where memsnapctl run jobs listen: their own /tmp (it travels with the image), else a dir per job."""
    return "/tmp/memsnap-quiesce" if private_tmp else f"/tmp/memsnap-quiesce-{job_id}"


@dataclass(frozen=True)
class Policy:
    """How long memsnapd waits for a job's answers, and what it does when they do not come."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    on_timeout: str = REFUSE

    @classmethod
    def from_env(cls, env: dict[str, str]) -> tuple[Policy, list[str]]:
        """The policy a job's environment asks for, and what was wrong with it (defaults used instead)."""
        problems: list[str] = []
        timeout = DEFAULT_TIMEOUT_S
        raw = env.get(ENV_TIMEOUT)
        if raw is not None:
            try:
                timeout = float(raw)
                if not math.isfinite(timeout) or timeout <= 0:
                    raise ValueError
            except ValueError:
                problems.append(f"{ENV_TIMEOUT}={raw[:40]!r} is not a positive number of seconds")
                timeout = DEFAULT_TIMEOUT_S
        if timeout > MAX_TIMEOUT_S:
            problems.append(f"{ENV_TIMEOUT}={timeout:g} is above the limit, {MAX_TIMEOUT_S:g} s")
            timeout = MAX_TIMEOUT_S
        on = env.get(ENV_ON_TIMEOUT, REFUSE).strip().lower()
        if on not in (REFUSE, PROCEED):
            problems.append(f"{ENV_ON_TIMEOUT}={on[:40]!r} is neither {REFUSE} nor {PROCEED}")
            on = REFUSE
        return cls(timeout, on), problems


def encode(msg: dict[str, Any]) -> bytes:
    """One message: a JSON object on one line."""
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


def read_line(sock: socket.socket, deadline: float) -> dict[str, Any] | None:
    """The next message (a JSON object line) before the monotonic deadline; None on EOF, timeout or garbage."""
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or len(buf) > MAX_LINE:
            return None
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except (TimeoutError, OSError):
            return None
        if not chunk:
            return None
        buf += chunk
    try:
        msg = json.loads(buf.split(b"\n", 1)[0])
    except ValueError:
        return None
    return msg if isinstance(msg, dict) else None
