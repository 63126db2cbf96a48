"""The move commit and the in-doubt protocol, both sides, with a FakeCriu and a scripted peer: no root."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from fakes import FakePeer, Procs, add_ckpt, add_job, make_engine, procs_fixture, state_of  # noqa: F401

from memsnap.catalog import STAGED
from memsnap.config import Config, DaemonConfig
from memsnap.errors import FailedPrecondition
from memsnap.move.plan import Commitments, Move
from memsnap.move.target import MoveTarget

UNAVAILABLE, REFUSED = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION


def _cfg(in_doubt_s: float = 0.0) -> Config:
    return Config(daemon=DaemonConfig(move_in_doubt_s=in_doubt_s))


# -- target -----------------------------------------------------------------------------------------
def test_commit_keeps_the_pending_move_and_answers_a_retry(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start()
    add_job(e, "job-t", pid, start, restored_from="ck-a")
    add_ckpt(e, "ck-a", STAGED, 1, meta={"move_pending": "job-t"})
    t = MoveTarget(e)
    assert t.commit("ck-a").job.id == "job-t"
    rec = e.catalog.get_checkpoint("ck-a")
    assert rec is not None and "move_pending" not in rec.meta
    assert t.commit("ck-a").job.id == "job-t"  # the first reply got lost: asked again


def test_commit_after_a_restart_finds_the_job_it_kept(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start()
    add_job(e, "job-t", pid, start, restored_from="ck-a")
    add_ckpt(e, "ck-a", STAGED, 1)  # committed before the restart: nothing pending any more
    assert MoveTarget(e).commit("ck-a").job.id == "job-t"


def test_commit_is_refused_when_no_moved_job_runs(tmp_path: Path) -> None:
    e = make_engine(tmp_path)
    add_ckpt(e, "ck-a", STAGED, 1, meta={"move_pending": "job-gone"})
    with pytest.raises(FailedPrecondition):
        MoveTarget(e).commit("ck-a")


def test_an_uncommitted_move_expires_and_its_job_dies(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start()
    add_job(e, "job-t", pid, start, restored_from="ck-a")
    add_ckpt(e, "ck-a", STAGED, 1, meta={"move_pending": "job-t"})
    MoveTarget(e)._expire("ck-a", "job-t")
    job, rec = e.catalog.get_job("job-t"), e.catalog.get_checkpoint("ck-a")
    assert job is not None and job.ended and state_of(pid) in ("", "Z")
    assert rec is not None and "move_pending" not in rec.meta


def test_a_committed_move_does_not_expire(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start()
    add_job(e, "job-t", pid, start, restored_from="ck-a")
    add_ckpt(e, "ck-a", STAGED, 1, meta={"move_pending": "job-t"})
    t = MoveTarget(e)
    t.commit("ck-a")
    t._expire("ck-a", "job-t")
    assert state_of(pid) not in ("", "Z")


# -- source -----------------------------------------------------------------------------------------
def test_the_commit_is_asked_again_through_a_lost_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "sleep", lambda s: None)
    e = make_engine(tmp_path)
    peer = FakePeer([UNAVAILABLE, UNAVAILABLE, UNAVAILABLE, None])
    kept, why, code = Commitments(e, _cfg()).ask(peer, "ck-a", "b:1", "job-a")  # type: ignore[arg-type]
    assert (kept, code, peer.asked) == (True, "OK", 4)


def test_a_refused_commit_is_not_kept(tmp_path: Path) -> None:
    e = make_engine(tmp_path)
    peer = FakePeer([REFUSED])
    kept, why, code = Commitments(e, _cfg()).ask(peer, "ck-a", "b:1", "job-a")  # type: ignore[arg-type]
    assert (kept, code, peer.asked) == (False, "FAILED_PRECONDITION", 1)


def test_an_unanswered_commit_is_in_doubt_until_move_in_doubt_s(tmp_path: Path) -> None:
    e = make_engine(tmp_path)
    commits = Commitments(e, _cfg(in_doubt_s=2.0))
    peer = FakePeer([UNAVAILABLE] * 1000)
    seen: list[list[str]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(commits.moves_in_doubt())
            time.sleep(0.05)

    w = threading.Thread(target=watch)
    w.start()
    try:
        kept, why, code = commits.ask(peer, "ck-a", "b:1", "job-a")  # type: ignore[arg-type]
    finally:
        done.set()
        w.join()
    assert (kept, code) == (False, "UNAVAILABLE") and "runs on both nodes" in why
    assert ["job-a -> b:1"] in seen and commits.moves_in_doubt() == []


def test_a_refused_commit_rolls_the_move_back_here(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start(stopped=True)
    add_ckpt(e, "ck-a", STAGED, pid, meta={"hold": True, "pid_start": start})
    journaled = []
    real = e.catalog.merge_meta

    def merge(ckpt_id: str, changes: dict[str, object]) -> bool:
        journaled.append(dict(changes))
        return real(ckpt_id, changes)

    e.catalog.merge_meta = merge  # type: ignore[method-assign]
    with pytest.raises(Exception, match="failed at commit"):
        Commitments(e, _cfg()).commit_on(FakePeer([REFUSED]), Move(pid=pid, job_id="", ckpt_id="ck-a"),  # type: ignore[arg-type]
                                         "ck-a", "b:1")
    assert state_of(pid) in ("S", "R")
    assert journaled[0].get("committing_to") == "b:1"  # journaled before asking
    # The move did not happen: the job runs on, and its image (nobody asked for a checkpoint) is gone.
    assert e.catalog.get_checkpoint("ck-a") is None


def _settle(e: object, peer: FakePeer) -> None:
    commits = Commitments(e, _cfg())  # type: ignore[arg-type]
    commits.settle(["ck-a"], lambda to: peer)
    for t in threading.enumerate():
        if t.name == "settle-ck-a":
            t.join(10)


def test_after_a_crash_a_commit_the_target_kept_ends_the_copy_here(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start(stopped=True)
    add_job(e, "job-a", pid, start)
    add_ckpt(e, "ck-a", STAGED, pid, job="job-a", meta={"hold": True, "pid_start": start, "committing_to": "b:1"})
    _settle(e, FakePeer([None]))
    rec = e.catalog.get_checkpoint("ck-a")
    assert state_of(pid) in ("", "Z") and rec is not None and rec.meta["moved_to"] == "b:1"
    assert "committing_to" not in rec.meta


def test_after_a_crash_a_commit_the_target_refused_runs_on_here(tmp_path: Path, procs: Procs) -> None:
    e = make_engine(tmp_path)
    pid, start = procs.start(stopped=True)
    add_ckpt(e, "ck-a", STAGED, pid, meta={"hold": True, "pid_start": start, "committing_to": "b:1"})
    _settle(e, FakePeer([REFUSED]))
    rec = e.catalog.get_checkpoint("ck-a")
    assert state_of(pid) in ("S", "R") and rec is not None and "committing_to" not in rec.meta
