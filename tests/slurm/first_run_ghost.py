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

_JOB_PID = ("", "")


def job_pid() -> str:
    """This job's host pid: the init of its own PID namespace when it runs under one (memsnap starts jobs
    under a small init, memsnap.jobinit), else this process. /proc is the host's, so pids are host pids.
    Looked up again only when our own host pid changed (a restore): an open /proc file caught by a
    checkpoint would name a pid that is gone at restore."""
    global _JOB_PID
    me = os.readlink("/proc/self")
    if _JOB_PID[0] != me:
        _JOB_PID = (me, _find_job_pid(me))
    return _JOB_PID[1]


def _find_job_pid(me: str) -> str:
    cur = me
    while True:
        try:
            with open(f"/proc/{cur}/status") as f:
                fields = dict(ln.split(":", 1) for ln in f.read().splitlines() if ":" in ln)
        except OSError:
            return me
        nspid = fields.get("NSpid", "").split()
        if len(nspid) > 1 and nspid[-1] == "1":
            return cur
        cur = fields.get("PPid", "0").strip()
        if len(nspid) <= 1 or cur in ("0", ""):
            return me

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
