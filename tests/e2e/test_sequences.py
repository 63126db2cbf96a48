"""Chains of operations on one job: the Nth restore, the checkpoint of a restored copy, names that carry
through generations. Each step checks the program's own state (the next tick, the same memory digest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

from tests.helpers import DaemonProc, counter_argv, start_digest, ticks, wait_for


def _stop_and_restore(d: DaemonProc, key: str, log: str, pid: int, jobs_to_kill: list[int]) -> dict:
    """checkpoint KEY --stop, then restore it; the restored job's JSON (it must resume at the next tick)."""
    ck = json.loads(d.ctl("--json", "checkpoint", key, "--stop", check=True).stdout)
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), 10, what=f"pid {pid} to end after --stop")
    last = ticks(log, pid)[-1].n
    r = d.ctl("--json", "restore", ck["id"])
    assert r.returncode == 0, f"restore of {ck['id']} failed: {r.stderr}"
    out = json.loads(r.stdout)
    jobs_to_kill.append(int(out["pid"]))
    wait_for(lambda: len(ticks(log, int(out["pid"]))) >= 2, 20, what="the restored copy to tick")
    assert ticks(log, int(out["pid"]))[0].n == last + 1
    return out


def test_a_job_survives_eight_stop_and_restore_generations_with_bounded_log_names(daemon, jobs_to_kill):
    with daemon.client() as c:
        job = c.run(counter_argv(8, 0.1), name="generations")
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: len(ticks(job.log_path)) >= 2, 30, what="the job to tick")
    digest = start_digest(job.log_path)
    key, pid = job.id, int(job.pid)
    names = []
    for _ in range(8):
        out = _stop_and_restore(daemon, key, job.log_path, pid, jobs_to_kill)
        key, pid = out["job"], int(out["pid"])
        got = json.loads(daemon.ctl("--json", "jobs", check=True).stdout)
        mine = next(j for j in got if j["id"] == key)
        names.append(mine["name"])
        log_name = os.path.basename(mine["log_path"])
        assert len(log_name) < 100, f"generation {len(names)}: log name grows ({len(log_name)}): {log_name}"
    assert set(names) == {"generations"}, names
    assert all(t.digest == digest for t in ticks(job.log_path, pid))


def test_a_restored_job_is_named_after_its_job_not_the_checkpoint_and_an_adopted_pid_after_its_command(
        daemon, jobs_to_kill):
    with daemon.client() as c:
        job = c.run(counter_argv(8, 0.1), name="train")
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: len(ticks(job.log_path)) >= 2, 30, what="the job to tick")
    daemon.ctl("checkpoint", job.id, "--stop", "--name", "mid2", check=True)
    out = json.loads(daemon.ctl("--json", "restore", "mid2", check=True).stdout)
    jobs_to_kill.append(int(out["pid"]))
    got = {j["id"]: j for j in json.loads(daemon.ctl("--json", "jobs", check=True).stdout)}
    assert got[out["job"]]["name"] == "train"

    # A process memsnap did not start (adopted by pid): its restored copy is named after its command.
    adopted = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", sys.executable, "-c",
                                "import time\nwhile True: time.sleep(0.1)"], start_new_session=True)
    jobs_to_kill.append(adopted.pid)
    root = int(wait_for(lambda: next(iter(psutil.Process(adopted.pid).children()), None), 10,
                        what="the adopted process").pid)  # type: ignore[attr-defined]
    ck = json.loads(daemon.ctl("--json", "checkpoint", str(root), "--stop", check=True).stdout)
    adopted.wait(10)
    out = json.loads(daemon.ctl("--json", "restore", ck["id"], check=True).stdout)
    jobs_to_kill.append(int(out["pid"]))
    got = {j["id"]: j for j in json.loads(daemon.ctl("--json", "jobs", check=True).stdout)}
    assert got[out["job"]]["name"] == os.path.basename(sys.executable), got[out["job"]]
