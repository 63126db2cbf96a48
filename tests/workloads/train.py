#!/usr/bin/env python3
"""Deterministic PyTorch CPU training loop; prints 'step N loss L' and 'final L' (exact float repr)."""
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
p.add_argument("--steps", type=int, default=300)
p.add_argument("--sleep", type=float, default=0.01)
a = p.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)  # same reduction order on every run
x = torch.randn(512, 64)
w_true = torch.randn(64, 1)
y = x @ w_true + 0.1 * torch.randn(512, 1)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(1, a.steps + 1):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    print(f"step {step} {job_pid()} loss {loss.item()!r}", flush=True)
    time.sleep(a.sleep)
print(f"final {job_pid()} {loss.item()!r}", flush=True)
