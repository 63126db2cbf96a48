#!/usr/bin/env python3
"""Renders bench.json (from scripts/bench/bench.py) as a markdown report and a PNG plot.

python3 scripts/bench/report.py bench/results/bench.json    # re-render bench.md and bench.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

GOAL_DOWNTIME_X = 8.0  # a: raw CRIU onto the network store vs memsnap, at 2 GiB
GOAL_OVERHEAD_X = 1.10  # b: memsnap vs raw CRIU into the same tmpfs
GOAL_LINK = 0.90  # c: drain throughput / link (incompressible)
GOAL_CAP = 0.90  # c (issue #3): drain throughput / --drain-bandwidth cap (incompressible)
GOAL_LAZY_S = 0.30  # e: lazy restore, time to first tick at 2 GiB
GOAL_IDLE_CPU = 0.5  # f: percent
GOAL_IDLE_RSS_MB = 80.0  # f


def _rows(summary: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    return {s["group"]: s for s in summary}


def v(s: dict[str, Any] | None, key: str) -> float | None:
    if not s:
        return None
    x = s.get(key)
    return float(x) if isinstance(x, (int, float)) else None


def f(s: dict[str, Any] | None, key: str, scale: float = 1.0, nd: int = 0, spread: bool = True) -> str:
    """'median (min–max)' of a summarized key."""
    x = v(s, key)
    if x is None or s is None:
        return "–"
    fmt = f"{{:.{nd}f}}"
    out = fmt.format(x * scale)
    lo, hi = s.get(key + "__min"), s.get(key + "__max")
    if spread and s.get("n", 1) > 1 and lo is not None and hi is not None:
        out += f" ({fmt.format(lo * scale)}–{fmt.format(hi * scale)})"
    return out


def ratio(a: float | None, b: float | None, nd: int = 2) -> str:
    return f"{a / b:.{nd}f}×" if a is not None and b else "–"


def mark(ok: bool | None) -> str:
    return "–" if ok is None else ("**met**" if ok else "**missed**")


def goals(res: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    sw = _rows(res["summary"]["sweep"])
    at2 = sw.get(2048) or (sw[max(sw)] if sw else None)
    size2 = at2["group"] if at2 else None
    out: list[tuple[str, str, str, bool | None]] = []
    # a
    a = None
    if at2:
        a = v(at2, "raw_net_downtime_ms") / v(at2, "ms_downtime_ms")  # type: ignore[operator]
    out.append(
        (
            f"a. job downtime: raw CRIU onto the network store / memsnap, at {size2} MiB",
            f"≥ {GOAL_DOWNTIME_X:g}×",
            f"{a:.1f}×" if a else "–",
            a >= GOAL_DOWNTIME_X if a else None,
        )
    )
    # b
    worst = None
    parts = []
    ratios = []
    for size, s in sorted(sw.items()):
        r = v(s, "ms_downtime_ms") / v(s, "raw_tmpfs_downtime_ms")  # type: ignore[operator]
        parts.append(f"{size}: {r:.2f}×")
        ratios.append(r)
        if size >= 512:
            worst = r if worst is None else max(worst, r)
    pooled = res.get("b_ratio_pooled")
    n = len([r for r in res.get("sweep", []) if "b_ratio" in r])
    out.append(
        (
            "b. memsnap downtime / raw CRIU into the same tmpfs: median of the per-run ratios (same job, "
            "same run) over all sizes; per size: ratio of the medians",
            f"≤ {GOAL_OVERHEAD_X:.2f}×",
            f"{pooled:.2f}× over {n} runs ({', '.join(parts)})" if pooled else "–",
            pooled <= GOAL_OVERHEAD_X if pooled else None,
        )
    )
    # c link
    big = [s for size, s in sw.items() if size >= 1024]
    if big:
        nom = min(v(s, "ms_drain_link_fraction") or 0 for s in big)
        ceil_MBps = res.get("link_check_1gbit", {}).get("write_MBps")
        ceil = min((v(s, "stored_MBps") or 0) / ceil_MBps for s in big) if ceil_MBps else None
        out.append(
            (
                "c. drain throughput / 1 Gbit/s link, random memory ≥ 1 GiB (worst size)",
                f"≥ {GOAL_LINK:.2f}",
                f"{nom:.2f} of nominal 125 MB/s; "
                + (
                    f"{ceil:.2f} of the {ceil_MBps:.0f} MB/s that a plain sequential write through the same "
                    "mount reaches"
                    if ceil
                    else ""
                ),
                nom >= GOAL_LINK,
            )
        )
    # c cap
    cap = [s for s in res["summary"]["cap"] if s["group"].split("|")[1] == "random"]
    if cap:
        worst_cap = min(v(s, "cap_fraction_stored") or 0 for s in cap)
        out.append(
            (
                "c. (issue #3) drain throughput / --drain-bandwidth cap, random memory (worst)",
                f"≥ {GOAL_CAP:.2f}",
                f"{worst_cap:.2f}",
                worst_cap >= GOAL_CAP,
            )
        )
    # e
    if at2:
        lz = v(at2, "ms_restore_lazy_first_tick_s")
        lazies = [v(s, "ms_restore_lazy_first_tick_s") for s in sw.values()]
        lazies = [x for x in lazies if x is not None]
        flat = f"; {min(lazies):.3f}–{max(lazies):.3f} s over {min(sw)}–{max(sw)} MiB" if lazies else ""
        out.append(
            (
                f"e. lazy restore: time to first tick at {size2} MiB (flat in size)",
                f"≤ {GOAL_LAZY_S:.1f} s",
                f"{lz:.3f} s{flat}" if lz is not None else "–",
                (lz <= GOAL_LAZY_S and max(lazies) <= GOAL_LAZY_S) if lz is not None else None,
            )
        )
    idle = res.get("idle") or {}
    if idle:
        out.append(
            (
                f"f. daemon idle CPU over {idle['seconds']:.0f} s",
                f"< {GOAL_IDLE_CPU}%",
                f"{idle['cpu_percent']:.2f}%",
                idle["cpu_percent"] < GOAL_IDLE_CPU,
            )
        )
        out.append(
            (
                "f. daemon RSS (idle, after all the work above)",
                f"< {GOAL_IDLE_RSS_MB:.0f} MB",
                f"{idle['rss_mb_max']:.1f} MB (fresh daemon: {res.get('daemon_rss_mb_fresh', 0):.1f} MB)",
                idle["rss_mb_max"] < GOAL_IDLE_RSS_MB,
            )
        )
    return out


def add_derived(res: dict[str, Any]) -> None:
    """Per-row numbers derived from the raw ones (kept out of bench.py so old JSON re-renders)."""
    for r in res.get("sweep", []) + res.get("torch", []) + res.get("link", []) + res.get("cap", []):
        if "stored_bytes" in r and r.get("ms_drain_s") and "stored_MBps" not in r:
            r["stored_MBps"] = r["stored_bytes"] / r["ms_drain_s"] / 1e6
        if r.get("raw_tmpfs_downtime_ms") and "ms_downtime_ms" in r:  # paired: same job, same run
            r["b_ratio"] = r["ms_downtime_ms"] / r["raw_tmpfs_downtime_ms"]
    from statistics import median

    ratios = [r["b_ratio"] for r in res.get("sweep", []) if "b_ratio" in r]
    res["b_ratio_pooled"] = median(ratios) if ratios else None

    for part, key in (("sweep", "mib"), ("link", "link_mbit"), ("torch", None)):
        for s in res["summary"].get(part, []):
            rows = [
                r for r in res.get(part, []) if "error" not in r and (key is None or r[key] == s["group"])
            ]
            for k in ("stored_MBps", "b_ratio"):
                vals = [r[k] for r in rows if k in r]
                if vals:
                    s[k], s[k + "__min"], s[k + "__max"] = median(vals), min(vals), max(vals)


def markdown(res: dict[str, Any], name: str) -> str:
    m = res["machine"]
    sw = _rows(res["summary"]["sweep"])
    lines: list[str] = []
    add = lines.append
    add(f"# memsnap benchmark{' (quick subset)' if res.get('quick') else ''}\n")
    add(
        f"Generated by `scripts/bench/run.sh{' --quick' if res.get('quick') else ''}` on {m['date_utc']} "
        f"(memsnap {m['git']}), {res.get('elapsed_s', 0) / 60:.1f} min. Every number is the **median of "
        f"{res['reps']} runs** with (min–max); the job's downtime is the largest gap between two of its own "
        f"timestamped ticks (it ticks every {res['tick_interval_s'] * 1000:.0f} ms), restore time runs from "
        "the request to the restored job's first tick. Method: docs/benchmarks.md.\n"
    )
    add("| machine | |\n|---|---|")
    for k, label in (
        ("cpu", "CPU"),
        ("cores", "cores"),
        ("hypervisor", "hypervisor"),
        ("mem_gib", "memory (GiB)"),
        ("os", "OS"),
        ("kernel", "kernel"),
        ("criu", "CRIU"),
        ("python", "Python"),
        ("openssh", "OpenSSH"),
        ("sshfs", "sshfs"),
        ("tier_fs", "memory tier"),
        ("store_backing_fs", "store server's disk"),
        ("loadavg_start", "load average at start"),
        ("loadavg_end", "load average at end"),
    ):
        val = m.get(k)
        if isinstance(val, (list, tuple)):
            val = " / ".join(f"{x:.2f}" for x in val)
        add(f"| {label} | {val} |")
    lc, lu = res.get("link_check_1gbit", {}), res.get("link_check_unlimited", {})
    add(
        f"\nNetwork store: sshd in its own network namespace, veth shaped with `tc tbf rate 1gbit` both ways, "
        f"mounted with sshfs (aes128-gcm) as memsnapd's `--store-dir`. A plain sequential write (fsynced) / read "
        f"of {lc.get('mib')} MiB through the mount: **{lc.get('write_MBps')} / {lc.get('read_MBps')} MB/s** at "
        f"1 Gbit/s (nominal 125 MB/s), {lu.get('write_MBps')} / {lu.get('read_MBps')} MB/s with no limit.\n"
    )

    add("## Goals\n\n| goal | target | measured | |\n|---|---|---|---|")
    for g, target, got, ok in goals(res):
        add(f"| {g} | {target} | {got} | {mark(ok)} |")

    add("\n## a/b. Job downtime during a checkpoint (ms; the job keeps running)\n")
    add(
        "| memory | quiet tick gap | memsnap → memory tier | raw `criu dump --leave-running` → tmpfs | "
        "raw CRIU → network store | memsnap / raw tmpfs (per-run ratio) | raw network / memsnap |\n|---|---|---|---|---|---|---|"
    )
    for size, s in sorted(sw.items()):
        add(
            f"| {size} MiB | {f(s, 'quiet_gap_ms', nd=1, spread=False)} | {f(s, 'ms_downtime_ms')} | "
            f"{f(s, 'raw_tmpfs_downtime_ms')} | {f(s, 'raw_net_downtime_ms')} | "
            f"{f(s, 'b_ratio', nd=2)} | "
            f"{ratio(v(s, 'raw_net_downtime_ms'), v(s, 'ms_downtime_ms'), 1)} |"
        )
    add(
        "\nCheckpoint call latency (until the image is staged, hashed and published; the job already runs again):\n"
    )
    add(
        "| memory | memsnap checkpoint RPC (ms) | raw CRIU wall (ms) | CRIU's own frozen time in memsnap (ms) | "
        "RPC / raw |\n|---|---|---|---|---|"
    )
    for size, s in sorted(sw.items()):
        add(
            f"| {size} MiB | {f(s, 'ms_ckpt_rpc_ms')} | {f(s, 'raw_tmpfs_wall_ms')} | {f(s, 'ms_criu_frozen_ms')} | "
            f"{ratio(v(s, 'ms_ckpt_rpc_ms'), v(s, 'raw_tmpfs_wall_ms'))} |"
        )

    add(
        "\n## c. Time to durable over the 1 Gbit/s network store (random memory, no `--drain-bandwidth` cap)\n"
    )
    add(
        "| memory | image (MiB) | stored (MiB) | time to durable from the request (s) | drain (s) | "
        "stored MB/s | of the link (125 MB/s) |\n|---|---|---|---|---|---|---|"
    )
    for size, s in sorted(sw.items()):
        add(
            f"| {size} MiB | {f(s, 'size_bytes', 1 / 2**20, spread=False)} | "
            f"{f(s, 'stored_bytes', 1 / 2**20, spread=False)} | {f(s, 'ms_durable_s', nd=1)} | "
            f"{f(s, 'ms_drain_s', nd=1)} | {f(s, 'stored_MBps', nd=1)} | "
            f"{f(s, 'ms_drain_link_fraction', nd=2)} |"
        )
    link = _rows(res["summary"].get("link", []))
    if link:
        add(f"\nLink sweep ({res['config']['link_sweep_mib']} MiB random, same store, tbf rate changed):\n")
        add("| link | time to durable (s) | stored MB/s | of the link |\n|---|---|---|---|")
        for rate, s in sorted(link.items()):
            add(
                f"| {rate} Mbit/s | {f(s, 'ms_durable_s', nd=1)} | {f(s, 'stored_MBps', nd=1)} | "
                f"{f(s, 'ms_drain_link_fraction', nd=2)} |"
            )
        s1 = sw.get(512)
        if s1:
            add(
                f"| 1000 Mbit/s (size sweep) | {f(s1, 'ms_durable_s', nd=1)} | {f(s1, 'stored_MBps', nd=1)} | "
                f"{f(s1, 'ms_drain_link_fraction', nd=2)} |"
            )

    cap = res["summary"].get("cap", [])
    if cap:
        add("\n## c. Issue #3: time to durable against the `--drain-bandwidth` cap\n")
        add(
            "Same network store (1 Gbit/s); the cap counts stored (compressed) bytes, so compressible memory "
            "drains faster than cap × raw size.\n"
        )
        add(
            "| cap | memory | size | time to durable (s) | drain (s) | stored (MiB) | stored MB/s / cap | "
            "raw MB/s |\n|---|---|---|---|---|---|---|---|"
        )
        for s in sorted(
            cap,
            key=lambda s: (s["group"].split("|")[0], s["group"].split("|")[1], int(s["group"].split("|")[2])),
        ):
            c, data, mib = s["group"].split("|")
            add(
                f"| {c}/s ({v(s, 'cap_MBps'):.1f} MB/s) | {data} | {mib} MiB | {f(s, 'ms_durable_s', nd=1)} | "
                f"{f(s, 'ms_drain_s', nd=2)} | {f(s, 'stored_bytes', 1 / 2**20, nd=1, spread=False)} | "
                f"{f(s, 'cap_fraction_stored', nd=2)} | {f(s, 'ms_drain_MBps', nd=0)} |"
            )

    add("\n## d/e. Restore: time from the request to the job's first tick (s)\n")
    add(
        "| memory | raw `criu restore` from tmpfs | memsnap from the tier | memsnap **lazy** from the tier | "
        "lazy: all pages in | raw `criu restore` from the network store | memsnap from the store (fetch) | "
        "store / tier |\n|---|---|---|---|---|---|---|---|"
    )
    for size, s in sorted(sw.items()):
        add(
            f"| {size} MiB | {f(s, 'raw_restore_tmpfs_s', nd=2)} | {f(s, 'ms_restore_tier_first_tick_s', nd=2)} | "
            f"{f(s, 'ms_restore_lazy_first_tick_s', nd=3)} | {f(s, 'ms_restore_lazy_all_pages_s', nd=2)} | "
            f"{f(s, 'raw_restore_net_s', nd=2)} | {f(s, 'ms_restore_store_first_tick_s', nd=2)} "
            f"({f(s, 'ms_restore_store_fetch_ms', 1e-3, nd=1, spread=False)}) | "
            f"{ratio(v(s, 'ms_restore_store_first_tick_s'), v(s, 'ms_restore_tier_first_tick_s'), 1)} |"
        )

    tor = _rows(res["summary"].get("torch", [])).get("pytorch")
    if tor:
        add("\n## PyTorch CPU training job (tests/workloads/train.py's model, one step every 10 ms)\n")
        add(
            f"Image {f(tor, 'size_bytes', 1 / 2**20, spread=False)} MiB, stored "
            f"{f(tor, 'stored_bytes', 1 / 2**20, spread=False)} MiB, RSS {f(tor, 'rss_bytes', 1e-6, spread=False)} MB; "
            f"quiet step gap {f(tor, 'quiet_gap_ms', nd=1, spread=False)} ms.\n"
        )
        add("| | memsnap | raw CRIU → tmpfs | raw CRIU → network store |\n|---|---|---|---|")
        add(
            f"| job downtime (ms) | {f(tor, 'ms_downtime_ms')} | {f(tor, 'raw_tmpfs_downtime_ms')} | "
            f"{f(tor, 'raw_net_downtime_ms')} |"
        )
        add(
            f"| checkpoint call (ms) | {f(tor, 'ms_ckpt_rpc_ms')} | {f(tor, 'raw_tmpfs_wall_ms')} | "
            f"{f(tor, 'raw_net_wall_ms')} |"
        )
        add(f"| time to durable (s) | {f(tor, 'ms_durable_s', nd=2)} | – | (= the dump) |")
        add(
            f"| restore to first step (s) | tier {f(tor, 'ms_restore_tier_first_tick_s', nd=2)}, lazy "
            f"{f(tor, 'ms_restore_lazy_first_tick_s', nd=3)}, store {f(tor, 'ms_restore_store_first_tick_s', nd=2)} | "
            f"{f(tor, 'raw_restore_tmpfs_s', nd=2)} | {f(tor, 'raw_restore_net_s', nd=2)} |"
        )

    idle = res.get("idle") or {}
    if idle:
        add(
            f"\n## f. Daemon at idle\n\nOver {idle['seconds']:.0f} s after all of the above (psutil on memsnapd): "
            f"CPU **{idle['cpu_percent']:.2f}%** of one core, RSS **{idle['rss_mb_max']:.1f} MB** "
            f"(USS {idle['uss_mb']:.1f} MB, {idle['threads']} threads); a freshly started daemon has "
            f"{res.get('daemon_rss_mb_fresh', 0):.1f} MB.\n"
        )
    if res.get("cli_status_s"):
        add(f"\nAll memsnap calls above are gRPC calls from the harness; the `memsnapctl` command line adds its own "
            f"start-up on top (`memsnapctl status`: {res['cli_status_s']:.2f} s).\n")
    if res.get("errors"):
        add("\n## Errors during the run\n")
        for e in res["errors"]:
            add(f"- {e['part']}: {e['error']}")
    add(f"\nPlot: `{name}.png`. Raw data (every run): `{name}.json`.\n")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sw = _rows(res["summary"]["sweep"])
    sizes = sorted(sw)
    fig, ax = plt.subplots(2, 2, figsize=(13, 9))

    def series(a: Any, key: str, label: str, scale: float = 1.0, style: str = "o-") -> None:
        xs = [x for x in sizes if v(sw[x], key) is not None]
        ys = [v(sw[x], key) * scale for x in xs]  # type: ignore[operator]
        lo = [sw[x][key + "__min"] * scale for x in xs]
        hi = [sw[x][key + "__max"] * scale for x in xs]
        if xs:
            a.errorbar(
                xs,
                ys,
                yerr=[
                    [y - lo_ for y, lo_ in zip(ys, lo, strict=True)],
                    [h - y for y, h in zip(ys, hi, strict=True)],
                ],
                fmt=style,
                label=label,
                capsize=3,
            )

    a = ax[0][0]
    series(a, "raw_net_downtime_ms", "raw CRIU → network store", 1e-3)
    series(a, "raw_tmpfs_downtime_ms", "raw CRIU → tmpfs", 1e-3)
    series(a, "ms_downtime_ms", "memsnap → memory tier", 1e-3, "s--")
    a.set(
        xscale="log",
        yscale="log",
        xlabel="job memory (MiB)",
        ylabel="job downtime (s)",
        title="a/b. Job downtime during a checkpoint",
    )
    a.set_xticks(sizes, [str(s) for s in sizes])
    a.legend()
    a.grid(True, which="both", alpha=0.3)

    a = ax[0][1]
    series(a, "stored_MBps", "memsnap drain, 1 Gbit/s link")
    a.axhline(125, color="k", lw=1, label="link: 125 MB/s")
    a.axhline(125 * GOAL_LINK, color="r", ls=":", lw=1, label=f"goal: {GOAL_LINK:.0%} of the link")
    ceil = res.get("link_check_1gbit", {}).get("write_MBps")
    if ceil:
        a.axhline(ceil, color="g", ls="--", lw=1, label=f"plain write through the mount: {ceil:.0f} MB/s")
    a.set(
        xscale="log",
        xlabel="job memory (MiB)",
        ylabel="MB/s",
        ylim=(0, 140),
        title="c. Drain throughput to the network store",
    )
    a.set_xticks(sizes, [str(s) for s in sizes])
    a.legend(loc="lower right", fontsize=8)
    a.grid(True, alpha=0.3)

    a = ax[1][0]
    series(a, "raw_restore_net_s", "raw CRIU from network store")
    series(a, "ms_restore_store_first_tick_s", "memsnap from store (fetch + restore)")
    series(a, "raw_restore_tmpfs_s", "raw CRIU from tmpfs")
    series(a, "ms_restore_tier_first_tick_s", "memsnap from tier", style="s--")
    series(a, "ms_restore_lazy_first_tick_s", "memsnap lazy from tier", style="^-")
    a.axhline(GOAL_LAZY_S, color="r", ls=":", lw=1, label=f"lazy goal {GOAL_LAZY_S} s")
    a.set(
        xscale="log",
        yscale="log",
        xlabel="job memory (MiB)",
        ylabel="request → first tick (s)",
        title="d/e. Restore",
    )
    a.set_xticks(sizes, [str(s) for s in sizes])
    a.legend(fontsize=8)
    a.grid(True, which="both", alpha=0.3)

    a = ax[1][1]
    cap = res["summary"].get("cap", [])
    for data, style in (("random", "o-"), ("compressible", "s--")):
        for c in sorted({s["group"].split("|")[0] for s in cap}):
            rows = sorted(
                [s for s in cap if s["group"].split("|")[:2] == [c, data]],
                key=lambda s: int(s["group"].split("|")[2]),
            )
            if rows:
                a.plot(
                    [int(s["group"].split("|")[2]) for s in rows],
                    [v(s, "ms_durable_s") for s in rows],
                    style,
                    label=f"{data}, cap {c}/s",
                )
                if data == "random":
                    xs = [int(s["group"].split("|")[2]) for s in rows]
                    a.plot(
                        xs, [x * 2**20 / 1e6 / v(rows[0], "cap_MBps") for x in xs], ":", color="gray", lw=1
                    )
    a.set(
        xscale="log",
        yscale="log",
        xlabel="job memory (MiB)",
        ylabel="time to durable (s)",
        title="c. Issue #3: time to durable vs --drain-bandwidth (dotted: size / cap)",
    )
    if cap:
        xs = sorted({int(s["group"].split("|")[2]) for s in cap})
        a.set_xticks(xs, [str(x) for x in xs])
    a.legend(fontsize=8)
    a.grid(True, which="both", alpha=0.3)

    from matplotlib.ticker import NullLocator

    for a in ax.flat:  # only the sizes as x ticks (log-axis minor labels overlap them)
        a.xaxis.set_minor_locator(NullLocator())
    fig.suptitle(
        f"memsnap vs raw CRIU — {res['machine']['cpu']}, {res['machine']['cores']} cores, "
        f"kernel {res['machine']['kernel']}, CRIU {res['machine']['criu']}; medians of {res['reps']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(res: dict[str, Any], out_dir: Path, name: str) -> None:
    add_derived(res)
    (out_dir / f"{name}.md").write_text(markdown(res, name))
    plot(res, out_dir / f"{name}.png")


if __name__ == "__main__":
    p = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/bench.json")
    render(json.loads(p.read_text()), p.parent, p.stem)
    print(f"wrote {p.with_suffix('.md')} and {p.with_suffix('.png')}")
