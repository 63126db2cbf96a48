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

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=600)
p.add_argument(
    "--sleep", type=float, default=0.02, help="seconds between steps, to leave room for a checkpoint"
)
a = p.parse_args()


me = os.readlink("/proc/self")
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
