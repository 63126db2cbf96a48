#!/usr/bin/env python3
"""A/B of two memsnap trees on the drain and fetch paths: checkpoint -> durable -> evict -> restore from the
store, alternating A and B so that drift on a noisy VM hits both alike.

    scripts/bench/ab.py --a /path/to/old/tree --b . [--mib 2048] [--reps 3] [--rate 1000 | --local]

--rate: the store is a directory over sshfs in a network namespace, shaped to that many Mbit/s (needs sshd and
sshfs); --local: a directory on this machine's disk instead.

Each tree's memsnapd runs with PYTHONPATH=<tree>. Prints per run and the medians; writes ab.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from netstore import NetStore  # noqa: E402

import bench  # noqa: E402


def one(tree: str, store: Path, rate_mbit: int, mib: int) -> dict[str, float]:
    os.environ["BENCH_MEMSNAP_SRC"] = tree
    d = bench.Daemon(store).start()
    try:
        job, log = bench.start_job(d, bench.counter_argv(mib))
        r = bench.memsnap_checkpoint(d, job, log, rate_mbit / 8 if rate_mbit else None)
        bench.kill(int(job.pid))
        with d.client() as c:
            c.evict(r["ckpt_id"])
        rs = bench.memsnap_restore(d, r["ckpt_id"], log)
        bench.kill(rs.pop("pid"))
        with d.client() as c:
            c.delete(r["ckpt_id"])
        return {
            "downtime_ms": r["ms_downtime_ms"],
            "ckpt_rpc_ms": r["ms_ckpt_rpc_ms"],
            "durable_s": r["ms_durable_s"],
            "drain_s": r["ms_drain_s"],
            "stored_MBps": r["stored_MBps"],
            "fetch_s": rs["fetch_ms"] / 1000,
            "fetch_MBps": r["stored_bytes"] / (rs["fetch_ms"] / 1000) / 1e6,
            "restore_store_s": rs["first_tick_s"],
        }
    finally:
        for pid in list(bench._ALL_PIDS):
            bench.kill(pid)
        d.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", default=str(bench.REPO))
    ap.add_argument("--mib", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--local", action="store_true", help="the store on this machine's disk, not over the network")
    ap.add_argument("--out", default=str(bench.REPO / "bench" / "results" / "tmp"))
    args = ap.parse_args()
    ns = None if args.local else NetStore(bench.BASE / "net", args.rate)
    store = bench.BASE / "ab-store" if ns is None else ns.mount / "store"
    rate = 0 if ns is None else args.rate
    rows: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    try:
        if ns is not None:
            ns.setup()
        bench.warm_memory(3 * args.mib / 1024 + 1)
        for rep in range(args.reps):
            for name, tree in (
                (("A", args.a), ("B", args.b)) if rep % 2 == 0 else (("B", args.b), ("A", args.a))
            ):
                r = one(str(Path(tree).resolve()), store, rate, args.mib)
                rows[name].append(r)
                print(f"rep {rep} {name}: " + ", ".join(f"{k} {x:.2f}" for k, x in r.items()), flush=True)
    finally:
        if ns is not None:
            ns.teardown()
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in rows.items() if rs}
    for n, m in med.items():
        print(f"median {n}: " + ", ".join(f"{k} {x:.2f}" for k, x in m.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab.json").write_text(
        json.dumps(
            {
                "a": args.a,
                "b": args.b,
                "mib": args.mib,
                "rate_mbit": rate,
                "store": "local disk" if ns is None else "sshfs over a network namespace",
                "runs": rows,
                "median": med,
                "date": time.ctime(),
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
