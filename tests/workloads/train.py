#!/usr/bin/env python3
"""Deterministic PyTorch CPU training loop; prints 'step N loss L' and 'final L' (exact float repr)."""
import argparse
import time

import torch
from jobpid import job_pid  # noqa: E402  (this folder is the script's sys.path[0])

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
