"""The target's expiry of a restored move the source never commits, on a fake timer: no root, no waiting."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fakes import NO_PID, Procs, add_ckpt, add_job, make_engine, procs_fixture, state_of  # noqa: F401

from memsnap.catalog import STAGED
from memsnap.config import Config, DaemonConfig, load_config
from memsnap.engine import Engine
from memsnap.move.facade import Mover
from memsnap.move.target import COMMIT_TIMEOUT_S, MoveTarget


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
