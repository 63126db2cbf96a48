#!/usr/bin/env python3
"""Benchmark: a plain move's downtime against raw CRIU + raw TCP of the same bytes, side by side, per tree.

    scripts/bench/dataplane_move.py [--mib 1024,2048,4096] [--reps 3] [--a OLD_TREE] [--b NEW_TREE]
                                    [--grpc] [--out bench/results]

Per (rep, size), for each variant in turn (the order rotates): a fresh job (scripts/bench/workload_counter.py,
random memory, ticking every 5 ms with its own CLOCK_REALTIME timestamps) on the variant's source daemon, then
  raw:     `criu dump --leave-running` of that job into tmpfs (dataplane.raw_dump: memsnapd's mount options),
           then every image file over one loopback TCP connection with os.sendfile to a receiver process that
           writes it into tmpfs (recv_into + write, no hashing), until it says it wrote the last byte;
           the baseline is dump wall + TCP wall (one after the other, as a script would do it);
  memsnap: `memsnapctl migrate` of the same job to the variant's target daemon (plain move, early resume: the
           default), its downtime from the job's own ticks (last tick at the source, first at the target) and
           memsnap's own figure and phases; the moved job is checked to tick on, then killed.
Variants: A and B are two trees (PYTHONPATH; A optional); with --grpc also "B-grpc", tree B with the image
inside the gRPC call (MEMSNAP_MIGRATE_GRPC=1 on its source). Each variant has its own source and target daemon
(loopback, one node token, the drain throttled to a trickle so it does not compete). Ratio = baseline / downtime
(goal: at least 0.8). Writes <out>/dataplane-move.json and .md. Needs root and CRIU.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import dataplane  # noqa: E402

import bench  # noqa: E402
from tests.helpers import DaemonProc, token_daemon  # noqa: E402

GiB = 1 << 30
GOAL = 0.8
BASE = bench.BASE / "dataplane-move"
RAW = bench.RAWTMP / "dataplane-move"
RECV = Path("/dev/shm/memsnap-dataplane-move-recv")
say = bench.say

# The raw TCP receiver: one connection; per file a header (name length, name, size), then its bytes.
RECEIVER = r"""
import os, socket, struct, sys
out = sys.argv[1]
ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(1)
print(ls.getsockname()[1], flush=True)
c, _ = ls.accept()
buf = bytearray(4 << 20); view = memoryview(buf)
def exact(n):
    got = bytearray(n); v = memoryview(got)
    while v:
        k = c.recv_into(v)
        if not k: raise SystemExit("cut")
        v = v[k:]
    return bytes(got)
while True:
    hdr = exact(10)
    nl, size = struct.unpack("!HQ", hdr)
    if nl == 0: break
    name = exact(nl).decode()
    fd = os.open(os.path.join(out, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    while size:
        k = c.recv_into(view[:min(size, len(buf))])
        if not k: raise SystemExit("cut")
        mv = view[:k]
        while mv: mv = mv[os.write(fd, mv):]
        size -= k
    os.close(fd)
c.sendall(b"k")
"""


def raw_tcp(src: Path) -> tuple[float, int]:
    """Every file of src over one loopback TCP connection (sendfile) into RECV; (seconds, bytes)."""
    shutil.rmtree(RECV, ignore_errors=True)
    RECV.mkdir(parents=True)
    rx = subprocess.Popen([sys.executable, "-c", RECEIVER, str(RECV)], stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout is not None
        port = int(rx.stdout.readline())
        files = sorted(p for p in src.iterdir() if p.is_file())
        total = 0
        t0 = time.monotonic()
        s = socket.create_connection(("127.0.0.1", port))
        for p in files:
            size = p.stat().st_size
            s.sendall(len(p.name).to_bytes(2, "big") + size.to_bytes(8, "big") + p.name.encode())
            fd = os.open(p, os.O_RDONLY)
            off = 0
            while off < size:
                off += os.sendfile(s.fileno(), fd, off, size - off)
            os.close(fd)
            total += size
        s.sendall(b"\0" * 10)
        assert s.recv(1) == b"k"
        dt = time.monotonic() - t0
        s.close()
        rx.wait(30)
        return dt, total
    finally:
        rx.kill()
        shutil.rmtree(RECV, ignore_errors=True)


def job_log_of(d: DaemonProc, job_id: str) -> str:
    with d.client() as c:
        for j in c.jobs():
            if j.id == job_id:
                return str(j.log_path)
    raise RuntimeError(f"no job {job_id} on {d.base}")


def one(variant: str, a: DaemonProc, b: DaemonProc, mib: int) -> dict[str, Any]:
    job, log = bench.start_job(a, bench.counter_argv(mib))
    pid = int(job.pid)
    rec: dict[str, Any] = {"variant": variant, "mib": mib, "load_before": os.getloadavg()[0]}
    raw = RAW / f"{variant}-{pid}"
    try:
        rec["raw_dump_s"] = dataplane.raw_dump(pid, raw)
        rec["raw_bytes"] = bench.dir_bytes(raw)
        rec["raw_tcp_s"], _ = raw_tcp(raw)
    finally:
        shutil.rmtree(raw, ignore_errors=True)
    rec["raw_s"] = rec["raw_dump_s"] + rec["raw_tcp_s"]
    time.sleep(0.3)
    t0 = time.time()
    r = a.ctl("--json", "migrate", job.id, "--to", b.address, timeout=900)  # type: ignore[attr-defined]
    if r.returncode != 0:
        raise RuntimeError(f"migrate failed: {r.stderr.strip()[-500:]}")
    out = json.loads(r.stdout)
    tpid = int(out["target_pid"])
    bench._ALL_PIDS.add(tpid)
    log.poll()
    last = max(ts for _n, ts in log.ticks[pid] if ts < time.time())
    tlog = bench.JobLog(job_log_of(b, out["target_job"]))
    first = tlog.wait_tick(tpid, after=t0, timeout=120)
    rec.update({"downtime_s": first - last, "memsnap_downtime_ms": out["downtime_ms"], "phases": out["phases"],
                "bytes": out["bytes_sent"]})
    streamed = [ln for ln in a.log.read_text().splitlines() if "while CRIU was still dumping" in ln]
    rec["path"] = ("channel" if streamed and "image channel" in streamed[-1] else "grpc") if streamed else "?"
    rec["ratio_run"] = rec["raw_s"] / rec["downtime_s"]
    # The moved job ticks on (the workload's own check), then goes; both sides forget the checkpoint.
    tlog.wait_tick(tpid, after=first + 0.05, timeout=30)
    bench.kill(tpid)
    for d in (a, b):
        d.ctl("delete", out["checkpoint"])  # type: ignore[attr-defined]
    rec["load_after"] = os.getloadavg()[0]
    return rec


def markdown(res: dict[str, Any]) -> str:
    rows, sizes, variants = res["runs"], res["sizes"], res["variants"]

    def vals(key: str, v: str, mib: int) -> list[float]:
        return [r[key] for r in rows if r["variant"] == v and r["mib"] == mib]

    def med(key: str, v: str, mib: int) -> float:
        return statistics.median(vals(key, v, mib))

    raw_all = {mib: [r for r in rows if r["mib"] == mib] for mib in sizes}
    out = [f"# Plain moves against raw CRIU + raw TCP (loopback, {res['machine']['cores']} cores)", "",
           f"{res['date']}, {res['reps']} reps, sizes {', '.join(str(s) for s in sizes)} MiB. Trees: "
           + ", ".join(f"{k} = `{v}`" for k, v in res["trees"].items()) + ". Script: `scripts/bench/dataplane_move.py`"
           " (its docstring says what each number is). Load average before/after each run is in the JSON.", "",
           "## Job downtime (its own CLOCK_REALTIME ticks), medians", "",
           "| size | raw dump + raw TCP (s) | " + " | ".join(f"{v}: downtime (s) | {v}: ratio" for v in variants)
           + " |", "|---|---:|" + "---:|---:|" * len(variants)]
    for mib in sizes:
        base = statistics.median(r["raw_s"] for r in raw_all[mib])
        cells = []
        for v in variants:
            d = med("downtime_s", v, mib)
            cells += [f"{d:.2f}", f"**{base / d:.2f}**"]
        out.append(f"| {mib} MiB | {base:.2f} | " + " | ".join(cells) + " |")
    out += ["", f"Ratio = median raw dump + raw TCP (every run of that size) / the variant's median downtime; goal "
            f"at least {GOAL}. Above 1: faster than dumping, then copying.", "",
            "## Where the time went, medians (s)", "",
            "| size | variant | raw dump | raw TCP (GB/s) | memsnap's downtime | dump | transfer after the dump | "
            "memsnap's bytes / (dump + transfer), GB/s | restore | paging in after resume | bytes |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mib in sizes:
        for v in variants:
            rs = [r for r in rows if r["variant"] == v and r["mib"] == mib]

            def ph(name: str, rs: list[dict[str, Any]] = rs) -> float:
                return statistics.median(r["phases"].get(name, 0) for r in rs) / 1000

            gbps = statistics.median(r["raw_bytes"] / r["raw_tcp_s"] / 1e9 for r in rs)
            ms_gbps = statistics.median(r["bytes"] / (r["phases"]["dump"] + r["phases"]["transfer"]) / 1e6
                                        for r in rs)
            out.append(f"| {mib} MiB | {v} | {med('raw_dump_s', v, mib):.2f} | {med('raw_tcp_s', v, mib):.2f} "
                       f"({gbps:.2f}) | {med('memsnap_downtime_ms', v, mib) / 1000:.2f} | {ph('dump'):.2f} | "
                       f"{ph('transfer'):.2f} | {ms_gbps:.2f} | {ph('restore'):.2f} | "
                       f"{ph('paging'):.2f} | {int(med('bytes', v, mib)):,} |")
    out += ["", "## Every run", ""]
    for r in rows:
        out.append(f"- {r['variant']} {r['mib']} MiB: downtime {r['downtime_s']:.2f} s (memsnap says "
                   f"{r['memsnap_downtime_ms']} ms, {r['path']}), raw {r['raw_dump_s']:.2f} + {r['raw_tcp_s']:.2f} s, "
                   f"ratio {r['ratio_run']:.2f}, load {r['load_before']:.1f}/{r['load_after']:.1f}")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", default="1024,2048,4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--a", default="", help="the old tree (optional)")
    ap.add_argument("--b", default=str(bench.REPO))
    ap.add_argument("--grpc", action="store_true", help="also tree B with the image inside the gRPC call")
    ap.add_argument("--out", default=str(bench.REPO / "bench" / "results"))
    ap.add_argument("--render", action="store_true", help="only rewrite <out>/dataplane-move.md from its JSON")
    args = ap.parse_args()
    if args.render:
        out = Path(args.out)
        (out / "dataplane-move.md").write_text(markdown(json.loads((out / "dataplane-move.json").read_text())))
        return 0
    sizes = [int(s) for s in args.mib.split(",")]
    trees = {"A": Path(args.a).resolve()} if args.a else {}
    trees["B"] = Path(args.b).resolve()
    shutil.rmtree(BASE, ignore_errors=True)
    BASE.mkdir(parents=True)
    token = BASE / "token"
    token.write_text(secrets.token_hex(32))
    os.chmod(token, 0o600)
    pairs: dict[str, tuple[DaemonProc, DaemonProc]] = {}
    extra = ("--drain-bandwidth", "1K")
    try:
        for name, tree in trees.items():
            env = {"PYTHONPATH": str(tree)}
            cd = ["env", "-C", str(tree)]  # (`python -m` puts the working directory first on sys.path)
            tgt = token_daemon(BASE / f"{name}-target", token, env=env, extra=extra, wrap=cd).start()
            src = token_daemon(BASE / f"{name}-source", token, env=env, extra=extra, wrap=cd).start()
            pairs[name] = (src, tgt)
        if args.grpc:
            src = token_daemon(BASE / "B-grpc-source", token, extra=extra, wrap=["env", "-C", str(trees["B"])],
                               env={"PYTHONPATH": str(trees["B"]), "MEMSNAP_MIGRATE_GRPC": "1"}).start()
            pairs["B-grpc"] = (src, pairs["B"][1])
        variants = list(pairs)
        for v in variants:
            say(f"{v}: warm-up")
            one(v, *pairs[v], 256)
        rows = []
        for rep in range(args.reps):
            for i, mib in enumerate(sizes):
                k = (rep + i) % len(variants)
                for v in variants[k:] + variants[:k]:
                    r = one(v, *pairs[v], mib)
                    say(f"rep {rep + 1} {mib} MiB {v}: downtime {r['downtime_s']:.2f} s, raw {r['raw_s']:.2f} s, "
                        f"ratio {r['ratio_run']:.2f} ({r['path']})")
                    rows.append(r)
    finally:
        for p in list(bench._ALL_PIDS):
            bench.kill(p)
        for src, tgt in pairs.values():
            src.cleanup()
            tgt.cleanup()
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "reps": args.reps, "sizes": sizes,
           "variants": variants, "trees": {k: dataplane.tree_commit(t) for k, t in trees.items()},
           "machine": dataplane.machine(), "runs": rows}
    out = Path(args.out)
    (out / "dataplane-move.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "dataplane-move.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
