#!/usr/bin/env python3
"""Test workload: takes an exclusive lock on --file and holds it for good, printing a tick now and then: flock(2)
by default (as programs guarding a data dir do), a POSIX lock with --posix. A restore of its checkpoint while it
still runs waits for an flock (CRIU restores it with a blocking flock(2)); this CRIU refuses a POSIX one at once."""
import argparse
import fcntl
import time

p = argparse.ArgumentParser()
p.add_argument("--file", required=True)
p.add_argument("--posix", action="store_true")
a = p.parse_args()

f = open(a.file, "a+")
if a.posix:
    fcntl.lockf(f, fcntl.LOCK_EX)
else:
    fcntl.flock(f, fcntl.LOCK_EX)
print("locked", flush=True)
n = 0
while True:
    n += 1
    print(f"tick {n}", flush=True)
    time.sleep(0.2)
