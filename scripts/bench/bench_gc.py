#!/usr/bin/env python3
"""gc time on a store of 20 checkpoints (4 counter jobs x 5 durable checkpoints, chunked POSIX store).

Runs a real memsnapd (root, CRIU) with [retention] keep_last = 1, chunk_grace = 0 and times, through the Gc
RPC's own duration_ms and the wall time of `memsnapctl gc`: gc --dry-run on the 20 checkpoints (median of
--runs), the real gc (deletes 16, sweeps their chunks), and gc on the 4 that are left (median of --runs).
Writes bench/results/gc.{json,md}.

    python3 scripts/bench/bench_gc.py [--mib 32] [--runs 5] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.helpers import DaemonProc, kill_job, start_counter  # noqa: E402


def ctl_gc(d: DaemonProc, *flags: str) -> tuple[dict[str, object], float]:
    t0 = time.perf_counter()
    r = d.ctl("--json", "gc", *flags, check=True)
    return json.loads(r.stdout), (time.perf_counter() - t0) * 1000


def store_stats(store: Path) -> tuple[int, int]:
    files = [p for p in (store / "chunks").rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--per-job", type=int, default=5)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    a = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="memsnap-bench-gc-"))
    cfg = base / "gc.toml"
    cfg.write_text("[retention]\nkeep_last = 1\nchunk_grace = 0\ngc_interval = 0\n")
    d = DaemonProc(base / "d", extra=["--config", str(cfg)])
    pids: list[int] = []
    try:
        d.start()
        t0 = time.monotonic()
        for _ in range(a.jobs):
            job = start_counter(d, pids, a.mib)
            for i in range(a.per_job):
                flags = ["--stop"] if i == a.per_job - 1 else []
                d.ctl("checkpoint", job.id, "--wait", "durable", *flags, check=True)
        setup_s = time.monotonic() - t0
        n = a.jobs * a.per_job
        chunks_before, bytes_before = store_stats(d.store)
        dry = [ctl_gc(d, "--dry-run") for _ in range(a.runs)]
        real, real_wall = ctl_gc(d)
        chunks_after, bytes_after = store_stats(d.store)
        steady = [ctl_gc(d) for _ in range(a.runs)]
        result = {
            "environment": {"python": platform.python_version(), "kernel": platform.release(),
                            "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")},
            "setup": {"jobs": a.jobs, "checkpoints_per_job": a.per_job, "checkpoints": n, "job_mib": a.mib,
                      "store": "posix, chunked (1 MiB average chunks)", "setup_s": round(setup_s, 1)},
            "store_before": {"chunks": chunks_before, "chunk_bytes": bytes_before},
            "dry_run": {"median_ms": statistics.median(r["duration_ms"] for r, _ in dry),
                        "median_wall_ms": round(statistics.median(w for _, w in dry), 1),
                        "would_delete": len(dry[0][0]["deleted"]), "would_sweep": dry[0][0]["chunks_swept"]},
            "gc": {"ms": real["duration_ms"], "wall_ms": round(real_wall, 1), "deleted": len(real["deleted"]),
                   "chunks_swept": real["chunks_swept"], "chunk_bytes_freed": real["chunk_bytes_freed"]},
            "store_after": {"chunks": chunks_after, "chunk_bytes": bytes_after},
            "steady": {"checkpoints": n - len(real["deleted"]),
                       "median_ms": statistics.median(r["duration_ms"] for r, _ in steady),
                       "median_wall_ms": round(statistics.median(w for _, w in steady), 1)},
            "runs": a.runs,
        }
    finally:
        for pid in pids:
            kill_job(pid)
        d.cleanup()
        subprocess.run(["rm", "-rf", str(base)], check=False)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gc.json").write_text(json.dumps(result, indent=1) + "\n")
    r = result
    md = f"""# gc on a store of {n} checkpoints

{a.jobs} counter jobs of {a.mib} MiB random memory, {a.per_job} durable checkpoints each, chunked POSIX store on
this VM (tmpfs tier, store on the local disk); `[retention] keep_last = 1`, `chunk_grace = 0`. Times are the
Gc RPC's own duration_ms (wall time of `memsnapctl gc` in brackets), medians of {a.runs} where repeated.

| step | checkpoints | time | result |
|---|---|---|---|
| `gc --dry-run` | {n} | {r['dry_run']['median_ms']} ms ({r['dry_run']['median_wall_ms']} ms) | would delete {r['dry_run']['would_delete']}, sweep {r['dry_run']['would_sweep']} chunks |
| `gc` | {n} | {r['gc']['ms']} ms ({r['gc']['wall_ms']} ms) | deleted {r['gc']['deleted']}, swept {r['gc']['chunks_swept']} chunks, {r['gc']['chunk_bytes_freed'] >> 20} MiB |
| `gc` again | {r['steady']['checkpoints']} | {r['steady']['median_ms']} ms ({r['steady']['median_wall_ms']} ms) | nothing to do |

Store chunks: {r['store_before']['chunks']} ({r['store_before']['chunk_bytes'] >> 20} MiB) before, {r['store_after']['chunks']} ({r['store_after']['chunk_bytes'] >> 20} MiB) after.
"""
    (a.out / "gc.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
