#!/usr/bin/env python3
"""Test workload that CRIU cannot checkpoint on its first Slurm run, and can on later runs.

On the first run (SLURM_RESTART_COUNT unset or 0) it holds a deleted 4 MiB file open, which CRIU
refuses to dump (its ghost-file limit is 1 MiB), so a requeue finds no checkpoint to restore.
Prints 'tick N HOSTPID 00' like tests/workloads/counter.py, and exits after --ticks ticks.
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "workloads"))
from jobpid import job_pid  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--ticks", type=int, default=30)
p.add_argument("--interval", type=float, default=0.1)
a = p.parse_args()

ghost = None
if os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0"):
    fd, path = tempfile.mkstemp(prefix="memsnap-ghost-", dir="/tmp")
    ghost = os.fdopen(fd, "wb+")
    ghost.write(os.urandom(4 << 20))
    ghost.flush()
    os.unlink(path)
print(f"start {job_pid()} 00 restart={os.environ.get('SLURM_RESTART_COUNT', '0')}",
      flush=True)
for n in range(1, a.ticks + 1):
    print(f"tick {n} {job_pid()} 00", flush=True)
    time.sleep(a.interval)
sys.exit(0)
