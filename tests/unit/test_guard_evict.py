"""When the guard drops a parked image's RAM copy once it is durable: never while a restore still reads that copy,
and as soon as none does. A real Engine (with a spill tier, or without) over FakeCriu; no root, no cgroups, no
drain (the test says when the image is durable)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes import KEY, FakeCriu, Procs, make_engine, procs_fixture  # noqa: F401 (procs_fixture: the fixture)

from memsnap import lifecycle
from memsnap.catalog import DRAINING, DURABLE
from memsnap.config import GuardConfig
from memsnap.engine import ROOT, DumpExtras, Engine
from memsnap.guard.service import PARKED, Guard
from memsnap.tiers import MEMORY, SPILL


class SlowCriu(FakeCriu):
    """A FakeCriu whose restore reads the image until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = threading.Event()
        self.done = threading.Event()

    def restore(self, images_dir: Path, work_dir: Path, opts: Any, notify: Any = None) -> int:
        self.reading.set()
        assert self.done.wait(30), "the test never let the restore finish"
        return super().restore(images_dir, work_dir, opts, notify)


@pytest.fixture
def criu() -> Iterator[SlowCriu]:
    c = SlowCriu()
    yield c
    c.done.set()
    for pid in c.restores:  # (the restored `sleep`s)
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def _parked(eng: Engine, guard: Guard, procs: Procs, into: str = MEMORY) -> str:
    """A durable checkpoint of a (then gone) process, dumped into the named tier, that the guard holds as job-1's
    park."""
    pid, _ = procs.start()
    rec = eng.checkpoint(ROOT, str(pid), extras=DumpExtras(into=into))
    p = next(p for p in procs.started if p.pid == pid)
    p.kill()
    p.wait()  # (its pid must be free for the restore)
    lifecycle.advance(eng.catalog, rec.id, DRAINING)
    lifecycle.advance(eng.catalog, rec.id, DURABLE, in_store=True)
    guard.adopt("job-1", os.getuid(), limit=0, priority=0, on_limit="park", cgroup="")
    guard.table.update("job-1", state=PARKED, checkpoint=rec.id)
    return rec.id


def _guard(state: Path, engine: Engine) -> Guard:
    return Guard(engine, GuardConfig(cgroup_root=str(state / "no-cgroupfs")), state)


def _restore_in_thread(eng: Engine, ckpt_id: str, criu: SlowCriu) -> threading.Thread:
    t = threading.Thread(target=eng.restore, args=(ROOT, ckpt_id), daemon=True)
    t.start()
    assert criu.reading.wait(10)
    return t


def _age(work_root: Path, ckpt_id: str, seconds: float) -> None:
    """Makes every restore work dir of ckpt_id (and its log) look untouched for that long."""
    then = time.time() - seconds
    for work in work_root.glob(f"{ckpt_id}.restore-*"):
        for p in (*work.iterdir(), work):
            os.utime(p, (then, then))


def test_a_restore_reading_for_minutes_still_keeps_the_tier_copy(tmp_path: Path, criu: SlowCriu,
                                                                  procs: Procs) -> None:
    eng = make_engine(tmp_path, criu=criu)
    guard = _guard(eng.cfg.state_dir, eng)
    ckpt = _parked(eng, guard, procs)
    t = _restore_in_thread(eng, ckpt, criu)
    _age(eng.work_root, ckpt, 120)  # (CRIU has been reading for two minutes, and its log has not moved)
    assert guard.parker.evict_step(ckpt, "job-1") is False  # (try again later)
    assert eng.tier.has(ckpt) and eng.catalog.get_checkpoint(ckpt).in_tier  # type: ignore[union-attr]
    criu.done.set()
    t.join(10)
    assert guard.parker.evict_step(ckpt, "job-1") is True  # (the restore is over: the copy goes)
    assert not eng.tier.has(ckpt) and not eng.catalog.get_checkpoint(ckpt).in_tier  # type: ignore[union-attr]


def test_a_finished_restores_fresh_work_dir_does_not_keep_the_tier_copy(tmp_path: Path, criu: SlowCriu,
                                                                        procs: Procs) -> None:
    eng = make_engine(tmp_path, criu=criu)
    guard = _guard(eng.cfg.state_dir, eng)
    ckpt = _parked(eng, guard, procs)
    work = eng.work_root / f"{ckpt}.restore-0a0b0c"  # a restore that failed a moment ago left its work dir
    work.mkdir()
    (work / "restore.log").write_text("Error (criu/cr-restore.c:1): boom\n")
    assert guard.parker.evict_step(ckpt, "job-1") is True
    assert not eng.tier.has(ckpt) and not eng.catalog.get_checkpoint(ckpt).in_tier  # type: ignore[union-attr]


def test_a_restore_of_a_spill_image_keeps_the_spill_copy(tmp_path: Path, criu: SlowCriu, procs: Procs) -> None:
    """With guard.spill_dir the park image lives in the spill tier; a restore of it reads there, and the one
    engine counts that reader: the copy stays until the restore is done, then goes."""
    eng = make_engine(tmp_path, criu=criu, spill=True)
    guard = _guard(eng.cfg.state_dir, eng)
    ckpt = _parked(eng, guard, procs, into=SPILL)
    assert eng.tier.where(ckpt) == SPILL
    t = _restore_in_thread(eng, ckpt, criu)
    _age(eng.work_root, ckpt, 120)
    assert guard.parker.evict_step(ckpt, "job-1") is False
    assert eng.tier.has(ckpt)
    criu.done.set()
    t.join(10)
    assert guard.parker.evict_step(ckpt, "job-1") is True
    assert not eng.tier.has(ckpt) and not eng.catalog.get_checkpoint(ckpt).in_tier  # type: ignore[union-attr]


def test_a_job_no_longer_parked_keeps_its_copy(tmp_path: Path, procs: Procs) -> None:
    eng = make_engine(tmp_path)
    guard = _guard(eng.cfg.state_dir, eng)
    ckpt = _parked(eng, guard, procs)
    guard.table.update("job-1", state="resumed")  # (a plain restore brought it back meanwhile)
    assert guard.parker.evict_step(ckpt, "job-1") is True
    assert eng.tier.has(ckpt)


def test_the_node_policy_counts_the_tiers_reservations(tmp_path: Path) -> None:
    eng = make_engine(tmp_path)
    guard = _guard(eng.cfg.state_dir, eng)
    assert guard.loop.tier_inflight() == 0
    with eng.tier.reserve(5 << 20), eng.tier.reserve(3 << 20):
        assert guard.loop.tier_inflight() == 8 << 20
    assert guard.loop.tier_inflight() == 0

