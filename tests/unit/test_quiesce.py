"""Quiesce hooks (memsnap.quiesce): memsnapd's side against real listener processes (tests/workloads/
quiesce_listener.py), the job's policy from its environment, and the engine's order around a dump (FakeCriu)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memsnap.engine import ROOT
from memsnap.errors import FailedPrecondition
from memsnap.quiesce import protocol
from memsnap.quiesce.notifier import Quiescer, QuiesceRefused
from memsnap.quiesce.protocol import Policy
from tests.unit.fakes import FakeCriu, make_engine
from tests.unit.quiesce_job import Job


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Any]:
    made: list[Job] = []

    def start(*args: str, where: Path | None = None, **env: str) -> Job:
        j = Job(where or tmp_path, *args, **env)
        made.append(j)
        return j

    yield start
    for j in made:
        j.kill()


def test_listeners_are_asked_then_told_to_resume(jobs: Any) -> None:
    job = jobs("--mode", "ack")
    q = Quiescer()
    done = q.quiesce(job.pid, "ck-1")
    assert done is not None and done.listeners == 1 and done.answers[0].ok
    assert job.lines() == ["ready", "quiesce"]
    answers = q.resume(job.pid, "ck-1", restored=False)
    assert [a.ok for a in answers] == [True]
    assert job.text().splitlines()[-1] == "resume ck-1 restored=False"


def test_every_listener_of_the_tree_is_asked_at_once(jobs: Any) -> None:
    job = jobs("--mode", "ack", "--delay", "0.4", "--children", "2")
    t0 = time.monotonic()
    done = Quiescer().quiesce(job.pid, "ck-2")
    took = time.monotonic() - t0
    assert done is not None and done.listeners == 3 and all(a.ok for a in done.answers)
    assert took < 1.0, f"three listeners taking 0.4 s each were asked one after another ({took:.2f} s)"


def test_a_refusal_refuses_the_checkpoint_with_the_jobs_reason_and_resumes_it(jobs: Any) -> None:
    job = jobs("--mode", "refuse")
    with pytest.raises(QuiesceRefused, match="NCCL communicator busy") as err:
        Quiescer().quiesce(job.pid, "ck-3")
    assert err.value.code == "FAILED_PRECONDITION" and isinstance(err.value, FailedPrecondition)
    assert "was not checkpointed" in str(err.value)


@pytest.mark.parametrize("on_timeout", ["refuse", "proceed"])
def test_no_answer_by_the_deadline_refuses_or_proceeds_as_the_job_asks(jobs: Any, on_timeout: str) -> None:
    job = jobs("--mode", "silent", MEMSNAP_QUIESCE_TIMEOUT_S="0.5", MEMSNAP_QUIESCE_ON_TIMEOUT=on_timeout)
    t0 = time.monotonic()
    if on_timeout == "refuse":
        with pytest.raises(QuiesceRefused, match=r"did not acknowledge the quiesce request within 0.5 s"):
            Quiescer().quiesce(job.pid, "ck-4")
    else:
        done = Quiescer().quiesce(job.pid, "ck-4")
        assert done is not None and done.answers[0].no_answer
    assert 0.45 < time.monotonic() - t0 < 5


def test_safe_point_round_trip(jobs: Any) -> None:
    job = jobs("--mode", "safepoint")
    q = Quiescer()
    t0 = time.monotonic()
    done = q.quiesce(job.pid, "ck-5")
    t1 = time.monotonic()
    q.resume(job.pid, "ck-5", restored=True)
    t2 = time.monotonic()
    assert done is not None and done.answers[0].ok
    assert job.text().splitlines()[1:] == ["quiesce (safe point)", "resume ck-5 restored=True"]
    print(f"quiesce round trip {1000 * (t1 - t0):.1f} ms, resume {1000 * (t2 - t1):.1f} ms")
    assert t1 - t0 < 2 and t2 - t1 < 2


def test_a_listener_outside_the_tree_is_not_asked(jobs: Any, tmp_path: Path) -> None:
    stranger = jobs("--mode", "ack", "--name", "stranger")
    qdir = str(stranger.dir)
    root = subprocess.Popen(["sleep", "60"], env={**os.environ, protocol.ENV_DIR: qdir})
    try:
        assert Quiescer().quiesce(root.pid, "ck-6") is None
    finally:
        root.kill()
        root.wait()
    assert stranger.lines() == ["ready"]


def test_a_symlinked_quiesce_dir_is_not_followed(jobs: Any, tmp_path: Path) -> None:
    job = jobs("--mode", "ack")
    link = tmp_path / "link"
    link.symlink_to(job.dir)
    root = subprocess.Popen(["sleep", "60"], env={**os.environ, protocol.ENV_DIR: str(link)})
    try:
        assert Quiescer().quiesce(root.pid, "ck-7") is None
    finally:
        root.kill()
        root.wait()


def test_a_job_without_listeners_costs_nothing() -> None:
    root = subprocess.Popen(["sleep", "60"], env={k: v for k, v in os.environ.items() if k != protocol.ENV_DIR})
    try:
        q = Quiescer()
        assert q.quiesce(root.pid, "ck-8") is None and q.resume(root.pid, "ck-8", restored=False) == []
    finally:
        root.kill()
        root.wait()


def test_policy_from_the_jobs_environment() -> None:
    assert Policy.from_env({}) == (Policy(30.0, "refuse"), [])
    assert Policy.from_env({"MEMSNAP_QUIESCE_TIMEOUT_S": "5", "MEMSNAP_QUIESCE_ON_TIMEOUT": "Proceed"}) == \
        (Policy(5.0, "proceed"), [])
    p, problems = Policy.from_env({"MEMSNAP_QUIESCE_TIMEOUT_S": "1e9"})
    assert p.timeout_s == protocol.MAX_TIMEOUT_S and "above the limit" in problems[0]
    for bad in ("nan", "-1", "soon", "0"):
        p, problems = Policy.from_env({"MEMSNAP_QUIESCE_TIMEOUT_S": bad, "MEMSNAP_QUIESCE_ON_TIMEOUT": "maybe"})
        assert p == Policy() and len(problems) == 2


# -- the engine: quiesce before anything touches the job, resume after ------------------------------------
class OrderCheckingCriu(FakeCriu):
    """A FakeCriu that notes what the job's listener had answered when the dump ran."""

    def __init__(self, job: Job) -> None:
        super().__init__()
        self.job = job
        self.seen_at_dump: list[str] = []

    def dump(self, pid: int, images_dir: Path, work_dir: Path, opts: Any, notify: Any = None) -> Any:
        self.seen_at_dump = self.job.lines()
        return super().dump(pid, images_dir, work_dir, opts, notify)


def test_engine_quiesces_before_the_dump_and_resumes_after_a_leave_running_one(jobs: Any, tmp_path: Path) -> None:
    job = jobs("--mode", "ack")
    criu = OrderCheckingCriu(job)
    e = make_engine(tmp_path, criu=criu)
    rec = e.checkpoint(ROOT, str(job.pid))
    assert criu.seen_at_dump == ["ready", "quiesce"]
    assert job.text().splitlines()[-1] == f"resume {rec.id} restored=False"
    cur = e.catalog.get_checkpoint(rec.id)
    assert cur is not None and "quiesce" not in cur.meta
    assert set(cur.meta["phases"]) >= {"quiesce", "dump", "freeze", "publish", "quiesce_resume"}


def test_engine_refuses_a_checkpoint_the_job_refuses_and_never_dumps(jobs: Any, tmp_path: Path) -> None:
    job = jobs("--mode", "refuse")
    criu = FakeCriu()
    e = make_engine(tmp_path, criu=criu)
    with pytest.raises(FailedPrecondition, match="NCCL communicator busy"):
        e.checkpoint(ROOT, str(job.pid))
    assert criu.dumps == []
    [rec] = e.catalog.checkpoints()
    assert rec.state == "failed" and "quiesce" not in rec.meta


def test_engine_tells_the_job_after_a_failed_dump(jobs: Any, tmp_path: Path) -> None:
    job = jobs("--mode", "ack")
    criu = FakeCriu()
    criu.fail_dump = "Error (criu/cr-dump.c:1): boom"
    e = make_engine(tmp_path, criu=criu)
    with pytest.raises(FailedPrecondition, match="boom"):
        e.checkpoint(ROOT, str(job.pid))
    assert job.text().splitlines()[-1].startswith("resume ck-") and job.text().endswith("restored=False\n")


def test_a_restart_tells_a_job_left_quiesced(jobs: Any, tmp_path: Path) -> None:
    job = jobs("--mode", "ack")
    e = make_engine(tmp_path)
    done = e.quiesce.quiesce(job.pid, "ck-9")  # (as a checkpoint would, before the daemon died)
    assert done is not None
    from memsnap.catalog import STAGED, CheckpointRecord, now_ms
    from memsnap.proc import start_time

    e.catalog.add_checkpoint(CheckpointRecord(id="ck-9", state=STAGED, pid=job.pid, owner_uid=0, created_ms=now_ms(),
                                              meta={"quiesce": True, "pid_start": start_time(job.pid)}))
    e.recover()
    assert job.text().splitlines()[-1] == "resume ck-9 restored=False"
    rec = e.catalog.get_checkpoint("ck-9")
    assert rec is not None and "quiesce" not in rec.meta


@pytest.mark.parametrize("where", ["/tmp/../tmp/q", "relative/q", "/nonexistent/q"])
def test_odd_quiesce_dirs_ask_nobody_and_never_fail(where: str) -> None:
    root = subprocess.Popen(["sleep", "60"], env={**os.environ, protocol.ENV_DIR: where})
    try:
        assert Quiescer().quiesce(root.pid, "ck-10") is None
    finally:
        root.kill()
        root.wait()


def test_a_held_job_that_resumes_here_hears_resume_and_one_that_moved_does_not(jobs: Any, tmp_path: Path) -> None:
    from memsnap.engine import DumpExtras

    e = make_engine(tmp_path)
    for resumed in (True, False):
        job = jobs("--mode", "ack")
        rec = e.checkpoint(ROOT, str(job.pid), extras=DumpExtras(hold=True))  # (a move's dump)
        assert job.lines() == ["ready", "quiesce"]
        cur = e.catalog.get_checkpoint(rec.id)
        assert cur is not None and cur.meta["quiesce"] is True  # (journaled: a restart would tell it)
        if resumed:
            e.resume_held(job.pid, rec.id)  # the move failed or was refused
            assert job.text().splitlines()[-1] == f"resume {rec.id} restored=False"
        else:
            e.end_held(job.pid, "", rec.id)  # it runs on the target now (whose restore tells it)
        cur = e.catalog.get_checkpoint(rec.id)
        assert cur is not None and "quiesce" not in cur.meta
