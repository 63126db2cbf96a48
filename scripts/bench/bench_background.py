#!/usr/bin/env python3
"""Benchmark: the job's own view of a lazy restore and a lazy move, with and without another checkpoint
draining (issue 21). The job (scripts/bench/workload_tick.py) holds --mib of random memory, ticks every
10 ms touching one page per tick, and logs each tick's time. From its tick log:

  resumed after   lazy restore: from the restore command to the job's first tick;
                  lazy move: the job's freeze (the gap across the move); "other drain" = one on each node
  lazy-restore-own: `checkpoint --stop`, then at once `restore --lazy` while that checkpoint drains
  largest stall   the largest gap between ticks in the --window seconds after it resumed, less one tick
  total stall     the sum of (gap - tick) over the gaps longer than 50 ms in that window

Trees, alternated run by run so that load on the shared VM hits all alike:
  before     main's code (--before, default /work/main), its daemon run with PYTHONPATH=<that tree>
  gate-off   this tree with drain.max_pause_s = 0: the new store writer and tunnel, drains never step aside
  after      this tree as shipped

The "io" part: a small job appends 4 KiB + fsync to a file on the store's disk every tick while a --mib
checkpoint drains: its own I/O latency (p50/p99/max), before and after. Fault latency in the page tunnel
(p50/p99, from the target's relay timer, this tree only) is read from the target daemon's log.

Needs root and CRIU. Run: python scripts/bench/bench_background.py [--mib 1024] [--runs 2]
Writes bench/results/background.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from memsnap.criu import Criu  # noqa: E402
from tests.helpers import DaemonProc, kill_job, token_daemon, wait_for  # noqa: E402

WORKLOAD = REPO / "scripts" / "bench" / "workload_tick.py"
INTERVAL = 0.01
TREE_ORDER = ["before", "gate-off", "after"]
STALL_MIN = 0.05
FAULTS = re.compile(r"page tunnel \w+ fault latency: (\d+) faults, p50 ([\d.]+) ms, p99 ([\d.]+) ms")
DURABLE = 4


def tick_times(log: str) -> list[float]:
    out = []
    try:
        text = Path(log).read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("t "):
            try:
                out.append(float(line.split()[1]))
            except (IndexError, ValueError):
                pass
    return out


def io_times(log: str) -> list[tuple[float, float]]:
    out = []
    for line in Path(log).read_text().splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "t" and parts[2] == "io":
            out.append((float(parts[1]), float(parts[3])))
    return out


def stalls(ts: list[float], start: float, window: float) -> tuple[float, float]:
    """(largest stall, total stall) in seconds among ticks in [start, start + window]."""
    sel = [t for t in ts if start <= t <= start + window]
    gaps = [b - a for a, b in zip(sel, sel[1:], strict=False)]
    largest = max(gaps, default=0.0) - INTERVAL
    total = sum(g - INTERVAL for g in gaps if g > STALL_MIN)
    return max(0.0, largest), total


def job_log(d: DaemonProc, job_id: str) -> str:
    """A job's log (a restored job logs to a file of its own)."""
    with d.client() as c:
        for j in c.jobs():
            if j.id == job_id:
                return str(j.log_path)
    raise SystemExit(f"no job {job_id}")


def run_job(d: DaemonProc, mib: int, *extra: str) -> Any:
    with d.client() as c:
        job = c.run([sys.executable, str(WORKLOAD), "--mib", str(mib), "--interval", str(INTERVAL), *extra],
                    name="bench-" + secrets.token_hex(3))
    wait_for(lambda: len(tick_times(job.log_path)) >= 5, 300, 0.1, "the job to tick")
    return job


def ctl_json(d: DaemonProc, *args: str) -> dict[str, Any]:
    r = d.ctl("--json", *args, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"memsnapctl {' '.join(args)} failed: {r.stderr}\n{d.log.read_text()[-3000:]}")
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def start_drain(d: DaemonProc, mib: int) -> tuple[Any, str]:
    """Another job's checkpoint, draining (the job runs on)."""
    y = run_job(d, mib)
    ck = ctl_json(d, "checkpoint", y.id)
    with d.client() as c:
        wait_for(lambda: c.show(ck["id"]).drained_bytes > 0 or c.show(ck["id"]).state == DURABLE, 120, 0.05,
                 "the other drain to start")
    return y, ck["id"]


def drain_state(d: DaemonProc, ckpt_id: str) -> str:
    with d.client() as c:
        k = c.show(ckpt_id)
    return f"{k.drained_bytes >> 20} MiB drained, state {k.state}"


def cleanup(d: DaemonProc, pids: list[int], ckpts: list[str]) -> None:
    for pid in pids:
        kill_job(pid)
    for ck in ckpts:
        d.ctl("delete", ck)


def lazy_restore(d: DaemonProc, mib: int, with_drain: bool, window: float, own: bool = False) -> dict[str, Any]:
    """own: restore --lazy right after checkpoint --stop, while that checkpoint's own drain runs."""
    x = run_job(d, mib)
    ck = ctl_json(d, "checkpoint", x.id, "--stop", *(() if own else ("--wait", "durable")))
    pids, ckpts = [int(x.pid)], [ck["id"]]
    try:
        other = ck["id"] if own else ""
        if with_drain and not own:
            y, other = start_drain(d, mib)
            pids.append(int(y.pid))
            ckpts.append(other)
        t0 = time.time()
        r = ctl_json(d, "restore", "--lazy", ck["id"])
        pids.append(int(r["pid"]))
        time.sleep(window + 1)
        ts = [t for t in tick_times(job_log(d, r["job"])) if t > t0]
        if not ts:
            raise SystemExit("the restored job never ticked")
        largest, total = stalls(ts, ts[0], window)
        res = {"resumed_after_ms": round((ts[0] - t0) * 1000), "largest_stall_ms": round(largest * 1000),
               "total_stall_ms": round(total * 1000)}
        if other:
            res["other_drain"] = drain_state(d, other)
        return res
    finally:
        cleanup(d, pids, ckpts)


def lazy_move(a: DaemonProc, b: DaemonProc, to: str, mib: int, with_drain: bool, window: float) -> dict[str, Any]:
    x = run_job(a, mib)
    pids_a, pids_b, ckpts_a, ckpts_b = [int(x.pid)], [], [], []
    try:
        if with_drain:  # as right after a plain move: another checkpoint drains on each node
            y, other = start_drain(b, mib)
            pids_b.append(int(y.pid))
            ckpts_b.append(other)
            y2, other2 = start_drain(a, mib)
            pids_a.append(int(y2.pid))
            ckpts_a.append(other2)
        log_before = b.log.read_text()
        t0 = time.time()
        out = ctl_json(a, "migrate", x.id, "--to", to, "--lazy")
        pids_b.append(int(out["target_pid"]))
        ckpts_b.append(out["checkpoint"])
        time.sleep(window + 1)
        moved = tick_times(job_log(b, out["target_job"]))
        ts = sorted([t for t in tick_times(x.log_path) if t > t0 - 0.5] + moved)
        gaps = [(b2 - a2, b2) for a2, b2 in zip(ts, ts[1:], strict=False)]
        freeze, resumed_at = max(gaps)  # the move's own gap: the longest one (checked: >= its downtime)
        largest, total = stalls(ts, resumed_at, window)
        res: dict[str, Any] = {"resumed_after_ms": round(freeze * 1000), "downtime_ms": out["downtime_ms"],
                               "largest_stall_ms": round(largest * 1000), "total_stall_ms": round(total * 1000)}
        found = FAULTS.findall(b.log.read_text()[len(log_before):])
        if found:
            n, p50, p99 = found[-1]
            res["faults"], res["fault_p50_ms"], res["fault_p99_ms"] = int(n), float(p50), float(p99)
        if with_drain:
            res["other_drain"] = f"target {drain_state(b, ckpts_b[0])}; source {drain_state(a, ckpts_a[0])}"
        return res
    finally:
        cleanup(a, pids_a, ckpts_a)
        cleanup(b, pids_b, ckpts_b)


def io_during_drain(d: DaemonProc, mib: int, store_dir: Path) -> dict[str, Any]:
    """A job's own small writes + fsync (on the store's disk) before and while a mib checkpoint drains."""
    io_file = store_dir.parent / f"io-{secrets.token_hex(3)}.dat"
    z = run_job(d, 16, "--fsync", str(io_file))
    pids, ckpts = [int(z.pid)], []
    try:
        time.sleep(3)
        y = run_job(d, mib)
        pids.append(int(y.pid))
        t_ck = time.time()
        ck = ctl_json(d, "checkpoint", y.id)
        ckpts.append(ck["id"])
        t_drain = time.time()
        with d.client() as c:
            wait_for(lambda: c.show(ck["id"]).state == DURABLE, 600, 0.1, "the drain to finish")
        t_end = time.time()
        samples = io_times(z.log_path)
        base = sorted(ms for t, ms in samples if t < t_ck)
        during = sorted(ms for t, ms in samples if t_drain <= t <= t_end)

        def q(xs: list[float], p: float) -> float:
            return round(xs[min(len(xs) - 1, int(p * len(xs)))], 2) if xs else 0.0

        return {"drain_s": round(t_end - t_drain, 1), "idle_p50_ms": q(base, 0.5), "idle_p99_ms": q(base, 0.99),
                "drain_p50_ms": q(during, 0.5), "drain_p99_ms": q(during, 0.99),
                "drain_max_ms": round(during[-1], 1) if during else 0.0}
    finally:
        cleanup(d, pids, ckpts)
        io_file.unlink(missing_ok=True)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def med(rs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rs if key in r]
    return statistics.median(vals) if vals else None


def markdown(data: dict[str, Any]) -> str:
    env = data["environment"]
    lines = [
        "# Background work and the job's view (issue 21)",
        "",
        f"{data['mib']} MiB job ticking every 10 ms, touching one page per tick; medians of {data['runs']} runs "
        f"per cell, trees alternated run by run. {env['cpus']} CPUs, kernel {env['kernel']}, CRIU {env['criu']}, "
        f"{env['date']}. Load average at start {data['load_start']}, at end {data['load_end']} (the VM is shared "
        "with other engineers' test runs).",
        "",
        "before = main's code; gate-off = this branch with drain.max_pause_s = 0 (drains never step aside); "
        "after = this branch. Stall = gap between ticks less one tick, in the "
        f"{data['window_s']} s after the job resumed; total = sum over gaps > 50 ms.",
        "",
        "| case | other drain | tree | resumed after ms | largest stall ms | total stall ms | fault p50 ms | "
        "fault p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, by_drain in data["cases"].items():
        for drain, by_tree in by_drain.items():
            for tree, cell in sorted(by_tree.items(), key=lambda kv: TREE_ORDER.index(kv[0])):
                def f(k: str, cell: dict[str, Any] = cell) -> str:
                    v = cell["median"].get(k)
                    return "–" if v is None else f"{round(v, 1):g}"
                lines.append(f"| {case} | {drain} | {tree} | {f('resumed_after_ms')} | {f('largest_stall_ms')} | "
                             f"{f('total_stall_ms')} | {f('fault_p50_ms')} | {f('fault_p99_ms')} |")
    if data.get("io"):
        lines += ["", f"## The job's own I/O (4 KiB append + fsync per tick) while a {data['mib']} MiB "
                  "checkpoint drains", "",
                  "| tree | drain s | idle p50 ms | idle p99 ms | during drain p50 ms | p99 ms | max ms |",
                  "|---|---|---|---|---|---|---|"]
        for tree, cell in sorted(data["io"].items(), key=lambda kv: TREE_ORDER.index(kv[0])):
            m = {k: round(v, 1) for k, v in cell["median"].items()}
            lines.append(f"| {tree} | {m['drain_s']} | {m['idle_p50_ms']} | {m['idle_p99_ms']} | {m['drain_p50_ms']} "
                         f"| {m['drain_p99_ms']} | {m['drain_max_ms']} |")
    lines += ["", "Raw runs: background.json.", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--window", type=float, default=8.0, help="seconds after the resume in which stalls count")
    p.add_argument("--before", default="/work/main", help="the old tree (main)")
    p.add_argument("--trees", default="before,gate-off,after")
    p.add_argument("--cases", default="lazy-restore,lazy-move,io")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (CRIU needs it)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the daemons and jobs on the way out
    os.chdir("/")  # `python -m memsnap.daemon` puts the cwd first on sys.path: each daemon must get its own tree
    trees = {"before": (args.before, ""), "gate-off": (str(REPO), "\n[drain]\nmax_pause_s = 0\n"),
             "after": (str(REPO), "")}
    names = [t for t in args.trees.split(",") if t in trees]
    cases = args.cases.split(",")
    base = Path(tempfile.mkdtemp(prefix="memsnap-bench-bg-", dir="/var/tmp"))
    token = base / "token"
    token.write_text(secrets.token_hex(32))
    os.chmod(token, 0o600)
    data: dict[str, Any] = {
        "mib": args.mib, "runs": args.runs, "window_s": args.window, "load_start": loadavg(),
        "environment": {"kernel": platform.release(), "criu": Criu().version(), "cpus": os.cpu_count(),
                        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "before_tree": args.before,
                        "before_commit": subprocess.run(["git", "-C", args.before, "rev-parse", "--short", "HEAD"],
                                                        capture_output=True, text=True).stdout.strip()},
        "cases": {}, "io": {},
    }
    nodes: dict[str, tuple[DaemonProc, DaemonProc, str]] = {}
    try:
        for name in names:
            tree, more = trees[name]
            env = {"PYTHONPATH": tree}
            a = token_daemon(base / f"{name}-a", token, more=more, env=env).start()
            b = token_daemon(base / f"{name}-b", token, more=more, env=env).start()
            nodes[name] = (a, b, str(b.address))  # type: ignore[attr-defined]
        raw: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
        for i in range(args.runs):
            for case in cases:
                for drain in ((False, True) if case not in ("io", "lazy-restore-own") else (True,)):
                    for name in names:
                        a, b, to = nodes[name]
                        load = loadavg()
                        if case == "lazy-restore":
                            res = lazy_restore(a, args.mib, drain, args.window)
                        elif case == "lazy-restore-own":
                            res = lazy_restore(a, args.mib, True, args.window, own=True)
                        elif case == "lazy-move":
                            res = lazy_move(a, b, to, args.mib, drain, args.window)
                        else:
                            res = io_during_drain(a, args.mib, a.store)
                        res["load"] = load
                        label = "yes" if drain else "no"
                        print(f"run {i + 1} {case} drain={label} {name}: {res}", flush=True)
                        raw.setdefault(case, {}).setdefault(label, {}).setdefault(name, []).append(res)
        for case, by_drain in raw.items():
            for label, by_tree in by_drain.items():
                for name, rs in by_tree.items():
                    keys = [k for k in rs[0] if isinstance(rs[0][k], (int, float))]
                    cell = {"runs": rs, "median": {k: med(rs, k) for k in keys}}
                    if case == "io":
                        data["io"][name] = cell
                    else:
                        data["cases"].setdefault(case, {}).setdefault(label, {})[name] = cell
    finally:
        for a, b, _ in nodes.values():
            a.cleanup()
            b.cleanup()
        if not os.environ.get("MEMSNAP_KEEP_LOGS"):
            shutil.rmtree(base, ignore_errors=True)
    data["load_end"] = loadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "background.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    (out / "background.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
