"""Preemption checkpoints a job, requeue restores it: real Slurm 22.05, real memsnapd, real CRIU.

The cluster is the one-node cluster of scripts/slurm/setup-test-cluster.sh (partitions low and high,
PreemptMode=REQUEUE, GraceTime=10, KillWait=30). The batch scripts exec `memsnapctl slurm run` and
reach the session's memsnapd through MEMSNAP_SOCKET (sbatch --export). The test cluster has no
Prolog/Epilog configured (its hooks would not know the test daemon's socket), so the tests run
scripts/slurm/epilog.sh themselves, with the environment slurmd gives it, where an epilog would run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, DaemonProc, counter_argv, start_digest, wait_for
from tests.slurm.slurmtools import (
    base_state,
    hook_env,
    job,
    launcher_script,
    output_ticks,
    release_requeued,
    run,
    sbatch,
    wait_job,
)

pytestmark = pytest.mark.slurm

EPILOG = REPO / "scripts" / "slurm" / "epilog.sh"
PROLOG = REPO / "scripts" / "slurm" / "prolog.sh"
GHOST = Path(__file__).resolve().parent / "first_run_ghost.py"


def _mine(d: DaemonProc, key: str) -> list:
    with d.client() as c:
        return [k for k in c.list() if k.name == key]


def _running(d: DaemonProc, key: str) -> list:
    with d.client() as c:
        return [j for j in c.jobs() if j.name == key and j.running]


def _epilog(d: DaemonProc, tmp: Path, job_id: str) -> str:
    """Runs the epilog hook as slurmd would; returns its log lines for this job."""
    r = subprocess.run([str(EPILOG)], env=hook_env(d.socket, tmp, job_id), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"the epilog must never fail the node: {r.returncode} {r.stderr}"
    log = tmp / "hooks.log"
    return "\n".join(ln for ln in (log.read_text() if log.exists() else "").splitlines()
                     if f"job {job_id}:" in ln)


def _stored(d: DaemonProc) -> bool:
    with d.client() as c:
        return c.status().store not in ("", "none")


def _assert_resumed(out: Path, first_pid: int, digest0: str, ticks_before: int) -> None:
    ts = output_ticks(out)
    first = [t for t in ts if t.hostpid == first_pid]
    second = [t for t in ts if t.hostpid != first_pid]
    # The requeued run replays the job log into its (truncated) output file: the first run's ticks...
    assert [t.n for t in first] == list(range(1, len(first) + 1)), out.read_text()[-2000:]
    assert len(first) == ticks_before, "the first run's output was not relayed in full"
    # ...then the restored copy's, starting at the *next* tick, with the same memory.
    assert second, out.read_text()[-2000:]
    assert len({t.hostpid for t in second}) == 1
    assert [t.n for t in second] == list(range(first[-1].n + 1, first[-1].n + 1 + len(second))), \
        f"the requeued run did not resume where the first stopped:\n{out.read_text()[-3000:]}"
    assert all(t.digest == digest0 for t in ts), "memory changed across checkpoint/restore"


def test_requeue_checkpoints_and_the_requeued_run_resumes_at_the_next_tick(daemon, slurm_idle, slurm_jobs,
                                                                             tmp_path):
    stored = _stored(daemon)
    job_id, out = sbatch(launcher_script(counter_argv(32, 0.1), ["--interval", "2"]), tmp_path, daemon.socket,
                         "-p", "low", name="requeue")
    slurm_jobs.append(job_id)
    key = f"slurm-{job_id}"
    wait_for(lambda: len(output_ticks(out)) >= 30, 60, 0.2, "the first run's ticks in the Slurm output")
    first_pid = output_ticks(out)[0].hostpid
    digest0 = start_digest(out)
    assert any(k.state in (2, 3, 4) for k in _mine(daemon, key)), "no periodic checkpoint after 3 s"

    run("scontrol", "requeue", job_id)
    wait_job(job_id, lambda j: j.get("JobState") == "PENDING", 60, "be requeued")
    text = out.read_text()
    assert "is being requeued" in text and f"checkpointing {key}" in text, text[-2000:]
    assert ("is durable" if stored else "is staged") in text, text[-2000:]
    assert not _running(daemon, key), "the workload still runs after its checkpoint with stop"
    ticks_before = len(output_ticks(out))

    # The epilog of a requeued run keeps the checkpoints for the next run.
    before = {k.id for k in _mine(daemon, key)}
    log = _epilog(daemon, tmp_path, job_id)
    assert "requeue" in log, log
    assert {k.id for k in _mine(daemon, key)} == before

    if stored:
        # As if the job came back on another node: only the store has the image. The restore fetches it.
        newest = max(_mine(daemon, key), key=lambda k: k.created_unix_ms)
        assert newest.state == 4, newest  # the launcher waited until durable
        with daemon.client() as c:
            c.evict(newest.id)
    release_requeued(job_id, restarts=1)
    wait_for(lambda: len([t for t in output_ticks(out) if t.hostpid != first_pid]) >= 10, 60, 0.2,
             "the requeued run to tick")
    text = out.read_text()
    assert f"restored {key} from checkpoint" in text, text[-2000:]
    if stored:  # no tier copy: the requeued run resumes at once and pages the job in from the store
        assert "from the store, paging in lazily" in text, text[-2000:]
    _assert_resumed(out, first_pid, digest0, ticks_before)
    assert job(job_id).get("Restarts") == "1"

    # scancel is not a requeue: the launcher stops the workload instead of checkpointing it...
    [restored] = _running(daemon, key)
    run("scancel", job_id)
    wait_for(lambda: not Path(f"/proc/{restored.pid}").exists(), 30, 0.2, "the workload to be stopped")
    wait_job(job_id, lambda j: j.get("JobState", "CANCELLED") == "CANCELLED", 60, "end")
    assert "cancelled or over" in out.read_text()
    # ...and the epilog of a job that really ended deletes its checkpoints.
    log = _epilog(daemon, tmp_path, job_id)
    assert "final" in log and "deleted" in log, log
    assert _mine(daemon, key) == []


def test_preemption_by_a_high_partition_job_checkpoints_and_requeue_restores(daemon, slurm_idle,
                                                                            slurm_jobs, tmp_path):
    cpus = str(_node_cpus())
    job_id, out = sbatch(launcher_script(counter_argv(32, 0.1)), tmp_path, daemon.socket, "-p", "low",
                         "-c", cpus, name="victim")
    slurm_jobs.append(job_id)
    key = f"slurm-{job_id}"
    wait_for(lambda: len(output_ticks(out)) >= 10, 60, 0.2, "the low job to tick")
    first_pid = output_ticks(out)[0].hostpid
    digest0 = start_digest(out)

    # A high-priority job that needs the whole node: the low job is preempted (requeued) after
    # GraceTime; a batch-only job gets SIGTERM only then, and has KillWait to checkpoint and leave.
    high, _ = sbatch("#!/bin/bash\nsleep 1\n", tmp_path, daemon.socket, "-p", "high", "-c", cpus, name="high")
    slurm_jobs.append(high)
    wait_job(job_id, lambda j: j.get("JobState") == "PENDING" and j.get("Restarts") == "1", 150,
             "be preempted and requeued")
    text = out.read_text()
    assert "is being requeued" in text and f"checkpointing {key}" in text, text[-2000:]
    ticks_before = len(output_ticks(out))
    assert ticks_before >= 10 and not _running(daemon, key)

    release_requeued(job_id, restarts=1, timeout=90)
    wait_for(lambda: len([t for t in output_ticks(out) if t.hostpid != first_pid]) >= 5, 60, 0.2,
             "the requeued low job to tick")
    assert base_state(high) in ("COMPLETED", "")
    _assert_resumed(out, first_pid, digest0, ticks_before)


def test_requeue_before_any_checkpoint_exists_starts_from_scratch(daemon, slurm_idle, slurm_jobs, tmp_path):
    # The first run cannot be checkpointed (CRIU refuses its 4 MiB deleted file), so when it is
    # requeued there is no checkpoint at all: the next run must start afresh, with no error and no hang.
    argv = [sys.executable, str(GHOST), "--ticks", "25", "--interval", "0.1"]
    job_id, out = sbatch(launcher_script(argv), tmp_path, daemon.socket, "-p", "low", name="nockpt")
    slurm_jobs.append(job_id)
    key = f"slurm-{job_id}"
    wait_for(lambda: len(output_ticks(out)) >= 5, 60, 0.2, "the first run to tick")
    first_pid = output_ticks(out)[0].hostpid
    run("scontrol", "requeue", job_id)
    wait_job(job_id, lambda j: j.get("JobState") == "PENDING", 60, "be requeued")
    text = out.read_text()
    assert f"checkpoint of {key} failed" in text, text[-2000:]
    assert not _running(daemon, key), "a workload whose checkpoint failed must not outlive its launcher"
    assert all(k.state == 5 for k in _mine(daemon, key)), "only a FAILED checkpoint may exist"

    release_requeued(job_id, restarts=1)
    done = wait_job(job_id, lambda j: j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 60,
                    "finish its second run")
    text = out.read_text()
    assert done["JobState"] == "COMPLETED" and done["ExitCode"] == "0:0", text[-2000:]
    assert f"no checkpoint of {key} yet: starting from the beginning" in text, text
    ts = output_ticks(out)
    assert [t.n for t in ts] == list(range(1, 26)) and len({t.hostpid for t in ts}) == 1, text
    assert ts[0].hostpid != first_pid
    assert "restart=1" in text and "Traceback" not in text and "exited with status 0" in text


def test_requeue_right_at_start_never_errs_or_hangs(daemon, slurm_idle, slurm_jobs, tmp_path):
    # Requeued the moment it runs: the launcher may not even have started the workload. Whatever the
    # interleaving, the job must finish its work, once, in order.
    job_id, out = sbatch(launcher_script(counter_argv(8, 0.05, "--ticks", "20")), tmp_path, daemon.socket,
                         "-p", "low", name="early")
    slurm_jobs.append(job_id)
    wait_job(job_id, lambda j: j.get("JobState") == "RUNNING", 60, "start")
    run("scontrol", "requeue", job_id)
    release_requeued(job_id, restarts=1)
    done = wait_job(job_id, lambda j: j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 60,
                    "finish")
    text = out.read_text()
    assert done["JobState"] == "COMPLETED" and done["ExitCode"] == "0:0", text
    assert [t.n for t in output_ticks(out)] == list(range(1, 21)), text
    assert "Traceback" not in text


def test_memsnapd_down_runs_the_workload_directly(daemon, slurm_idle, slurm_jobs, tmp_path):
    dead = str(tmp_path / "no-daemon-here.sock")
    ok_id, ok_out = sbatch(launcher_script(counter_argv(4, 0.05, "--ticks", "5")), tmp_path, dead,
                           "-p", "low", name="direct-ok")
    bad_id, bad_out = sbatch(launcher_script(["sh", "-c", "echo direct-run; exit 3"]), tmp_path, dead,
                             "-p", "low", name="direct-bad")
    slurm_jobs.extend([ok_id, bad_id])
    final = ("COMPLETED", "FAILED", "CANCELLED")
    ok = wait_job(ok_id, lambda j: j.get("JobState") in final, 60, "finish")
    bad = wait_job(bad_id, lambda j: j.get("JobState") in final, 60, "finish")
    text = ok_out.read_text()
    assert ok["JobState"] == "COMPLETED" and ok["ExitCode"] == "0:0", text
    assert "memsnapd is not available" in text and "running the workload directly" in text, text
    assert [t.n for t in output_ticks(ok_out)] == [1, 2, 3, 4, 5]
    # The workload's exit status is the job's.
    assert bad["JobState"] == "FAILED" and bad["ExitCode"] == "3:0", bad_out.read_text()
    assert "direct-run" in bad_out.read_text()


def test_usr1_checkpoints_and_requeues_the_job_itself(daemon, slurm_idle, slurm_jobs, tmp_path):
    # What `sbatch --signal=B:USR1@120` delivers before the time limit (or, with
    # PreemptParameters=send_user_signal, when a preemption's grace time starts).
    job_id, out = sbatch(launcher_script(counter_argv(16, 0.1)), tmp_path, daemon.socket, "-p", "low",
                         name="usr1")
    slurm_jobs.append(job_id)
    key = f"slurm-{job_id}"
    wait_for(lambda: len(output_ticks(out)) >= 10, 60, 0.2, "the job to tick")
    first_pid = output_ticks(out)[0].hostpid
    digest0 = start_digest(out)
    run("scancel", "--batch", "--signal=USR1", job_id)
    wait_job(job_id, lambda j: j.get("JobState") == "PENDING" and j.get("Restarts") == "1", 60,
             "requeue itself")
    text = out.read_text()
    assert f"SIGUSR1: checkpointing {key} and requeueing the job" in text, text[-2000:]
    assert f"requeued Slurm job {job_id}" in text, text[-2000:]
    ticks_before = len(output_ticks(out))
    release_requeued(job_id, restarts=1)
    wait_for(lambda: len([t for t in output_ticks(out) if t.hostpid != first_pid]) >= 5, 60, 0.2,
             "the requeued run to tick")
    _assert_resumed(out, first_pid, digest0, ticks_before)


def test_launcher_killed_orphan_is_rescued_by_the_next_run_or_stopped_by_the_epilog(daemon, slurm_idle,
                                                                                     slurm_jobs, tmp_path):
    job_id, out = sbatch(launcher_script(counter_argv(8, 0.1)), tmp_path, daemon.socket, "-p", "low",
                         name="orphan")
    slurm_jobs.append(job_id)
    key = f"slurm-{job_id}"
    wait_for(lambda: len(output_ticks(out)) >= 5, 60, 0.2, "the job to tick")
    digest0 = start_digest(out)
    [w] = _running(daemon, key)
    # SIGKILL to the launcher alone: it cannot clean up, and the workload is no child of the job
    # (memsnapd started it), so Slurm does not kill it either.
    run("scancel", "--batch", "--signal=KILL", job_id)
    wait_job(job_id, lambda j: j.get("JobState") == "FAILED", 60, "fail")
    assert Path(f"/proc/{w.pid}").exists(), "expected the orphaned workload to outlive its launcher"

    # Requeued (a finished batch job can be), the next run finds the orphan still running: it
    # checkpoints it with stop and restores that, so nothing runs twice and no tick is lost.
    run("scontrol", "requeue", job_id)
    release_requeued(job_id, restarts=1)
    wait_for(lambda: len({t.hostpid for t in output_ticks(out)}) >= 2, 60, 0.2, "the restored copy to tick")
    wait_for(lambda: not Path(f"/proc/{w.pid}").exists(), 10, 0.1, "the orphan to be gone")
    text = out.read_text()
    assert f"memsnap job {w.id} (pid {w.pid}) of an earlier run still runs; checkpointing it" in text, text
    ts = output_ticks(out)
    assert [t.n for t in ts] == list(range(1, len(ts) + 1)), text[-3000:]
    assert all(t.digest == digest0 for t in ts)

    # Killed again, and this time not requeued: the epilog stops the orphan and drops the checkpoints.
    [w2] = _running(daemon, key)
    run("scancel", "--batch", "--signal=KILL", job_id)
    wait_job(job_id, lambda j: j.get("JobState") == "FAILED", 60, "fail")
    assert Path(f"/proc/{w2.pid}").exists()
    log = _epilog(daemon, tmp_path, job_id)
    assert "final" in log and f"killed pids {w2.pid}" in log and "deleted" in log, log
    wait_for(lambda: not _running(daemon, key), 10, 0.1, "the orphan to be gone")
    assert _mine(daemon, key) == []


def test_prolog_never_fails_the_node(daemon, tmp_path):
    env = hook_env(daemon.socket, tmp_path, "4242")
    assert subprocess.run([str(PROLOG)], env=env, timeout=120).returncode == 0
    down = {**env, "MEMSNAP_SOCKET": str(tmp_path / "dead.sock")}
    assert subprocess.run([str(PROLOG)], env=down, timeout=120).returncode == 0
    assert "memsnapd does not answer" in (tmp_path / "hooks.log").read_text()
    strict = {**down, "MEMSNAP_PROLOG_STRICT": "1", "MEMSNAP_PROLOG_START_WAIT": "1"}
    assert subprocess.run([str(PROLOG)], env=strict, timeout=120).returncode == 1
    # The epilog of a job memsnap never saw is quiet: it succeeds and logs nothing.
    logged = (tmp_path / "hooks.log").read_text()
    assert subprocess.run([str(EPILOG)], env=env, timeout=120).returncode == 0
    assert (tmp_path / "hooks.log").read_text() == logged


def _node_cpus() -> int:
    r = run("sinfo", "-h", "-N", "-o", "%c")
    return int(r.stdout.split()[0])
