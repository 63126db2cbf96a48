"""A checkpoint's life: its states, the legal next state of each, and the one writer of them.

    (new) ──► DUMPING ──► STAGED ──► DRAINING ──► DURABLE
                 │          ▲  │       │  │ ▲
                 │          └──┼───────┘  └─┘ (a drain that restarts, after a crash)
                 │             │       │
                 └─────────────┴───────┴─► FAILED

    (new) ──► DURABLE   a stored copy cataloged here (adopted from the store, or a move's via the store)

DUMPING: CRIU is writing the image into the tier's staging area (or a move's target receives it).
STAGED: published in the memory tier, restorable, waiting for its drain. DRAINING: being written to the store;
a failed attempt goes back to STAGED and is retried. DURABLE: in the store (its tier copy may be evicted).
FAILED: the dump, the publish, or the tier copy before it was stored, was lost; kept with its reason until
deleted. Any checkpoint may be forgotten (deleted) in any state.

Every state change in memsnap goes through advance() (tests/unit/test_lifecycle.py holds the rest of memsnap to
it): the change and its check are one SQL statement, so two writers racing cannot both win, and an illegal
change raises IllegalTransition (a bug) instead of quietly rewriting history. Waiters block in wait() until
something about the checkpoint changed, instead of polling the catalog.

Every change of a checkpoint's marks (the meta keys in MARKS, each typed) after its birth goes through mark():
one merge under the catalog's lock, so the drain's counts and a move's commit mark, written at the same moment
by two threads, never lose each other's.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from memsnap.catalog import DRAINING, DUMPING, DURABLE, FAILED, STAGED, Catalog, CheckpointRecord

NEXT: dict[str, tuple[str, ...]] = {
    DUMPING: (STAGED, FAILED),
    STAGED: (DRAINING, FAILED),
    DRAINING: (DRAINING, STAGED, DURABLE, FAILED),
    DURABLE: (),
    FAILED: (),
}
BORN = (DUMPING, DURABLE)  # the states a checkpoint may enter the catalog in
SETTLED = (DURABLE, FAILED)  # nothing more happens to it on its own


# The marks a checkpoint's meta may get after its birth, and their types (mark() refuses any other).
MARKS: dict[str, type | tuple[type, ...]] = {
    # a move (catalog.MoveMarks says what each means)
    "hold": bool, "lazy_move": str, "committing_to": str, "moved_to": str, "moved_job": str, "move_pending": str,
    "pages_remote": bool, "move_incoming": str,
    # the guard: a park image ({reason, at_ms, job[, spill]}), and that it lies in the spill tier
    "parked": dict, "spill": bool,
    # steps recover() undoes after a crash (Engine.journal): a job asked to quiesce, CUDA state it locked
    "quiesce": bool, "gpu": dict,
    # a restore's placeholder container ({runtime, name[, handle]}) until its job is recorded (memsnap.restorer)
    "placeholder": dict,
    # facts recorded later: a chunked drain's counts, the dump's and the last restore's phases, the tier files'
    # (inode, size, mtime, ctime) when they were last hashed
    "store": dict, "phases": dict, "restore_phases": dict, "fingerprint": dict,
}


def mark(catalog: Catalog, ckpt_id: str, **marks: Any) -> bool:
    """Sets (a value of its type) or clears (None) marks of a checkpoint, atomically; False when it is gone.
    TypeError for a name that is no mark or a value of the wrong type (a bug)."""
    for name, value in marks.items():
        want = MARKS.get(name)
        if want is None:
            raise TypeError(f"{name!r} is not a checkpoint mark (memsnap.lifecycle.MARKS)")
        if value is not None and not isinstance(value, want):
            raise TypeError(f"checkpoint mark {name!r} takes {want}, not {type(value).__name__}")
    return catalog.merge_meta(ckpt_id, marks)


def new_id() -> str:
    """A new checkpoint's id: ck-YYYYmmdd-HHMMSS-<6 hex>, sortable by when it was taken, unique on this node."""
    return "ck-" + time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


class IllegalTransition(RuntimeError):
    """A state change the lifecycle does not allow: a bug in memsnap, never the caller's fault."""


def sources(to: str) -> tuple[str, ...]:
    """The states from which `to` may be entered."""
    if to not in NEXT:
        raise IllegalTransition(f"{to!r} is not a checkpoint state")
    return tuple(s for s, nxt in NEXT.items() if to in nxt)


def begin(catalog: Catalog, rec: CheckpointRecord) -> None:
    """Journals a new checkpoint, in one of the states a checkpoint is born in."""
    if rec.state not in BORN:
        raise IllegalTransition(f"checkpoint {rec.id} cannot enter the catalog as {rec.state} (only as "
                                f"{' or '.join(BORN)})")
    catalog.add_checkpoint(rec)


def advance(catalog: Catalog, ckpt_id: str, to: str, **changes: Any) -> bool:
    """Moves a checkpoint to state `to` and journals `changes` with it, atomically. False when the checkpoint is
    gone (deleted meanwhile: nothing to do); IllegalTransition when its state may not be followed by `to`."""
    if catalog.update_if_state(ckpt_id, sources(to), state=to, **changes):
        return True
    cur = catalog.get_checkpoint(ckpt_id)
    if cur is None:
        return False
    raise IllegalTransition(f"checkpoint {ckpt_id} is {cur.state}: it cannot become {to}")


def forget(catalog: Catalog, ckpt_id: str) -> None:
    """Deletes a checkpoint's record, whatever its state (what it held is the caller's to remove first)."""
    catalog.delete_checkpoint(ckpt_id)


def wait(catalog: Catalog, ckpt_id: str, done: Callable[[CheckpointRecord | None], bool],
         timeout: float, active: Callable[[], bool] = lambda: True, tick: float = 0.5) -> CheckpointRecord | None:
    """The checkpoint's record once done(record) holds (the record is None once it is gone), or when timeout
    passed or active() turned false. Wakes on each change journaled for it (a transition, drain progress), and
    every `tick` seconds to ask active(). (It reads the record again after any checkpoint's write: a cheap
    SQLite read, instead of a poll every 100 ms.)"""
    deadline = time.monotonic() + timeout
    while True:
        seen = catalog.generation()
        rec = catalog.get_checkpoint(ckpt_id)
        left = deadline - time.monotonic()
        if done(rec) or left <= 0 or not active():
            return rec
        catalog.wait_changed(seen, min(tick, left))
