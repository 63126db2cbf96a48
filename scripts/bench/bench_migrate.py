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
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from memsnap.criu import Criu  # noqa: E402
from memsnap.move.stream import CHUNK_BYTES  # noqa: E402
from tests.e2e.test_remote import token_daemon  # noqa: E402
from tests.helpers import DaemonProc, counter_argv, kill_job, ticks, wait_for  # noqa: E402

MODES = {"pipelined": {}, "pipelined-plain": {}, "serial": {"MEMSNAP_MIGRATE_SERIAL": "1"}, "lazy": {}}
MODE_ARGS = {"lazy": ["--lazy"], "pipelined-plain": ["--plain-restore"]}
# memsnap.move logs how much of the image it had read for sending when CRIU returned.
STREAMED = re.compile(r"streamed (\d+) of \d+ bytes while CRIU was still dumping")


def daemon(base: Path, token: Path, env: dict[str, str]) -> tuple[DaemonProc, str]:
    # A node of the tests' loopback cluster (node token in `token`, every cluster port a peer): jobs move
    # only to configured peers. The drain is throttled to a trickle so that it does not compete with the
    # move for the two cores.
    d = token_daemon(base, token, env=env, extra=("--drain-bandwidth", "1K"))
    return d.start(), str(d.address)  # type: ignore[attr-defined]


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
        # Lazy and early resume: pages/paging run after the job resumed; complete = resumed + that.
        complete = out["downtime_ms"] + out["phases"].get("pages", 0) + out["phases"].get("paging", 0)
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
    modes = data["modes"]
    lines = [
        "# Moving a running job: downtime",
        "",
        f"{data['mib']} MiB of random memory (tests/workloads/counter.py), moved between two memsnapd on one "
        f"machine over loopback TCP (gRPC, bearer token, no TLS), {CHUNK_BYTES >> 20} MiB blake3-checked "
        "chunks. "
        f"Median of {data['runs']} runs per mode after a warm-up, modes alternating. "
        f"Kernel {env['kernel']}, CRIU {env['criu']}, "
        f"{env['cpus']} cores, {env['mem_gib']} GiB RAM, {env['date']}.",
        "",
        "Downtime = from the freeze until the job runs on the target. All memory in place = until its last "
        "page is where it belongs (the same moment for the plain restores).",
        "",
        "| mode | downtime (ms) | vs serial | dump | transfer after dump | restore | paging in / pages | "
        "all memory in place (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = ["pipelined", "pipelined-plain", "serial", "lazy"]
    modes = {k: modes[k] for k in sorted(modes, key=lambda k: order.index(k) if k in order else len(order))}
    serial = modes.get("serial")
    for mode, m in modes.items():
        p = m["median_phases_ms"]
        ratio = f"{m['median_downtime_ms'] / serial['median_downtime_ms']:.2f}×" if serial else ""
        lines.append(
            f"| {mode} | **{m['median_downtime_ms']:.0f}** | {ratio} | {p.get('dump', 0):.0f} | "
            f"{p.get('transfer', 0):.0f} | {p.get('restore', 0):.0f} | "
            f"{p.get('paging', p.get('pages', 0)):.0f} | {m.get('median_complete_ms', 0):.0f} |"
        )
    lines += ["", "Every run (downtime ms: dump / transfer / restore / paging-or-pages ms):", ""]
    for mode, m in modes.items():
        runs = "; ".join(
            f"{r['downtime_ms']} ({r['phases'].get('dump', 0)} / {r['phases'].get('transfer', 0)} / "
            f"{r['phases'].get('restore', 0)} / {r['phases'].get('paging', r['phases'].get('pages', 0))})"
            for r in m["runs"]
        )
        lines.append(f"- {mode}: {runs}")
    sweep = data.get("lazy_sweep") or {}
    if sweep:
        lines += ["", "## Lazy moves: time to resume against size", "",
                  "| job memory | resumed after (ms) | all pages after (ms) | dump (ms) | images (ms) | "
                  "restore (ms) |", "|---:|---:|---:|---:|---:|---:|"]
        sweep = dict(sorted(sweep.items(), key=lambda kv: int(kv[0])))
        for mib, m in sweep.items():
            p = m["median_phases_ms"]
            lines.append(f"| {mib} MiB | **{m['median_resume_ms']:.0f}** | {m['median_complete_ms']:.0f} | "
                         f"{p.get('dump', 0):.0f} | {p.get('transfer', 0):.0f} | {p.get('restore', 0):.0f} |")
        lines += ["", "Every run (resumed / all pages, ms): " + "; ".join(
            f"{mib} MiB: " + ", ".join(f"{r['downtime_ms']}/{r['complete_ms']}" for r in m["runs"])
            for mib, m in sweep.items()) + "."]
    lines += [
        "",
        "Modes: **serial** = dump, then copy, then a plain restore, one after the other (the baseline). "
        "**pipelined-plain** = files stream while CRIU writes them, then a plain restore. "
        "**pipelined** (the default) = the same stream, then an early resume: the target restores the job's "
        "state and lets it run while lazy-pages pages its memory in from the verified local copy; the "
        "source lets go only once every page is in place. **lazy** (`--lazy`) = post-copy: the job resumes "
        "on the target after a dump without its memory, whose pages then come from the frozen source "
        "through the authenticated page tunnel.",
        "",
        "Reading these numbers: overlapping the transfer with the dump can save at most the dump time, so "
        "with a plain restore the pipelined downtime is bounded below by (transfer + restore) / (dump + "
        "transfer + restore) of the serial one. Here source, target and the 'network' share two cores, "
        "so the stream also slows the dump down. Restoring 2 GiB is seconds of page faults on this VM; "
        "the early resume takes that out of the downtime, and lazy moves take the transfer out too.",
        "",
        "Reproduce: `sudo python scripts/bench/bench_migrate.py --mib 2048 --runs 3`",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=2048, help="job memory (default 2048)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", default="pipelined,pipelined-plain,serial,lazy")
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
        if not os.environ.get("MEMSNAP_KEEP_LOGS"):
            shutil.rmtree(base, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "migrate.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    (out / "migrate.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
