"""A real workload: PyTorch CPU training checkpointed mid-run reaches the bit-identical final loss."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, job_output, wait_for

TRAIN = REPO / "tests" / "workloads" / "train.py"
STEPS = 300


def _final(text: str, hostpid: int | None = None) -> str | None:
    for line in text.splitlines():
        m = re.match(r"^final (\d+) (\S+)$", line.strip())
        if m and (hostpid is None or int(m.group(1)) == hostpid):
            return m.group(2)
    return None


def _steps(text: str) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"^step (\d+) ", text, re.M)]


def test_pytorch_training_restored_mid_run_reaches_identical_final_loss(daemon, jobs_to_kill):
    # Uninterrupted reference run, outside memsnap.
    ref = subprocess.run([sys.executable, str(TRAIN), "--steps", str(STEPS), "--sleep", "0"],
                         capture_output=True, text=True, timeout=300, check=True)
    want = _final(ref.stdout)
    assert want is not None

    with daemon.client() as c:
        job = c.run([sys.executable, str(TRAIN), "--steps", str(STEPS), "--sleep", "0.02"], name="torch")
    jobs_to_kill.append(int(job.pid))
    log = Path(job.log_path)
    wait_for(lambda: len(_steps(log.read_text())) >= 60, 120, what="training to reach step 60")
    ck = json.loads(daemon.ctl("--json", "checkpoint", job.id, "--stop", check=True).stdout)
    stopped_at = max(_steps(log.read_text()))
    assert stopped_at < STEPS, "training finished before the checkpoint; make it slower"

    pid = json.loads(daemon.ctl("--json", "restore", ck["id"], check=True).stdout)["pid"]
    jobs_to_kill.append(pid)
    got = wait_for(lambda: _final(job_output(log), pid), 180, what="the restored run to finish")
    assert got == want, f"restored run ended at loss {got}, uninterrupted run at {want}"
    resumed = [int(m.group(1)) for m in re.finditer(rf"^step (\d+) {pid} ", job_output(log), re.M)]
    assert resumed[0] == stopped_at + 1
