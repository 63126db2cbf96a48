#!/usr/bin/env python3
"""Where memsnapd spends the checkpoint, drain and restore time: one job, py-spy on the daemon throughout.

    scripts/bench/profile_daemon.py [--mib 1024] [--rate 1000 | --local] [--out bench/results/tmp/profile]

Runs the network store (scripts/bench/netstore.py) and a daemon as bench.py does, records memsnapd with
`py-spy record --idle --threads --format raw` while it checkpoints a job, drains it, and restores it from
the tier and from the store, then prints per thread the functions where the wall time went. The raw
collapsed stacks are kept next to the summary (flamegraph.pl or speedscope can draw them).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from netstore import NetStore  # noqa: E402

import bench  # noqa: E402


def summarize(raw: Path, top: int = 12) -> str:
    """Self and inclusive sample counts per thread from py-spy's collapsed-stack output."""
    per_thread: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    incl: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        thread = frames[0].split(" ")[0] if frames else "?"
        if not any(k in thread for k in ("drain", "grpc", "thread (")):
            thread = frames[0]
        count = int(n)
        totals[thread] += count
        per_thread[thread][frames[-1]] += count
        for f in set(frames[1:]):
            incl[thread][f] += count
    out = []
    for thread, total in totals.most_common(6):
        out.append(f"== {thread}: {total} samples")
        out.append("  self:")
        for f, c in per_thread[thread].most_common(top):
            out.append(f"    {100 * c / total:5.1f}%  {f}")
        out.append("  inclusive:")
        for f, c in incl[thread].most_common(top):
            out.append(f"    {100 * c / total:5.1f}%  {f}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rate", type=int, default=1000, help="link Mbit/s")
    ap.add_argument("--out", default=str(bench.REPO / "bench" / "results" / "tmp" / "profile"))
    ap.add_argument("--rate-hz", type=int, default=200)
    ap.add_argument("--local", action="store_true", help="the store is a directory on this machine's disk")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ns = NetStore(bench.BASE / "net", args.rate)
    d = None
    spy = None
    try:
        if args.local:
            store = bench.BASE / "local-store"
            shutil.rmtree(store, ignore_errors=True)
            store.mkdir(parents=True)
        else:
            ns.setup()
            store = ns.mount / "store"
        d = bench.Daemon(store).start()
        assert d.proc is not None
        job, log = bench.start_job(d, bench.counter_argv(args.mib))
        raw = out / "memsnapd.pyspy.txt"
        spy = subprocess.Popen(
            [
                "py-spy",
                "record",
                "--idle",
                "--threads",
                "--nonblocking",
                "--format",
                "raw",
                "--rate",
                str(args.rate_hz),
                "-o",
                str(raw),
                "-p",
                str(d.proc.pid),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)
        marks = {}
        t0 = time.time()
        r = bench.memsnap_checkpoint(d, job, log, args.rate / 8 if args.rate else None)
        marks["checkpoint+drain"] = time.time() - t0
        bench.kill(int(job.pid))
        t0 = time.time()
        rt = bench.memsnap_restore(d, r["ckpt_id"], log)
        bench.kill(rt.pop("pid"))
        marks["restore tier"] = time.time() - t0
        with d.client() as c:
            c.evict(r["ckpt_id"])
        t0 = time.time()
        rs = bench.memsnap_restore(d, r["ckpt_id"], log)
        bench.kill(rs.pop("pid"))
        marks["restore store"] = time.time() - t0
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
        text = "\n".join(
            [f"{k}: {v:.2f}s" for k, v in marks.items()]
            + [f"checkpoint: {r}", f"restore tier: {rt}", f"restore store: {rs}", "", summarize(raw)]
        )
        (out / "summary.txt").write_text(text + "\n")
        print(text)
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
        for pid in list(bench._ALL_PIDS):
            bench.kill(pid)
        if d is not None:
            d.stop()
        if not args.local:
            ns.teardown()
    return 0


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("run as root")
    sys.exit(main())
