"""Fixtures for the Slurm tests: a one-node cluster that must be up (CI starts it with
scripts/slurm/setup-test-cluster.sh) and cleanup of what a test submitted."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from memsnap.client import ClientError
from tests.helpers import DaemonProc, kill_job

IDLE_WAIT_S = 120


@pytest.fixture
def slurm_idle() -> str:
    """The test node, once sinfo shows it idle (no other job on it). Fails, never skips."""
    missing = [c for c in ("sinfo", "sbatch", "scontrol", "scancel") if not shutil.which(c)]
    if missing:
        pytest.fail(f"Slurm is not installed ({', '.join(missing)} missing): run "
                    "scripts/slurm/setup-test-cluster.sh first (CI does)")
    deadline = time.monotonic() + IDLE_WAIT_S
    seen = ""
    while time.monotonic() < deadline:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=15)
        seen = (r.stdout or r.stderr).strip()
        lines = [ln.split() for ln in seen.splitlines() if ln.strip()]
        if r.returncode == 0 and lines and all(len(ln) == 2 and ln[1] == "idle" for ln in lines):
            return lines[0][0]
        time.sleep(0.5)
    pytest.fail(f"the Slurm test node is not idle after {IDLE_WAIT_S}s (sinfo: {seen or 'no answer'}); "
                "start it with scripts/slurm/setup-test-cluster.sh and cancel stray jobs (squeue)")


@pytest.fixture
def slurm_jobs(daemon: DaemonProc) -> Iterator[list[str]]:
    """Slurm job ids a test submitted: cancelled at teardown, and their memsnap workloads killed."""
    ids: list[str] = []
    yield ids
    for job_id in ids:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    try:
        with daemon.client() as c:
            for j in c.jobs():
                if j.running and any(j.name == f"slurm-{i}" for i in ids):
                    kill_job(int(j.pid))
    except ClientError:
        pass
