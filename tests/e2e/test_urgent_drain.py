"""Urgent drains never wait behind foreground work: `checkpoint --wait durable` finishes fast while a stuck
foreground hold (a restore blocked on a file lock) pauses every other drain, even when the only drain worker
holds a drain paused behind it."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.e2e.test_criu_deadline import criu_of, lock_holder
from tests.helpers import REPO, counter_argv, ticks, wait_for


def test_checkpoint_wait_durable_finishes_fast_while_a_stuck_foreground_hold_pauses_the_other_drains(
        make_daemon, jobs_to_kill, tmp_path):
    # One drain worker, 4 MiB/s: the big job's drain is still running when the restore below blocks.
    d = make_daemon("urgent", extra=["--drain-concurrency", "1", "--drain-bandwidth", "4M"],
                    env={"MEMSNAP_CRIU_STALL_S": "300"}).start()
    locker, locked_ck = lock_holder(d, jobs_to_kill, tmp_path)
    with d.client() as c:
        big = c.run(counter_argv(64, 0.2))
        small = c.run(counter_argv(2, 0.2))
    jobs_to_kill += [int(big.pid), int(small.pid)]
    wait_for(lambda: ticks(big.log_path) and ticks(small.log_path), 60, what="the jobs to tick")
    big_ck = json.loads(d.ctl("--json", "checkpoint", big.id, check=True).stdout)["id"]
    wait_for(lambda: json.loads(d.ctl("--json", "show", big_ck, check=True).stdout)["state"] == "draining", 30,
             what="the big drain to start")

    # The stuck foreground hold: a restore of the lock holder's checkpoint waits for the lock it still holds.
    env = {"PYTHONPATH": str(REPO), "MEMSNAP_SOCKET": d.socket}
    stuck = subprocess.Popen([sys.executable, "-m", "memsnap.cli", "--json", "restore", locked_ck], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: json.loads(d.ctl("--json", "status", check=True).stdout).get("drains_paused"), 30,
                 what="the big drain to pause behind the stuck restore")
        t0 = time.monotonic()
        ck = json.loads(d.ctl("--json", "checkpoint", small.id, "--wait", "durable", check=True,
                              timeout=200).stdout)
        took = time.monotonic() - t0
        assert ck["state"] == "durable"
        assert took < 20, f"checkpoint --wait durable took {took:.1f} s behind a stuck foreground hold"
        status = json.loads(d.ctl("--json", "status", check=True).stdout)
        assert status.get("drains_paused") and "restore" in status.get("drains_paused_reason", ""), status
    finally:
        with d.client() as c:  # the lock goes with its holder: the restore gets it and ends
            c.stop_job(locker, kill=True)
        out, _ = stuck.communicate(timeout=120)
        if stuck.returncode == 0:
            jobs_to_kill.append(json.loads(out)["pid"])
    wait_for(lambda: not criu_of(d), 10, what="criu to be gone")
