"""The workload without memsnapd: a plain child process, no checkpoints, but the job runs and its exit
status is known (memsnap.slurm.launcher falls back to this when the daemon does not answer)."""

from __future__ import annotations

import signal
import subprocess
from collections import deque
from collections.abc import Callable

from memsnap.slurm import env as slurm_env
from memsnap.slurm.env import SlurmJob

POLL_S = 0.2


def run_direct(argv: list[str], signals: deque[int], note: Callable[[str], None], slurm: SlurmJob | None) -> int:
    """Runs argv, relaying the signals the launcher queued; returns its exit status (128+N if killed)."""
    try:
        proc = subprocess.Popen(argv)
    except OSError as exc:
        note(f"cannot start {argv[0]}: {exc.strerror}")
        return 127
    while True:
        try:
            rc = proc.wait(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        while signals:
            sig = signals.popleft()
            if sig in (signal.SIGUSR1, signal.SIGUSR2):
                # Meant for the launcher (sbatch --signal=B:USR1@N); the workload may not expect it.
                note(f"{signal.Signals(sig).name}: no checkpoint without memsnapd; ignored")
            elif _forward(sig, slurm):
                try:
                    proc.send_signal(sig)
                except OSError:
                    pass
    return 128 - rc if rc < 0 else rc


def _forward(sig: int, slurm: SlurmJob | None) -> bool:
    """Under Slurm a SIGTERM/SIGINT that ends the job reaches every process of the step, the workload
    included; forward only what Slurm did not deliver itself (e.g. scancel -b)."""
    if sig not in (signal.SIGTERM, signal.SIGINT):
        return False
    if slurm is None:
        return True
    return slurm_env.job_fate(slurm.job_id, slurm.restart_count) == "running"
