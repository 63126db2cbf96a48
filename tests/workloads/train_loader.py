#!/usr/bin/env python3
"""Soak workload: deterministic PyTorch CPU training fed by a DataLoader with worker processes (persistent
workers, shared-memory batches). Prints 'step N LOSS' (exact float repr) every step. It trains until the file
--stop-at names holds a step number and that step is done, then prints 'final N LOSS'. The same seed gives the
same losses on every run, so every step of a checkpointed, restored or moved run must print the reference's.
SIGUSR1 makes the main process allocate and touch as many MiB as --grow-file says, once, then free them (the
memory guard parks it at its limit meanwhile).
"""
import argparse
import os
import signal
import time

import torch
from torch.utils.data import DataLoader, Dataset

p = argparse.ArgumentParser()
p.add_argument("--stop-at", default="")
p.add_argument("--steps", type=int, default=0, help="stop after this many steps (the reference run)")
p.add_argument("--sleep", type=float, default=0.05)
p.add_argument("--workers", type=int, default=2)
p.add_argument("--grow-file", default="", help="SIGUSR1: allocate as many MiB as this file says")
a = p.parse_args()


class Points(Dataset):
    """Sample i is made from i alone (in whichever worker): the data never depends on scheduling."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(32, generator=g)
        return x, x.sum(dim=0, keepdim=True) * 0.5 + torch.randn(1, generator=g) * 0.1


grow = [False]
signal.signal(signal.SIGUSR1, lambda *_: grow.__setitem__(0, True))
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
loader = DataLoader(Points(), batch_size=64, shuffle=True, num_workers=a.workers, persistent_workers=a.workers > 0,
                    generator=torch.Generator().manual_seed(1))
step, stop_at = 0, 0
while True:
    for x, y in loader:
        step += 1
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        print(f"step {step} {loss.item()!r}", flush=True)
        if grow[0]:
            grow[0] = False
            mib = int(open(a.grow_file).read())
            buf = bytearray(mib << 20)
            for off in range(0, len(buf), 4096):
                buf[off] = 1
            print(f"grew {mib}", flush=True)
            del buf
        if a.stop_at and not stop_at and os.path.exists(a.stop_at):
            stop_at = int(open(a.stop_at).read().strip() or 0)
        if step == a.steps or (stop_at and step >= stop_at):
            print(f"final {step} {loss.item()!r}", flush=True)
            raise SystemExit(0)
        time.sleep(a.sleep)
