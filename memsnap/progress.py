"""Progress of long operations (a restore's fetch from the store, a move), for clients that poll it.

A client names its operation with a random op_id in the request (RestoreRequest, MigrateRequest,
ResumeJobRequest). The servicer opens it for the handler thread (begin); the engine and the mover report into
it (phase); Status(op_id) reads it back (get), for the caller that started it only. Reading is cheap: byte
counts are callables evaluated at the poll, so nothing is written on the data path.
"""

from __future__ import annotations

import os
import string
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

OP_ID_CHARS = frozenset(string.ascii_letters + string.digits + "-_")
OP_ID_MAX = 64


@dataclass
class Op:
    """One operation in progress."""

    op_id: str
    kind: str  # restore, resume, migrate
    owner_uid: int
    started_unix_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    phase: str = ""  # e.g. fetch, restore, transfer, drain, restore on target
    total_bytes: int = 0  # of this phase (0: no byte count)
    done: Callable[[], int] | None = None

    def done_bytes(self) -> int:
        """Bytes of this phase done so far (0 when it has no byte count)."""
        try:
            return max(0, int(self.done())) if self.done is not None else 0
        except Exception:  # a reader racing the end of the phase (a file gone): nothing to report
            return 0


_lock = threading.Lock()
_ops: dict[tuple[int, str], Op] = {}  # (owner uid, op id): one user can never take or see another's
_local = threading.local()


def valid_op_id(op_id: str) -> bool:
    """A client's op id: 1..64 letters, digits, '-' or '_'."""
    return 0 < len(op_id) <= OP_ID_MAX and all(c in OP_ID_CHARS for c in op_id)


@contextmanager
def begin(op_id: str, kind: str, owner_uid: int) -> Iterator[Op | None]:
    """Makes op_id the current operation of this thread (nothing when op_id is empty or this owner's is taken)."""
    if not op_id or not valid_op_id(op_id):
        yield None
        return
    op = Op(op_id, kind, owner_uid)
    with _lock:
        if (owner_uid, op_id) in _ops:
            op = None  # type: ignore[assignment]
        else:
            _ops[(owner_uid, op_id)] = op
    prev = getattr(_local, "op", None)
    _local.op = op
    try:
        yield op
    finally:
        _local.op = prev
        if op is not None:
            with _lock:
                _ops.pop((owner_uid, op_id), None)


def current() -> Op | None:
    """The operation this thread works for, if a client asked to follow it."""
    return getattr(_local, "op", None)


def phase(name: str, total_bytes: int = 0, done: Callable[[], int] | None = None) -> None:
    """Enters a phase of the current operation (a no-op when nobody follows it)."""
    op = current()
    if op is not None:
        op.phase, op.total_bytes, op.done = name, max(0, total_bytes), done


def get(op_id: str, uid: int, is_root: bool) -> Op | None:
    """The operation op_id, if it runs and belongs to uid (root sees all)."""
    with _lock:
        op = _ops.get((uid, op_id))
        if op is None and is_root:
            op = next((o for (_, i), o in _ops.items() if i == op_id), None)
    return op


def dir_bytes(path: Path, skip: tuple[str, ...] = ()) -> Callable[[], int]:
    """A byte counter for a directory being filled (the sizes of its files but those in skip; links not followed)."""
    def count() -> int:
        total = 0
        try:
            with os.scandir(path) as it:
                for e in it:
                    if e.name not in skip and e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_size
        except OSError:
            return 0
        return total
    return count
