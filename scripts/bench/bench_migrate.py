#!/usr/bin/env python3
"""Benchmark: downtime of moving a running job between two memsnapd on this machine (loopback TCP).

Modes, each a median of --runs moves after one warm-up move (runs alternate between modes):
  pipelined  memsnapctl migrate as shipped: image files stream while CRIU still writes them.
  serial     the same path with pipelining off (MEMSNAP_MIGRATE_SERIAL=1 on the source): dump, then
             copy, then restore, one after the other. This is the baseline pipelining must beat.
  lazy       memsnapctl migrate --lazy (post-copy): the job resumes on the target first, its pages
             follow through the page tunnel. Also run at --lazy-mib sizes, to show time-to-resume
             against size.

Downtime is the job's freeze until it runs on the target (for lazy: until it resumed there, with
the time until every page had arrived reported next to it). The workload is
tests/workloads/counter.py with random (incompressible) memory. Writes <out>/migrate.json and .md.
Needs root and CRIU, like the e2e tests. Run: python scripts/bench/bench_migrate.py [--mib 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from memsnap.criu import Criu  # noqa: E402
from memsnap.migrate import CHUNK_BYTES  # noqa: E402
from tests.helpers import DaemonProc, counter_argv, kill_job, ticks, wait_for  # noqa: E402

MODES = {"pipelined": {}, "pipelined-plain": {}, "serial": {"MEMSNAP_MIGRATE_SERIAL": "1"}, "lazy": {}}
MODE_ARGS = {"lazy": ["--lazy"], "pipelined-plain": ["--plain-restore"]}
# memsnap.migrate logs how much of the image it had read for sending when CRIU returned.
STREAMED = re.compile(r"streamed (\d+) of \d+ bytes while CRIU was still dumping")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def daemon(base: Path, token: Path, env: dict[str, str]) -> tuple[DaemonProc, str]:
    port = free_port()
    # The drain is throttled to a trickle so that it does not compete with the move for the two cores.
    d = DaemonProc(
        base,
        env=env,
        extra=["--listen", f"127.0.0.1:{port}", "--auth-token-file", str(token), "--drain-bandwidth", "1K"],
    )
    return d.start(), f"127.0.0.1:{port}"


def one_move(a: DaemonProc, b: DaemonProc, to: str, mib: int, mode: str = "pipelined") -> dict[str, Any]:
    with a.client() as c:
        job = c.run(counter_argv(mib, 0.1, "--digest-every", "1000000"), name="bench")
    try:
        wait_for(lambda: len(ticks(job.log_path)) >= 2, 300, 0.1, "the job to tick")
        r = a.ctl("--json", "migrate", job.id, "--to", to, *MODE_ARGS.get(mode, []), timeout=900)
        if r.returncode != 0:
            raise SystemExit(f"migrate failed: {r.stderr}")
        out = json.loads(r.stdout)
        last = ticks(job.log_path, job.pid)[-1].n
        wait_for(lambda: len(ticks(job.log_path, out["target_pid"])) >= 1, 60, 0.05, "the moved job to tick")
        first = ticks(job.log_path, out["target_pid"])[0].n
        if first != last + 1:
            raise SystemExit(f"moved job resumed at tick {first}, expected {last + 1}")
        kill_job(out["target_pid"])
        for d in (a, b):
            d.ctl("delete", out["checkpoint"])
        streamed = [int(m.group(1)) for m in STREAMED.finditer(a.log.read_text())]
        # Lazy: the pages phase runs after the job resumed; complete = resumed + all pages there.
        complete = out["downtime_ms"] + out["phases"].get("pages", 0)
        return {"downtime_ms": out["downtime_ms"], "phases": out["phases"], "bytes": out["bytes_sent"],
                "complete_ms": complete,
                "bytes_during_dump": streamed[-1] if streamed and mode != "lazy" else 0}
    finally:
        kill_job(int(job.pid))


def run_modes(modes: list[str], base: Path, token: Path, mib: int, runs: int) -> dict[str, Any]:
    """One source daemon per mode, one target; runs alternate between modes so that background load on a
    shared machine hits all modes alike."""
    target, to = daemon(base / "target", token, {})
    sources = {}
    try:
        for mode in modes:
            sources[mode], _ = daemon(base / f"{mode}-source", token, MODES[mode])
        results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for mode in modes:
            print(f"{mode}: warm-up", flush=True)
            one_move(sources[mode], target, to, mib, mode)
        for i in range(runs):
            for mode in modes:
                res = one_move(sources[mode], target, to, mib, mode)
                print(f"{mode}: run {i + 1}: downtime {res['downtime_ms']} ms, phases {res['phases']}",
                      flush=True)
                results[mode].append(res)
    finally:
        for d in (*sources.values(), target):
            d.cleanup()
    out = {}
    for mode, rs in results.items():
        names = list(rs[0]["phases"])
        out[mode] = {
            "runs": rs,
            "median_downtime_ms": statistics.median(r["downtime_ms"] for r in rs),
            "median_phases_ms": {n: statistics.median(r["phases"][n] for r in rs) for n in names},
            "bytes": rs[0]["bytes"],
            "median_bytes_during_dump": statistics.median(r["bytes_during_dump"] for r in rs),
            "median_complete_ms": statistics.median(r["complete_ms"] for r in rs),
        }
    return out


def lazy_sweep(base: Path, token: Path, sizes: list[int], runs: int) -> dict[str, Any]:
    """Time-to-resume of lazy moves against job size (median of runs after a warm-up)."""
    target, to = daemon(base / "lazy-target", token, {})
    source, _ = daemon(base / "lazy-source", token, {})
    out: dict[str, Any] = {}
    try:
        one_move(source, target, to, sizes[0], "lazy")
        for mib in sizes:
            rs = []
            for i in range(runs):
                res = one_move(source, target, to, mib, "lazy")
                print(f"lazy {mib} MiB: run {i + 1}: resumed after {res['downtime_ms']} ms, all pages after "
                      f"{res['complete_ms']} ms", flush=True)
                rs.append(res)
            out[str(mib)] = {"runs": rs, "median_resume_ms": statistics.median(r["downtime_ms"] for r in rs),
                             "median_complete_ms": statistics.median(r["complete_ms"] for r in rs),
                             "median_phases_ms": {n: statistics.median(r["phases"][n] for r in rs)
                                                  for n in rs[0]["phases"]}}
    finally:
        source.cleanup()
        target.cleanup()
    return out


def markdown(data: dict[str, Any]) -> str:
    env = data["environment"]
    lines = [
        "# Moving a running job: downtime",
        "",
        f"{data['mib']} MiB of random memory (tests/workloads/counter.py), moved between two memsnapd on one "
        f"machine over loopback TCP (gRPC, bearer token, no TLS), {CHUNK_BYTES >> 20} MiB blake3-checked "
        "chunks. "
        f"Median of {data['runs']} runs per mode after a warm-up, modes alternating. "
        f"Kernel {env['kernel']}, CRIU {env['criu']}, "
        f"{env['cpus']} cores, {env['mem_gib']} GiB RAM.",
        "",
        "Downtime = from the freeze (CRIU's freezing + frozen time) until the job runs on the target.",
        "",
        "| mode | downtime (ms) | dump | transfer after dump | restore | image | read while dumping |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, m in data["modes"].items():
        p = m["median_phases_ms"]
        lines.append(
            f"| {mode} | **{m['median_downtime_ms']:.0f}** | {p.get('dump', 0):.0f} | "
            f"{p.get('transfer', 0):.0f} | {p.get('restore', 0):.0f} | "
            f"{m['bytes'] / 2**20:.0f} MiB | {m.get('median_bytes_during_dump', 0) / 2**20:.0f} MiB |"
        )
    lines += ["", "Every run (downtime ms, dump / transfer / restore ms):", ""]
    for mode, m in data["modes"].items():
        runs = "; ".join(
            f"{r['downtime_ms']} ({r['phases'].get('dump', 0)} / {r['phases'].get('transfer', 0)} / "
            f"{r['phases'].get('restore', 0)})"
            for r in m["runs"]
        )
        lines.append(f"- {mode}: {runs}")
    pipe, serial = data["modes"].get("pipelined"), data["modes"].get("serial")
    if pipe and serial:
        gain = (1 - pipe["median_downtime_ms"] / serial["median_downtime_ms"]) * 100
        lines += [
            "",
            f"Median downtime, pipelined vs serial: {pipe['median_downtime_ms']:.0f} vs "
            f"{serial['median_downtime_ms']:.0f} ms ({gain:+.0f}% saved).",
        ]
    lines += [
        "",
        "Reading these numbers: pipelining hides the part of the transfer that overlaps the dump, so "
        "it saves at most the dump time; 'read while dumping' is how much of the image had left for "
        "the target (or waited in the 64 MiB send queue) when CRIU returned. The transfer here is "
        "Python gRPC with a blake3 pass per chunk and per file on each side. In this benchmark source, "
        "target and the 'network' share one machine's cores, so the overlap also takes CPU from the "
        "dump; between two nodes the transfer runs on the other node's cores and the NIC.",
    ]
    lines += [
        "",
        "Phases: dump = CRIU dump (the image streams meanwhile when pipelined); transfer = what is "
        "left to send after CRIU returned, plus the target's verification and publish; "
        "restore = the target's restore until the job runs. Lazy (post-copy) moves are not "
        "implemented, so not measured.",
        "",
        "Reproduce: `sudo python scripts/bench/bench_migrate.py --mib 2048 --runs 3`",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=2048, help="job memory (default 2048)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", default="pipelined,serial,lazy")
    p.add_argument("--lazy-mib", default="256,1024,2048", help="sizes for the lazy time-to-resume sweep ('' = none)")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (CRIU needs it)")
    base = Path(tempfile.mkdtemp(prefix="memsnap-bench-migrate-"))
    token = base / "token"
    token.write_text(secrets.token_hex(32))
    data: dict[str, Any] = {
        "mib": args.mib,
        "runs": args.runs,
        "chunk_bytes": CHUNK_BYTES,
        "environment": {
            "kernel": platform.release(),
            "criu": Criu().version(),
            "cpus": os.cpu_count(),
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"),
        },
        "modes": {},
    }
    try:
        data["modes"] = run_modes(args.modes.split(","), base, token, args.mib, args.runs)
        if args.lazy_mib:
            data["lazy_sweep"] = lazy_sweep(base, token, [int(x) for x in args.lazy_mib.split(",")], args.runs)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "migrate.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    (out / "migrate.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
