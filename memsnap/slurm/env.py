"""What the launcher and the hooks learn from Slurm: the job's environment and scontrol's answers.

Observed on Slurm 22.05 (and relied on here):
- a requeued batch job runs again with SLURM_RESTART_COUNT=N (N >= 1); SLURM_JOB_RESTART_COUNT is
  not set by 22.05 but is read too, in case a later version sets it;
- on `scontrol requeue` and on preemption with PreemptMode=REQUEUE, the batch shell gets SIGCONT and
  SIGTERM *after* slurmctld requeued the job: `scontrol show job` then says JobState=COMPLETING,
  Restarts already incremented and EndTime=Unknown;
- on `scancel` or a time limit it says JobState=COMPLETING (later CANCELLED/TIMEOUT) with EndTime set
  and Restarts unchanged;
- the epilog sees the same COMPLETING state, so EndTime tells a requeue from a real end there too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Fate = Literal["requeue", "final", "running", "unknown"]

# Base states in which a job is waiting to run (again).
_WAITING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD"}
# States in which the job still runs (nobody is ending it).
_ACTIVE = {"RUNNING", "CONFIGURING", "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT", "POWER_UP_NODE"}
_NO_TIME = {"", "Unknown", "None", "N/A"}
_FIELD = re.compile(r"(?:^|\s)(JobState|Restarts|EndTime|Reason|JobId)=(\S*)")


class SlurmQueryError(Exception):
    """scontrol could not be run or did not answer in time."""


def key_for(job_id: str) -> str:
    """The memsnap job name (and checkpoint label) of a Slurm job: slurm-<jobid>."""
    return f"slurm-{job_id}"


def restart_count(env: Mapping[str, str]) -> int:
    """How often Slurm restarted this job (0 on the first run)."""
    for var in ("SLURM_RESTART_COUNT", "SLURM_JOB_RESTART_COUNT"):
        value = env.get(var, "").strip()
        if value.isdigit():
            return int(value)
    return 0


@dataclass(frozen=True)
class SlurmJob:
    """The Slurm job the launcher runs in."""

    job_id: str
    restart_count: int

    @property
    def key(self) -> str:
        """Default memsnap key of this job."""
        return key_for(self.job_id)

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> SlurmJob | None:
        """The job from SLURM_JOB_ID, or None outside Slurm."""
        env = os.environ if env is None else env
        job_id = (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "").strip()
        if not job_id:
            return None
        return cls(job_id=job_id, restart_count=restart_count(env))


@dataclass(frozen=True)
class JobInfo:
    """The fields of `scontrol -o show job` that decide a job's fate."""

    state: str
    restarts: int
    end_time: str
    reason: str


def parse_show_job(text: str) -> JobInfo:
    """Parses one line of `scontrol -o show job ID`."""
    fields = {k: v for k, v in _FIELD.findall(text)}
    if "JobState" not in fields:
        raise SlurmQueryError(f"unexpected scontrol output: {text.strip()[:200]!r}")
    restarts = fields.get("Restarts", "0")
    return JobInfo(state=fields["JobState"], restarts=int(restarts) if restarts.isdigit() else 0,
                   end_time=fields.get("EndTime", ""), reason=fields.get("Reason", ""))


def scontrol() -> str:
    """Path of scontrol (hooks run without a search path)."""
    found = shutil.which("scontrol") or shutil.which("scontrol", path="/usr/local/bin:/usr/bin:/bin")
    if not found:
        raise SlurmQueryError("scontrol is not installed or not on PATH")
    return found


def show_job(job_id: str, timeout: float = 5.0) -> JobInfo | None:
    """The job as slurmctld sees it; None once slurmctld no longer knows it (purged after MinJobAge)."""
    try:
        r = subprocess.run([scontrol(), "-o", "show", "job", job_id], capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmQueryError(f"scontrol show job {job_id}: {exc}") from exc
    if r.returncode != 0:
        if "Invalid job id" in r.stderr or "Invalid job id" in r.stdout:
            return None
        raise SlurmQueryError(f"scontrol show job {job_id} failed: {(r.stderr or r.stdout).strip()[:200]}")
    line = next((ln for ln in r.stdout.splitlines() if "JobState=" in ln), "")
    return parse_show_job(line)


def classify(info: JobInfo | None, known_restarts: int | None = None) -> Fate:
    """What is happening to the job: requeued, really over, still running, or unknown.

    known_restarts is the caller's own restart count (the launcher's SLURM_RESTART_COUNT): slurmctld
    increments Restarts before it signals a requeued job, so a higher count means a requeue.
    """
    if info is None:
        return "final"
    base = info.state.split("+")[0]
    if base in _WAITING:
        return "requeue"
    if known_restarts is not None and info.restarts > known_restarts:
        return "requeue"
    if base in _ACTIVE:
        return "running"
    if base == "COMPLETING" and info.end_time in _NO_TIME:
        return "requeue"
    return "final"


def job_fate(job_id: str, known_restarts: int | None = None, timeout: float = 5.0) -> Fate:
    """classify(show_job(job_id)); "unknown" when slurmctld cannot be asked."""
    try:
        return classify(show_job(job_id, timeout), known_restarts)
    except SlurmQueryError:
        return "unknown"


def kill_wait(timeout: float = 5.0) -> int | None:
    """KillWait from slurm.conf, in seconds: how long a signalled job has before SIGKILL."""
    try:
        r = subprocess.run([scontrol(), "show", "config"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired, SlurmQueryError):
        return None
    m = re.search(r"^KillWait\s*=\s*(\d+)", r.stdout, re.MULTILINE)
    return int(m.group(1)) if m else None


def requeue(job_id: str, known_restarts: int | None = None, timeout: float = 10.0) -> str:
    """Asks slurmctld to requeue the job; returns "" on success, else the error.

    Called from inside the job, scontrol is one of the job's processes, and the requeue it asked for signals
    them all: it may die of that signal before it exits 0 (seen in CI: exit status -15 for a job that was
    requeued). A scontrol killed by a signal succeeded if slurmctld says the job is being requeued
    (classify(), with the caller's own restart count)."""
    try:
        r = subprocess.run([scontrol(), "requeue", job_id], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired, SlurmQueryError) as exc:
        return str(exc)
    if r.returncode == 0 or (r.returncode < 0 and job_fate(job_id, known_restarts) == "requeue"):
        return ""
    return (r.stderr or r.stdout).strip() or f"exit status {r.returncode}"
