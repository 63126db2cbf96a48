"""Retry schedules: the delays between attempts, and the loop that tries again after each.

A schedule is any iterable of delays in seconds: a Backoff (each delay `factor` times the one before, at most
max_s, optionally cut short by a deadline) or a plain tuple when the delays are few and fixed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
RetryOn = type[Exception] | tuple[type[Exception], ...] | Callable[[Exception], bool]


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: the delay after the n-th failed attempt (n from 0) is initial * factor**n, at most
    max_s (factor 1.0: a constant delay)."""

    initial: float
    factor: float = 2.0
    max_s: float = math.inf

    def delay(self, n: int) -> float:
        """The delay after failed attempt n (from 0); max_s however large n grows."""
        try:
            grown = self.initial * self.factor ** max(n, 0)
        except OverflowError:  # (factor**n past a float's range: long past max_s)
            grown = math.inf
        return min(self.max_s, grown)

    def delays(self, deadline: float | None = None, *, least_s: float = 0.0) -> Iterator[float]:
        """delay(0), delay(1), ...: without end, or until time.monotonic() reaches deadline; each delay is
        cut to the time left before the deadline, though never below least_s."""
        n = 0
        while True:
            d = self.delay(n)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                d = min(d, max(least_s, left))
            yield d
            n += 1


def retrying(fn: Callable[[], T], retry_on: RetryOn, delays: Iterable[float],
             on_retry: Callable[[int, Exception], None] | None = None,
             sleep: Callable[[float], None] = time.sleep) -> T:
    """fn(), called again after each delay while it raises an exception that retry_on accepts (an exception
    class, a tuple of them, or a predicate). An exception it does not accept, or the last one once the delays
    run out, is raised. on_retry(n, exc) runs before the n-th delay (n from 0)."""
    accepts = _predicate(retry_on)
    schedule = iter(delays)
    n = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if not accepts(exc):
                raise
            d = next(schedule, None)
            if d is None:
                raise
            if on_retry is not None:
                on_retry(n, exc)
        sleep(d)
        n += 1


def _predicate(retry_on: RetryOn) -> Callable[[Exception], bool]:
    if isinstance(retry_on, (type, tuple)):
        types = retry_on
        return lambda e: isinstance(e, types)
    return retry_on
