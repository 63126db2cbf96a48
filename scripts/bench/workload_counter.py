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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "workloads"))
from jobpid import job_pid  # noqa: E402

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
