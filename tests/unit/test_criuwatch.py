"""The progress deadline's pure parts: when a tree counts as stalled, and what /proc/locks says it waits for."""

from __future__ import annotations

import os

from memsnap.criuwatch import ProgressWatch, lock_waits


def test_progress_watch_counts_only_time_without_any_change():
    now = [0.0]
    samples = iter([1, 1, 2, 2, 2, 2, 2])
    w = ProgressWatch(1, 10.0, clock=lambda: now[0], probe=lambda pid: next(samples))
    now[0] = 9.0
    assert not w.stalled()  # same sample, 9 s
    now[0] = 15.0
    assert not w.stalled()  # it moved: the clock starts again at 15
    now[0] = 24.0
    assert not w.stalled()
    now[0] = 25.5
    assert w.stalled() and w.idle_s() == 10.5
    w.reset()  # (a message from CRIU)
    assert not w.stalled()


def test_lock_waits_names_the_waiter_and_the_holder():
    me = os.getpid()
    locks = ("1: POSIX  ADVISORY  WRITE 4242 fe:00:12345 0 EOF\n"
             f"1: -> POSIX  ADVISORY  WRITE {me} fe:00:12345 0 EOF\n"
             "2: FLOCK  ADVISORY  WRITE 77 fe:00:999 0 EOF\n"
             "2: -> FLOCK  ADVISORY  WRITE 78 fe:00:999 0 EOF\n")
    got = lock_waits({me}, locks)
    assert len(got) == 1
    assert got[0].startswith(f"pid {me} waits for a POSIX write lock on inode fe:00:12345 held by pid 4242")
    assert lock_waits({12}, locks) == []
