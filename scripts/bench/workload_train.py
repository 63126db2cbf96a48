#!/usr/bin/env python3
"""Benchmark workload: the PyTorch CPU training loop of tests/workloads/train.py, run until killed.

Same seed, model, data and optimizer as tests/workloads/train.py (which stays untouched); each step prints
'tick STEP HOSTPID UNIXTIME LOSS' so the benchmark reads the job's downtime from its own timestamps.
"""

import argparse
import os
import sys
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--sleep", type=float, default=0.01)
a = p.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)
x = torch.randn(512, 64)
w_true = torch.randn(64, 1)
y = x @ w_true + 0.1 * torch.randn(512, 1)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
print(f"ready {os.readlink('/proc/self')} {time.time():.6f}", flush=True)
out = sys.stdout
step = 0
while True:
    step += 1
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    out.write(f"tick {step} {os.readlink('/proc/self')} {time.time():.6f} {loss.item()!r}\n")
    out.flush()
    time.sleep(a.sleep)
