#!/usr/bin/env python3
"""The long soak: real programs under memsnap, a seeded random sequence of operations on two nodes.

    sudo python3 scripts/soak.py --ops 240 --seed 7            # writes bench/results/soak.{json,md}

All programs (redis, memcached, nginx with wrk and ab, sqlite, a JVM, PyTorch with DataLoader workers) run at
once on a two-node cluster (network namespaces, tests/soak/cluster.py); each step picks a program and an
operation (tests/soak/sequence.py) and then checks the program's own data and both nodes' health. A failed
step is recorded, the program restarted, and the run goes on; the report counts lost data, CRIU processes left
behind and images left over, and gives the freeze, downtime, first answer and p99 of every kind of operation.
The CI subset is tests/soak/test_soak.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers import criu_of, restorable_ids  # noqa: E402
from tests.soak import cluster as clusters  # noqa: E402
from tests.soak.programs import KINDS, DataLost, make  # noqa: E402
from tests.soak.sequence import Runner, summary  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=240, help="operations in all (at least 200 for the report)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--programs", default=",".join(sorted(KINDS)), help="comma-separated: " + ", ".join(KINDS))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "soak"), help="writes OUT.json and OUT.md")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("soak.py: run as root (real CRIU)")
    rng = random.Random(a.seed)
    base = Path(tempfile.mkdtemp(prefix="memsnap-soak-", dir="/var/tmp"))
    cluster = clusters.build(base)
    kinds = [k for k in a.programs.split(",") if k]
    programs = [make(k, cluster, i) for i, k in enumerate(kinds)]
    for p in programs:
        if p.name.startswith("sqlite"):
            p.journal = rng.choice(["wal", "delete"])  # type: ignore[attr-defined]
    runner = Runner(cluster, programs, rng, log=lambda line: print(line, flush=True))
    lost: list[str] = []
    stuck: list[str] = []
    leftovers: list[str] = []
    load0, t0 = os.getloadavg()[0], time.time()
    try:
        for p in programs:
            p.start(cluster.a)
        for _ in range(a.ops):
            p = rng.choice(programs)
            try:
                runner.step(p)
            except Exception as exc:  # recorded in runner.results; find out what kind of failure it was
                text = str(exc)
                if isinstance(exc, DataLost):
                    lost.append(f"{p.name}: {text[:300]}")
                if "criu left" in text:
                    stuck.append(f"{p.name}: {text[:300]}")
                if "restorable: extra" in text:
                    leftovers.append(f"{p.name}: {text[:300]}")
                restart(cluster, p)
        for p in programs:
            try:
                p.finish()
            except DataLost as exc:
                lost.append(f"{p.name} at the end: {exc}")
        stuck += [f"{d.name}: {c}" for d in cluster.nodes for c in criu_of(d)]
    finally:
        for p in programs:
            p.stop()
        cluster.close()
    report = {"seed": a.seed, "ops_requested": a.ops, "programs": kinds, "seconds": round(time.time() - t0),
              "loadavg_start": load0, "loadavg_end": os.getloadavg()[0], "cores": os.cpu_count(),
              "lost_data": lost, "stuck_criu": stuck, "leftover_images": leftovers,
              **summary(runner.results), "steps": [asdict(r) for r in runner.results]}
    Path(a.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
    Path(a.out + ".md").write_text(render(report))
    print(render(report))
    return 1 if report["failed"] or lost or stuck or leftovers else 0


def restart(cluster: clusters.Cluster, p: object) -> None:
    """After a failed step: the program starts afresh on node a (its old copies are killed), and what the step
    left restorable goes (it is counted already), so the next steps are judged on their own."""
    p.stop()  # type: ignore[attr-defined]
    for d in cluster.nodes:
        for ck in restorable_ids(d):
            d.ctl("delete", ck)
    fresh = make(p.name.split("-")[0], cluster, int(p.name.rsplit("-", 1)[1]))  # type: ignore[attr-defined]
    p.__dict__.update(fresh.__dict__)  # (the runner holds this object)
    p.base = p.base.with_name(p.base.name + f"-{int(time.time())}")  # type: ignore[attr-defined]
    p.start(cluster.a)  # type: ignore[attr-defined]


def render(r: dict) -> str:
    lines = [f"# Soak: {r['operations']} operations on real programs, seed {r['seed']}", "",
             f"`sudo python3 scripts/soak.py --ops {r['ops_requested']} --seed {r['seed']}` ({r['seconds']} s, "
             f"{r['cores']} cores, load {r['loadavg_start']:.1f} -> {r['loadavg_end']:.1f}); programs: "
             f"{', '.join(r['programs'])}.", "",
             f"- failed operations: **{r['failed']}** of {r['operations']}; refused by design: {r['refused']} "
             "(a move of a job holding a lock on a file both nodes share: rolled back, the job ran on)",
             f"- programs whose data was lost: **{len(r['lost_data'])}**",
             f"- CRIU processes left behind: **{len(r['stuck_criu'])}**",
             f"- images left over: **{len(r['leftover_images'])}**", "",
             "| operation | runs | failed | refused | freeze ms (p50 / p99) | downtime ms (p50 / p99) | first answer "
             "ms (p50 / p99) | client p99 ms (median) |", "|---|---|---|---|---|---|---|---|"]

    def two(row: dict, key: str) -> str:
        v = row.get(key)
        return f"{v['median']:.0f} / {v['p99']:.0f}" if v else "-"

    for op, row in r["by_op"].items():
        p99 = row.get("p99_ms")
        lines.append(f"| {op} | {row['runs']} | {row['failed']} | {row['refused']} | {two(row, 'frozen_ms')} | "
                     f"{two(row, 'downtime_ms')} | {two(row, 'first_answer_ms')} | "
                     + (f"{p99['median']:.1f} |" if p99 else "- |"))
    for title, key in (("Data lost", "lost_data"), ("CRIU left behind", "stuck_criu"),
                       ("Images left over", "leftover_images")):
        if r[key]:
            lines += ["", f"## {title}", *[f"- {x}" for x in r[key]]]
    failed = [s for s in r["steps"] if not s["ok"]]
    if failed:
        lines += ["", "## Failed operations", *[f"- {s['program']} {s['op']}: {s['error'][:400]}" for s in failed]]
    lines += ["", "freeze: CRIU's own frozen time of the dump; downtime: from the freezing command to the job "
              "running again, seen from outside (moves: memsnapd's downtime_ms); first answer: the client's first "
              "answered request after the operation (TCP programs)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
