"""Which tier copies Engine.reserve evicts to make room, and when it gives up: FakeCriu, no root."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from fakes import add_ckpt, make_engine, put_in_tier

from memsnap.catalog import DURABLE, STAGED
from memsnap.errors import TierExhausted
from memsnap.tiers import SPILL

MIB = 1 << 20


def _durable(e: object, ckpt_id: str, used_ms: int, nbytes: int = 3 * MIB) -> None:
    add_ckpt(e, ckpt_id, DURABLE, 1, in_tier=True, in_store=True, size_bytes=nbytes, last_used_ms=used_ms)  # type: ignore[arg-type]
    put_in_tier(e, ckpt_id, nbytes)  # type: ignore[arg-type]


def test_least_recently_used_durable_copy_goes_first(tmp_path: Path) -> None:
    e = make_engine(tmp_path, capacity=10 * MIB)
    _durable(e, "ck-old", 1000)
    _durable(e, "ck-new", 3000)
    _durable(e, "ck-mid", 2000)
    e.reserve(3 * MIB).release()  # 1 MiB free: one copy must go
    kept = {c: e.catalog.get_checkpoint(c).in_tier for c in ("ck-old", "ck-mid", "ck-new")}  # type: ignore[union-attr]
    assert kept == {"ck-old": False, "ck-mid": True, "ck-new": True}
    assert not e.tier.has("ck-old")


def test_staged_copies_are_never_evicted(tmp_path: Path) -> None:
    e = make_engine(tmp_path, capacity=8 * MIB)
    add_ckpt(e, "ck-staged", STAGED, 1, in_tier=True, size_bytes=6 * MIB)
    put_in_tier(e, "ck-staged", 6 * MIB)
    with pytest.raises(TierExhausted):
        e.reserve(4 * MIB)
    assert e.tier.has("ck-staged")


def test_nothing_is_evicted_when_evicting_everything_would_not_be_enough(tmp_path: Path) -> None:
    e = make_engine(tmp_path, capacity=8 * MIB)
    _durable(e, "ck-a", 1000)
    with pytest.raises(TierExhausted):
        e.reserve(20 * MIB)
    assert e.tier.has("ck-a")


def test_a_copy_in_use_is_skipped_not_waited_for(tmp_path: Path) -> None:
    e = make_engine(tmp_path, capacity=7 * MIB)
    _durable(e, "ck-old", 1000)
    _durable(e, "ck-new", 2000)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with e.checkpoint_lock("ck-old"):  # a restore or fetch of ck-old in another thread
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    try:
        e.reserve(3 * MIB).release()
    finally:
        release.set()
        t.join()
    assert e.tier.has("ck-old") and not e.tier.has("ck-new")


def test_a_durable_copy_in_the_spill_tier_is_neither_evicted_nor_counted_as_room(tmp_path: Path) -> None:
    """A park image in the guard's spill tier is DURABLE and in_tier, but not in the memory tier: evicting it
    would free nothing there."""
    e = make_engine(tmp_path, capacity=8 * MIB, spill=True)
    add_ckpt(e, "ck-spilled", DURABLE, 1, in_tier=True, in_store=True, size_bytes=6 * MIB, last_used_ms=1)
    put_in_tier(e, "ck-spilled", 6 * MIB, into=SPILL)
    _durable(e, "ck-here", 1000)
    with pytest.raises(TierExhausted):
        e.reserve(9 * MIB)  # (5 MiB free, ck-here frees 3 more: not enough, so nothing goes)
    assert e.catalog.get_checkpoint("ck-spilled").in_tier  # type: ignore[union-attr]
    assert e.tier.has("ck-here")
    e.reserve(7 * MIB).release()  # (what ck-here frees is enough: it goes, the spill image stays)
    assert e.catalog.get_checkpoint("ck-spilled").in_tier  # type: ignore[union-attr]
    assert e.tier.where("ck-spilled") == SPILL and not e.tier.has("ck-here")


def test_room_in_the_spill_tier_evicts_nothing_from_the_memory_tier(tmp_path: Path) -> None:
    e = make_engine(tmp_path, capacity=8 * MIB, spill=True)
    _durable(e, "ck-here", 1000)
    e.reserve(7 * MIB, into=SPILL).release()  # (the spill tier's filesystem has room; the memory tier's copy stays)
    assert e.tier.has("ck-here") and e.catalog.get_checkpoint("ck-here").in_tier  # type: ignore[union-attr]
