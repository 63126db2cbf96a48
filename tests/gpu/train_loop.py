#!/usr/bin/env python3
"""GPU workload: a deterministic PyTorch training loop; prints 'step HOSTPID N LOSS' and 'final HOSTPID HEX REPR'.

Same seed, same GPU model and same step count give a bit-identical final loss, so a run that was
checkpointed and restored half way must print the same HEX as an uninterrupted one.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
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
p.add_argument("--steps", type=int, default=600)
p.add_argument(
    "--sleep", type=float, default=0.02, help="seconds between steps, to leave room for a checkpoint"
)
a = p.parse_args()


me = job_pid()
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.backends.cudnn.benchmark = False
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(1234)
x = torch.randn(8192, 512, device=dev, generator=gen)
y = torch.tanh(x @ torch.randn(512, 1, device=dev, generator=gen))
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)).to(dev)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
loss = torch.zeros((), device=dev)
for step in range(a.steps):
    idx = torch.randint(0, x.shape[0], (256,), device=dev, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    if step % 10 == 0:
        print(f"step {me} {step} {loss.item():.6f}", flush=True)
    if a.sleep:
        time.sleep(a.sleep)
final = float(loss.item())
print(f"final {me} {final.hex()} {final!r}", flush=True)
sys.exit(0)
