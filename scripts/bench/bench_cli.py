#!/usr/bin/env python3
"""memsnapctl start-up: `memsnapctl --help` against `python3 -c pass` with the same interpreter.

Every Slurm prolog/epilog and every script pays memsnapctl's start-up, so the target is at most 3x a bare
interpreter start. Runs both alternately (after a warm-up), N times each, and writes the medians and their
ratio to bench/results/cli.{json,md}. Also times `import memsnap.cli` and a `memsnapctl status` against
no daemon (a call that loads gRPC, and fails at once), for scale. No root or daemon needed.

    python3 scripts/bench/bench_cli.py [--runs 30] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def timed(argv: list[str], env: dict[str, str]) -> float:
    """Wall time of one run, in ms."""
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    a = ap.parse_args()
    py = sys.executable
    env = {**os.environ, "PYTHONPATH": str(REPO), "MEMSNAP_SOCKET": "/nonexistent/memsnapd.sock"}
    # The console script's own code: `from memsnap.cli import main; main()`.
    ctl = [py, "-c", "import sys; from memsnap.cli import main; sys.argv[0] = 'memsnapctl'; main()"]
    cases = {
        "python -c pass": [py, "-c", "pass"],
        "memsnapctl --help": [*ctl, "--help"],
        "import memsnap.cli": [py, "-c", "import memsnap.cli"],
        "memsnapctl status (no daemon, loads gRPC)": [*ctl, "status"],
    }
    for argv in cases.values():  # warm the page cache and .pyc files
        timed(argv, env)
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.runs):
        for name, argv in cases.items():
            samples[name].append(timed(argv, env))
    med = {k: statistics.median(v) for k, v in samples.items()}
    ratio = med["memsnapctl --help"] / med["python -c pass"]
    result = {
        "environment": {"python": platform.python_version(), "interpreter": py, "kernel": platform.release(),
                        "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")},
        "runs": a.runs, "median_ms": {k: round(v, 1) for k, v in med.items()},
        "samples_ms": {k: [round(x, 1) for x in v] for k, v in samples.items()},
        "help_over_bare_python": round(ratio, 2), "target": 3.0, "within_target": ratio <= 3.0,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "cli.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = "\n".join(f"| {k} | {v:.1f} | {v / med['python -c pass']:.2f}x |" for k, v in med.items())
    (a.out / "cli.md").write_text(
        "# memsnapctl start-up\n\n"
        f"Median wall time of {a.runs} runs each, alternating, after a warm-up; Python {platform.python_version()} "
        f"({py}), kernel {platform.release()}, {os.cpu_count()} CPUs, {result['environment']['date']}. "
        "Target: `memsnapctl --help` within 3x `python -c pass`.\n\n"
        "| command | median (ms) | vs python -c pass |\n|---|---:|---:|\n" + rows + "\n\n"
        f"**memsnapctl --help / python -c pass = {ratio:.2f}x** "
        f"({'within' if ratio <= 3.0 else 'OVER'} the 3x target).\n")
    print(f"--help {med['memsnapctl --help']:.1f} ms, python -c pass {med['python -c pass']:.1f} ms: {ratio:.2f}x")


if __name__ == "__main__":
    main()
