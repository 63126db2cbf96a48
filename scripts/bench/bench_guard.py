#!/usr/bin/env python3
"""Benchmark: the memory guard parking a job at its memory limit (cgroup v1 here), and resuming it.

Measures, per run:
  trigger-to-frozen  from the limit event (oom_control eventfd; the job waits at its limit) until every
                     task of the job is stopped (SIGSTOP + headroom), from the guard's own clock;
  park               from the event until the image is staged and the job gone (CRIU dump included);
  memory freed       the job cgroup's usage at the trigger, and the node's used memory (MemTotal -
                     MemAvailable) at the trigger against after the park (after the tier copy's
                     eviction, for a park into the tmpfs tier);
  peak node memory   MemTotal - MemAvailable, sampled every 20 ms by the guard during the park;
  lost work          ticks between the last tick before the park and the first after the resume (0 =
                     none), next to the ticks since the last periodic checkpoint (what an OOM kill and a
                     restart from that checkpoint would have lost).
Spill tiers: "tmpfs" = the memory tier (/dev/shm; evicted once drained to the store), "disk" =
guard.spill_dir on the root disk. Workload: tests/workloads/counter.py --grow-mib (a repeated 1 MiB
random block, so compressible by the drain). Node numbers include whatever else runs on the machine.
Writes <out>/guard.json and guard.md. Needs root, CRIU and the v1 memory controller.
Run: python scripts/bench/bench_guard.py [--sizes 1024,4096] [--latency-runs 5]
"""

from __future__ import annotations

import argparse
import json
import platform
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
from memsnap.guard.psi import read_node  # noqa: E402
from tests.helpers import DaemonProc, counter_argv, kill_job, ticks, wait_for  # noqa: E402

M = 1 << 20


def node_used() -> int:
    return read_node("/nonexistent").used


def guard_jobs(d: DaemonProc) -> dict[str, Any]:
    p = d.state / "guard" / "jobs.json"
    return json.loads(p.read_text()) if p.exists() else {}


def start_daemon(base: Path, spill: Path | None) -> DaemonProc:
    base.mkdir(parents=True, exist_ok=True)
    cfg = base / "guard.toml"
    cfg.write_text(f'[guard]\nspill_dir = "{spill}"\n' if spill else "")
    return DaemonProc(base / "d", extra=["--config", str(cfg)]).start()


def one_park(d: DaemonProc, limit_mib: int, grow_mib: int, periodic: bool = True,
             spill: Path | None = None) -> dict[str, Any]:
    """Runs a growing job under --memory-limit limit_mib until it is parked, then resumes it with twice
    the limit; returns the numbers (spill: the spill dir, to report what it still holds once settled)."""
    base_used = node_used()
    r = d.ctl("--json", "run", "--memory-limit", f"{limit_mib}M", "--name", f"bench{limit_mib}", "--",
              *counter_argv(16, 0.1, "--grow-mib", str(grow_mib), "--grow-max-mib", str(limit_mib * 2)), check=True)
    job = json.loads(r.stdout)
    periodic_tick = 0
    try:
        if periodic:  # a periodic checkpoint early on, as a scheduler's checkpoint interval would take
            wait_for(lambda: len(ticks(job["log"])) >= 1, 60, 0.02, "the first tick")
            with d.client() as c:
                ck = c.checkpoint(job["job"])
            periodic_tick = ticks(job["log"])[-1].n
            periodic_id = ck.id
        wait_for(lambda: guard_jobs(d)[job["job"]]["state"] == "parked", 600, 0.02, "the park")
        t_parked = time.monotonic()
        g = guard_jobs(d)[job["job"]]
        st = g["stats"]
        cg_after = int(Path(g["cgroup"], "memory.usage_in_bytes").read_text())
        # the guard reports the peak once the park's memory is settled (tier copy evicted, or spilled)
        wait_for(lambda: guard_jobs(d)[job["job"]]["stats"].get("peak_node_used_bytes"), 900, 0.1, "the peak")
        settled_ms = (time.monotonic() - t_parked) * 1000
        spill_after = sum(f.stat().st_size for f in spill.rglob("*") if f.is_file()) if spill else 0
        st = guard_jobs(d)[job["job"]]["stats"]
        used_after = int(st.get("node_used_after_park_bytes") or node_used())
        used_start = int(st.get("node_used_at_park_start_bytes") or 0)
        with d.client() as c:
            tier_after = int(c.status().tier_used_bytes)
        before = ticks(job["log"], job["pid"])
        t0 = time.monotonic()
        res = json.loads(d.ctl("--json", "resume", job["job"], "--memory-limit", f"{limit_mib * 2}M",
                               check=True).stdout)
        resume_ms = (time.monotonic() - t0) * 1000
        after: list[Any] = wait_for(lambda: ticks(job["log"], res["pid"]), 120, 0.02, "resumed ticks")  # type: ignore[assignment]
        kill_job(res["pid"])
        with d.client() as c:
            for ck_ in c.list():
                try:
                    c.delete(ck_.id)
                except Exception:
                    pass
        return {
            "limit_mib": limit_mib, "image_mib": round(st["image_bytes"] / M, 1),
            "trigger_to_frozen_ms": st["trigger_to_frozen_ms"], "park_ms": st["park_ms"],
            "dump_ms": st["dump_ms"], "criu_frozen_ms": st["frozen_ms"], "resume_ms": round(resume_ms),
            "at_limit_at_trigger": st["at_limit_at_trigger"], "oom_kills": st["oom_kills"],
            "cgroup_usage_at_trigger_mib": round(st["usage_at_trigger"] / M), "cgroup_usage_after_mib":
                round(cg_after / M), "node_used_before_job_mib": round(base_used / M),
            "node_used_at_park_start_mib": round(used_start / M), "tier_used_after_mib": round(tier_after / M),
            "node_peak_during_park_mib": round(st["peak_node_used_bytes"] / M),
            "node_used_after_park_mib": round(used_after / M),
            "node_freed_mib": round((used_start - used_after) / M),
            "lost_ticks": after[0].n - before[-1].n - 1 if before else None,
            "ticks_since_periodic_checkpoint": (before[-1].n - periodic_tick) if periodic and before else None,
            "periodic_checkpoint": periodic_id if periodic else "",
            "parked_to_settled_ms": round(settled_ms), "spill_after_mib": round(spill_after / M),
            "resumed_from_store": bool(res.get("from_store")),
        }
    finally:
        kill_job(job["pid"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,4096", help="job limits in MiB for the park-time runs")
    ap.add_argument("--latency-runs", type=int, default=5, help="256 MiB parks for trigger-to-frozen")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--spill-ram", action="store_true",
                    help="only parks into a spill_dir on tmpfs (RAM): drained, then evicted once durable; "
                         "writes guard-spill-ram.{json,md}")
    a = ap.parse_args()
    out = Path(a.out)
    if a.spill_ram:
        spill_ram(a, out)
        return
    work = Path(tempfile.mkdtemp(prefix="memsnap-bench-guard-"))
    spill = Path(tempfile.mkdtemp(prefix="memsnap-bench-spill-", dir="/var/tmp"))
    shutil.rmtree(spill)
    results: dict[str, Any] = {
        "kernel": platform.release(), "criu": Criu().version(), "cpus": __import__("os").cpu_count(),
        "mem_total_mib": read_node().mem_total >> 20, "date": time.strftime("%Y-%m-%d"), "latency": [],
        "parks": []}
    t_all = time.monotonic()
    try:
        d = start_daemon(work / "tmpfs", None)
        try:
            for i in range(a.latency_runs):
                r = one_park(d, 256, 32, periodic=False)
                r["tier"] = "tmpfs"
                results["latency"].append(r)
                print("latency", i, r["trigger_to_frozen_ms"], r["park_ms"], flush=True)
            for size in [int(s) for s in a.sizes.split(",") if s]:
                r = one_park(d, size, max(64, size // 16))
                r["tier"] = "tmpfs"
                results["parks"].append(r)
                print(json.dumps(r), flush=True)
        finally:
            d.cleanup()
        d = start_daemon(work / "disk", spill)
        try:
            for size in [int(s) for s in a.sizes.split(",") if s]:
                r = one_park(d, size, max(64, size // 16))
                r["tier"] = "disk (spill_dir)"
                results["parks"].append(r)
                print(json.dumps(r), flush=True)
        finally:
            d.cleanup()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(spill, ignore_errors=True)
    results["wall_s"] = round(time.monotonic() - t_all)
    out.mkdir(parents=True, exist_ok=True)
    (out / "guard.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "guard.md").write_text(report(results))
    print(report(results))


def spill_ram(a: Any, out: Path) -> None:
    """Parks into a spill_dir on /dev/shm: the image is drained to the store and its RAM copy evicted."""
    work = Path(tempfile.mkdtemp(prefix="memsnap-bench-guard-"))
    spill = Path(tempfile.mkdtemp(prefix="memsnap-bench-spill-", dir="/dev/shm"))
    shutil.rmtree(spill)
    r: dict[str, Any] = {"kernel": platform.release(), "criu": Criu().version(), "date": time.strftime("%Y-%m-%d"),
                         "parks": []}
    try:
        d = start_daemon(work / "ram", spill)
        try:
            for size in [int(s) for s in a.sizes.split(",") if s]:
                x = one_park(d, size, max(64, size // 16), spill=spill)
                x["tier"] = "tmpfs (spill_dir)"
                r["parks"].append(x)
                print(json.dumps(x), flush=True)
        finally:
            d.cleanup()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(spill, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "guard-spill-ram.json").write_text(json.dumps(r, indent=2) + "\n")
    lines = ["# Memory guard: parking into a spill_dir on tmpfs (RAM), drained and evicted once durable", "",
             f"kernel {r['kernel']}, CRIU {r['criu']}, {r['date']}; `python scripts/bench/bench_guard.py "
             f"--spill-ram --sizes {a.sizes}`. Node memory = MemTotal - MemAvailable (a shared machine).", "",
             "| job limit | image | park (trigger→parked) | parked → durable and evicted | spill dir after | "
             "node peak during park | node used at park start → after | resume (fetched from the store) | "
             "lost ticks |", "|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for x in r["parks"]:
        lines.append(f"| {x['limit_mib']} MiB | {x['image_mib']:.0f} MiB | {x['park_ms']:.0f} ms | "
                     f"{x['parked_to_settled_ms']} ms | {x['spill_after_mib']} MiB | "
                     f"{x['node_peak_during_park_mib']} MiB | {x['node_used_at_park_start_mib']} → "
                     f"{x['node_used_after_park_mib']} MiB | {x['resume_ms']} ms "
                     f"({'yes' if x['resumed_from_store'] else 'no'}) | **{x['lost_ticks']}** |")
    lines += ["", "Parked → durable and evicted: from the park until the drain made the image durable and the guard "
              "dropped the spill copy (the peak sampler stops then). Spill dir after: what the tmpfs spill dir still "
              "holds at that point. Times come from a machine shared with other test runs: compare rows of one file "
              "only, not with guard.md.", ""]
    (out / "guard-spill-ram.md").write_text("\n".join(lines))
    print("\n".join(lines))


def report(r: dict[str, Any]) -> str:
    lat = r["latency"]
    ttf = [x["trigger_to_frozen_ms"] for x in lat]
    park = [x["park_ms"] for x in lat]
    lines = [
        "# Memory guard: parking a job at its memory limit instead of an OOM kill",
        "",
        f"cgroup v1 memory controller (oom_kill_disable=1, oom_control eventfd), kernel {r['kernel']}, CRIU "
        f"{r['criu']}, {r['cpus']} cores, {r['mem_total_mib'] >> 10} GiB RAM, {r['date']}; run took {r['wall_s']} s. "
        "Workload: tests/workloads/counter.py growing until it waits at its limit. Node memory = MemTotal - "
        "MemAvailable, and includes everything else running on this shared machine.",
        "",
        f"## Trigger to frozen ({len(lat)} parks of a 256 MiB job, tmpfs tier)",
        "",
        f"- trigger-to-frozen (limit event until every task stopped): median **{statistics.median(ttf):.1f} ms** "
        f"(min {min(ttf):.1f}, max {max(ttf):.1f})" if ttf else "- none",
        f"- trigger to parked (image staged, job gone): median {statistics.median(park):.0f} ms" if park else "",
        f"- OOM kills: {sum(x['oom_kills'] for x in lat)}; every park began with the job waiting at its limit: "
        f"{all(x['at_limit_at_trigger'] for x in lat)}",
        "",
        "## Park time, memory freed, peak node memory, lost work",
        "",
        "| job limit | spill tier | image | trigger→frozen | park (trigger→parked) | CRIU dump | "
        "cgroup usage at trigger → after | tier after | node used at park start | node peak during park | "
        "node used after | node freed | resume | lost ticks | ticks since periodic ckpt |",
        "|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["parks"]:
        lines.append(
            f"| {x['limit_mib']} MiB | {x['tier']} | {x['image_mib']:.0f} MiB | {x['trigger_to_frozen_ms']:.0f} ms | "
            f"**{x['park_ms']:.0f} ms** | {x['dump_ms']} ms | {x['cgroup_usage_at_trigger_mib']} → "
            f"{x['cgroup_usage_after_mib']} MiB | {x['tier_used_after_mib']} MiB | "
            f"{x['node_used_at_park_start_mib']} MiB | "
            f"{x['node_peak_during_park_mib']} MiB | {x['node_used_after_park_mib']} MiB | "
            f"{x['node_freed_mib']} MiB | {x['resume_ms']} ms | **{x['lost_ticks']}** | "
            f"{x['ticks_since_periodic_checkpoint']} |")
    lines += [
        "",
        "Lost ticks: the resumed job's first tick minus the parked one's last, minus one (0 = it went on "
        "exactly where it stopped). Ticks since periodic checkpoint: the work (0.1 s ticks) an OOM kill "
        "would have lost, restarting from the checkpoint taken at the first tick.",
        "Tier after: what the memory tier still holds once the park settled: the periodic checkpoint taken at "
        "the first tick (the parked image itself is evicted, or was never there). "
        "Node columns come from a machine shared with other work (other test runs here swung its use by a GiB "
        "or more within seconds): the 1 GiB rows' node freed is lost in that noise; the cgroup column is exact. "
        "For the tmpfs tier, node used after = after the drain made the image durable and the guard evicted "
        "the tier copy; the peak covers the dump into tmpfs (job and image both in RAM). For the disk spill "
        "tier the image never enters RAM (page cache aside).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
