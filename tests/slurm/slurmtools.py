"""Small helpers to drive the one-node test cluster (scripts/slurm/setup-test-cluster.sh) from tests."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import REPO, Tick, ticks

_FIELD = re.compile(r"(?:^|\s)([A-Za-z:/]+)=(\S*)")


def run(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Runs a Slurm command."""
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        why = r.stderr.strip() or r.stdout.strip()
        raise AssertionError(f"{' '.join(argv)} failed ({r.returncode}): {why}")
    return r


def job(job_id: str) -> dict[str, str]:
    """`scontrol -o show job` as a dict ({} once slurmctld forgot the job)."""
    r = run("scontrol", "-o", "show", "job", job_id, check=False)
    if r.returncode != 0:
        return {}
    return dict(_FIELD.findall(r.stdout))


def base_state(job_id: str) -> str:
    """JobState without flags ('' if unknown)."""
    return job(job_id).get("JobState", "")


def wait_job(job_id: str, pred: object, timeout: float, what: str) -> dict[str, str]:
    """Polls `scontrol show job` until pred(fields) holds."""
    deadline = time.monotonic() + timeout
    last: dict[str, str] = {}
    while time.monotonic() < deadline:
        last = job(job_id)
        if pred(last):  # type: ignore[operator]
            return last
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for job {job_id} to {what}; last seen: "
                         f"{ {k: last.get(k) for k in ('JobState', 'Reason', 'Restarts', 'ExitCode')} }")


def release_requeued(job_id: str, restarts: int, timeout: float = 60) -> None:
    """A requeued job waits ~2 min (BeginTime); start it sooner. `scontrol update ... StartTime=now`
    is what 22.05 accepts (BeginTime=now is refused), once the job is PENDING. Not at once, though:
    slurmd refuses a batch job whose credential was revoked (killed) in the same second ("Job
    credential revoked") and the job is then lost, so give it a moment."""
    deadline = time.monotonic() + timeout
    pending_since = 0.0
    while time.monotonic() < deadline:
        j = job(job_id)
        state, count = j.get("JobState"), int(j.get("Restarts", "0"))
        if state in ("RUNNING", "COMPLETED") and count >= restarts:
            return
        if state == "PENDING" and count >= restarts:
            pending_since = pending_since or time.monotonic()
            if time.monotonic() - pending_since >= 2.0:
                run("scontrol", "update", f"jobid={job_id}", "StartTime=now", check=False)
        time.sleep(0.3)
    raise AssertionError(f"requeued job {job_id} did not start again within {timeout}s: {job(job_id)}")


def launcher_script(argv: list[str], launcher_opts: list[str] | None = None) -> str:
    """A batch script that execs the launcher, as docs/slurm.md recommends."""
    launcher = [sys.executable, "-m", "memsnap.cli", "slurm", "run", *(launcher_opts or []), "--", *argv]
    return "#!/bin/bash\nexec " + " ".join(shlex.quote(a) for a in launcher) + "\n"


def sbatch(script: str, workdir: Path, socket: str, *opts: str,
           name: str = "memsnap-test") -> tuple[str, Path]:
    """Submits a batch job that talks to memsnapd on socket; returns (job id, output file)."""
    path = workdir / f"{name}.sh"
    path.write_text(script)
    path.chmod(0o755)
    out = workdir / f"{name}-%j.out"
    r = run("sbatch", "--parsable", "-J", name, "-o", str(out), "--requeue", f"--chdir={workdir}",
            f"--export=ALL,MEMSNAP_SOCKET={socket},PYTHONPATH={REPO}", *opts, str(path))
    job_id = r.stdout.strip().split(";")[0]
    return job_id, Path(str(out).replace("%j", job_id))


def output_ticks(out: Path) -> list[Tick]:
    """The counter's ticks as relayed into the Slurm output file."""
    return ticks(out)


def hook_env(socket: str, tmp: Path, job_id: str) -> dict[str, str]:
    """The environment slurmd gives a Prolog/Epilog, pointed at the test daemon."""
    ctl = tmp / "memsnapctl"
    if not ctl.exists():
        ctl.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(REPO))} exec {shlex.quote(sys.executable)} "
                       "-m memsnap.cli \"$@\"\n")
        ctl.chmod(0o755)
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLURM_JOB_ID": job_id,
            "SLURM_SCRIPT_CONTEXT": "epilog_slurmd", "MEMSNAPCTL": str(ctl), "MEMSNAP_SOCKET": socket,
            "MEMSNAP_HOOK_LOG": str(tmp / "hooks.log"), "MEMSNAP_HOOKS_ENV": "/nonexistent"}
