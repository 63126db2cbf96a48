"""A pid found with pgrep or ps inside a managed job names that job: checkpoint, stop, kill and migrate act on
the whole job and say so (a checkpoint of part of a PID namespace cannot work: CRIU needs the namespace's init).
Ownership stays as for the job itself: another uid naming such a pid learns nothing about the job."""

from __future__ import annotations

import json
import re

import psutil
import pytest

from tests.helpers import NOBODY, DaemonProc, start_counter, ticks, wait_for
from tests.helpers import counter_job as _counter
from tests.helpers import migrate as _migrate
from tests.helpers import ticking_with as _keeps_ticking_with


def _program(job_pid: int) -> int:
    """The job's own program: the one child of its init (what `pgrep -f counter.py` finds)."""
    kids = wait_for(lambda: psutil.Process(job_pid).children(), 10, what="the job's program")
    return int(kids[0].pid)  # type: ignore[index]


def _note(pid: int, job_id: str, name: str, done: str) -> str:
    return f"pid {pid} is in job {job_id} ({name}): {done} the whole job"


def test_checkpoint_of_a_pid_inside_a_job_checkpoints_the_whole_job(daemon: DaemonProc, jobs_to_kill):
    job = start_counter(daemon, jobs_to_kill, 8, "pgrep-ckpt")
    child = _program(job.pid)
    r = daemon.ctl("checkpoint", str(child))
    assert r.returncode == 0, r.stderr
    assert _note(child, job.id, "pgrep-ckpt", "checkpointed") in r.stderr
    ck = json.loads(daemon.ctl("--json", "checkpoint", str(child), check=True).stdout)
    assert ck["note"] == _note(child, job.id, "pgrep-ckpt", "checkpointed")
    assert ck["job"] == job.id and ck["pid"] == job.pid and ck["state"] in ("staged", "draining", "durable")
    assert len(ticks(job.log, job.pid)) >= 2 and psutil.pid_exists(child)  # it runs on


@pytest.mark.parametrize("verb", ["stop", "kill"])
def test_stop_and_kill_of_a_pid_inside_a_job_end_the_whole_job(daemon: DaemonProc, jobs_to_kill, verb):
    job = start_counter(daemon, jobs_to_kill, 4, f"pgrep-{verb}")
    child = _program(job.pid)
    r = daemon.ctl(verb, str(child))
    assert r.returncode == 0, r.stderr
    done = "stopped" if verb == "stop" else "killed"
    assert _note(child, job.id, f"pgrep-{verb}", done) in r.stderr
    assert f"{job.id} (pgrep-{verb}) {done}" in r.stdout
    wait_for(lambda: not psutil.pid_exists(job.pid) and not psutil.pid_exists(child), 10, what="the job to end")
    rows = {j["id"]: j for j in json.loads(daemon.ctl("--json", "jobs", check=True).stdout)}
    assert rows[job.id]["running"] is False


def test_another_user_naming_a_pid_inside_roots_job_learns_nothing_of_the_job(open_daemon: DaemonProc,
                                                                              jobs_to_kill):
    """As uid 65534 over the real socket: the answers are those for the job itself (checkpoint: PERMISSION_DENIED,
    stop/kill: NOT_FOUND, as for an invisible job), and none names the job or its root pid."""
    job = start_counter(open_daemon, jobs_to_kill, 4, "roots-secret")
    child = _program(job.pid)
    for args, code in ((("checkpoint", str(child)), "PERMISSION_DENIED"), (("stop", str(child)), "NOT_FOUND"),
                       (("kill", str(child)), "NOT_FOUND")):
        r = open_daemon.ctl("--json", *args, user=NOBODY)
        err = json.loads(r.stderr)["error"]
        assert err["code"] == code, (args, err)
        assert job.id not in err["message"] and "roots-secret" not in err["message"], err
        assert not re.search(rf"\b{job.pid}\b", err["message"]), err
    assert psutil.pid_exists(child) and len(ticks(job.log, job.pid)) >= 2


@pytest.mark.usefixtures("no_copy_outlives_the_test")
def test_migrate_of_a_pid_inside_a_job_moves_the_whole_job(pair, jobs_to_kill):
    a, b = pair.a, pair.b
    job = _counter(a, jobs_to_kill, 8, "pgrep-move")
    child = _program(job["pid"])
    r = _migrate(a, str(child), "--to", b.address)
    assert r.returncode == 0, r.stderr + a.log.read_text()[-2000:]
    out = json.loads(r.stdout)
    assert out["note"] == _note(child, job["id"], "pgrep-move", "moved")
    jobs_to_kill.append(out["target_pid"])
    last = ticks(job["log"], job["pid"])[-1]
    wait_for(lambda: ticks(job["log"], out["target_pid"]), 20, what="the moved job to tick")
    assert ticks(job["log"], out["target_pid"])[0].n == last.n + 1
    _keeps_ticking_with(job, out["target_pid"], job["digest"], fresh=3)
    assert not psutil.pid_exists(job["pid"])
