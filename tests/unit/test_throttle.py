"""Bandwidth throttle and size parsing."""

from __future__ import annotations

import threading
import time

import pytest

from memsnap.store.throttle import Throttle
from memsnap.units import parse_size

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("123", 123),
        ("0", 0),
        ("512K", 512 * KiB),
        ("512k", 512 * KiB),
        ("100M", 100 * MiB),
        ("1G", GiB),
        ("1.5G", 3 * GiB // 2),
        ("2T", 2 << 40),
        ("1Ki", KiB),
        ("1KiB", KiB),
        ("4mib", 4 * MiB),
        ("10MB", 10 * MiB),
        ("10M/s", 10 * MiB),
        ("1.5GiB/s", 3 * GiB // 2),
        (" 8 M ", 8 * MiB),
        ("100B", 100),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-1", "1X", "1KK", "1.5", "M", "1 G B B", "1e6"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_throttle_rate() -> None:
    t = Throttle(8 * MiB)  # burst is 1 MiB, so 4 MiB take about 3/8 s
    start = time.monotonic()
    for _ in range(64):
        t.consume(64 * KiB)
    elapsed = time.monotonic() - start
    assert 0.3 <= elapsed <= 1.0


def test_throttle_shared_by_threads() -> None:
    t = Throttle(16 * MiB)  # burst 1.6 MiB: 8 MiB from 4 threads take about 0.4 s

    def drain() -> None:
        for _ in range(16):
            t.consume(128 * KiB)

    threads = [threading.Thread(target=drain) for _ in range(4)]
    start = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert 0.3 <= time.monotonic() - start <= 1.2


def test_throttle_unlimited_and_invalid() -> None:
    start = time.monotonic()
    for rate in (None, 0):
        t = Throttle(rate)
        t.consume(10 * GiB)
        assert t.rate is None
    assert time.monotonic() - start < 0.1
    with pytest.raises(ValueError):
        Throttle(-1)
