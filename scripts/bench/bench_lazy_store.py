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
import io
import json
import os
import re
import select
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import netstore  # noqa: E402
from netstore import NetStore  # noqa: E402

import bench  # noqa: E402  (its Daemon, JobLog, job start and durable wait)
from bench import REPO, Daemon, counter_argv, kill, say, start_job, wait_durable  # noqa: E402
from memsnap.store import chunks  # noqa: E402

OUT = REPO / "bench" / "results"
# Names of our own, so that other benchmarks running on this machine (bench.py, with netstore's defaults)
# neither share nor tear down this run's daemon dirs, tier or network namespace.
BASE = Path("/var/tmp/memsnap-bench-lazystore")
bench.BASE, bench.TIER = BASE, Path("/dev/shm/memsnap-bench-lazystore-tier")
netstore.NS, netstore.VETH_HOST, netstore.VETH_NS = "mslazy", "mslazy-h", "mslazy-n"
netstore.HOST_IP, netstore.NS_IP, netstore.PORT = "10.213.78.1", "10.213.78.2", 2223


def cpu_by_role(d: Daemon, ns: NetStore, job_pid: int) -> dict[str, float]:
    """CPU seconds used so far by: the daemon (with its reaped children: lazy-pages, criu), the job, the store's
    client side (sshfs and its ssh), its server side (sshd, which a real store would run elsewhere), and the
    whole machine (busy time of every core)."""
    out = {"daemon": 0.0, "job": 0.0, "store_client": 0.0, "store_server": 0.0}
    t = psutil.cpu_times()
    out["machine"] = t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)
    mount = str(ns.mount)
    for p in psutil.process_iter(["pid", "ppid", "name", "cmdline"]):
        try:
            ct = p.cpu_times()
            cmd = " ".join(p.info["cmdline"] or [])
            if p.info["pid"] == job_pid:
                role = "job"
            elif d.proc is not None and p.info["pid"] == d.proc.pid:
                out["daemon"] += ct.children_user + ct.children_system
                role = "daemon"
            elif "lazy-pages" in cmd and mount not in cmd:
                role = "daemon"  # (lazy-pages, until the daemon reaps it)
            elif p.info["name"] == "sshfs" and mount in cmd or p.info["name"] == "ssh" and netstore.NS_IP in cmd:
                role = "store_client"
            elif p.info["name"] == "sshd" and (str(ns.keys) in cmd or "sshd:" in cmd and "root" in cmd):
                role = "store_server"
            else:
                continue
            out[role] += ct.user + ct.system
        except psutil.Error:
            continue
    return out


def wait_exit(procs: list[psutil.Process], timeout: float) -> None:
    """Returns as soon as every process in procs exited (pidfd: no polling)."""
    for p in procs:
        try:
            fd = os.pidfd_open(p.pid)
        except OSError:
            continue
        try:
            select.select([fd], [], [], timeout)
        finally:
            os.close(fd)


def restore(d: Daemon, ns: NetStore, ckpt_id: str, log: bench.JobLog, lazy: bool) -> dict[str, Any]:
    with d.client() as c:
        t0 = time.time()
        r = c.restore(ckpt_id, lazy=lazy)
        t1 = time.time()
    pid = int(r.pid)
    bench._ALL_PIDS.add(pid)
    cpu0 = cpu_by_role(d, ns, pid) if lazy else {}
    lazy_pages = d.lazy_servers(ckpt_id) if lazy else []
    if r.job.log_path and r.job.log_path != log.path:  # (a restored job writes a log of its own)
        log = bench.JobLog(r.job.log_path)
    first = log.wait_tick(pid, after=t0)
    out: dict[str, Any] = {"resumed_s": first - t0, "rpc_s": t1 - t0, "fetch_ms": r.fetch_ms,
                           "restore_ms": r.restore_ms, "from_store": r.from_store, "pid": pid}
    if lazy:
        wait_exit(lazy_pages, 900)
        t_all = time.time()
        cpu1 = cpu_by_role(d, ns, pid)
        out["all_resident_s"] = t_all - t0
        # CPU while paging in, in cores (seconds of CPU per second): who competes for this VM's 2 cores.
        out["cpu_cores"] = {k: round((cpu1[k] - cpu0[k]) / (t_all - t1), 2) for k in cpu1}
        # The job ticks every 5 ms meanwhile: its largest gap is the longest it stalled on a missing page.
        log.wait_tick(pid, after=t_all + 0.05)
        ts = [t for _n, t in log.ticks[pid] if first <= t <= t_all]
        out["ticks_while_paging"] = len(ts)
        out["max_stall_while_paging_ms"] = max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=0) * 1000
        out["page_server"] = page_server_line(d, ckpt_id)
    return out


def page_server_line(d: Daemon, ckpt_id: str) -> dict[str, float]:
    """The numbers of the daemon's log line for this lazy restore (memsnap.pageserver.restore._verdict)."""
    pat = re.compile(rf"lazy restore of {re.escape(ckpt_id)} from the store: every page resident ([\d.]+) s.*?"
                     r"fetched at once (\d+) times; (\d+) faults waited on the store, (\d+) ms in all; "
                     r"prefetch done ([\d.]+) s")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = pat.search((d.base / "memsnapd.log").read_text(errors="replace"))
        if m:
            return {"resident_after_resume_s": float(m[1]), "fetched_at_once": int(m[2]),
                    "fault_waits": int(m[3]), "fault_wait_ms": int(m[4]), "prefetch_done_s": float(m[5])}
        time.sleep(0.1)
    return {}


def read_stored(ns: NetStore, ckpt_id: str) -> dict[str, float]:
    """The link as this run sees it: every stored chunk of the checkpoint read once, one after the other, in
    file order, through the same mount (open, read, close: as the page server fetches one; a packed chunk is
    read from its place in its pack), in MB/s."""
    store = ns.mount / "store"
    stored = json.loads((store / ckpt_id / "manifest.json").read_bytes())
    st = chunks.chunked_storage(stored)
    assert st is not None, f"{ckpt_id} is not stored chunked"
    refs = list({ref.id: ref for lay in st.files.values() for ref in lay.chunks}.values())
    n = 0
    t0 = time.monotonic()
    for ref in refs:
        key, off, size = (chunks.chunk_key(ref.id), 0, -1) if ref.loc is None else \
            (chunks.pack_key(ref.loc[0]), ref.loc[1], ref.loc[2])
        with open(store / key, "rb", buffering=0) as raw, io.BufferedReader(raw, 1 << 20) as f:
            f.seek(off)
            n += len(f.read(size))
    dt = time.monotonic() - t0
    return {"bytes": n, "s": dt, "MBps": n / dt / 1e6}


def one_rep(d: Daemon, ns: NetStore, mib: int, order: list[str], link_MBps: float) -> dict[str, Any]:
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
            r = restore(d, ns, info.id, log, lazy=case == "lazy")
            kill(r.pop("pid"))
            rec.update({f"{case}_{k}": v for k, v in r.items()})
        say("  the same stored bytes read through the mount, one stream")
        seq = read_stored(ns, info.id)
        rec["seq_read_MBps"] = seq["MBps"]
        rec["lazy_resident_MBps"] = rec["stored_bytes"] / rec["lazy_all_resident_s"] / 1e6
        rec["lazy_link_fraction"] = rec["lazy_resident_MBps"] / link_MBps
        rec["full_MBps"] = rec["stored_bytes"] / rec["full_resumed_s"] / 1e6
        rec["lazy_vs_full_rate"] = rec["lazy_resident_MBps"] / rec["full_MBps"]
        rec["lazy_vs_seq_read"] = rec["lazy_resident_MBps"] / rec["seq_read_MBps"]
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
    load_before = list(os.getloadavg())
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
            say(f"rep {i + 1}/{args.reps}: {args.mib} MiB, {' then '.join(order)} (load {os.getloadavg()[0]:.1f})")
            load = os.getloadavg()[0]
            row = one_rep(d, ns, args.mib, order, nominal)
            row["load_before"] = load
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

    def med_sub(key: str, sub: str) -> float:
        return statistics.median(r[key].get(sub, 0.0) for r in rows)

    pre_ms = [r["lazy_rpc_s"] * 1000 - r["lazy_restore_ms"] for r in rows]
    summary = {
        "mib": args.mib, "reps": len(rows), "rate_mbit": args.rate_mbit, "nominal_link_MBps": args.rate_mbit / 8,
        "load_before": load_before, "load_after": list(os.getloadavg()),
        "link_measured": link, "seq_read_MBps": med("seq_read_MBps"), "stored_bytes": med("stored_bytes"),
        "full_resumed_s": med("full_resumed_s"), "lazy_resumed_s": med("lazy_resumed_s"),
        "lazy_rpc_s": med("lazy_rpc_s"), "lazy_restore_ms": med("lazy_restore_ms"),
        "lazy_before_criu_ms": statistics.median(pre_ms), "lazy_fetch_ms": med("lazy_fetch_ms"),
        "resumed_speedup": med("full_resumed_s") / med("lazy_resumed_s"),
        "lazy_all_resident_s": med("lazy_all_resident_s"), "lazy_resident_MBps": med("lazy_resident_MBps"),
        "lazy_link_fraction": med("lazy_link_fraction"), "lazy_vs_seq_read": med("lazy_vs_seq_read"),
        "lazy_vs_measured_link": med("lazy_resident_MBps") / link["read_MBps"],
        "full_MBps": med("full_MBps"), "lazy_vs_full_rate": med("lazy_vs_full_rate"),
        "lazy_max_stall_ms": med("lazy_max_stall_while_paging_ms"),
        "lazy_fault_waits": med_sub("lazy_page_server", "fault_waits"),
        "lazy_fault_wait_ms": med_sub("lazy_page_server", "fault_wait_ms"),
        "lazy_cpu_cores": {k: statistics.median(r["lazy_cpu_cores"][k] for r in rows)
                           for k in rows[0]["lazy_cpu_cores"]},
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    cpu = summary["lazy_cpu_cores"]
    md = [
        f"# Lazy restore from the store ({args.mib} MiB, {args.rate_mbit} Mbit/s store, {len(rows)} reps, medians)",
        "",
        f"Load average {summary['load_before'][0]:.1f} before, {summary['load_after'][0]:.1f} after (2 cores).",
        "",
        "| case | resumed after | all pages resident after | largest stall after resuming | rate over the link |",
        "|---|---|---|---|---|",
        f"| `restore` from the store (today) | {summary['full_resumed_s']:.2f} s | (same) | - | "
        f"{summary['full_MBps']:.0f} MB/s |",
        f"| `restore --lazy` from the store | {summary['lazy_resumed_s']:.2f} s | "
        f"{summary['lazy_all_resident_s']:.2f} s | {summary['lazy_max_stall_ms']:.0f} ms | "
        f"{summary['lazy_resident_MBps']:.0f} MB/s |",
        "",
        "The lazy rate against:",
        "",
        "| the nominal link | the same stored bytes read through the same mount, one stream, same rep | "
        "the link check at the start (256 MiB file) | the full restore's rate, same rep |",
        "|---|---|---|---|",
        f"| {summary['lazy_link_fraction']:.2f} of {args.rate_mbit / 8:.0f} MB/s | "
        f"{summary['lazy_vs_seq_read']:.2f} of {summary['seq_read_MBps']:.0f} MB/s | "
        f"{summary['lazy_vs_measured_link']:.2f} of {link['read_MBps']:.0f} MB/s | "
        f"{summary['lazy_vs_full_rate']:.2f} |",
        "",
        f"Resumed {summary['resumed_speedup']:.0f}x sooner. Of the lazy restore's {summary['lazy_resumed_s']:.2f} s "
        f"to the first tick: {summary['lazy_before_criu_ms']:.0f} ms before CRIU's restore (manifest, small "
        f"files, eager ranges: {summary['lazy_fetch_ms']:.0f} ms of it), {summary['lazy_restore_ms']:.0f} ms "
        f"CRIU's restore, the rest the job's first faults ({summary['lazy_fault_waits']:.0f} of them waited on "
        f"the store, {summary['lazy_fault_wait_ms']:.0f} ms in all). While paging in, in cores: daemon with "
        f"lazy-pages {cpu['daemon']:.2f}, store client (sshfs, ssh) {cpu['store_client']:.2f}, store server "
        f"(sshd) {cpu['store_server']:.2f}, job {cpu['job']:.2f}, whole machine {cpu['machine']:.2f} of 2. "
        f"Stored image: {summary['stored_bytes'] / 1e6:.0f} MB (chunked, zstd; random memory does not "
        "compress). Chunk cache off. Rates = stored bytes / time from the request until lazy-pages exited "
        "(every page in place), ratios are medians of the per-rep ratios.",
        "",
        "| rep | order | resumed after (lazy / full) | all resident | lazy MB/s | one-stream read MB/s | "
        "load before |",
        "|---|---|---|---|---|---|---|",
        *(f"| {i + 1} | {' then '.join(r['order'])} | {r['lazy_resumed_s']:.2f} s / {r['full_resumed_s']:.2f} s | "
          f"{r['lazy_all_resident_s']:.2f} s | {r['lazy_resident_MBps']:.0f} | {r['seq_read_MBps']:.0f} | "
          f"{r['load_before']:.1f} |" for i, r in enumerate(rows)),
    ]
    (OUT / f"{args.name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
