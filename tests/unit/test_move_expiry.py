"""The target's expiry of a restored move the source never commits, on a fake timer: no root, no waiting."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fakes import NO_PID, Procs, add_ckpt, add_job, make_engine, procs_fixture, put_in_tier, state_of  # noqa: F401

from memsnap import lifecycle
from memsnap.catalog import DURABLE, STAGED
from memsnap.config import Config, DaemonConfig, load_config
from memsnap.engine import Engine
from memsnap.move.facade import Mover
from memsnap.move.target import COMMIT_TIMEOUT_S, MoveTarget, drop_incoming


class Timers:
    """A fake timer: records (seconds, fn) and fires when the test says so (time passes only here)."""

    def __init__(self) -> None:
        self.armed: list[tuple[float, Callable[[], None]]] = []

    def __call__(self, seconds: float, fn: Callable[[], None]) -> None:
        self.armed.append((seconds, fn))

    def fire(self) -> None:
        """The oldest armed timer runs out."""
        _, fn = self.armed.pop(0)
        fn()


def _pending_move(e: Engine, procs: Procs) -> int:
    """A job restored here for a move of ck-a that the source has not committed yet; its pid."""
    pid, start = procs.start()
    add_job(e, "job-t", pid, start, restored_from="ck-a")
    add_ckpt(e, "ck-a", STAGED, NO_PID, meta={"move_pending": "job-t"})
    return pid


def test_an_uncommitted_move_is_killed_when_its_timer_runs_out(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid = _pending_move(e, procs)
    timers = Timers()
    t = MoveTarget(e, commit_timeout_s=7.0, timer=timers)
    t._arm_expiry("ck-a", "job-t")
    assert [s for s, _ in timers.armed] == [7.0]
    assert state_of(pid) in ("S", "R")  # nothing happens before the timer runs out
    timers.fire()
    job, rec = e.catalog.get_job("job-t"), e.catalog.get_checkpoint("ck-a")
    assert job is not None and job.ended and state_of(pid) in ("", "Z")
    assert rec is not None and "move_pending" not in rec.meta


def test_a_move_committed_before_its_timer_runs_out_stays(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid = _pending_move(e, procs)
    timers = Timers()
    t = MoveTarget(e, timer=timers)
    t._arm_expiry("ck-a", "job-t")
    t.commit("ck-a")
    timers.fire()
    job = e.catalog.get_job("job-t")
    assert job is not None and not job.ended and state_of(pid) in ("S", "R")


def test_a_lazy_move_still_paging_in_rearms_its_timer(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid = _pending_move(e, procs)
    timers = Timers()
    t = MoveTarget(e, commit_timeout_s=7.0, timer=timers)
    busy = [True]
    t.tunnels.busy = lambda ckpt_id: busy[0]  # type: ignore[method-assign]
    t._arm_expiry("ck-a", "job-t")
    timers.fire()
    assert state_of(pid) in ("S", "R") and [s for s, _ in timers.armed] == [7.0]
    busy[0] = False
    timers.fire()
    assert state_of(pid) in ("", "Z") and timers.armed == []


def test_the_commit_timeout_is_120_s_unless_configured(tmp_path: Path) -> None:
    e = make_engine(tmp_path)
    assert COMMIT_TIMEOUT_S == 120.0 and MoveTarget(e).commit_timeout_s == 120.0
    assert Mover(e, Config()).target.commit_timeout_s == 120.0
    cfg_file = tmp_path / "memsnap.toml"
    cfg_file.write_text("[daemon]\nmove_commit_timeout_s = 7.5\n")
    assert Mover(e, load_config(str(cfg_file))).target.commit_timeout_s == 7.5
    assert Mover(e, Config(daemon=DaemonConfig(move_commit_timeout_s=3.0))).target.commit_timeout_s == 3.0


class RecordingDrain:
    """The drain and the repository a target needs for a move: what it was asked to store and delete."""

    def __init__(self) -> None:
        self.enqueued: list[str] = []
        self.deleted: list[str] = []

    def enqueue(self, ckpt_id: str, delay_s: float = 0.0) -> None:
        self.enqueued.append(ckpt_id)

    def delete(self, rec: object) -> None:
        self.deleted.append(rec.id)  # type: ignore[attr-defined]


def _received(e: Engine, kind: str = "streamed", state: str = STAGED) -> None:
    """ck-r, an image that came for a move not committed yet, in the tier (and, kind 'store', in the store)."""
    put_in_tier(e, "ck-r", 4096)
    add_ckpt(e, "ck-r", state, NO_PID, in_tier=True, in_store=kind == "store", meta={"move_incoming": kind})


def test_an_image_received_for_a_move_that_never_restores_goes_when_its_timer_runs_out(tmp_path: Path) -> None:
    drain = RecordingDrain()
    e = make_engine(tmp_path, drain=drain, repo=drain)
    _received(e)
    timers = Timers()
    t = MoveTarget(e, commit_timeout_s=7.0, timer=timers)
    t._timer(t.commit_timeout_s, lambda: t._expire_incoming("ck-r"))  # (what receive() arms)
    timers.fire()
    assert e.catalog.get_checkpoint("ck-r") is None and not e.tier.has("ck-r")
    assert drain.enqueued == []  # never stored: it was never this node's


def test_a_committed_move_keeps_its_image_and_only_then_stores_it(tmp_path: Path, procs: Procs) -> None:
    drain = RecordingDrain()
    e = make_engine(tmp_path, drain=drain, repo=drain)
    _received(e)
    pid, start = procs.start()
    add_job(e, "job-t", pid, start, restored_from="ck-r")
    lifecycle.mark(e.catalog, "ck-r", move_incoming="streamed", move_pending="job-t")
    timers = Timers()
    t = MoveTarget(e, timer=timers)
    t.commit("ck-r")
    t._expire_incoming("ck-r")
    rec = e.catalog.get_checkpoint("ck-r")
    assert rec is not None and "move_incoming" not in rec.meta and e.tier.has("ck-r")
    assert drain.enqueued == ["ck-r"]


def test_an_expired_move_takes_its_image_with_it(tmp_path: Path, procs: Procs) -> None:
    drain = RecordingDrain()
    e = make_engine(tmp_path, drain=drain, repo=drain)
    _received(e)
    pid, start = procs.start()
    add_job(e, "job-t", pid, start, restored_from="ck-r")
    lifecycle.mark(e.catalog, "ck-r", move_incoming="streamed", move_pending="job-t")
    timers = Timers()
    t = MoveTarget(e, commit_timeout_s=7.0, timer=timers)
    t._arm_expiry("ck-r", "job-t")
    timers.fire()
    assert state_of(pid) in ("", "Z")
    assert e.catalog.get_checkpoint("ck-r") is None and not e.tier.has("ck-r")


def test_a_failed_move_via_the_store_forgets_the_sources_copy_here_but_never_deletes_it(tmp_path: Path) -> None:
    drain = RecordingDrain()
    e = make_engine(tmp_path, drain=drain, repo=drain)
    _received(e, kind="store", state=DURABLE)
    assert drop_incoming(e, "ck-r")
    assert e.catalog.get_checkpoint("ck-r") is None and not e.tier.has("ck-r")
    assert drain.deleted == []  # (the stored copy is the source's)


def test_a_restart_drops_an_image_received_for_a_move_that_never_happened(tmp_path: Path) -> None:
    e = make_engine(tmp_path, drain=RecordingDrain(), repo=RecordingDrain())
    _received(e)
    e.recover(moves=Mover(e, Config()))
    assert e.catalog.get_checkpoint("ck-r") is None and not e.tier.has("ck-r")
