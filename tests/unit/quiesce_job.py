"""A listener process for the quiesce tests (tests/workloads/quiesce_listener.py), started with MEMSNAP_QUIESCE_DIR."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from memsnap.quiesce import protocol

REPO = Path(__file__).resolve().parents[2]
LISTENER = REPO / "tests" / "workloads" / "quiesce_listener.py"


class Job:
    """A listener process (and its children) started with MEMSNAP_QUIESCE_DIR; its stdout in a file."""

    def __init__(self, tmp: Path, *args: str, **env: str) -> None:
        self.dir = tmp / "q"
        self.out = tmp / f"out-{len(list(tmp.glob('out-*')))}.txt"
        e = {**os.environ, "PYTHONPATH": str(REPO), protocol.ENV_DIR: str(self.dir), **env}
        with open(self.out, "wb") as f:
            self.proc = subprocess.Popen([sys.executable, str(LISTENER), *args], stdout=f, env=e,
                                         start_new_session=True)
        self.pid = self.proc.pid
        kids = next((int(args[i + 1]) for i, x in enumerate(args) if x == "--children"), 0)
        deadline = time.monotonic() + 20
        while self.lines().count("ready") < 1 + kids:
            assert time.monotonic() < deadline and self.proc.poll() is None, self.out.read_text()
            time.sleep(0.02)

    def lines(self) -> list[str]:
        return [ln.split()[0] for ln in self.out.read_text().splitlines() if ln.strip()]

    def text(self) -> str:
        return self.out.read_text()

    def kill(self) -> None:
        try:
            os.killpg(self.pid, 9)
        except OSError:
            pass
        self.proc.wait()
