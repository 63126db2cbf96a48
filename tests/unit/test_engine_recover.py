"""Engine.recover, branch by branch, with a FakeCriu and real (unprivileged) processes: no root, no CRIU."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes import NO_PID, Procs, add_ckpt, add_job, make_engine, procs_fixture, put_in_tier, state_of  # noqa: F401

from memsnap import jobs
from memsnap.catalog import DRAINING, DUMPING, DURABLE, FAILED, STAGED, CheckpointRecord
from memsnap.engine import Engine
from memsnap.tiers import SPILL


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
    add_ckpt(e, "ck-a", STAGED, NO_PID, meta={"move_pending": "job-x"})
    moves = Moves()
    e.recover(moves)
    assert moves.calls == [("abandon", "ck-a")]


def test_interrupted_lazy_target_goes_to_the_mover(tmp_path: Path) -> None:
    e = make_engine(tmp_path)
    add_ckpt(e, "ck-a", STAGED, NO_PID, meta={"pages_remote": True, "move_pending": "job-x"})
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
    add_ckpt(e, "ck-lost", STAGED, NO_PID, in_tier=True)  # a reboot emptied the tier
    add_ckpt(e, "ck-stored", DURABLE, NO_PID, in_tier=True, in_store=True)
    fixed = e.recover(Moves())
    assert fixed == {"failed_dumps": 0, "stray_staging": 1, "stray_tier": 1, "lost_tier": 2}
    assert not e.tier.has("ck-stray")
    lost, stored = e.catalog.get_checkpoint("ck-lost"), e.catalog.get_checkpoint("ck-stored")
    assert lost is not None and lost.state == FAILED and not lost.in_tier
    assert stored is not None and stored.state == DURABLE and not stored.in_tier


def test_cuda_state_a_killed_daemon_left_is_given_back(tmp_path: Path) -> None:
    gpu = Gpu()
    e = make_engine(tmp_path, gpu=gpu)
    add_ckpt(e, "ck-a", FAILED, NO_PID, meta={"gpu": {"pids": [NO_PID]}})
    e.recover(Moves())
    rec = e.catalog.get_checkpoint("ck-a")
    assert gpu.recovered == [{"pids": [NO_PID]}] and rec is not None and "gpu" not in rec.meta


def test_jobs_whose_process_is_gone_end(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start()
    add_job(e, "job-live", pid, start)
    add_job(e, "job-gone", pid, start + 100)  # same pid, another start time: a reused pid
    e.recover(Moves())
    live, gone = e.catalog.get_job("job-live"), e.catalog.get_job("job-gone")
    assert live is not None and not live.ended
    assert gone is not None and gone.ended


# -- decisions the mutation run found unchecked (docs/mutation.md) ------------------------------------
@pytest.fixture(name="orphans")
def orphans_fixture() -> Iterator[list[int]]:
    """Pids of `sleep`s that are not descendants of this test (killed after it)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _orphan(orphans: list[int], stopped: bool = False) -> tuple[int, float]:
    """(pid, start) of a `sleep` whose parent shell has exited: a signal sent to this test's own process
    tree does not reach it, as a job's tree is not the daemon's."""
    out = subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True,
                         check=True)
    pid = int(out.stdout)
    orphans.append(pid)
    if stopped:
        os.kill(pid, signal.SIGSTOP)
    return pid, jobs.start_time(pid)


def _hold(e: Engine, state: str, pid: int, meta: dict[str, Any], ckpt_id: str = "ck-a") -> None:
    add_ckpt(e, ckpt_id, state, pid, job="job-a", in_tier=state != DUMPING, meta=meta)
    if meta.get("stop") and state != DUMPING:
        put_in_tier(e, ckpt_id, 10)


# (state, meta, what recover does to the live process: "resumed" or "killed")
BRANCHES = {
    "interrupted --stop dump": (DUMPING, {"stop": True}, "resumed"),
    "interrupted lazy dump the target confirmed": (DUMPING, {"hold": True, "moved_to": "b:1"}, "killed"),
    "held copy the target kept": (STAGED, {"hold": True, "moved_to": "b:1"}, "killed"),
    "held copy without a commit": (STAGED, {"hold": True}, "resumed"),
    "published --stop checkpoint": (STAGED, {"stop": True}, "killed"),
}


@pytest.mark.parametrize("branch", list(BRANCHES))
def test_a_reused_pid_is_neither_resumed_nor_killed(branch: str, tmp_path: Path, procs: Procs) -> None:
    state, meta, _ = BRANCHES[branch]
    e = make_engine(tmp_path)
    pid, start = procs.start(stopped=True)
    add_job(e, "job-a", pid, start + 100)
    _hold(e, state, pid, {**meta, "pid_start": start + 100})  # the pid now belongs to another process
    e.recover(Moves())
    assert state_of(pid) == "T"


@pytest.mark.parametrize("branch", list(BRANCHES))
def test_a_row_without_pid_start_acts_on_its_pid(branch: str, tmp_path: Path, orphans: list[int]) -> None:
    # (rows written before pid_start was journaled: the pid alone decides)
    state, meta, done = BRANCHES[branch]
    e = make_engine(tmp_path)
    pid, start = _orphan(orphans, stopped=True)
    add_job(e, "job-a", pid, start)
    _hold(e, state, pid, dict(meta))
    e.recover(Moves())
    wait_gone_or_running = {"resumed": ("S", "R"), "killed": ("", "Z")}[done]
    assert state_of(pid) in wait_gone_or_running


@pytest.mark.parametrize("branch", list(BRANCHES))
def test_each_branch_acts_on_the_jobs_own_tree_and_releases_the_hold(branch: str, tmp_path: Path,
                                                                     orphans: list[int]) -> None:
    state, meta, done = BRANCHES[branch]
    e = make_engine(tmp_path)
    pid, start = _orphan(orphans, stopped=True)
    add_job(e, "job-a", pid, start)
    _hold(e, state, pid, {**meta, "pid_start": start})
    e.recover(Moves())
    assert state_of(pid) in {"resumed": ("S", "R"), "killed": ("", "Z")}[done]
    rec = e.catalog.get_checkpoint("ck-a")
    if branch == "held copy without a commit":  # (a move that did not happen leaves no image: as its rollback)
        assert rec is None and not e.tier.has("ck-a")
    else:
        assert rec is not None and not rec.meta.get("hold")
    job = e.catalog.get_job("job-a")
    assert job is not None and job.ended == (done == "killed")


def test_a_plain_checkpoint_of_a_running_job_is_left_running(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start()
    add_job(e, "job-a", pid, start)
    add_ckpt(e, "ck-a", STAGED, pid, job="job-a", in_tier=True, meta={"pid_start": start})
    put_in_tier(e, "ck-a", 10)
    e.recover(Moves())
    job = e.catalog.get_job("job-a")
    assert state_of(pid) in ("S", "R") and job is not None and not job.ended


def test_a_stop_checkpoint_whose_tier_copy_is_gone_leaves_its_job_running(tmp_path: Path, procs: Procs) -> None:
    # --stop ends the job only once its image is safe: without the tier copy, killing it would lose it.
    e = make_engine(tmp_path)
    pid, start = procs.start()
    add_job(e, "job-a", pid, start)
    add_ckpt(e, "ck-a", STAGED, pid, job="job-a", in_tier=False, meta={"stop": True, "pid_start": start})
    e.recover(Moves())
    assert state_of(pid) in ("S", "R")


def test_every_row_is_reconciled_after_ones_handed_to_the_mover(tmp_path: Path, orphans: list[int]) -> None:
    e = make_engine(tmp_path)
    held, held_start = _orphan(orphans, stopped=True)
    done, done_start = _orphan(orphans)
    add_ckpt(e, "ck-1", STAGED, NO_PID, meta={"pages_remote": True})
    add_ckpt(e, "ck-2", STAGED, NO_PID, meta={"move_pending": "job-x"})
    add_ckpt(e, "ck-3", STAGED, held, meta={"hold": True, "pid_start": held_start})
    add_ckpt(e, "ck-4", STAGED, done, in_tier=True, meta={"stop": True, "pid_start": done_start})
    put_in_tier(e, "ck-4", 10)
    moves = Moves()
    e.recover(moves)
    assert moves.calls == [("lazy_target", "ck-1"), ("abandon", "ck-2")]
    assert state_of(held) in ("S", "R") and state_of(done) in ("", "Z")


def test_the_counts_add_up(tmp_path: Path) -> None:
    e = make_engine(tmp_path)
    for ckpt_id in ("ck-1", "ck-2"):
        add_ckpt(e, ckpt_id, DUMPING, NO_PID, meta={"pid_start": 1.0})
    for ckpt_id in ("ck-x", "ck-y"):
        e.tier.new_staging(ckpt_id)
    fixed = e.recover(Moves())
    assert fixed["failed_dumps"] == 2 and fixed["stray_staging"] == 2


def test_a_copy_on_the_guards_spill_tier_is_not_lost(tmp_path: Path) -> None:
    e = make_engine(tmp_path, spill=True)
    add_ckpt(e, "ck-a", STAGED, NO_PID, in_tier=True, meta={"spill": True})
    put_in_tier(e, "ck-a", 4096, into=SPILL)
    fixed = e.recover(Moves())
    rec = e.catalog.get_checkpoint("ck-a")
    assert rec is not None and rec.in_tier and rec.state == STAGED and fixed["lost_tier"] == 0
    assert e.pending_drains() == ["ck-a"]  # (one drain for both tiers)


def test_recovery_cleans_the_spill_tier_too(tmp_path: Path) -> None:
    """A half-written park image and a copy no record names, in the spill tier: both go, like the memory tier's."""
    e = make_engine(tmp_path, spill=True)
    e.tier.new_staging("ck-half", into=SPILL)
    put_in_tier(e, "ck-stray", 4096, into=SPILL)
    fixed = e.recover(Moves())
    assert fixed["stray_staging"] == 1 and fixed["stray_tier"] == 1
    assert e.tier.spill is not None and list(e.tier.spill.staging_ids()) == [] and not e.tier.has("ck-stray")


def test_only_a_copy_not_yet_durable_fails_when_its_tier_copy_is_lost(tmp_path: Path) -> None:
    e = make_engine(tmp_path)
    add_ckpt(e, "ck-draining", DRAINING, NO_PID, in_tier=True)
    add_ckpt(e, "ck-failed", FAILED, NO_PID, in_tier=True, last_error="criu said no")
    e.recover(Moves())
    draining, failed = e.catalog.get_checkpoint("ck-draining"), e.catalog.get_checkpoint("ck-failed")
    assert draining is not None and draining.state == FAILED and "lost" in draining.last_error
    assert failed is not None and failed.last_error == "criu said no" and not failed.in_tier


def test_a_placeholder_journaled_by_an_unfinished_restore_is_removed_and_the_entry_cleared(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memsnap import containers, cri

    removed: list[tuple[str, str]] = []
    monkeypatch.setattr(containers, "remove", lambda runtime, handle: removed.append((runtime, handle)))
    monkeypatch.setattr(cri, "find_placeholder_pod", lambda name: {"pod-b": "sandbox-1"}.get(name, ""))
    e = make_engine(tmp_path)
    add_ckpt(e, "ck-a", DURABLE, NO_PID, in_store=True, meta={"placeholder": {"runtime": "podman", "name": "web2"}})
    add_ckpt(e, "ck-b", DURABLE, NO_PID, in_store=True, meta={"placeholder": {"runtime": "cri", "name": "pod-b"}})
    add_ckpt(e, "ck-c", DURABLE, NO_PID, in_store=True,
             meta={"placeholder": {"runtime": "cri", "name": "pod-c", "handle": "sandbox-2"}})
    add_ckpt(e, "ck-d", DURABLE, NO_PID, in_store=True, meta={"placeholder": {"runtime": "cri", "name": "gone"}})
    fixed = e.recover(Moves())
    assert sorted(removed) == [("cri", "sandbox-1"), ("cri", "sandbox-2"), ("podman", "web2")]
    assert fixed["placeholders"] == 4
    for ck in ("ck-a", "ck-b", "ck-c", "ck-d"):
        rec = e.catalog.get_checkpoint(ck)
        assert rec is not None and "placeholder" not in rec.meta and rec.state == DURABLE
