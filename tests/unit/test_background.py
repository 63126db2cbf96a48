"""The foreground/background gate (memsnap.background), with an injected clock, and the ranged-sync writer."""

from __future__ import annotations

import heapq
import os
import threading
from pathlib import Path

import pytest

from memsnap import background
from memsnap.background import Gate, take_due
from memsnap.store import posix
from memsnap.store.posix import PosixStore


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_gate(max_pause_s: float = 60.0) -> tuple[Gate, Clock]:
    clock = Clock()
    return Gate(max_pause_s=max_pause_s, clock=clock, wall=lambda: 1.7e9, poll_s=0.005), clock


def paused_in_thread(g: Gate, ckpt_id: str) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def run() -> None:
        g.pause_point(ckpt_id)
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


def wait_until(cond: object, what: str) -> None:
    ev = threading.Event()
    for _ in range(2000):
        if cond():  # type: ignore[operator]
            return
        ev.wait(0.005)
    raise AssertionError(f"never: {what}")


def test_queued_drain_waits_while_foreground_work_runs() -> None:
    g, _ = make_gate()
    heap = [(0.0, "ck-a")]
    with g.foreground("restore"):
        assert take_due(heap, now=1.0, g=g) is None
        assert heap == [(0.0, "ck-a")]
        snap = g.snapshot()
        assert snap["drains_paused"] and snap["drains_paused_reason"] == "restore"
        assert snap["drain_waits"] == 1 and snap["drains_held"] == ["drain:ck-a (waiting)"]
    assert take_due(heap, now=1.0, g=g) == "ck-a"
    assert heap == [] and not g.snapshot()["drains_paused"]


def test_the_spare_worker_takes_only_urgent_drains_and_leaves_the_others_untouched() -> None:
    g, _ = make_gate()
    heap = [(0.0, "ck-a"), (0.5, "ck-b")]
    with g.foreground("restore"):
        assert take_due(heap, now=1.0, g=g, urgent_only=True) is None
        assert not g.snapshot()["drains_held"]  # (not counted as waiting: the spare worker never asked)
        with g.urgent("ck-b"):
            assert take_due(heap, now=1.0, g=g, urgent_only=True) == "ck-b"
    assert heap == [(0.0, "ck-a")]


def test_drain_not_yet_due_is_not_taken() -> None:
    g, _ = make_gate()
    heap = [(5.0, "ck-a")]
    assert take_due(heap, now=1.0, g=g) is None and heap == [(5.0, "ck-a")]


def test_running_drain_pauses_until_foreground_work_ends_and_counts_the_time() -> None:
    g, clock = make_gate()
    token = g.hold("dump")
    t, done = paused_in_thread(g, "ck-a")
    wait_until(g.paused, "the drain pauses")
    assert not done.is_set()
    assert g.snapshot()["drain_pauses"] == 1
    clock.t += 7.0
    g.release(token)
    t.join(5)
    assert done.is_set()
    snap = g.snapshot()
    assert not snap["drains_paused"] and snap["drains_paused_seconds"] == pytest.approx(7.0)
    assert snap["drain_pause_overrides"] == 0


def test_pause_point_returns_at_once_without_foreground_work() -> None:
    g, _ = make_gate()
    g.pause_point("ck-a")
    assert g.snapshot()["drain_pauses"] == 0


def test_hold_while_lasts_until_its_predicate_turns_false() -> None:
    g, _ = make_gate()
    serving = [True]
    g.hold_while("lazy pages", lambda: serving[0])
    assert g.busy() == "lazy pages"
    t, done = paused_in_thread(g, "ck-a")
    wait_until(g.paused, "the drain pauses")
    serving[0] = False
    t.join(5)
    assert done.is_set() and g.busy() == ""


def test_urgent_drain_neither_waits_nor_pauses() -> None:
    g, _ = make_gate()
    heap = [(0.0, "ck-a"), (0.5, "ck-b")]
    heapq.heapify(heap)
    with g.foreground("restore"), g.urgent("ck-b"):
        assert take_due(heap, now=1.0, g=g) == "ck-b"  # jumps the waiting one
        g.pause_point("ck-b")
    assert g.snapshot()["drain_pause_overrides"] == 1


def test_drain_becoming_urgent_stops_pausing() -> None:
    g, _ = make_gate()
    with g.foreground("lazy move"):
        t, done = paused_in_thread(g, "ck-a")
        wait_until(g.paused, "the drain pauses")
        with g.urgent("ck-a"):
            t.join(5)
            assert done.is_set()


def test_pause_bound_spent_lets_the_drain_run() -> None:
    g, clock = make_gate(max_pause_s=30.0)
    with g.foreground("lazy pages"):
        t, done = paused_in_thread(g, "ck-a")
        wait_until(g.paused, "the drain pauses")
        clock.t += 31.0
        t.join(5)
        assert done.is_set()
        g.pause_point("ck-a")  # spent: no more pauses for this drain
        assert g.snapshot()["drain_pause_overrides"] == 1
        g.forget("ck-a")
        heap = [(0.0, "ck-a")]
        assert take_due(heap, now=1.0, g=g) is None  # a new drain of it starts with a fresh bound


def test_max_pause_zero_turns_the_gate_off() -> None:
    g, _ = make_gate(max_pause_s=0)
    with g.foreground("restore"):
        g.pause_point("ck-a")
        assert take_due([(0.0, "ck-a")], now=1.0, g=g) == "ck-a"
    assert g.snapshot()["drain_pauses"] == g.snapshot()["drain_waits"] == 0


def test_wait_idle_waits_for_foreground_work() -> None:
    g, _ = make_gate()
    token = g.hold("guard park")
    done = threading.Event()
    threading.Thread(target=lambda: (g.wait_idle("gc"), done.set()), daemon=True).start()
    wait_until(g.paused, "gc waits")
    assert not done.is_set()
    g.release(token)
    wait_until(done.is_set, "gc runs")


def test_moved_away_drain_stops() -> None:
    background.check_still_wanted("ck-not-moved")
    background.mark_moved_away("ck-moved-1")
    with pytest.raises(background.MovedAway):
        background.check_still_wanted("ck-moved-1")


# -- the POSIX store writer syncs as it goes ---------------------------------------------------------
def test_posix_writer_syncs_ranges_as_it_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []
    real = posix.sync_range

    def counting(fd: int, offset: int, nbytes: int, flags: int) -> bool:
        calls.append((offset, nbytes, flags))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(posix, "sync_range", counting)
    root = tmp_path / "store"
    store = PosixStore(root, create=True)
    w = store.open_writer("ck-1/pages-1.img")
    piece = os.urandom(1 << 20)
    for _ in range((5 * posix.SYNC_RANGE) >> 20):
        w.write(piece)
    waited = [c for c in calls if c[2] & 4]  # SYNC_FILE_RANGE_WAIT_AFTER: that range is on disk
    assert len(waited) >= 4
    assert [c[0] for c in waited] == sorted(c[0] for c in waited)  # in order, one range after another
    obj = w.commit()
    assert obj.size_bytes == 5 * posix.SYNC_RANGE
    assert (root / "ck-1" / "pages-1.img").stat().st_size == obj.size_bytes


def test_posix_writer_falls_back_to_fdatasync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    syncs: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(posix, "sync_range", lambda *a: False)
    monkeypatch.setattr(posix.os, "fdatasync", lambda fd: (syncs.append(fd), real(fd))[1])
    store = PosixStore(tmp_path / "store", create=True)
    w = store.open_writer("ck-1/pages-1.img")
    for _ in range((3 * posix.SYNC_RANGE) >> 20):
        w.write(b"\0" * (1 << 20))
    assert len(syncs) >= 3
    w.commit()


# -- the page tunnel's conversation check (memsnap.move.psflow) ------------------------------------------
def _iov(cmd: int, nr: int, vaddr: int) -> bytes:
    import struct

    return struct.pack("<IIQQ", cmd, nr, vaddr, 1)


def test_page_flow_matches_replies_to_requests_across_message_boundaries() -> None:
    from memsnap.move.psflow import PageFlow
    from memsnap.pageserver.wire import IOV_41

    t = PageFlow(IOV_41)
    out = _iov(7, 1, 0x1000) + _iov(7, 4, 0x8000)
    assert t.sent(out[:10], 1.0) == ""  # a request split over two messages
    assert t.sent(out[10:], 1.0) == ""
    back = _iov(6 | 1 << 16, 1, 0x1000) + b"p" * 4096 + _iov(6, 4, 0x8000) + b"q" * 4 * 4096
    assert t.received(back[:100], 1.002) == ""
    assert t.received(back[100:5000], 1.003) == ""
    assert t.received(back[5000:], 1.010) == ""
    assert t.fault_ms == [pytest.approx(2.0)] and t.bulk_ms == [pytest.approx(3.0)]  # (its header came at 1.003)
    assert t.summary().startswith("1 faults, p50 2.0 ms, p99 2.0 ms (1 background requests")
    # The close, its status, then the end of the stream: a clean end.
    assert t.sent(_iov(0x1024, 0, 0), 1.1) == "" and t.received(b"\0\0", 1.2) == "" and \
        t.received(b"\0\0", 1.2) == ""
    assert t.ended() == ""


def test_page_flow_refuses_bytes_nobody_asked_for_and_an_early_end() -> None:
    from memsnap.move.psflow import PageFlow
    from memsnap.pageserver.wire import IOV_41

    t = PageFlow(IOV_41)
    assert t.sent(_iov(7, 1, 0x1000), 1.0) == ""
    assert "answered" in t.received(_iov(6, 1, 0x2000) + b"x" * 4096, 1.1)  # a reply to another request
    assert t.broken and t.received(b"x", 1.2) == t.broken  # (nothing more passes)

    idle = PageFlow(IOV_41)  # what crashed lazy-pages (BUG at page-xfer.c:1635): bytes, or an EOF, waiting for none
    assert "no request outstanding" in idle.received(b"\0" * 24, 1.0)
    assert "before lazy-pages had every page" in PageFlow(IOV_41).ended()
    waiting = PageFlow(IOV_41)
    waiting.sent(_iov(7, 4, 0x1000), 1.0)
    waiting.received(_iov(6, 4, 0x1000) + b"y" * 4096, 1.1)  # (one page of four)
    assert "outstanding" in waiting.ended()
    assert "unexpected request" in PageFlow(IOV_41).sent(_iov(0x99, 1, 0), 1.0)
