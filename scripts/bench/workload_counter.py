#!/usr/bin/env python3
"""Benchmark workload: N MiB of memory plus a counter that prints a wall-clock timestamp on every tick.

A bench-own copy of tests/workloads/counter.py (which stays untouched): every line is
'tick N HOSTPID UNIXTIME', so the job's downtime is the largest gap between its own timestamps,
measured by the job and not by memsnap's or CRIU's timers. Memory is filled with blake3 XOF output
(incompressible, ~1.3 GB/s, so a 4 GiB job starts in seconds) or, with --compressible, the repeating
1 MiB pattern of tests/workloads/counter.py --compressible. The loop touches only a few interpreter
pages per tick, like a job between two steps.
"""

import argparse
import os
import sys
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
p.add_argument("--mib", type=int, default=32)
p.add_argument("--interval", type=float, default=0.005)
p.add_argument("--compressible", action="store_true")
a = p.parse_args()

CHUNK = 64 << 20
mem = bytearray(a.mib << 20)
view = memoryview(mem)
if a.compressible:
    block = bytes(range(256)) * 4096
    for off in range(0, len(mem), len(block)):
        n = min(len(block), len(mem) - off)
        view[off : off + n] = block[:n]
else:
    import blake3

    seed = os.urandom(32)
    for i, off in enumerate(range(0, len(mem), CHUNK)):
        n = min(CHUNK, len(mem) - off)
        view[off : off + n] = blake3.blake3(seed + i.to_bytes(8, "little")).digest(length=n)
del view
me = job_pid()
print(f"ready {me} {time.time():.6f}", flush=True)
n = 0
out = sys.stdout
while True:
    n += 1
    out.write(f"tick {n} {job_pid()} {time.time():.6f}\n")
    out.flush()
    time.sleep(a.interval)
