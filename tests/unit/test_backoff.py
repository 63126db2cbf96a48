"""memsnap.backoff: the schedules' delays, the deadline, and the retry loop."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from memsnap.backoff import Backoff, retrying


def test_delays_grow_by_factor_up_to_max() -> None:
    assert [Backoff(1.0, 2.0, 60.0).delay(n) for n in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert [Backoff(0.5, 1.5, 30.0).delay(n) for n in range(3)] == [0.5, 0.75, 1.125]
    assert [Backoff(1.0, 1.0).delay(n) for n in range(3)] == [1.0, 1.0, 1.0]
    assert list(itertools.islice(Backoff(1.0, 3.0).delays(), 4)) == [1, 3, 9, 27]


def test_a_long_run_of_failures_stays_at_max_instead_of_overflowing() -> None:
    # 2 ** 1100 as an int times a float, or 1.5 ** 1800, raise OverflowError.
    assert Backoff(1.0, 2.0, 60.0).delay(1100) == 60.0
    assert Backoff(0.5, 1.5, 30.0).delay(1800) == 30.0
    assert Backoff(1.0).delay(5000) == math.inf


def test_delays_are_cut_to_the_deadline_and_stop_there(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("memsnap.backoff.time", SimpleNamespace(monotonic=lambda: now[0]))

    def run(deadline: float) -> list[float]:
        now[0] = 100.0
        got = []
        for d in Backoff(1.0, 2.0, 60.0).delays(deadline=deadline, least_s=0.1):
            got.append(d)
            now[0] += d
        return got

    assert run(104.5) == [1.0, 2.0, 1.5]
    assert run(103.05) == [1.0, 2.0, 0.1]  # 0.05 s left: not cut below least_s
    assert run(100.0) == []


def test_retrying_tries_again_after_each_delay_then_raises_the_last_error() -> None:
    calls: list[int] = []
    naps: list[float] = []
    seen: list[tuple[int, str]] = []

    def fail() -> None:
        calls.append(1)
        raise OSError(f"try {len(calls)}")

    with pytest.raises(OSError, match="try 3"):
        retrying(fail, OSError, (0.2, 0.5), on_retry=lambda n, e: seen.append((n, str(e))), sleep=naps.append)
    assert (len(calls), naps, seen) == (3, [0.2, 0.5], [(0, "try 1"), (1, "try 2")])


def test_retrying_returns_the_first_success() -> None:
    results: Iterator[int | Exception] = iter([ValueError("blip"), ValueError("blip"), 7])
    naps: list[float] = []

    def fn() -> int:
        r = next(results)
        if isinstance(r, Exception):
            raise r
        return r

    assert retrying(fn, (KeyError, ValueError), Backoff(1.0, 2.0).delays(), sleep=naps.append) == 7
    assert naps == [1.0, 2.0]


def test_retrying_raises_at_once_what_retry_on_does_not_accept() -> None:
    naps: list[float] = []

    def fn() -> None:
        raise ValueError("tampered")

    with pytest.raises(ValueError, match="tampered"):
        retrying(fn, lambda e: "tampered" not in str(e), (1.0,), sleep=naps.append)
    with pytest.raises(ValueError):
        retrying(fn, KeyError, (1.0,), sleep=naps.append)
    assert naps == []
