"""Foreground and background work: drains (and other background work) step aside while a job is frozen,
restored, moved or paged in.

Foreground work is what a job waits for: a freeze or dump, a restore, serving lazy pages (a lazy restore,
and a lazy move on both nodes until its verdict) and the guard's park. Background work is what only the
store waits for: drains, fetch-ahead, GC. On a small node the two compete for the same cores and the same
disk, and the job's own ticks stalled for seconds behind a drain (issue 21).

    foreground(reason)          a context: foreground work is in flight meanwhile
    hold_while(reason, alive)   foreground until alive() turns false (a lazy-pages server still serving)
    may_start(ckpt_id)          a queued drain may start now (nothing in the foreground, or it is urgent)
    pause_point(ckpt_id)        a running drain waits here, between blocks, while foreground work runs
    wait_idle(kind)             fetch-ahead and GC wait here before they start
    urgent(ckpt_id)             a context: someone waits for this checkpoint to be durable (`checkpoint
                                --wait durable`, the Slurm launcher inside its KillWait budget): its drain
                                neither waits nor pauses

Durability deadlines still hold: an urgent drain ignores the gate (and a spare drain worker takes it when
every other worker holds a drain paused behind foreground work), and any other drain waits at most
max_pause_s in all (then it runs, and the override is counted), so a stuck lazy-pages server cannot hold
the store back for ever. max_pause_s = 0 turns the gate off (the old behaviour). See docs/background.md.

One gate per daemon process (gate()); unit tests make their own with an injected clock.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# How often a paused drain looks again (foreground holds given as predicates are polled, not signalled).
POLL_S = 0.05
DEFAULT_MAX_PAUSE_S = 60.0


@dataclass
class _Hold:
    reason: str
    since: float
    alive: Callable[[], bool] | None = None


class Gate:
    """Tracks foreground work and holds background work back while there is some."""

    def __init__(self, max_pause_s: float = DEFAULT_MAX_PAUSE_S, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, poll_s: float = POLL_S) -> None:
        self.max_pause_s = max_pause_s
        self._clock, self._wall, self._poll_s = clock, wall, poll_s
        self._cv = threading.Condition()
        self._ids = itertools.count(1)
        self._holds: dict[int, _Hold] = {}
        self._urgent: dict[str, int] = {}
        self._held: dict[str, str] = {}  # work held back now -> "paused" (running) / "waiting" (queued)
        self._held_at: dict[str, float] = {}  # ... since when
        self._held_since = 0.0  # clock when _held last became non-empty
        self._held_since_wall = 0.0
        self._paused_total = 0.0  # seconds with something held back, before _held_since
        self._overridden: set[str] = set()
        self._spent: dict[str, float] = {}  # seconds each drain was held back so far (for max_pause_s)
        self.pauses = 0  # running drains paused
        self.waits = 0  # queued drains (or fetch-ahead, GC) that waited
        self.overrides = 0  # times a drain ran through foreground work: urgent, or its pause bound spent

    # -- foreground ---------------------------------------------------------------------------
    def hold(self, reason: str, alive: Callable[[], bool] | None = None) -> int:
        """Marks foreground work as started; release(token) ends it (or alive() turning false does)."""
        with self._cv:
            token = next(self._ids)
            self._holds[token] = _Hold(reason, self._clock(), alive)
            return token

    def release(self, token: int) -> None:
        """Ends the foreground work that hold() started (idempotent)."""
        with self._cv:
            self._holds.pop(token, None)
            self._cv.notify_all()

    @contextmanager
    def foreground(self, reason: str) -> Iterator[None]:
        """Foreground work in flight for the duration of the with block."""
        token = self.hold(reason)
        try:
            yield
        finally:
            self.release(token)

    def hold_while(self, reason: str, alive: Callable[[], bool]) -> int:
        """Foreground work until alive() turns false (checked whenever the gate is asked)."""
        return self.hold(reason, alive)

    def busy(self) -> str:
        """Why background work must wait now ("" when nothing runs in the foreground)."""
        with self._cv:
            return self._busy_locked()

    def _busy_locked(self) -> str:
        for token, h in list(self._holds.items()):
            if h.alive is not None:
                try:
                    still = h.alive()
                except Exception:  # a predicate that fails holds nothing back
                    still = False
                if not still:
                    del self._holds[token]
        reasons = sorted({h.reason for h in self._holds.values()})
        return ", ".join(reasons)

    # -- urgency --------------------------------------------------------------------------------
    @contextmanager
    def urgent(self, ckpt_id: str) -> Iterator[None]:
        """Someone waits for ckpt_id to become durable: its drain ignores the gate meanwhile."""
        with self._cv:
            self._urgent[ckpt_id] = self._urgent.get(ckpt_id, 0) + 1
            self._cv.notify_all()
        try:
            yield
        finally:
            with self._cv:
                n = self._urgent.get(ckpt_id, 0) - 1
                if n > 0:
                    self._urgent[ckpt_id] = n
                else:
                    self._urgent.pop(ckpt_id, None)

    def is_urgent(self, ckpt_id: str) -> bool:
        with self._cv:
            return ckpt_id in self._urgent

    # -- background -----------------------------------------------------------------------------
    def _must_hold(self, key: str, ckpt_id: str) -> bool:
        """Whether work `key` must stay back now (caller holds _cv); counts the override when it may not."""
        if self.max_pause_s <= 0:
            return False
        why = self._busy_locked()
        if not why:
            return False
        spent = self._spent.get(key, 0.0)
        if key in self._held:
            spent += self._clock() - self._held_at[key]
        if (ckpt_id and ckpt_id in self._urgent) or spent >= self.max_pause_s:
            if key not in self._overridden:
                self._overridden.add(key)
                self.overrides += 1
            return False
        return True

    def _enter(self, key: str, state: str) -> None:
        if key in self._held:
            return
        now = self._clock()
        if not self._held:
            self._held_since, self._held_since_wall = now, self._wall()
        self._held[key], self._held_at[key] = state, now
        if state == "paused":
            self.pauses += 1
        else:
            self.waits += 1

    def _leave(self, key: str) -> None:
        if key not in self._held:
            return
        now = self._clock()
        self._spent[key] = self._spent.get(key, 0.0) + now - self._held_at.pop(key)
        del self._held[key]
        if not self._held:
            self._paused_total += now - self._held_since

    def may_start(self, ckpt_id: str) -> bool:
        """Whether a queued drain of ckpt_id may start now; while it may not, it counts as waiting."""
        key = "drain:" + ckpt_id
        with self._cv:
            if self._must_hold(key, ckpt_id):
                self._enter(key, "waiting")
                return False
            self._leave(key)
            return True

    def forget(self, ckpt_id: str) -> None:
        """A drain is over (done, failed or gone): drops what the gate kept about it."""
        key = "drain:" + ckpt_id
        with self._cv:
            self._leave(key)
            self._spent.pop(key, None)
            self._overridden.discard(key)

    def pause_point(self, ckpt_id: str, stop: Callable[[], bool] | None = None) -> None:
        """A running drain calls this between blocks: it returns at once, or once the foreground work is
        over (or the drain became urgent, its pause bound was spent, or stop() turned true)."""
        self._hold_back("drain:" + ckpt_id, ckpt_id, "paused", stop)

    def wait_idle(self, kind: str, stop: Callable[[], bool] | None = None) -> None:
        """Fetch-ahead and GC call this before they start: they wait while foreground work runs."""
        self._hold_back(f"{kind}:{next(self._ids)}", "", "waiting", stop)

    def _hold_back(self, key: str, ckpt_id: str, state: str, stop: Callable[[], bool] | None) -> None:
        with self._cv:
            try:
                while self._must_hold(key, ckpt_id) and not (stop is not None and stop()):
                    self._enter(key, state)
                    self._cv.wait(self._poll_s)
            finally:
                self._leave(key)

    # -- reporting --------------------------------------------------------------------------------
    def paused_seconds(self) -> float:
        """Seconds during which some background work was held back, in all."""
        with self._cv:
            return self._paused_total + (self._clock() - self._held_since if self._held else 0.0)

    def paused(self) -> bool:
        """Whether some background work is held back now."""
        with self._cv:
            return bool(self._held)

    def snapshot(self) -> dict[str, Any]:
        """Fields for `memsnapctl status` (StatusResponse)."""
        with self._cv:
            held = dict(self._held)
            since = self._held_since_wall if held else 0.0
            reason = self._busy_locked() if held else ""
        return {
            "drains_paused": bool(held),
            "drains_paused_since_unix_ms": int(since * 1000),
            "drains_paused_reason": reason,
            "drains_held": sorted(f"{k} ({v})" for k, v in held.items()),
            "drain_pauses": self.pauses,
            "drain_waits": self.waits,
            "drain_pause_overrides": self.overrides,
            "drains_paused_seconds": self.paused_seconds(),
        }


def take_due(heap: list[tuple[float, str]], now: float | None = None, g: Gate | None = None,
             urgent_only: bool = False) -> str | None:
    """Pops the first due drain of a drain queue (a heap of (due, ckpt_id)) that may start now: while
    foreground work runs only an urgent one (or one whose pause bound is spent) may. None: all wait.
    urgent_only: only a drain someone waits for (the drain service's spare worker)."""
    g = g or _GATE
    now = time.monotonic() if now is None else now
    for due, ckpt_id in sorted(heap):
        if due > now:
            break
        if urgent_only and not g.is_urgent(ckpt_id):
            continue
        if g.may_start(ckpt_id):
            heap.remove((due, ckpt_id))
            heapq.heapify(heap)
            return ckpt_id
    return None


class MovedAway(Exception):
    """The checkpoint being drained was moved to another node, which drains the same image: stop."""


_MOVED: set[str] = set()
_MOVED_LOCK = threading.Lock()


def mark_moved_away(ckpt_id: str) -> None:
    """A committed move gave ckpt_id's job to another node, which drains the same image: a drain of it here
    stops at its next block, and never removes store objects under its id (in a shared store, they may be
    the target's)."""
    with _MOVED_LOCK:
        _MOVED.add(ckpt_id)


def moved_away(ckpt_id: str) -> bool:
    """Whether mark_moved_away(ckpt_id) was called in this process."""
    with _MOVED_LOCK:
        return ckpt_id in _MOVED


def check_still_wanted(ckpt_id: str) -> None:
    """Raises MovedAway when a committed move gave ckpt_id's job to another node (docs/background.md)."""
    if moved_away(ckpt_id):
        raise MovedAway(f"{ckpt_id} moved to another node, which drains the same image")


_GATE = Gate()


def gate() -> Gate:
    """This process's gate."""
    return _GATE


def configure(max_pause_s: float) -> None:
    """Sets the bound on a drain's pauses (the daemon's drain.max_pause_s; 0 turns the gate off)."""
    _GATE.max_pause_s = max_pause_s


__all__ = ["DEFAULT_MAX_PAUSE_S", "Gate", "MovedAway", "check_still_wanted", "configure", "gate", "mark_moved_away",
           "moved_away", "take_due"]
