#!/usr/bin/env python3
"""Test workload: fills --mib of memory with a non-zero pattern, then checks every page of it, over and over:
a page that reads as zeros is memory that is not its own (a lazy restore that lost its pages), and it prints
'ZERO PAGE' the moment it sees one. Prints 'tick N HOSTPID' every 10 passes."""
import argparse
import time

from jobpid import job_pid  # noqa: E402  (this folder is the script's sys.path[0])

PAGE = 4096
p = argparse.ArgumentParser()
p.add_argument("--mib", type=int, default=64)
a = p.parse_args()

pages = (a.mib << 20) // PAGE
mem = bytearray(b"\xa5" * (pages * PAGE))
print(f"start {job_pid()} {pages}", flush=True)
n = 0
while True:
    n += 1
    for i in range(0, pages, 256):  # 1 MiB at a time: the first byte of each of its pages
        firsts = mem[i * PAGE:(i + 256) * PAGE:PAGE]
        if b"\0" in firsts:
            print(f"ZERO PAGE at page {i + firsts.index(0)} in pass {n} ({job_pid()})", flush=True)
    if n % 10 == 0:
        print(f"tick {n} {job_pid()}", flush=True)
    time.sleep(0.02)
