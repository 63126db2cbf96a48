#!/usr/bin/env python3
"""Raw `criu dump` / `criu restore -d` of 2, 4 and 8 GiB of random memory with two CRIU builds, alternating.

One workload per size (tests/workloads/counter.py --mib N, random memory, a fresh SHA-1 digest of all of it on
every tick). Each cycle dumps the running process with one criu (without --leave-running: the process is killed
and its memory freed) into a tmpfs dir under /dev/shm, restores it from there with the same criu
(`restore -d`), deletes the images, and checks the restored process: same host pid alive, and the second
fresh digest it prints after the restore (computed wholly from restored memory) equals the one it started
with. The next cycle dumps that restored process with the other criu. Per run the two versions go A B, then
B A, then A B. The first dump of a size is of the freshly started process, every later one of a restored
one: the record says which.

Times are wall-clock around the criu command; CRIU's own stats (stats-dump: frozen, memdump, memwrite;
stats-restore: restore) are decoded without crit from the stats images CRIU leaves in its -W work dir.

Usage (root): scripts/bench/criu_versions.py [--sizes 2,4,8] [--runs 3] [--runs-8 1]
    [--criu-a /usr/local/sbin/criu] [--criu-b /opt/criu-4.2.1/sbin/criu] [--out bench/results/criu-versions]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
COUNTER = REPO / "tests" / "workloads" / "counter.py"
BASE = Path("/dev/shm/criu-versions")
EMPTY_LIBDIR = BASE / "empty-libdir"  # as bench.py and memsnapd: no CRIU plugins
GIB = 1 << 30


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def mem_available() -> int:
    for ln in Path("/proc/meminfo").read_text().splitlines():
        if ln.startswith("MemAvailable:"):
            return int(ln.split()[1]) * 1024
    return 0


def criu_version(criu: str) -> str:
    out = subprocess.run([criu, "--version"], capture_output=True, text=True).stdout
    return next((ln.split()[1] for ln in out.splitlines() if ln.startswith("Version:")), "?")


# -- CRIU stats images (stats.proto: stats_entry{dump=1, restore=2}; times in microseconds) -------------
DUMP_FIELDS = {1: "freezing_time", 2: "frozen_time", 3: "memdump_time", 4: "memwrite_time", 5: "pages_scanned",
               7: "pages_written", 10: "page_pipes", 11: "page_pipe_bufs"}
RESTORE_FIELDS = {1: "pages_compared", 2: "pages_skipped_cow", 3: "forking_time", 4: "restore_time",
                  5: "pages_restored"}


def _varint(b: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return v, i


def _fields(b: bytes) -> dict[int, Any]:
    out: dict[int, Any] = {}
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            out[num], i = _varint(b, i)
        elif wt == 2:
            n, i = _varint(b, i)
            out[num], i = b[i:i + n], i + n
        elif wt == 5:
            out[num], i = struct.unpack_from("<I", b, i)[0], i + 4
        elif wt == 1:
            out[num], i = struct.unpack_from("<Q", b, i)[0], i + 8
        else:
            raise ValueError(f"wire type {wt}")
    return out


def read_stats(path: Path) -> dict[str, int]:
    """The dump or restore entry of a stats-dump / stats-restore image (one u32 magic, then u32 size + entry)."""
    if not path.exists():
        return {}
    raw = path.read_bytes()
    for off in (4, 8):  # stats images carry no common magic; be lenient
        try:
            (size,) = struct.unpack_from("<I", raw, off)
            if off + 4 + size > len(raw):
                continue
            top = _fields(raw[off + 4:off + 4 + size])
        except (ValueError, IndexError, struct.error):
            continue
        if 1 in top:
            names, sub = DUMP_FIELDS, top[1]
        elif 2 in top:
            names, sub = RESTORE_FIELDS, top[2]
        else:
            continue
        return {names[k]: v for k, v in _fields(sub).items() if k in names}
    return {}


# -- the workload --------------------------------------------------------------------------------------
class Workload:
    def __init__(self, mib: int) -> None:
        self.mib = mib
        self.logpath = BASE / f"counter-{mib}.log"
        self.logpath.unlink(missing_ok=True)
        # A session leader with its stdio on files: raw CRIU dumps it without --shell-job.
        with open(self.logpath, "w") as out, open(os.devnull) as null:
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, str(COUNTER), "--mib", str(mib), "--interval", "0.2", "--digest-every", "1"],
                stdin=null, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        t0 = time.monotonic()
        start = self.wait_line(lambda w: w[0] == "start", 0, timeout=60 + mib / 100)
        self.digest = start[2]
        log(f"{mib} MiB workload pid {self.pid} up in {time.monotonic() - t0:.1f}s, digest {self.digest}")

    def lines(self) -> list[list[str]]:
        return [ln.split() for ln in self.logpath.read_text().splitlines() if ln.strip()]

    def wait_line(self, pred: Any, skip: int, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for w in self.lines()[skip:]:
                if pred(w):
                    return w
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"workload exited {self.proc.returncode}: {self.logpath}")
            time.sleep(0.1)
        raise TimeoutError(f"no such line in {self.logpath} within {timeout:.0f}s")

    def dumped(self) -> None:
        """After a dump (which kills the tasks): reap our child so its pid is free for the restore."""
        if self.proc is not None:
            self.proc.wait(30)
            self.proc = None
        deadline = time.monotonic() + 30
        while Path(f"/proc/{self.pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def verify_restored(self, nlines_before: int) -> dict[str, Any]:
        """The restored process is alive and its second fresh digest after the restore (read wholly from restored
        memory) is the one it started with."""
        fresh: list[list[str]] = []
        t0 = time.monotonic()
        deadline = t0 + 60 + 2 * self.mib / 300
        while len(fresh) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError(f"restored pid {self.pid}: {len(fresh)} fresh digests in time ({self.logpath})")
            fresh = [w for w in self.lines()[nlines_before:] if w[0] == "tick" and w[-1] == "fresh"]
            time.sleep(0.2)
        alive = Path(f"/proc/{self.pid}").exists()
        ok = alive and fresh[1][3] == self.digest and fresh[1][2] == str(self.pid)
        return {"alive": alive, "digest_after": fresh[1][3], "digest_ok": ok,
                "verify_s": round(time.monotonic() - t0, 2)}

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc is not None:
            self.proc.wait()
        deadline = time.monotonic() + 30
        while Path(f"/proc/{self.pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)


# -- raw CRIU, as scripts/bench/bench.py drives it -------------------------------------------------------
def criu_common(work: Path) -> list[str]:
    return ["-W", str(work), "--ext-unix-sk", "--file-locks", "-v2", "-L", str(EMPTY_LIBDIR)]


def run_criu(argv: list[str], work: Path, what: str) -> float:
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True)
    dt = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"criu {what} failed ({r.returncode}): {r.stderr.strip()[-300:]} (log in {work})")
    return dt


def cycle(w: Workload, criu: str, tag: str) -> dict[str, Any]:
    images, dwork, rwork = BASE / "img", BASE / f"work-dump-{tag}", BASE / f"work-restore-{tag}"
    for d in (images, dwork, rwork):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    rec: dict[str, Any] = {"from_restored": w.proc is None, "mem_available_gib": round(mem_available() / GIB, 1)}
    rec["dump_s"] = run_criu([criu, "dump", "-t", str(w.pid), "-D", str(images), "-o", "dump.log",
                              *criu_common(dwork)], dwork, "dump")
    w.dumped()
    rec["image_bytes"] = sum(p.stat().st_size for p in images.iterdir() if p.is_file())
    rec["dump_stats_us"] = read_stats(dwork / "stats-dump")
    nlines = len(w.lines())
    pidfile = rwork / "root.pid"
    rec["restore_s"] = run_criu([criu, "restore", "-D", str(images), "-d", "--pidfile", str(pidfile),
                                 "-o", "restore.log", *criu_common(rwork)], rwork, "restore")
    rec["restore_stats_us"] = read_stats(rwork / "stats-restore")
    restored = int(pidfile.read_text().strip())
    if restored != w.pid:
        raise RuntimeError(f"restored pid {restored} != {w.pid}")
    shutil.rmtree(images)  # free the tmpfs before the restored process is checked and dumped again
    rec.update(w.verify_restored(nlines))
    if not rec["digest_ok"]:
        raise RuntimeError(f"restore check failed: {rec}")
    for d in (dwork, rwork):
        shutil.rmtree(d, ignore_errors=True)
    return rec


def summarise(runs: list[dict[str, Any]], gib: int) -> dict[str, Any]:
    def med(key: str) -> float:
        return round(float(statistics.median(r[key] for r in runs)), 3)

    def med_stat(group: str, key: str) -> float | None:
        vals = [r[group][key] / 1e6 for r in runs if key in r[group]]
        return round(statistics.median(vals), 3) if vals else None

    s: dict[str, Any] = {"n": len(runs), "dump_s": med("dump_s"), "restore_s": med("restore_s")}
    s["dump_s_per_gib"] = round(s["dump_s"] / gib, 3)
    s["restore_s_per_gib"] = round(s["restore_s"] / gib, 3)
    for k in ("frozen_time", "memdump_time", "memwrite_time"):
        s[f"{k}_s"] = med_stat("dump_stats_us", k)
    s["restore_time_s"] = med_stat("restore_stats_us", "restore_time")
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2,4,8", help="GiB, comma-separated")
    ap.add_argument("--runs", type=int, default=3, help="runs per version and size")
    ap.add_argument("--runs-8", type=int, default=0, help="runs per version at 8 GiB (default: --runs)")
    ap.add_argument("--criu-a", default="/usr/local/sbin/criu")
    ap.add_argument("--criu-b", default="/opt/criu-4.2.1/sbin/criu")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "criu-versions"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (criu)")

    crius = {criu_version(a.criu_a): a.criu_a, criu_version(a.criu_b): a.criu_b}
    va, vb = list(crius)
    BASE.mkdir(parents=True, exist_ok=True)
    EMPTY_LIBDIR.mkdir(exist_ok=True)
    res: dict[str, Any] = {
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg_start": loadavg(),
        "kernel": os.uname().release, "cpus": os.cpu_count(),
        "mem_total_gib": round(int(Path("/proc/meminfo").read_text().split()[1]) / (1 << 20), 1),
        "crius": crius, "images": str(BASE / "img") + " (tmpfs)", "sizes": {}, "skipped": [],
    }
    log(f"criu {va}={a.criu_a}, {vb}={a.criu_b}; load {res['loadavg_start']}")
    for gib in (int(x) for x in a.sizes.split(",")):
        runs = a.runs_8 if gib == 8 and a.runs_8 else a.runs
        # the process and one image of it in memory at once, plus 1 GiB to spare
        need = 2 * gib * GIB + GIB
        if mem_available() < need:
            why = f"{gib} GiB: MemAvailable {mem_available() / GIB:.1f} GiB < {need / GIB:.0f} GiB needed"
            log("SKIP " + why)
            res["skipped"].append(why)
            continue
        log(f"== {gib} GiB, {runs} run(s) per version; free -g:\n" +
            subprocess.run(["free", "-g"], capture_output=True, text=True).stdout)
        w = Workload(gib * 1024)
        per: dict[str, list[dict[str, Any]]] = {va: [], vb: []}
        try:
            for r in range(runs):
                for v in ((va, vb) if r % 2 == 0 else (vb, va)):
                    if mem_available() < gib * GIB + GIB:
                        raise RuntimeError(f"MemAvailable {mem_available() / GIB:.1f} GiB: no room for the image")
                    rec = cycle(w, crius[v], f"{gib}g")
                    rec.update(run=r + 1, version=v, load=loadavg())
                    per[v].append(rec)
                    log(f"{gib} GiB run {r + 1} criu {v}: dump {rec['dump_s']:.2f}s restore {rec['restore_s']:.2f}s "
                        f"(stats {rec['dump_stats_us'].get('memdump_time', 0) / 1e6:.2f}/"
                        f"{rec['restore_stats_us'].get('restore_time', 0) / 1e6:.2f}) digest ok, load {rec['load']}")
        finally:
            w.kill()
            shutil.rmtree(BASE / "img", ignore_errors=True)
        res["sizes"][str(gib)] = {"runs": per, "median": {v: summarise(per[v], gib) for v in per if per[v]}}
        Path(a.out + ".json").write_text(json.dumps(res, indent=1) + "\n")  # partial results survive a later failure
    res["loadavg_end"] = loadavg()
    res["ended_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    Path(a.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
    log(f"done; load {res['loadavg_end']}; wrote {a.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
