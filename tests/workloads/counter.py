#!/usr/bin/env python3
"""Test workload: random memory plus a counter; prints 'tick N HOSTPID DIGEST [fresh]' so a restore can be checked.

HOSTPID comes from /proc/self, which resolves in the host's proc mount even inside a job's own PID
namespace, so two restored copies of one image tell their lines apart.
"""
import argparse
import hashlib
import os
import sys
import time

from jobpid import job_pid  # noqa: E402  (this folder is the script's sys.path[0])

p = argparse.ArgumentParser()
p.add_argument("--mib", type=int, default=32)
p.add_argument("--interval", type=float, default=0.1)
p.add_argument("--digest-every", type=int, default=1)
p.add_argument("--ticks", type=int, default=0, help="exit after this many ticks (0 = forever)")
p.add_argument("--compressible", action="store_true", help="repetitive memory instead of random")
p.add_argument("--grow-mib", type=int, default=0, help="allocate and touch this much more memory every tick "
               "(the digest stays that of the first --mib, so a restore is still checked)")
p.add_argument("--grow-max-mib", type=int, default=0, help="stop growing at this many MiB grown (0 = never)")
a = p.parse_args()

if a.compressible:
    block = bytes(range(256)) * 4096
    mem = bytearray(block * (a.mib * (1 << 20) // len(block)))
else:
    mem = bytearray(os.urandom(a.mib << 20))


def digest() -> str:
    return hashlib.sha1(mem).hexdigest()[:16]


d = digest()
print(f"start {job_pid()} {d}", flush=True)
grown: list[bytearray] = []
# Growth is written from user space (slice assignment), never by the kernel on our behalf (os.urandom into
# a buffer): at a memory cgroup's limit a user page fault waits, where a kernel copy would fail.
pattern = os.urandom(1 << 20)
n = 0
while True:
    n += 1
    if a.grow_mib and (not a.grow_max_mib or len(grown) * a.grow_mib < a.grow_max_mib):
        chunk = bytearray(a.grow_mib << 20)
        for off in range(0, len(chunk), 1 << 20):
            chunk[off:off + (1 << 20)] = pattern
        grown.append(chunk)
    fresh = n % a.digest_every == 0
    if fresh:
        d = digest()
    # "fresh": the digest was computed from memory on this tick (else it is the last one, kept in a variable)
    print(f"tick {n} {job_pid()} {d}{' fresh' if fresh else ''}", flush=True)
    if a.ticks and n >= a.ticks:
        sys.exit(0)
    time.sleep(a.interval)
