#!/usr/bin/env python3
"""Test workload: an inference-like server. Static "weights" (deterministic from --seed, so two jobs with the same
seed hold the same bytes) plus a small state rewritten every tick (a KV cache); prints 'start HOSTPID DIGEST' and
'tick N HOSTPID DIGEST [fresh]' like counter.py, the digest being that of the weights.
"""
import argparse
import os
import sys
import time

import blake3
from jobpid import job_pid  # noqa: E402  (this folder is the script's sys.path[0])

p = argparse.ArgumentParser()
p.add_argument("--weights-mib", type=int, default=64)
p.add_argument("--state-mib", type=int, default=4)
p.add_argument("--seed", default="weights-1")
p.add_argument("--interval", type=float, default=0.1)
p.add_argument("--digest-every", type=int, default=10)
a = p.parse_args()

weights = bytearray(blake3.blake3(a.seed.encode()).digest(length=a.weights_mib << 20))
state = bytearray(a.state_mib << 20)


def digest() -> str:
    return blake3.blake3(weights).hexdigest()[:16]


d = digest()
print(f"start {job_pid()} {d}", flush=True)
n = 0
slot = 256 << 10
while True:
    n += 1
    if state:  # rewrite one 256 KiB slot of the state per tick, in turn
        off = (n * slot) % len(state)
        state[off:off + slot] = os.urandom(min(slot, len(state) - off))
    fresh = n % a.digest_every == 0
    if fresh:
        d = digest()
    print(f"tick {n} {job_pid()} {d}{' fresh' if fresh else ''}", flush=True)
    time.sleep(a.interval)
    if n > 10 ** 9:
        sys.exit(0)
