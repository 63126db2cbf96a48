"""A `criu restore` that stops making progress is killed with its tasks after a progress deadline
(MEMSNAP_CRIU_STALL_S), reported with what it waited for, and leaves the node healthy: no criu left, no
job, drains not held back."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import psutil

from tests.helpers import REPO, DaemonProc, wait_for

LOCKHOLDER = REPO / "tests" / "workloads" / "lockholder.py"


def criu_of(d: DaemonProc) -> list[int]:
    """criu processes the daemon started (its descendants): other daemons' CRIU on this box is not ours."""
    assert d.proc is not None
    try:
        return [p.pid for p in psutil.Process(d.proc.pid).children(recursive=True) if p.name() == "criu"]
    except psutil.Error:
        return []


def lock_holder(d: DaemonProc, jobs_to_kill: list[int], where: Path) -> tuple[str, str]:
    """A job holding a POSIX lock on a file for good, checkpointed while it runs on: (job id, checkpoint id)."""
    with d.client() as c:
        job = c.run([sys.executable, str(LOCKHOLDER), "--file", str(where / "locked")], name="locker")
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: "tick 2" in Path(job.log_path).read_text(), 30, what="the job to take its lock")
    ck = json.loads(d.ctl("--json", "checkpoint", job.id, check=True).stdout)
    return job.id, ck["id"]


def test_a_restore_blocked_on_a_file_lock_is_killed_after_the_deadline_and_says_who_holds_it(
        make_daemon, jobs_to_kill, tmp_path):
    d = make_daemon("deadline", env={"MEMSNAP_CRIU_STALL_S": "3"}).start()
    job_id, ck = lock_holder(d, jobs_to_kill, tmp_path)
    t0 = time.monotonic()
    r = d.ctl("--json", "restore", ck, timeout=120)
    took = time.monotonic() - t0
    if r.returncode == 0:
        jobs_to_kill.append(json.loads(r.stdout)["pid"])
    assert r.returncode != 0 and "FAILED_PRECONDITION" in r.stderr, r.stdout + r.stderr
    assert took < 30, f"the stalled restore took {took:.0f} s to fail"
    assert "made no progress" in r.stderr and "restore.log" in r.stderr, r.stderr
    assert "FLOCK write lock on " + str(tmp_path / "locked") in r.stderr, r.stderr
    # The node is healthy: no criu of ours, no second copy, drains not held back.
    wait_for(lambda: not criu_of(d), 10, what="criu to be gone")
    with d.client() as c:
        assert [j.id for j in c.jobs() if j.running] == [job_id]
    assert not json.loads(d.ctl("--json", "status", check=True).stdout).get("drains_paused")
