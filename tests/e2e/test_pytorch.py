"""A real workload: PyTorch CPU training checkpointed mid-run reaches the bit-identical final loss."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


AMX = REPO / "tests" / "workloads" / "amx.py"
XTILEDATA = 1 << 18


def _amx_steps(text: str) -> list[tuple[int, int, str]]:
    return [(int(m.group(1)), int(m.group(2), 16), m.group(3))
            for m in re.finditer(r"^step (\d+) (0x[0-9a-f]+) (\S+)$", text, re.M)]


def test_pytorch_on_amx_tiles_runs_on_after_a_restore(daemon, jobs_to_kill):
    # oneDNN runs bf16 products on AMX tiles, once the process asked the kernel for them; that permission is the
    # process's, not in its image. Without scripts/criu-patches/0004 the restored job lost it and died of SIGILL
    # at its next product (or of SIGSEGV at its first instruction, when dumped with tile state).
    if "amx_tile" not in Path("/proc/cpuinfo").read_text():
        # (this project's test machine and CI have AMX; elsewhere there is nothing to lose)
        pytest.skip("needs a CPU with AMX (amx_tile in /proc/cpuinfo)")
    with daemon.client() as c:
        job = c.run([sys.executable, str(AMX), "--interval", "0.05"], name="amx")
    jobs_to_kill.append(int(job.pid))
    log = Path(job.log_path)
    wait_for(lambda: len(_amx_steps(log.read_text())) >= 3, 120, what="the products to start")
    before = _amx_steps(log.read_text())
    assert before[-1][1] & XTILEDATA, f"oneDNN did not ask for AMX here: {before[-1]}"
    ck = json.loads(daemon.ctl("--json", "checkpoint", job.id, "--stop", check=True).stdout)
    last = _amx_steps(log.read_text())[-1][0]  # (the stopped original's last, in its own log)
    r = json.loads(daemon.ctl("--json", "restore", ck["id"], check=True).stdout)
    jobs_to_kill.append(r["pid"])
    wait_for(lambda: len([s for s in _amx_steps(job_output(log)) if s[0] > last]) >= 5
             or "Illegal instruction" in job_output(log) or "Segmentation fault" in job_output(log),
             60, what="the restored job to go on")
    after = [s for s in _amx_steps(job_output(log)) if s[0] > last]
    assert len(after) >= 5, "the restored job died: " + job_output(log)[-500:]
    assert all(s[1] & XTILEDATA for s in after)
    assert {s[2] for s in before + after} == {before[0][2]}
