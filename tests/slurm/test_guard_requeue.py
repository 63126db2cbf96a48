"""The memory guard under Slurm: a workload of `memsnapctl slurm run --memory-limit` that reaches its limit is
parked by memsnapd (checkpointed and stopped, never OOM killed), the launcher requeues the Slurm job, and the
requeued run resumes the parked checkpoint through the guard, with that run's --memory-limit, at the next tick
with the same memory. Real Slurm 22.05, real memsnapd, real CRIU, real v1 memory cgroups.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from tests.helpers import DaemonProc, counter_argv, guard_table, start_digest, wait_for
from tests.slurm.slurmtools import job, output_ticks, release_requeued, sbatch, wait_job

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(not Path("/sys/fs/cgroup/memory/memory.oom_control").exists(),
                                 reason="needs the cgroup v1 memory controller (this test node has it)")]


def _guard_jobs(d: DaemonProc) -> dict:
    return guard_table(d.state)


def _named(d: DaemonProc, name: str) -> set[str]:
    """The ids of the daemon's jobs called name (the daemon is shared: other tests' jobs are in its lists)."""
    return {r["id"] for r in json.loads(d.ctl("--json", "jobs", check=True).stdout) if r["name"] == name}


def _script(limit_file: Path, argv: list[str]) -> str:
    """A batch script whose --memory-limit is read at each run (a user raising it for the requeued run)."""
    launcher = [sys.executable, "-m", "memsnap.cli", "slurm", "run"]
    return ("#!/bin/bash\nexec " + " ".join(shlex.quote(a) for a in launcher)
            + f' --memory-limit "$(cat {shlex.quote(str(limit_file))})" -- '
            + " ".join(shlex.quote(a) for a in argv) + "\n")


def test_workload_parked_at_its_memory_limit_is_requeued_and_resumed_at_the_next_tick(
        daemon: DaemonProc, slurm_idle: str, slurm_jobs: list[str], tmp_path: Path) -> None:
    limit = tmp_path / "limit"
    limit.write_text("128M")
    argv = counter_argv(16, 0.2, "--grow-mib", "32", "--grow-max-mib", "192")
    job_id, out = sbatch(_script(limit, argv), tmp_path, daemon.socket, "-p", "low", name="guarded")
    slurm_jobs.append(job_id)
    key = f"slurm-{job_id}"

    # The first run grows past 128M: memsnapd parks the workload; the launcher sees it and requeues the job.
    wait_job(job_id, lambda j: j.get("JobState") == "PENDING" and j.get("Restarts") == "1", 120,
             "be requeued by the launcher after the park")
    text = out.read_text()
    assert f"the memory guard parked {key}" in text and f"requeued Slurm job {job_id}" in text, text[-2000:]
    ours = _named(daemon, key)
    parked = [g for g in _guard_jobs(daemon).values() if g["state"] == "parked" and g["job_id"] in ours]
    assert len(parked) == 1 and "memory limit" in parked[0]["reason"], parked
    assert parked[0]["stats"]["oom_kills"] == 0
    first = output_ticks(out)
    first_pid = first[0].hostpid
    digest0 = start_digest(out)

    # The requeued run (the user gave it more memory) resumes the parked checkpoint through the guard.
    limit.write_text("512M")
    release_requeued(job_id, restarts=1)
    wait_for(lambda: len([t for t in output_ticks(out) if t.hostpid != first_pid]) >= 5, 90, 0.2,
             "the resumed workload to tick")
    text = out.read_text()
    assert f"restored {key} from checkpoint {parked[0]['checkpoint']}" in text, text[-2000:]
    ts = output_ticks(out)
    before = [t for t in ts if t.hostpid == first_pid]
    after = [t for t in ts if t.hostpid != first_pid]
    assert [t.n for t in before] == list(range(1, len(before) + 1)), text[-3000:]
    assert [t.n for t in after] == list(range(before[-1].n + 1, before[-1].n + 1 + len(after))), text[-3000:]
    assert all(t.digest == digest0 for t in ts), "memory changed across the park and the resume"
    assert job(job_id).get("Restarts") == "1"

    g = _guard_jobs(daemon)
    old = g[parked[0]["job_id"]]
    assert old["state"] == "resumed"
    new = g[old["resumed_as"]]
    assert new["state"] == "running" and new["limit"] == 512 << 20 and new["cgroup"] == old["cgroup"]
    assert int(Path(new["cgroup"], "memory.limit_in_bytes").read_text()) == 512 << 20
