"""memsnapctl: progress of a long single RPC (restore from the store, resume, migrate).

The call runs in a second thread with a random op_id in its request; this thread polls Status(op_id) on the
same channel and shows what the daemon reports (memsnap.progress): a bar with rate and ETA on a terminal,
plain lines otherwise (one per phase and per quarter), and with -o json/yaml one JSON object per update, on
stderr, so that stdout keeps the single result object scripts parse. Nothing is shown for a call that ends
within FIRST_S. Imported only by commands that talk to the daemon (never for --help).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from memsnap.cli_fmt import Progress, human_s
from memsnap.client import ClientError, MemsnapClient

T = TypeVar("T")
POLL_S = 0.5
FIRST_S = 0.5  # a call done by then shows nothing (a plain local restore)


def follow(c: MemsnapClient, what: str, call: Callable[[str], T], as_json: bool,
           stream: Any = None) -> T:
    """Runs call(op_id) (a blocking RPC on c) while showing its progress; returns its result or raises its error."""
    stream = stream or sys.stderr
    tty = bool(getattr(stream, "isatty", lambda: False)())
    op_id = os.urandom(12).hex()
    box: dict[str, Any] = {}
    t0 = time.monotonic()

    def run() -> None:
        try:
            box["ok"] = call(op_id)
        except BaseException as exc:  # re-raised in the caller's thread
            box["err"] = exc

    t = threading.Thread(target=run, name="memsnapctl-call", daemon=True)
    t.start()
    t.join(FIRST_S)
    view = _View(what, stream, tty and not as_json, as_json, t0)
    while t.is_alive():
        try:
            st = c.status(op_id=op_id, timeout=5)
            view.show(st.progress if st.HasField("progress") else None)
        except ClientError:
            view.show(None)  # an older daemon, or a hiccup: elapsed time only
        t.join(POLL_S)
    view.done()
    if "err" in box:
        raise box["err"]
    result: T = box["ok"]
    return result


class _View:
    """One display of an operation's progress."""

    def __init__(self, what: str, stream: Any, tty: bool, as_json: bool, t0: float) -> None:
        self.what, self.stream, self.tty, self.as_json = what, stream, tty, as_json
        self.bar = Progress(what, stream, tty)
        self.t0 = t0
        self._phase: str | None = None
        self._phase_t0 = self.t0

    def show(self, p: Any) -> None:
        phase = p.phase if p is not None and p.phase else ""
        if phase != self._phase:
            self._phase, self._phase_t0 = phase, time.monotonic()
            self.bar.samples = []  # a new phase: its own rate
            self.bar.t0 = self._phase_t0
        done, total = (int(p.done_bytes), int(p.total_bytes)) if p is not None else (0, 0)
        if self.as_json:
            self._json(phase, done, total)
        elif total > 0:
            self.bar.update(min(done, total), total, phase)
        elif self.tty:
            self.bar.spin(f"{self.what}: {phase}" if phase else self.what)
        elif phase and self.bar._last_plain != (phase, -1):
            self.bar._last_plain = (phase, -1)
            self.stream.write(f"{self.what}: {phase} ({human_s(time.monotonic() - self.t0)} so far)\n")
            self.stream.flush()

    def _json(self, phase: str, done: int, total: int) -> None:
        elapsed = time.monotonic() - self.t0
        rate = self.bar.rate(done) if total > 0 else 0.0
        obj: dict[str, Any] = {"progress": self.what, "phase": phase, "elapsed_s": round(elapsed, 1)}
        if total > 0:
            obj.update(done_bytes=done, total_bytes=total, rate_bytes_per_s=int(rate),
                       eta_s=round((total - done) / rate, 1) if rate > 0 and done < total else None)
        self.stream.write(json.dumps(obj) + "\n")
        self.stream.flush()

    def done(self) -> None:
        if not self.as_json:
            self.bar.done()
