"""Bandwidth throttle (sizes and rates: test_units.py)."""

from __future__ import annotations

import threading

import pytest

from memsnap.store import throttle as throttle_module
from memsnap.store.throttle import Throttle

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class FakeClock:
    """Stands in for the throttle's time module: sleep() advances monotonic() at once and is recorded."""

    def __init__(self, advance_on_sleep: bool = True) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []
        self.advance = advance_on_sleep
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.sleeps.append(seconds)
            if self.advance:
                self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(throttle_module, "time", c)
    return c


def test_throttle_rate(clock: FakeClock) -> None:
    t = Throttle(8 * MiB)  # burst is 1 MiB: the other 3 MiB of 4 MiB cost exactly 3/8 s
    for _ in range(64):
        t.consume(64 * KiB)
    assert clock.now - 1000.0 == pytest.approx(3 / 8)
    assert len(clock.sleeps) == 64 - 16  # the first 1 MiB (16 x 64 KiB) is the burst: no wait
    assert all(s == pytest.approx(64 * KiB / (8 * MiB)) for s in clock.sleeps)


def test_throttle_refills_with_time_up_to_the_burst(clock: FakeClock) -> None:
    t = Throttle(8 * MiB)
    t.consume(MiB)  # the burst, spent
    assert clock.sleeps == []
    clock.now += 10  # idle for long: the bucket refills only to the burst, not 80 MiB
    t.consume(MiB)
    assert clock.sleeps == []
    t.consume(MiB)
    assert clock.sleeps == [pytest.approx(1 / 8)]


def test_throttle_shared_by_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    frozen = FakeClock(advance_on_sleep=False)  # time stands still: every byte past the burst is debt
    monkeypatch.setattr(throttle_module, "time", frozen)
    t = Throttle(16 * MiB)  # burst 1.6 MiB

    def drain() -> None:
        for _ in range(16):
            t.consume(128 * KiB)

    threads = [threading.Thread(target=drain) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    # One bucket for all four: the last caller waits for all 8 MiB past the burst, not for its own 2 MiB.
    burst = 16 * MiB // 10
    assert max(frozen.sleeps) == pytest.approx((8 * MiB - burst) / (16 * MiB))
    assert len(frozen.sleeps) == 64 - burst // (128 * KiB)


def test_set_rate_refills_and_changes_the_cap(clock: FakeClock) -> None:
    t = Throttle(8 * MiB)
    t.consume(2 * MiB)
    assert clock.sleeps == [pytest.approx(1 / 8)]
    t.set_rate(None)
    t.consume(GiB)
    assert t.rate is None and len(clock.sleeps) == 1


def test_throttle_unlimited_and_invalid(clock: FakeClock) -> None:
    for rate in (None, 0):
        t = Throttle(rate)
        t.consume(10 * GiB)
        assert t.rate is None
    assert clock.sleeps == []
    with pytest.raises(ValueError):
        Throttle(-1)
