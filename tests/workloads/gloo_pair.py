#!/usr/bin/env python3
"""Two torch.distributed ranks (gloo) in one job, made checkpointable with memsnap.quiesce.torchdist.

The launcher (this script without --rank) starts both ranks as its children and waits. Each rank does one
all_reduce per step; rank r contributes r + 1 + step, so the sum must be 3 + 2 * step. Lines:
    step STEP rank RANK sum SUM ok|BAD gen GENERATION pid HOSTPID
    quiesced rank RANK gen GENERATION   (after the process group was re-created around a checkpoint)
"""

import argparse
import os
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=100000)
p.add_argument("--interval", type=float, default=0.1)
a = p.parse_args()

if a.rank < 0:
    kids = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--steps", str(a.steps),
                              "--interval", str(a.interval)]) for r in (0, 1)]
    sys.exit(max(k.wait() for k in kids))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jobpid import job_pid  # noqa: E402

from memsnap.quiesce.torchdist import init_process_group  # noqa: E402

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
rdv = f"/tmp/gloo-{os.environ.get('MEMSNAP_JOB') or os.getppid()}"  # (the job's own /tmp: it travels with it)
pg = init_process_group("gloo", rank=a.rank, world_size=2, init_method=f"file://{rdv}")
for step in range(a.steps):
    if pg.safe_point():
        print(f"quiesced rank {a.rank} gen {pg.generation}", flush=True)
    t = torch.tensor([float(a.rank + 1 + step)])
    dist.all_reduce(t)
    want = 3 + 2 * step
    print(f"step {step} rank {a.rank} sum {int(t.item())} {'ok' if t.item() == want else 'BAD'} "
          f"gen {pg.generation} pid {job_pid()}", flush=True)
    time.sleep(a.interval)
