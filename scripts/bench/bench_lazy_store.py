#!/usr/bin/env python3
"""Lazy restore from the store (memsnap.pageserver) against today's full restore from the store, side by
side in one run: a counter job of --mib MiB (random memory: nothing compresses), checkpointed, durable in
a POSIX store behind a rate-limited link (scripts/bench/netstore.py: sshfs to a netns over a tc-limited
veth, 1 Gbit/s by default), its tier copy evicted, then restored:

  full:  `restore` fetches every chunk into the tier, then CRIU restores (what `restore --lazy` did
         before too: it fetched the whole image first);
  lazy:  `restore --lazy`: the small files and the eager pages are fetched, the job resumes, its lazy
         pages follow through the page server (faults first, a prefetcher streams the rest in order).

Reported per case: time from the request to the job's first tick after the restore ("resumed after"), and
for lazy also the time until every page is resident (lazy-pages exits), as a rate over the link: the
stored bytes of the image (what crossed it) per second, against the link's nominal rate and against the
rate measured through the mount. The chunk cache is off, so every restore reads the store. Cases
alternate in order between repetitions; medians and their ratio go to bench/results/lazy-store.{json,md}.

    sudo python3 scripts/bench/bench_lazy_store.py [--mib 2048] [--reps 3] [--rate-mbit 1000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import netstore  # noqa: E402
from netstore import NetStore  # noqa: E402

import bench  # noqa: E402  (its Daemon, JobLog, job start and durable wait)
from bench import REPO, Daemon, counter_argv, kill, say, start_job, wait_durable  # noqa: E402

OUT = REPO / "bench" / "results"
# Names of our own, so that other benchmarks running on this machine (bench.py, with netstore's defaults)
# neither share nor tear down this run's daemon dirs, tier or network namespace.
BASE = Path("/var/tmp/memsnap-bench-lazystore")
bench.BASE, bench.TIER = BASE, Path("/dev/shm/memsnap-bench-lazystore-tier")
netstore.NS, netstore.VETH_HOST, netstore.VETH_NS = "mslazy", "mslazy-h", "mslazy-n"
netstore.HOST_IP, netstore.NS_IP, netstore.PORT = "10.213.78.1", "10.213.78.2", 2223


def restore(d: Daemon, ckpt_id: str, log: bench.JobLog, lazy: bool) -> dict[str, Any]:
    with d.client() as c:
        t0 = time.time()
        r = c.restore(ckpt_id, lazy=lazy)
        t1 = time.time()
    pid = int(r.pid)
    bench._ALL_PIDS.add(pid)
    if r.job.log_path and r.job.log_path != log.path:  # (a restored job writes a log of its own)
        log = bench.JobLog(r.job.log_path)
    first = log.wait_tick(pid, after=t0)
    out: dict[str, Any] = {"resumed_s": first - t0, "rpc_s": t1 - t0, "fetch_ms": r.fetch_ms,
                           "from_store": r.from_store, "pid": pid}
    if lazy:
        deadline = time.monotonic() + 900
        while d.lazy_servers(ckpt_id) and time.monotonic() < deadline:
            time.sleep(0.005)
        t_all = time.time()
        out["all_resident_s"] = t_all - t0
        # The job ticks every 5 ms meanwhile: its largest gap is the longest it stalled on a missing page.
        log.wait_tick(pid, after=t_all + 0.05)
        ts = [t for _n, t in log.ticks[pid] if first <= t <= t_all]
        out["ticks_while_paging"] = len(ts)
        out["max_stall_while_paging_ms"] = max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=0) * 1000
    return out


def one_rep(d: Daemon, mib: int, order: list[str], link_MBps: float) -> dict[str, Any]:
    job, log = start_job(d, counter_argv(mib))
    pid = int(job.pid)
    rec: dict[str, Any] = {"order": order}
    try:
        with d.client() as c:
            info = c.checkpoint(job.id)
            dur = wait_durable(c, info.id)
        rec.update(ckpt_id=info.id, size_bytes=info.size_bytes, stored_bytes=dur.stored_bytes)
        kill(pid)
        for case in order:
            with d.client() as c:
                if c.show(info.id).in_tier:
                    c.evict(info.id)
            say(f"  {case} restore from the store")
            r = restore(d, info.id, log, lazy=case == "lazy")
            kill(r.pop("pid"))
            rec.update({f"{case}_{k}": v for k, v in r.items()})
        rec["lazy_resident_MBps"] = rec["stored_bytes"] / rec["lazy_all_resident_s"] / 1e6
        rec["lazy_link_fraction"] = rec["lazy_resident_MBps"] / link_MBps
        rec["full_MBps"] = rec["stored_bytes"] / rec["full_resumed_s"] / 1e6
        rec["lazy_vs_full_rate"] = rec["lazy_resident_MBps"] / rec["full_MBps"]
        with d.client() as c:
            c.delete(info.id)
    finally:
        kill(pid)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rate-mbit", type=int, default=1000)
    ap.add_argument("--name", default="lazy-store")
    args = ap.parse_args()
    BASE.mkdir(parents=True, exist_ok=True)
    ns = NetStore(BASE / "net-lazystore", args.rate_mbit)
    d: Daemon | None = None
    rows: list[dict[str, Any]] = []
    try:
        say(f"network store at {args.rate_mbit} Mbit/s")
        ns.setup()
        link = ns.check()
        say(f"link through the mount: {link}")
        cfg = BASE / "lazystore.toml"
        cfg.write_text('[store]\nchunk_cache_size = ""\n')  # every restore reads the store
        store = ns.mount / "store"
        store.mkdir(exist_ok=True)
        d = Daemon(store, ["--config", str(cfg)]).start()
        nominal = args.rate_mbit * 1e6 / 8 / 1e6
        for i in range(args.reps):
            order = ["full", "lazy"] if i % 2 == 0 else ["lazy", "full"]
            say(f"rep {i + 1}/{args.reps}: {args.mib} MiB, {' then '.join(order)}")
            row = one_rep(d, args.mib, order, nominal)
            row["link_measured_read_MBps"] = link["read_MBps"]
            rows.append(row)
            say(f"  full: resumed after {row['full_resumed_s']:.2f}s | lazy: resumed after "
                f"{row['lazy_resumed_s']:.2f}s, all resident after {row['lazy_all_resident_s']:.2f}s "
                f"({row['lazy_resident_MBps']:.0f} MB/s = {row['lazy_link_fraction']:.2f} of the link)")
    finally:
        if d is not None:
            d.stop()
        for pid in list(bench._ALL_PIDS):
            kill(pid)
        ns.teardown()
        shutil.rmtree(BASE / "net-lazystore", ignore_errors=True)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    summary = {
        "mib": args.mib, "reps": len(rows), "rate_mbit": args.rate_mbit, "nominal_link_MBps": args.rate_mbit / 8,
        "link_measured": link, "stored_bytes": med("stored_bytes"),
        "full_resumed_s": med("full_resumed_s"), "lazy_resumed_s": med("lazy_resumed_s"),
        "resumed_speedup": med("full_resumed_s") / med("lazy_resumed_s"),
        "lazy_all_resident_s": med("lazy_all_resident_s"), "lazy_resident_MBps": med("lazy_resident_MBps"),
        "lazy_link_fraction": med("lazy_link_fraction"),
        "lazy_vs_measured_link": med("lazy_resident_MBps") / link["read_MBps"],
        "full_MBps": med("full_MBps"), "lazy_vs_full_rate": med("lazy_vs_full_rate"),
        "lazy_max_stall_ms": med("lazy_max_stall_while_paging_ms"),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    md = [
        f"# Lazy restore from the store ({args.mib} MiB, {args.rate_mbit} Mbit/s store, {len(rows)} reps, medians)",
        "",
        "| case | resumed after | all pages resident after | largest stall after resuming | rate over the link |",
        "|---|---|---|---|---|",
        f"| `restore` from the store (today) | {summary['full_resumed_s']:.2f} s | (same) | - | "
        f"{summary['full_MBps']:.0f} MB/s |",
        f"| `restore --lazy` from the store | {summary['lazy_resumed_s']:.2f} s | "
        f"{summary['lazy_all_resident_s']:.2f} s | {summary['lazy_max_stall_ms']:.0f} ms | "
        f"{summary['lazy_resident_MBps']:.0f} MB/s = "
        f"{summary['lazy_link_fraction']:.2f} of {args.rate_mbit / 8:.0f} MB/s nominal, "
        f"{summary['lazy_vs_measured_link']:.2f} of {link['read_MBps']:.0f} MB/s measured |",
        "",
        f"Resumed {summary['resumed_speedup']:.0f}x sooner; every page resident at "
        f"{summary['lazy_vs_full_rate']:.2f} of the full restore's rate over the same link (median of the "
        f"per-rep ratios). Stored image: {summary['stored_bytes'] / 1e6:.0f} MB "
        "(chunked, zstd; random memory does not compress). Chunk cache off. Rate = stored bytes / time from the "
        "request until lazy-pages exited (every page in place).",
    ]
    (OUT / f"{args.name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
