"""Quiesce hooks with a real job: two torch.distributed (gloo) ranks in one memsnapctl run job, made
checkpointable with one call (memsnap.quiesce.torchdist). A leave-running checkpoint and a --stop checkpoint
restored: after each, the ranks re-create their process group and the next all_reduce gives the right sum."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tests.helpers import REPO, job_output, wait_for

GLOO = REPO / "tests" / "workloads" / "gloo_pair.py"
LINE = re.compile(r"^step (\d+) rank (\d) sum (\d+) (ok|BAD) gen (\d+) pid (\d+)$", re.M)


def _steps(text: str, pid: int | None = None, gen: int | None = None) -> list[tuple[int, int, str]]:
    """(step, rank, ok|BAD) of the lines of pid's copy (and generation)."""
    return [(int(m[1]), int(m[2]), m[4]) for m in LINE.finditer(text)
            if (pid is None or int(m[6]) == pid) and (gen is None or int(m[5]) == gen)]


def _both_ranks(text: str, n: int, pid: int | None = None, gen: int | None = None) -> bool:
    got = _steps(text, pid, gen)
    return all(sum(1 for _, r, _ in got if r == rank) >= n for rank in (0, 1))


def test_two_gloo_ranks_quiesce_and_all_reduce_the_right_sum_after_checkpoint_and_restore(daemon, jobs_to_kill):
    job = json.loads(daemon.ctl("--json", "run", "--name", "gloo-pair", "--", sys.executable, str(GLOO),
                                "--interval", "0.05", check=True).stdout)
    pid = int(job["pid"])
    jobs_to_kill.append(pid)
    log = Path(job["log"])
    wait_for(lambda: _both_ranks(log.read_text(), 5), 120, what="both ranks to all_reduce 5 times")

    # 1. leave-running: the ranks quiesce at one step, the dump runs, they re-create the group and go on
    ck = json.loads(daemon.ctl("--json", "checkpoint", job["job"], check=True).stdout)
    wait_for(lambda: _both_ranks(log.read_text(), 3, pid, gen=1), 60, what="both ranks to go on in generation 1")
    text = log.read_text()
    assert "quiesced rank 0 gen 1" in text and "quiesced rank 1 gen 1" in text
    shown = json.loads(daemon.ctl("--json", "show", ck["id"], check=True).stdout)
    names = [p["name"] for p in shown["phases"]]
    assert names[:1] == ["quiesce"] and {"dump", "publish", "quiesce_resume"} <= set(names), shown

    # 2. --stop, then restore: the restored ranks get "resume" (restored) and rebuild the group again
    ck2 = json.loads(daemon.ctl("--json", "checkpoint", job["job"], "--stop", check=True).stdout)
    new_pid = int(json.loads(daemon.ctl("--json", "restore", ck2["id"], check=True).stdout)["pid"])
    jobs_to_kill.append(new_pid)
    wait_for(lambda: _both_ranks(job_output(log), 3, new_pid, gen=2), 90,
             what="both restored ranks to all_reduce in generation 2")
    text = job_output(log)
    assert not [s for s in _steps(text) if s[2] != "ok"], "an all_reduce gave the wrong sum"
    stopped_at = max(s for s, _, _ in _steps(text, pid))
    first_after = min(s for s, _, _ in _steps(text, new_pid))
    assert first_after == stopped_at + 1, (stopped_at, first_after)
    shown = json.loads(daemon.ctl("--json", "show", ck2["id"], check=True).stdout)
    assert {"criu_restore", "quiesce_resume"} <= {p["name"] for p in shown["restore_phases"]}, shown
