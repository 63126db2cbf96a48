#!/usr/bin/env python3
"""How fast this machine hands out memory, by how long ago it was freed (why the data-plane numbers swing).

    scripts/bench/vm_memory.py [--mib 2048] [--idle 0,2,5,20,0] [--reps 2] [--out bench/results]

Run as root on a quiet machine. A VM whose guest reports free pages to its host (virtio-balloon free page
reporting: /sys/module/page_reporting) has those pages taken back by the host; the next touch faults them in
on the host as well. So the cost of memory depends on how long ago the node freed it. This script writes MIB
of random bytes into a file on a tmpfs of its own (huge=always: 2 MiB pages, the order the host takes back)
and on /dev/shm (4 KiB pages), removes it, waits IDLE seconds, and writes it again, for each IDLE in turn,
REPS times. It reports seconds per GiB for each write and the host's reported_kib counter before and after each
wait (when the kernel has it). Writes <out>/vm-memory.json and <out>/vm-memory.md.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPORTED = Path("/sys/module/page_reporting/parameters/reported_kib")
ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")
CHUNK = 1 << 20


def reported_mib() -> float | None:
    try:
        return int(REPORTED.read_text()) / 1024
    except (OSError, ValueError):
        return None


def write_file(path: Path, mib: int, buf: mmap.mmap) -> float:
    """Seconds to write mib MiB into path (a new file); the file is removed after."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        t0 = time.perf_counter()
        for i in range(mib):
            os.pwrite(fd, buf, i * CHUNK)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=2048)
    ap.add_argument("--idle", default="0,2,5,20,0", help="seconds to wait after each free, comma-separated")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "bench" / "results"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (it mounts a tmpfs)", file=sys.stderr)
        return 2
    idles = [float(x) for x in args.idle.split(",")]
    buf = mmap.mmap(-1, CHUNK)
    buf.write(os.urandom(CHUNK))
    huge = Path(tempfile.mkdtemp(prefix="memsnap-vmmem-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.mib * 2}m,huge=always,mode=0700", "tmpfs", str(huge)],
                   check=True)
    shm = Path(tempfile.mkdtemp(prefix="memsnap-vmmem-", dir="/dev/shm"))
    rows: list[dict[str, object]] = []
    t_start = time.time()
    try:
        for rep in range(args.reps):
            for fs, d in (("tmpfs huge=always (2 MiB pages)", huge), ("/dev/shm (4 KiB pages)", shm)):
                write_file(d / "first", args.mib, buf)  # (the state before the first wait: just freed)
                for pos, idle in enumerate(idles):
                    before = reported_mib()
                    time.sleep(idle)
                    after = reported_mib()
                    s = write_file(d / "f", args.mib, buf)
                    row = {"rep": rep, "fs": fs, "pos": pos, "idle_s": idle, "s_per_gib": s / (args.mib / 1024),
                           "reported_during_wait_mib": None if before is None or after is None else after - before}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        subprocess.run(["umount", str(huge)], check=False)
        os.rmdir(huge)
        os.rmdir(shm)
    order = ORDER.read_text().strip() if ORDER.exists() else "(no page_reporting module)"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start)), "mib": args.mib, "reps": args.reps,
            "page_reporting_order": order, "kernel": os.uname().release,
            "load_before": os.getloadavg()[0]}
    (out / "vm-memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        "# How fast this VM hands out memory, by how long ago it was freed",
        "",
        f"`scripts/bench/vm_memory.py --mib {args.mib} --idle {args.idle} --reps {args.reps}`, {meta['date']}, "
        f"kernel {meta['kernel']}, free page reporting order {order}. Each cell: the median of {args.reps} writes "
        f"of {args.mib} MiB (1 MiB pwrites of random bytes into a new file), s/GiB, after the previous write's "
        "file was removed and the script waited that long; in brackets the MiB the guest reported to its host "
        "during the wait (the reported_kib counter). The first column's wait follows a write removed at once.",
        "",
        "| filesystem | " + " | ".join(f"wait {i:g} s" for i in idles) + " |",
        "|---|" + "---:|" * len(idles),
    ]
    for fs in dict.fromkeys(str(r["fs"]) for r in rows):
        cells = []
        for pos in range(len(idles)):
            got = [r for r in rows if r["fs"] == fs and r["pos"] == pos]
            secs = [float(r["s_per_gib"]) for r in got]  # type: ignore[arg-type]
            rep_mib = [float(r["reported_during_wait_mib"]) for r in got  # type: ignore[arg-type]
                       if r["reported_during_wait_mib"] is not None]
            cells.append(f"{statistics.median(secs):.2f}" + (f" ({statistics.median(rep_mib):.0f})" if rep_mib else ""))
        lines.append(f"| {fs} | " + " | ".join(cells) + " |")
    (out / "vm-memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
