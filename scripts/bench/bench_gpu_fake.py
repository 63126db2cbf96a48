#!/usr/bin/env python3
"""The GPU driver calls of a checkpoint and a restore for 1-4 CUDA processes, one after another (the old way)
against in parallel (one thread per process), on the fake driver of the unit tests with a fixed delay per call.
No GPU is needed: this measures memsnap's own orchestration, not the driver (the device issue does that on a
lent GPU). Writes bench/results/gpu-fake.{json,md}.

    python3 scripts/bench/bench_gpu_fake.py [--delay 0.2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit")]

from fake_cuda import FakeLib  # noqa: E402

from memsnap.gpu.checkpointer import GpuCheckpointer  # noqa: E402
from memsnap.gpu.driver import DriverApi  # noqa: E402


def run(n: int, delay: float, serial: bool) -> tuple[float, float]:
    pids = list(range(10, 10 + 10 * n, 10))
    lib = FakeLib(pids)
    lib.delay = {op: delay for op in ("Lock", "Checkpoint", "Restore", "Unlock")}
    ckpt = GpuCheckpointer(DriverApi(lib))
    t0 = time.monotonic()
    if serial:  # (what the driver calls cost one process after another)
        for p in pids:
            ckpt.suspend([p], timeout_ms=5000).release()
    else:
        ckpt.suspend(pids, timeout_ms=5000).release()
    t1 = time.monotonic()
    if serial:
        for p in pids:
            ckpt.restore([p])
    else:
        ckpt.restore(pids)
    return t1 - t0, time.monotonic() - t1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--delay", type=float, default=0.2, help="seconds per driver call")
    a = ap.parse_args()
    rows = []
    for n in (1, 2, 3, 4):
        (cs, rs), (cp, rp) = run(n, a.delay, True), run(n, a.delay, False)
        rows.append({"processes": n, "checkpoint_serial_s": round(cs, 3), "checkpoint_parallel_s": round(cp, 3),
                     "restore_serial_s": round(rs, 3), "restore_parallel_s": round(rp, 3),
                     "checkpoint_ratio": round(cp / cs, 3)})
    out = REPO / "bench" / "results" / "gpu-fake"
    out.with_suffix(".json").write_text(json.dumps({"delay_s": a.delay, "rows": rows}, indent=1) + "\n")
    md = [f"# GPU driver calls, serial vs parallel (fake driver, {a.delay} s per call)", "",
          "`python3 scripts/bench/bench_gpu_fake.py` (no GPU: memsnap's orchestration only; lock + checkpoint, "
          "then restore + unlock).", "",
          "| CUDA processes | checkpoint serial s | parallel s | ratio | restore serial s | parallel s |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['processes']} | {r['checkpoint_serial_s']} | {r['checkpoint_parallel_s']} | "
           f"{r['checkpoint_ratio']} | {r['restore_serial_s']} | {r['restore_parallel_s']} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
