#!/usr/bin/env python3
"""Test workload: PyTorch bf16 matrix products, which oneDNN runs on AMX tiles where the CPU has them (it asks
the kernel for AMX first: arch_prctl(ARCH_REQ_XCOMP_PERM)). Prints 'step N PERM DIGEST' every --interval s:
PERM is the process's XSTATE permission mask (ARCH_GET_XCOMP_PERM, hex; bit 18 is AMX tile data), DIGEST the
product's sum, the same on every step (fixed inputs)."""
import argparse
import ctypes
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--interval", type=float, default=0.1)
a = p.parse_args()

libc = ctypes.CDLL(None, use_errno=True)


def perm() -> str:
    mask = ctypes.c_uint64(0)
    libc.syscall(158, 0x1022, ctypes.byref(mask))  # arch_prctl(ARCH_GET_XCOMP_PERM, &mask)
    return hex(mask.value)


g = torch.Generator().manual_seed(0)
x = torch.randn(256, 256, generator=g).to(torch.bfloat16)
y = torch.randn(256, 256, generator=g).to(torch.bfloat16)
n = 0
while True:
    n += 1
    print(f"step {n} {perm()} {float((x @ y).float().sum())!r}", flush=True)
    time.sleep(a.interval)
