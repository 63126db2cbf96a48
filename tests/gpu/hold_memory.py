#!/usr/bin/env python3
"""GPU workload: holds GIB GiB of random device memory; prints 'ready HOSTPID SUM', then 'done HOSTPID SUM'.

After 'ready' it waits for GO_FILE to exist, then sums its device memory again: a checkpoint and
restore in between must give the same SUM.
"""

import argparse
import os
import time

import torch

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
p.add_argument("--gib", type=int, required=True)
p.add_argument("--go-file", required=True)
a = p.parse_args()

me = job_pid()
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
