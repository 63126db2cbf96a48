#!/usr/bin/env python3
"""The checkpoint call and the restore from the tier into a tier that memsnapd mounts with huge pages
(tier.huge_pages = "within_size", the shipped config) against one with 4 KiB pages ("never"), after the node sat
idle: on a VM whose host takes back the memory the guest frees, huge pages come back from the host first.

    scripts/bench/tier_huge.py [--mib 1024] [--reps 3] [--idle 20] [--out bench/results]

Run as root on a quiet machine, with no other memsnapd. Per rep and setting (the order alternates): a fresh
memsnapd with tier.mount = true and that huge_pages (scripts/bench/dataplane.py's daemon, store and tier dirs), a
job of MIB random MiB (bench.counter_argv), IDLE seconds of waiting, the checkpoint call (its wall time and the
job's longest gap between ticks), the job killed, IDLE seconds, the restore from the tier to the restored job's
first tick; then the daemon stopped and the tmpfs unmounted. Writes <out>/tier-huge.json and <out>/tier-huge.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import dataplane as dp  # noqa: E402

import bench  # noqa: E402
from memsnap.tier import host_takes_back_free_memory  # noqa: E402

SETTINGS = ("within_size", "never")


def cycle(huge: str, mib: int, idle: float, cfg_dir: Path) -> dict[str, float]:
    cfg = cfg_dir / f"tier-{huge}.toml"
    cfg.write_text(f'[tier]\nmount = true\nhuge_pages = "{huge}"\n')
    dp.wipe()
    dp.STORE.mkdir(parents=True)
    d = dp.Daemon(dp.STORE, ["--config", str(cfg)])
    try:
        d.start()
        job, log = bench.start_job(d, bench.counter_argv(mib, False))
        time.sleep(idle)
        r = bench.memsnap_checkpoint(d, job, log, None)
        bench.kill(int(job.pid))
        time.sleep(idle)
        rt = bench.memsnap_restore(d, r["ckpt_id"], log)
        bench.kill(rt.pop("pid"))
        return {"ckpt_call_ms": r["ms_ckpt_rpc_ms"], "job_gap_ms": r.get("ms_downtime_ms", float("nan")),
                "restore_tier_s": rt["first_tick_s"]}
    finally:
        for p in list(bench._ALL_PIDS):
            bench.kill(p)
        d.stop()
        dp.wipe()
        subprocess.run(["umount", str(dp.TIER)], check=False)
        shutil.rmtree(dp.TIER, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--idle", type=float, default=20.0)
    ap.add_argument("--out", default=str(bench.REPO / "bench" / "results"))
    args = ap.parse_args()
    if dp.other_daemons():
        print("another memsnapd runs here: stop it first", file=sys.stderr)
        return 2
    os.environ["BENCH_MEMSNAP_SRC"] = str(bench.REPO)
    t0 = time.time()
    rows: list[dict[str, object]] = []
    cfg_dir = bench.BASE / "tier-huge"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    for rep in range(args.reps):
        for huge in SETTINGS if rep % 2 == 0 else SETTINGS[::-1]:
            load = os.getloadavg()[0]
            got = cycle(huge, args.mib, args.idle, cfg_dir)
            rows.append({"rep": rep, "huge_pages": huge, "load_before": load, **got})
            print(json.dumps(rows[-1]), flush=True)
    med = {h: {k: statistics.median(float(r[k]) for r in rows if r["huge_pages"] == h)  # type: ignore[arg-type]
               for k in ("ckpt_call_ms", "job_gap_ms", "restore_tier_s")} for h in SETTINGS}
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)), "mib": args.mib, "reps": args.reps,
            "idle_s": args.idle, "host_takes_back_free_memory": host_takes_back_free_memory(),
            "minutes": round((time.time() - t0) / 60, 1), "machine": dp.machine()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tier-huge.json").write_text(json.dumps({"meta": meta, "rows": rows, "medians": med}, indent=1) + "\n")
    lines = [
        "# A tier with huge pages against one with 4 KiB pages, after the node sat idle",
        "",
        f"`scripts/bench/tier_huge.py --mib {args.mib} --reps {args.reps} --idle {args.idle:g}`, {meta['date']} "
        f"({meta['minutes']} min), {meta['machine']['cores']} cores, kernel {meta['machine']['kernel']}; "
        f"the host takes back freed memory (virtio-balloon free page reporting): "
        f"{'yes' if meta['host_takes_back_free_memory'] else 'no'}. memsnapd mounts the tier (tier.mount = true) "
        f"with the huge_pages shown; a job of {args.mib} MiB random memory; {args.idle:g} s idle before the "
        "checkpoint call and again before the restore. Medians of the reps, (min-max).",
        "",
        "| tier.huge_pages | checkpoint call, ms | the job's longest tick gap, ms | restore from the tier, s |",
        "|---|---:|---:|---:|",
    ]
    for h in SETTINGS:
        mine = [r for r in rows if r["huge_pages"] == h]

        def cell(k: str, fmt: str, mine: list[dict[str, object]] = mine, h: str = h) -> str:
            vals = [float(r[k]) for r in mine]  # type: ignore[arg-type]
            return f"{med[h][k]:{fmt}} ({min(vals):{fmt}}-{max(vals):{fmt}})"

        lines.append(f"| {h} | {cell('ckpt_call_ms', '.0f')} | {cell('job_gap_ms', '.0f')} | "
                     f"{cell('restore_tier_s', '.2f')} |")
    ratio = med["within_size"]["ckpt_call_ms"] / med["never"]["ckpt_call_ms"]
    lines += ["", f"Checkpoint call, within_size / never: {ratio:.2f}x.", ""]
    (out / "tier-huge.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
