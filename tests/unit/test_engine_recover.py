"""Engine.recover, branch by branch, with a FakeCriu and real (unprivileged) processes: no root, no CRIU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fakes import Procs, add_ckpt, add_job, make_engine, procs_fixture, put_in_tier, state_of  # noqa: F401

from memsnap.catalog import DUMPING, DURABLE, FAILED, STAGED, CheckpointRecord


class Moves:
    """A MoveRecovery that records what the engine handed over."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def in_doubt(self, rec: CheckpointRecord) -> None:
        self.calls.append(("in_doubt", rec.id))

    def abandon(self, rec: CheckpointRecord) -> None:
        self.calls.append(("abandon", rec.id))

    def lazy_target_interrupted(self, rec: CheckpointRecord) -> None:
        self.calls.append(("lazy_target", rec.id))


class Gpu:
    def __init__(self) -> None:
        self.recovered: list[Any] = []

    def recover(self, entry: dict[str, Any]) -> dict[int, str]:
        self.recovered.append(entry)
        return {}


def test_interrupted_dump_fails_and_its_staging_goes(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start()
    add_ckpt(e, "ck-a", DUMPING, pid, meta={"stop": False, "pid_start": start})
    staging = e.tier.new_staging("ck-a")
    fixed = e.recover(Moves())
    rec = e.catalog.get_checkpoint("ck-a")
    assert rec is not None and rec.state == FAILED and "daemon stopped" in rec.last_error
    assert not staging.exists() and fixed["failed_dumps"] == 1
    assert state_of(pid) in ("S", "R")


def test_interrupted_stop_dump_resumes_the_stopped_job(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start(stopped=True)
    add_ckpt(e, "ck-a", DUMPING, pid, meta={"stop": True, "pid_start": start})
    e.recover(Moves())
    assert state_of(pid) in ("S", "R")


def test_interrupted_lazy_dump_the_target_confirmed_ends_the_held_copy(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start(stopped=True)
    add_job(e, "job-a", pid, start)
    add_ckpt(e, "ck-a", DUMPING, pid, job="job-a", meta={"hold": True, "pid_start": start, "moved_to": "b:1"})
    e.recover(Moves())
    assert state_of(pid) in ("", "Z")
    job = e.catalog.get_job("job-a")
    assert job is not None and job.ended


def test_interrupted_dump_with_commit_in_doubt_goes_to_the_mover_and_stays_stopped(tmp_path: Path,
                                                                                  procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start(stopped=True)
    add_ckpt(e, "ck-a", DUMPING, pid, meta={"hold": True, "pid_start": start, "committing_to": "b:1"})
    moves = Moves()
    e.recover(moves)
    assert moves.calls == [("in_doubt", "ck-a")]
    assert state_of(pid) == "T"


def test_held_copy_in_doubt_goes_to_the_mover_and_keeps_its_cuda_state_locked(tmp_path: Path,
                                                                             procs: Procs) -> None:
    gpu = Gpu()
    e = make_engine(tmp_path, gpu=gpu)
    pid, start = procs.start(stopped=True)
    add_ckpt(e, "ck-a", STAGED, pid, meta={"hold": True, "pid_start": start, "committing_to": "b:1",
                                           "gpu": {"pids": [pid]}})
    moves = Moves()
    e.recover(moves)
    assert moves.calls == [("in_doubt", "ck-a")]
    assert state_of(pid) == "T" and gpu.recovered == []


def test_held_copy_the_target_kept_ends(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start(stopped=True)
    add_job(e, "job-a", pid, start)
    add_ckpt(e, "ck-a", STAGED, pid, job="job-a", meta={"hold": True, "pid_start": start, "moved_to": "b:1"})
    e.recover(Moves())
    assert state_of(pid) in ("", "Z")
    rec = e.catalog.get_checkpoint("ck-a")
    assert rec is not None and rec.meta["hold"] is False


def test_held_copy_without_a_commit_runs_on(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start(stopped=True)
    add_ckpt(e, "ck-a", STAGED, pid, meta={"hold": True, "pid_start": start})
    moves = Moves()
    e.recover(moves)
    assert state_of(pid) in ("S", "R") and moves.calls == []


def test_restored_move_never_committed_goes_to_the_mover(tmp_path: Path) -> None:
    e = make_engine(tmp_path)
    add_ckpt(e, "ck-a", STAGED, 1, meta={"move_pending": "job-x"})
    moves = Moves()
    e.recover(moves)
    assert moves.calls == [("abandon", "ck-a")]


def test_interrupted_lazy_target_goes_to_the_mover(tmp_path: Path) -> None:
    e = make_engine(tmp_path)
    add_ckpt(e, "ck-a", STAGED, 1, meta={"pages_remote": True, "move_pending": "job-x"})
    moves = Moves()
    e.recover(moves)
    assert moves.calls == [("lazy_target", "ck-a")]


def test_without_a_mover_a_commit_in_doubt_stays_stopped(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start(stopped=True)
    add_ckpt(e, "ck-a", STAGED, pid, meta={"hold": True, "pid_start": start, "committing_to": "b:1"})
    e.recover(None)
    assert state_of(pid) == "T"


def test_published_stop_checkpoint_ends_its_job(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start(stopped=True)
    add_job(e, "job-a", pid, start)
    add_ckpt(e, "ck-a", STAGED, pid, job="job-a", in_tier=True, meta={"stop": True, "pid_start": start})
    put_in_tier(e, "ck-a", 10)
    e.recover(Moves())
    assert state_of(pid) in ("", "Z")
    job = e.catalog.get_job("job-a")
    assert job is not None and job.ended


def test_strays_go_and_lost_tier_copies_are_marked(tmp_path: Path) -> None:
    e = make_engine(tmp_path)
    put_in_tier(e, "ck-stray", 10)  # no catalog row
    e.tier.new_staging("ck-half")
    add_ckpt(e, "ck-lost", STAGED, 1, in_tier=True)  # a reboot emptied the tier
    add_ckpt(e, "ck-stored", DURABLE, 1, in_tier=True, in_store=True)
    fixed = e.recover(Moves())
    assert fixed == {"failed_dumps": 0, "stray_staging": 1, "stray_tier": 1, "lost_tier": 2}
    assert not e.tier.has("ck-stray")
    lost, stored = e.catalog.get_checkpoint("ck-lost"), e.catalog.get_checkpoint("ck-stored")
    assert lost is not None and lost.state == FAILED and not lost.in_tier
    assert stored is not None and stored.state == DURABLE and not stored.in_tier


def test_cuda_state_a_killed_daemon_left_is_given_back(tmp_path: Path) -> None:
    gpu = Gpu()
    e = make_engine(tmp_path, gpu=gpu)
    add_ckpt(e, "ck-a", FAILED, 1, meta={"gpu": {"pids": [1]}})
    e.recover(Moves())
    rec = e.catalog.get_checkpoint("ck-a")
    assert gpu.recovered == [{"pids": [1]}] and rec is not None and "gpu" not in rec.meta


def test_jobs_whose_process_is_gone_end(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start()
    add_job(e, "job-live", pid, start)
    add_job(e, "job-gone", pid, start + 100)  # same pid, another start time: a reused pid
    e.recover(Moves())
    live, gone = e.catalog.get_job("job-live"), e.catalog.get_job("job-gone")
    assert live is not None and not live.ended
    assert gone is not None and gone.ended
