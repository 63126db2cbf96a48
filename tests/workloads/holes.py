#!/usr/bin/env python3
"""Test workload: memory that keeps giving pages back, as allocators do (glibc trimming an arena, a JVM's GC,
PyTorch's caching allocator), and takes them again.

--mib MiB of anonymous memory in which page p always holds the same bytes; every tick it drops --punch random
pages (MADV_DONTNEED: a lazily restored job's lazy-pages gets a REMOVE event for each), checks that each reads
back as zeros, writes it again, and every --digest-every ticks hashes all of its memory. Prints
'start HOSTPID DIGEST' and 'tick N HOSTPID DIGEST [fresh]' like counter.py (tests.helpers.ticks reads both); a
dropped page that did not read zeros ends it with 'stale page P'.
"""
import argparse
import hashlib
import mmap
import random
import sys
import time

from jobpid import job_pid  # noqa: E402  (this folder is the script's sys.path[0])

PAGE = mmap.PAGESIZE
p = argparse.ArgumentParser()
p.add_argument("--mib", type=int, default=64)
p.add_argument("--punch", type=int, default=64, help="pages dropped and written again every tick")
p.add_argument("--interval", type=float, default=0.02)
p.add_argument("--digest-every", type=int, default=1, help="hash all of its memory every this many ticks")
a = p.parse_args()

pages = (a.mib << 20) // PAGE
mem = mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
block = hashlib.shake_128(b"holes").digest(1 << 20)  # (page p holds a 4 KiB slice of it, chosen by p)


def content(page: int) -> bytes:
    off = (page * 7919 % 256) * PAGE
    return block[off:off + PAGE]


for pg in range(pages):
    mem[pg * PAGE:(pg + 1) * PAGE] = content(pg)


def digest() -> str:
    return hashlib.blake2b(mem, digest_size=8).hexdigest()


print(f"start {job_pid()} {digest()}", flush=True)
zero = bytes(PAGE)
rng = random.Random()
n, d = 0, digest()
while True:
    n += 1
    for pg in rng.sample(range(pages), min(a.punch, pages)):
        mem.madvise(mmap.MADV_DONTNEED, pg * PAGE, PAGE)
        if mem[pg * PAGE:(pg + 1) * PAGE] != zero:
            print(f"stale page {pg}", flush=True)
            sys.exit(1)
        mem[pg * PAGE:(pg + 1) * PAGE] = content(pg)
    fresh = n % a.digest_every == 0
    if fresh:
        d = digest()
    print(f"tick {n} {job_pid()} {d}{' fresh' if fresh else ''}", flush=True)
    time.sleep(a.interval)
