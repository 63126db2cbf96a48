#!/usr/bin/env python3
"""Benchmark workload (scripts/bench/bench_background.py): holds --mib of random memory and ticks every
--interval seconds, touching one page per tick (the next one, round robin), printing the tick's wall time.

Its own tick log is the job's view of a checkpoint, restore or move: the largest gap between ticks is the
longest the job stalled. With --fsync FILE it also appends 4 KiB to FILE and fsyncs it every tick, and
prints how long that took (the job's own I/O latency).
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--mib", type=int, default=1024)
p.add_argument("--interval", type=float, default=0.01)
p.add_argument("--fsync", default="")
a = p.parse_args()

size = a.mib << 20
mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: CRIU pages it lazily
for off in range(0, size, 1 << 20):
    mem[off:off + (1 << 20)] = os.urandom(1 << 20)
pages = size // 4096
out = sys.stdout
fd = os.open(a.fsync, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if a.fsync else -1
block = os.urandom(4096)
print("ready", flush=True)
i = 0
nxt = time.monotonic()
while True:
    off = (i % pages) * 4096
    mem[off] = (mem[off] + 1) & 0xFF  # one page, read and written
    if fd >= 0:
        t0 = time.monotonic()
        os.write(fd, block)
        os.fsync(fd)
        out.write(f"t {time.time():.6f} io {(time.monotonic() - t0) * 1000:.3f}\n")
    else:
        out.write(f"t {time.time():.6f}\n")
    out.flush()
    i += 1
    nxt += a.interval
    now = time.monotonic()
    if not now - a.interval < nxt <= now + a.interval:  # late, or the clock moved (a restore on another clock)
        nxt = now + a.interval
    time.sleep(max(0.0, nxt - now))
