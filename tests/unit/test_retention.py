"""The retention policy (memsnap.retention): pure logic with an injected clock."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from memsnap.retention import (
    LAST_DURABLE,
    NO_POLICY,
    Policy,
    format_duration,
    parse_duration,
    plan,
    series_of,
)

NOW = 1_800_000_000_000  # ms
MIN = 60_000


@dataclass
class Rec:
    id: str
    created_ms: int
    state: str = "durable"
    name: str = ""
    job: str = "j1"
    pid: int = 100
    owner_uid: int = 1000
    meta: dict[str, Any] = field(default_factory=dict)


def ago(minutes: float) -> int:
    return NOW - int(minutes * MIN)


def series(*ages: float, **kw: Any) -> list[Rec]:
    """Checkpoints of one job, c0 the oldest."""
    return [Rec(f"c{i}", ago(a), **kw) for i, a in enumerate(sorted(ages, reverse=True))]


def run(recs: list[Rec], pol: Policy, in_use: Any = None) -> Any:
    return plan(recs, lambda s: pol, NOW, in_use or (lambda r: ""))


def test_keep_last_one_of_three_deletes_the_two_older():
    p = run(series(30, 20, 10), Policy(keep_last=1))
    assert p.delete == ["c0", "c1"]
    assert p.keep == {"c2": LAST_DURABLE}


def test_keep_last_zero_still_keeps_the_newest_durable():
    p = run(series(30, 20, 10), Policy(keep_last=0))
    assert p.delete == ["c0", "c1"] and list(p.keep) == ["c2"]


def test_newest_durable_is_kept_when_newer_ones_are_still_draining():
    recs = series(30, 20, 10)
    recs[2].state = "draining"
    p = run(recs, Policy(keep_last=0))
    assert p.delete == ["c0"]
    assert p.keep["c1"] == LAST_DURABLE and p.keep["c2"].startswith("not durable")


def test_keep_within_keeps_only_the_recent_ones():
    p = run(series(180, 90, 45, 5), Policy(keep_within_s=parse_duration("1h")))
    assert p.delete == ["c0", "c1"]
    assert p.keep["c2"].startswith("keep-within 1h")


def test_rules_are_a_union():
    p = run(series(300, 200, 100, 50, 5), Policy(keep_last=2, keep_within_s=3600 * 2))
    # c4 newest durable, c3 second of keep-last 2, c2 within 2h (100 min): c0, c1 go
    assert p.delete == ["c0", "c1"]


def test_no_policy_keeps_everything():
    p = run(series(300, 200, 100), Policy())
    assert p.delete == [] and set(p.keep.values()) == {NO_POLICY}


def test_in_use_checkpoints_stay_whatever_the_policy():
    p = run(series(30, 20, 10), Policy(keep_last=1), in_use=lambda r: "a restore reads it" if r.id == "c0" else "")
    assert p.delete == ["c1"] and p.keep["c0"] == "a restore reads it"


def test_failed_checkpoints_are_left_to_prune_and_not_counted():
    recs = series(30, 20, 10)
    recs[2].state = "failed"
    p = run(recs, Policy(keep_last=1))
    assert p.delete == ["c0"]
    assert p.keep["c2"].startswith("failed") and p.keep["c1"] == LAST_DURABLE


def test_series_are_separate_per_job_and_per_owner():
    a = series(30, 20, 10, job="ja")
    b = [Rec(f"b{i}", ago(m), job="jb") for i, m in enumerate((25, 15))]
    c = [Rec("u2", ago(40), job="ja", owner_uid=2000)]
    p = run([*a, *b, *c], Policy(keep_last=1))
    assert p.delete == ["c0", "b0", "c1"]
    assert p.keep["u2"] == LAST_DURABLE  # another owner's series, even with the same job id


def test_a_name_groups_checkpoints_across_restored_jobs():
    recs = [Rec("old", ago(30), job="j1", name="train"), Rec("new", ago(10), job="j2", name="train")]
    p = run(recs, Policy(keep_last=1))
    assert p.delete == ["old"]


def test_unmanaged_processes_form_a_series_per_pid_and_start_time():
    r1 = Rec("a", ago(30), job="", meta={"pid_start": 5.0})
    r2 = Rec("b", ago(10), job="", meta={"pid_start": 5.0})
    r3 = Rec("c", ago(20), job="", meta={"pid_start": 9.0})  # same pid, another process
    p = run([r1, r2, r3], Policy(keep_last=1))
    assert p.delete == ["a"] and series_of(r1) != series_of(r3)


def test_per_series_policy_overrides_the_default_rule_by_rule():
    default = Policy(keep_last=5, keep_within_s=60)
    job = Policy(keep_last=1)
    eff = job.over(default)
    assert eff == Policy(keep_last=1, keep_within_s=60)
    recs = series(30, 20, 10, job="ja") + [Rec(f"o{i}", ago(m), job="jo") for i, m in enumerate((30, 20, 10))]
    p = plan(recs, lambda s: eff if s.endswith("job:ja") else default, NOW)
    assert p.delete == ["c0", "c1"]


def test_a_checkpoint_from_the_future_counts_as_recent():
    recs = series(30, 10) + [Rec("future", NOW + 5 * MIN, state="durable")]
    p = run(recs, Policy(keep_last=0, keep_within_s=60))
    assert "future" not in p.delete


@pytest.mark.parametrize("text,seconds", [("90", 90), ("90s", 90), ("30m", 1800), ("2h", 7200), ("7d", 604800),
                                          ("2w", 1209600), ("1h30m", 5400), ("1.5h", 5400), ("500ms", 0.5),
                                          ("0", 0)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "h", "2x", "-1h", "1h 2", "2 3h", "1e9w", "nan"])
def test_parse_duration_refuses(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_format_duration_round_trips():
    for s in (0, 59, 90, 3600, 5400, 86400 + 7200):
        assert parse_duration(format_duration(s)) == s


def test_policy_bounds():
    with pytest.raises(ValueError):
        Policy(keep_last=-1)
    with pytest.raises(ValueError):
        Policy(keep_within_s=float("inf"))
    assert Policy.from_dict(Policy(3, 60.0).to_dict()) == Policy(3, 60.0)
    assert Policy().describe() == "keep everything"
    assert Policy(2, 7200).describe() == "keep-last 2, keep-within 2h"


# -- the collector (memsnap.gc) over a real Engine and catalog, FakeCriu, no store -----------------------

def _collector(tmp_path, default: Policy, **kw: Any) -> Any:
    from fakes import make_engine

    from memsnap.gc import Collector

    e = make_engine(tmp_path)
    return Collector(e, default, grace_s=0, clock=lambda: NOW / 1000, **kw)


def _durable(gc: Any, ckpt_id: str, minutes_ago: float, job: str = "j1", uid: int | None = None,
             **meta: Any) -> None:
    import os

    from fakes import put_in_tier

    from memsnap.catalog import CheckpointRecord

    rec = CheckpointRecord(id=ckpt_id, state="durable", pid=1, owner_uid=os.getuid() if uid is None else uid,
                           created_ms=ago(minutes_ago), job=job, in_tier=True, meta=dict(meta))
    gc.engine.catalog.add_checkpoint(rec)
    put_in_tier(gc.engine, ckpt_id, 4096)


def _ids(gc: Any) -> list[str]:
    return [r.id for r in gc.engine.catalog.checkpoints()]


def test_collector_deletes_what_the_policy_lets_go_through_the_delete_path(tmp_path):
    from memsnap.engine import ROOT

    gc = _collector(tmp_path, Policy(keep_last=1))
    for i, m in enumerate((30, 20, 10)):
        _durable(gc, f"c{i}", m)
    rep = gc.run(ROOT)
    assert [r.id for r in rep.deleted] == ["c0", "c1"] and _ids(gc) == ["c2"]
    assert not gc.engine.tier.has("c0") and gc.engine.tier.has("c2")
    assert rep.kept == {"c2": LAST_DURABLE} and not rep.swept


def test_collector_dry_run_deletes_nothing(tmp_path):
    from memsnap.engine import ROOT

    gc = _collector(tmp_path, Policy(keep_last=1))
    for i, m in enumerate((30, 20, 10)):
        _durable(gc, f"c{i}", m)
    rep = gc.run(ROOT, dry_run=True)
    assert [r.id for r in rep.deleted] == ["c0", "c1"] and _ids(gc) == ["c0", "c1", "c2"]
    assert gc.engine.tier.has("c0")


def test_collector_keeps_checkpoints_in_use(tmp_path):
    from types import SimpleNamespace

    from memsnap.engine import ROOT
    from memsnap.gc import IN_MOVE, IN_RESTORE, PARKED

    gc = _collector(tmp_path, Policy(keep_last=0))
    for i, m in enumerate((50, 40, 30, 20)):
        _durable(gc, f"c{i}", m, hold=(i == 1))
    _durable(gc, "newest", 10)
    gc.engine.restorer.mark_reading("c0", +1)  # a restore's CRIU reads c0's tier copy
    gc.engine.guard = SimpleNamespace(get=lambda job: SimpleNamespace(state="parked", checkpoint="c2"))
    lock = gc.engine.copies.lock_for("c3")
    held = threading.Event()
    release = threading.Event()

    def hold_lock() -> None:  # a fetch or restore in another thread holds c3's lock
        with lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold_lock)
    t.start()
    held.wait(10)
    try:
        rep = gc.run(ROOT)
    finally:
        release.set()
        t.join()
    assert rep.deleted == []
    assert rep.kept["c0"] == IN_RESTORE and rep.kept["c1"] == IN_MOVE and rep.kept["c2"] == PARKED
    assert rep.kept["c3"].startswith("busy") and rep.kept["newest"] == LAST_DURABLE
    gc.engine.restorer.mark_reading("c0", -1)
    gc.engine.guard = None
    assert [r.id for r in gc.run(ROOT).deleted] == ["c0", "c2", "c3"]


def test_collector_as_a_user_touches_only_that_users_checkpoints_and_never_sweeps(tmp_path):
    from memsnap.engine import Caller

    gc = _collector(tmp_path, Policy(keep_last=0))
    for i, m in enumerate((30, 20, 10)):
        _durable(gc, f"mine{i}", m, uid=4242)
        _durable(gc, f"other{i}", m, uid=4343)
    rep = gc.run(Caller(uid=4242, gid=4242))
    assert [r.id for r in rep.deleted] == ["mine0", "mine1"]
    assert not any(k.startswith("other") for k in rep.kept)
    assert {"other0", "other1", "other2"} <= set(_ids(gc))
    assert not rep.swept and "root only" in rep.sweep_note


def test_a_series_policy_overrides_the_default(tmp_path):
    import os

    from memsnap.engine import ROOT

    gc = _collector(tmp_path, Policy())  # the node keeps everything
    for i, m in enumerate((30, 20, 10)):
        _durable(gc, f"a{i}", m, job="ja")
        _durable(gc, f"b{i}", m, job="jb")
    gc.set_policy(f"{os.getuid()}/job:ja", 1, None)
    assert [r.id for r in gc.run(ROOT).deleted] == ["a0", "a1"]
    gc.set_policy(f"{os.getuid()}/job:ja", None, 3600.0)  # adds a rule, keeps keep-last
    assert gc.policy_for(f"{os.getuid()}/job:ja") == Policy(1, 3600.0)


def test_collector_sweeps_through_the_sweeper_as_root_with_a_dry_runs_deletions_as_gone(tmp_path):
    from memsnap.engine import ROOT
    from memsnap.gc import SweepResult

    calls = []

    class Sweeper:
        def sweep(self, dry_run: bool, now: float, gone: set[str]) -> SweepResult:
            calls.append((dry_run, now, gone))
            return SweepResult(deleted=3, bytes_freed=300, kept_in_grace=1)

    gc = _collector(tmp_path, Policy(keep_last=1), sweeper=Sweeper())
    for i, m in enumerate((30, 20, 10)):
        _durable(gc, f"c{i}", m)
    rep = gc.run(ROOT, dry_run=True)
    assert rep.swept and rep.sweep == SweepResult(3, 300, 1)
    assert calls == [(True, NOW / 1000, {"c0", "c1"})]
    gc.run(ROOT)
    assert calls[-1] == (False, NOW / 1000, set())


def test_a_deferred_sweep_is_reported_as_deferred_not_failed(tmp_path):
    from memsnap.engine import ROOT
    from memsnap.gc import SweepResult
    from memsnap.store.chunkgc import SweepDeferred

    class Sweeper:
        def sweep(self, dry_run: bool, now: float, gone: set[str]) -> SweepResult:
            raise SweepDeferred("1 drain(s) into /s still ran after 10 s: the sweep deleted nothing")

    rep = _collector(tmp_path, Policy(keep_last=1), sweeper=Sweeper()).run(ROOT)
    assert rep.sweep_deferred and not rep.sweep_failed and not rep.swept
    assert "deleted nothing" in rep.sweep_note


def test_periodic_gc_waits_while_foreground_work_runs_then_runs(tmp_path, monkeypatch) -> None:
    import threading

    from memsnap import background

    g = background.Gate(max_pause_s=60.0, poll_s=0.005)
    monkeypatch.setattr(background, "_GATE", g)
    gc = _collector(tmp_path, Policy(keep_last=1))
    ran = threading.Event()
    monkeypatch.setattr(gc, "run", lambda caller, dry_run=False: ran.set())
    token = g.hold("restore")  # foreground work in flight
    gc.start(0.01)
    try:
        assert not ran.wait(0.5), "the periodic gc ran while foreground work was in flight"
        assert any(k.startswith("gc:") for k in g.snapshot()["drains_held"]), g.snapshot()
        g.release(token)
        assert ran.wait(10), "the periodic gc never ran once the foreground work ended"
    finally:
        gc.stop()


# -- shared stores: one node may delete a stored copy (retention.not_ours) -------------------------------

class _RecordingRepo:
    """The store side of delete (memsnap.repository): which stored copies went."""

    def __init__(self) -> None:
        self.deleted: list[str] = []

    def delete(self, rec: Any) -> None:
        self.deleted.append(rec.id)


def test_gc_and_delete_free_only_the_stored_copies_this_node_owns_and_forget_the_rest(tmp_path):
    """A move's source (moved_to) and a node that adopted another's checkpoint (home) only forget their rows."""
    import os

    from fakes import make_engine

    from memsnap.catalog import CheckpointRecord
    from memsnap.engine import ROOT
    from memsnap.gc import Collector

    repo = _RecordingRepo()
    e = make_engine(tmp_path, repo=repo)  # type: ignore[arg-type]
    here = e.node
    for i, meta in enumerate(({}, {"moved_to": "n2"}, {"home": "n9"}, {"home": here}, {}, {"home": "n9"})):
        e.catalog.add_checkpoint(CheckpointRecord(id=f"c{i}", state="durable", pid=1, owner_uid=os.getuid(),
                                                  created_ms=ago(60 - i), job="j1", in_store=True, meta=meta))
    rep = Collector(e, Policy(keep_last=1), grace_s=0, clock=lambda: NOW / 1000).run(ROOT)
    assert [r.id for r in rep.deleted] == ["c0", "c1", "c2", "c3", "c4"]
    assert repo.deleted == ["c0", "c3", "c4"]  # made here (c3: adopted back from the store by its own maker)
    assert rep.forgotten == {"c1": "its job moved to n2, which deletes it", "c2": "n9 made it and deletes it"}
    e.delete(ROOT, "c5")
    assert repo.deleted == ["c0", "c3", "c4"] and e.catalog.get_checkpoint("c5") is None
