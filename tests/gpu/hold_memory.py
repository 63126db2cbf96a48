#!/usr/bin/env python3
"""GPU workload: holds GIB GiB of random device memory; prints 'ready HOSTPID SUM', then 'done HOSTPID SUM'.

After 'ready' it waits for GO_FILE to exist, then sums its device memory again: a checkpoint and
restore in between must give the same SUM.
"""

import argparse
import os
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--gib", type=int, required=True)
p.add_argument("--go-file", required=True)
a = p.parse_args()

me = os.readlink("/proc/self")
chunk = 256 << 20
gen = torch.Generator(device="cuda").manual_seed(a.gib)
bufs = [
    torch.randint(0, 256, (chunk,), dtype=torch.uint8, device="cuda", generator=gen) for _ in range(a.gib * 4)
]


def total() -> int:
    return int(sum(int(b.sum(dtype=torch.int64)) for b in bufs))


print(f"ready {me} {total()}", flush=True)
while not os.path.exists(a.go_file):
    time.sleep(0.1)
print(f"done {me} {total()}", flush=True)
