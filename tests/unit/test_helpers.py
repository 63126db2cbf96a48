"""The test helpers themselves can fail: a same-memory check needs a digest freshly computed from memory."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import COUNTER, keeps_ticking_with, start_digest, ticks, wait_for


@pytest.fixture
def counter(tmp_path: Path) -> Iterator[object]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(*extra: str) -> tuple[Path, int]:
        log = tmp_path / f"counter-{len(procs)}.log"
        with open(log, "wb") as f:
            p = subprocess.Popen([sys.executable, str(COUNTER), "--mib", "1", "--interval", "0.02", *extra],
                                 stdout=f)
        procs.append(p)
        wait_for(lambda: ticks(log), 20)
        return log, p.pid

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_ticks_say_which_digests_were_computed_on_that_tick(counter) -> None:
    log, pid = counter("--digest-every", "3")
    wait_for(lambda: len(ticks(log)) >= 7, 20)
    assert [t.fresh for t in ticks(log)[:6]] == [False, False, True, False, False, True]


def test_the_same_memory_check_needs_a_fresh_digest(counter) -> None:
    log, pid = counter("--digest-every", "100000")  # never recomputed: only the start digest, carried over
    with pytest.raises(AssertionError, match="freshly computed digest"):
        keeps_ticking_with(log, pid, start_digest(log), more=3, timeout=2)
    log, pid = counter("--digest-every", "5")
    keeps_ticking_with(log, pid, start_digest(log), more=3, timeout=20)


def test_the_same_memory_check_sees_another_digest(counter) -> None:
    log, pid = counter("--digest-every", "2")
    with pytest.raises(AssertionError, match="other memory digests"):
        keeps_ticking_with(log, pid, "0" * 16, more=3, timeout=20)
