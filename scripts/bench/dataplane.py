#!/usr/bin/env python3
"""The data plane side by side (issue #30): memsnap's checkpoint, drain and restores against the plain baselines
(raw CRIU, cp + fsync, a plain read), for one or two memsnap trees, in one run.

    scripts/bench/dataplane.py [--mib 1024,2048,4096] [--reps 3] [--a OLD_TREE] [--b NEW_TREE] [--compressible]
        [--daemon-arg=--compression-level=1 ...] [--no-warmup] [--free-page-reporting hold|leave]
        [--out bench/results]

Run as root. OLD_TREE is e.g. `git worktree add --detach /work/old <commit>`; NEW_TREE defaults to this repo.
Each tree's memsnapd runs with PYTHONPATH=<tree> (bench.Daemon, as scripts/bench/ab.py does, but with a socket,
state dir and tier of this script's own, so that it never wipes those of another bench run); the store is a
POSIX directory on this machine's disk (under bench.BASE, not tmpfs), the tier a tmpfs dir under /dev/shm.
It refuses to start while another memsnapd runs on this machine, and notes any that start during the run.

One cycle = one tree, one size, one fresh daemon, one job (bench.counter_argv: MIB of random memory, or with
--compressible a repeating pattern, ticking every 5 ms):

  1. plain baselines on that job: `criu dump --leave-running` into a fresh tmpfs dir (wall time, as bench.py
     does it, plus the mount options memsnapd gives CRIU for a job in a mount namespace of its own);
     cp of those image files onto the store's filesystem, then fsync of each file and of the dir (timed
     together); the tmpfs dump is removed; sync + drop_caches; a plain read of every copied file, by one
     thread, then again after drop_caches by 8 threads (the goal takes the faster); copy removed;
  2. memsnap: checkpoint into the tier (call time, the job's downtime), drain to durable, with memsnapd's VmRSS
     (and RssAnon/RssFile/RssShmem) and utime+stime sampled every 50 ms (growth = peak during the drain minus
     idle before the call; core-seconds from the end of the call to durable); job killed; restore from the
     tier (to the first tick), killed; evict, sync + drop_caches, restore from the store (to the first tick;
     memsnap's fetch time; the node's file page cache, /proc/meminfo Cached less Shmem, sampled every 20 ms:
     its peak and its value at the first tick above the start), killed; checkpoint deleted; then the daemon is
     asked for leftover checkpoints and running jobs (none expected), stopped, and the store, tier and copies
     are wiped.

On a VM that reports free pages to its host (bench/results/vm-memory.md) the reporting is held off for the
sitting and the memory touched once first (bench.FreePageReportingHeld; --free-page-reporting leave keeps it):
otherwise each step's cost depends on how long ago the node freed memory. At most the job and one image are in
memory at a time (the tmpfs dump is gone before memsnap's checkpoint) and
one image copy is on disk. Reps are the outer loop, sizes the inner one; in each (rep, size) the trees take
turns going first. Ratios are of the medians per size; the plain baselines pool the cycles of both trees.
Writes <out>/dataplane.json (every run, the medians, the ratios) and <out>/dataplane.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import psutil  # noqa: E402

import bench  # noqa: E402
from memsnap import mounts, proc  # noqa: E402
from memsnap.criu import own_mount_ns  # noqa: E402
from memsnap.proc import tree_rss  # noqa: E402

GiB = 1 << 30
SAMPLE_S = 0.05
STORE = bench.BASE / "dataplane-store"
PLAIN = bench.BASE / "dataplane-plain"
DAEMON = bench.BASE / "dataplane-daemon"  # socket, log and state dir (bench.Daemon's are bench.BASE / "daemon")
TIER = Path("/dev/shm/memsnap-dataplane-tier")
RAW = bench.RAWTMP / "dataplane"
CLK_TCK = os.sysconf("SC_CLK_TCK")
GOAL_DRAIN = 0.8  # plain cp+fsync s / memsnap drain s, at least
GOAL_STORE = 0.9  # (plain read s + memsnap restore from the tier s) / memsnap restore from the store s, at least
GOAL_CKPT = 1.15  # memsnap checkpoint call / raw criu dump wall, at most
GOAL_FLAT = 1.2  # largest / smallest median s/GiB across sizes, at most (this script's reading of "flat")
say = bench.say


# -- helpers ---------------------------------------------------------------------------------------------
def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def tree_commit(tree: Path) -> str:
    git = ["git", "-C", str(tree)]
    sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "memsnap"], capture_output=True, text=True)
    return (sha or "?") + ("+dirty" if dirty.stdout.strip() else "")


def daemon_config(tree: Path, extra: list[str]) -> dict[str, str]:
    """The tree's effective settings for the data plane (memsnapd --print-config with the bench's flags)."""
    args = [sys.executable, "-m", "memsnap.daemon", "--config", "/dev/null", "--store-dir", str(STORE),
            "--tier-dir", str(TIER), "--state-dir", str(DAEMON / "state"), *extra,
            "--print-config"]
    r = subprocess.run(args, capture_output=True, text=True, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
    keep = {"store.format", "store.chunk_size", "store.pack_size", "store.chunk_cache_size", "drain.concurrency",
            "drain.compression_level", "drain.compression_threads", "drain.bandwidth", "tier.huge_pages"}
    out: dict[str, str] = {}
    section = ""
    for ln in r.stdout.splitlines():
        if m := re.match(r"^\[(\w+)\]$", ln):
            section = m.group(1)
        elif (m := re.match(r"^(\w+) = (.*?)(\s+#.*)?$", ln)) and f"{section}.{m.group(1)}" in keep:
            out[f"{section}.{m.group(1)}"] = m.group(2)
    return out


def machine() -> dict[str, Any]:
    """bench.machine() without the network store's tools (this script has no network store)."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "")
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    hyp = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Hypervisor vendor")), "")
    criu = subprocess.run([bench.CRIU, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "hypervisor": hyp,
        "mem_gib": round(psutil.virtual_memory().total / GiB, 1),
        "swap_gib": round(psutil.swap_memory().total / GiB, 1),
        "os": bench._os_release(),
        "kernel": os.uname().release,
        "criu": criu.replace("Version: ", ""),
        "python": sys.version.split()[0],
        "thp": thp.read_text().strip() if thp.exists() else "",
        "tier_fs": bench._fstype(TIER.parent),
        "store_fs": bench._fstype(bench.BASE),
    }


def stats(vals: list[float]) -> dict[str, float] | None:
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def values(rows: list[dict[str, Any]], key: str, mib: int, tree: str | None = None) -> list[float]:
    """key over the good rows of one size (of one tree; tree None = every tree: the plain baselines)."""
    return [r[key] for r in rows if r["mib"] == mib and "error" not in r and (tree is None or r["tree"] == tree)
            and isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def med(rows: list[dict[str, Any]], key: str, mib: int, tree: str | None = None) -> float | None:
    v = values(rows, key, mib, tree)
    return statistics.median(v) if v else None


def div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- the daemon ----------------------------------------------------------------------------------------------
class Daemon(bench.Daemon):
    """bench.Daemon with this script's own socket, log, state dir and tier (bench.Daemon.start() wipes the state
    dir and bench.TIER before it starts: with the shared ones it would wipe another bench run's)."""

    def __init__(self, store_dir: Path, extra: list[str] | None = None) -> None:
        super().__init__(store_dir, extra)
        self.base = DAEMON
        self.sock = str(DAEMON / "memsnapd.sock")

    def start(self) -> Daemon:
        saved, bench.TIER = bench.TIER, TIER
        try:
            super().start()
        finally:
            bench.TIER = saved
        return self


def other_daemons(mine: int | None = None) -> list[str]:
    """memsnapd processes on this machine other than `mine` (another bench run, a test, the service)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if p.info["pid"] != mine and ("memsnap.daemon" in cmd or any(c.endswith("/memsnapd") for c in cmd[:2])):
            found.append(f"{p.info['pid']}: {' '.join(cmd)[:160]}")
    return found


# -- the daemon's RSS and CPU ------------------------------------------------------------------------------
class Sampler(threading.Thread):
    """Every 50 ms: unix time, utime+stime in seconds and the RSS fields (bytes) of one process."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, float, dict[str, int]]] = []
        self._stop_ev = threading.Event()

    def sample(self) -> tuple[float, float, dict[str, int]]:
        t = time.time()
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()  # fields[0] is field 3 (state): utime, stime = 14, 15
        cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
        mem = {}
        for ln in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, rest = ln.partition(":")
            if key in self.FIELDS:
                mem[key] = int(rest.split()[0]) * 1024
        return t, cpu, mem

    def run(self) -> None:
        while not self._stop_ev.is_set():
            self.samples.append(self.sample())
            self._stop_ev.wait(SAMPLE_S)

    def stop(self) -> None:
        self._stop_ev.set()
        self.join()
        self.samples.append(self.sample())

    def cpu_at(self, t: float) -> float:
        """CPU seconds at time t, linear between the samples around it."""
        prev = self.samples[0]
        for s in self.samples:
            if s[0] >= t:
                if s[0] <= prev[0]:
                    return s[1]
                return prev[1] + (t - prev[0]) / (s[0] - prev[0]) * (s[1] - prev[1])
            prev = s
        return self.samples[-1][1]

    def idle(self, field: str, before: float) -> float:
        """The median of field over the samples before `before`."""
        return statistics.median([m[field] for t, _, m in self.samples if t < before] or [self.samples[0][2][field]])

    def peak(self, field: str, t0: float, t1: float) -> int:
        """The largest field in [t0, t1] (widened by one sample period each side)."""
        return max([m[field] for t, _, m in self.samples if t0 - SAMPLE_S <= t <= t1 + SAMPLE_S]
                   or [self.samples[-1][2][field]])


# -- the plain baselines -----------------------------------------------------------------------------------
def raw_dump(pid: int, images: Path) -> float:
    """bench.raw_dump with the mount options memsnapd gives CRIU for a job in a mount namespace of its own
    (memsnap.criu._common_opts and Criu.dump: auto external mounts with their sharing and masters, the mounts
    the job does not use left out, the job's log mount external, TCP closed); returns the wall time in s."""
    work = bench.BASE / "rawwork" / f"dump-{images.name}"
    shutil.rmtree(work, ignore_errors=True)
    for d in (images, work, bench._EMPTY_LIBDIR):
        d.mkdir(parents=True, exist_ok=True)
    extra = ["--tcp-close"]
    if own_mount_ns(pid):
        extra += ["--external", "mnt[]:sm"]
        for path in mounts.to_leave_out([p.pid for p in proc.tree(pid)]):
            extra += ["--skip-mnt", path]
        if mounts.has_job_log(pid):
            extra += ["--external", f"mnt[{mounts.JOB_LOG}]:{mounts.LOG_MOUNT_KEY}"]
    argv = [bench.CRIU, "dump", "-t", str(pid), "-D", str(images), "--leave-running", "-o", "dump.log",
            *bench.criu_common(work), *extra]
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True)
    dt = time.monotonic() - t0
    if r.returncode != 0:
        logf = work / "dump.log"
        tail = logf.read_text(errors="replace").strip().splitlines()[-3:] if logf.exists() else []
        raise RuntimeError(f"criu dump failed: {' | '.join(tail) or r.stderr.strip()[-300:]} (log {work}/dump.log)")
    shutil.rmtree(work, ignore_errors=True)  # (kept when it failed)
    return dt


def copy_fsync(src: Path, dst: Path) -> tuple[float, float]:
    """cp of every file of src into dst, then fsync of each and of dst; returns (copy s, copy + fsync s)."""
    dst.mkdir(parents=True)
    files = sorted(p for p in src.iterdir() if p.is_file())
    t0 = time.monotonic()
    for p in files:
        shutil.copyfile(p, dst / p.name)
    t1 = time.monotonic()
    for p in files:
        fd = os.open(dst / p.name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    dfd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return t1 - t0, time.monotonic() - t0


def read_all(d: Path) -> tuple[float, int]:
    """Reads every file of d to its end (4 MiB reads); returns (seconds, bytes)."""
    buf = bytearray(4 << 20)
    n = 0
    t0 = time.monotonic()
    for p in sorted(p for p in d.iterdir() if p.is_file()):
        with open(p, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
    return time.monotonic() - t0, n


def read_parallel(d: Path, threads: int = 8) -> tuple[float, int]:
    """Reads every file of d to its end in 4 MiB preads by `threads` threads at once (as memsnap's fetch reads
    its packs: a disk answers several reads in flight faster than one); returns (seconds, bytes)."""
    from concurrent.futures import ThreadPoolExecutor
    piece = 4 << 20
    fds = [os.open(p, os.O_RDONLY) for p in sorted(p for p in d.iterdir() if p.is_file())]
    local = threading.local()

    def read(job: tuple[int, int]) -> int:
        if not hasattr(local, "buf"):
            local.buf = bytearray(piece)
        return os.preadv(job[0], [local.buf], job[1])

    try:
        jobs = [(fd, off) for fd in fds for off in range(0, os.fstat(fd).st_size, piece)]
        t0 = time.monotonic()
        with ThreadPoolExecutor(threads) as pool:
            n = sum(pool.map(read, jobs))
        return time.monotonic() - t0, n
    finally:
        for fd in fds:
            os.close(fd)


def plain(pid: int, log: bench.JobLog, tag: str) -> dict[str, Any]:
    raw, copy = RAW / tag, PLAIN / tag
    out: dict[str, Any] = {}
    try:
        t0 = time.time()
        out["raw_dump_ms"] = raw_dump(pid, raw) * 1000
        out["raw_downtime_ms"] = log.max_gap_ms(pid, t0, time.time())
        out["raw_bytes"] = bench.dir_bytes(raw)
        out["plain_copy_s"], out["plain_cp_fsync_s"] = copy_fsync(raw, copy)
        shutil.rmtree(raw)
        drop_caches()
        out["plain_read_s"], out["plain_read_bytes"] = read_all(copy)
        drop_caches()
        out["plain_read_par_s"], _n = read_parallel(copy)
        out["plain_read_best_s"] = min(out["plain_read_s"], out["plain_read_par_s"])
    finally:
        shutil.rmtree(raw, ignore_errors=True)
        shutil.rmtree(copy, ignore_errors=True)
    gib = out["raw_bytes"] / GiB
    out["raw_dump_s_per_gib"] = out["raw_dump_ms"] / 1000 / gib
    out["plain_cp_fsync_s_per_gib"] = out["plain_cp_fsync_s"] / gib
    out["plain_read_s_per_gib"] = out["plain_read_s"] / gib
    out["plain_read_par_s_per_gib"] = out["plain_read_par_s"] / gib
    return out


class PageCachePeak:
    """The node's file page cache (/proc/meminfo Cached less Shmem: not the tier's tmpfs) sampled every 20 ms
    while it runs: its peak and last value above the value at the start, bytes."""

    def __init__(self) -> None:
        self.start = self.peak = self.last = self._now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _now() -> int:
        f = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return (int(f["Cached"].split()[0]) - int(f["Shmem"].split()[0])) * 1024

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.last = self._now()
            self.peak = max(self.peak, self.last)

    def __enter__(self) -> PageCachePeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.last = self._now()
        self.peak = max(self.peak, self.last)


# -- memsnap -----------------------------------------------------------------------------------------------
def memsnap(d: Daemon, job: Any, log: bench.JobLog) -> dict[str, Any]:
    assert d.proc is not None
    sampler = Sampler(d.proc.pid)
    sampler.start()
    time.sleep(0.3)  # the idle RSS before the call
    try:
        r = bench.memsnap_checkpoint(d, job, log, None)
    finally:
        sampler.stop()
    ckpt_id = r["ckpt_id"]
    with d.client() as c:
        t_dur = c.show(ckpt_id).durable_unix_ms / 1000
    t_end = t_dur - r["ms_drain_s"]  # the end of the checkpoint call
    t_call = t_end - r["ms_ckpt_rpc_ms"] / 1000
    gib = r["size_bytes"] / GiB
    core_s = sampler.cpu_at(t_dur) - sampler.cpu_at(t_end)
    out: dict[str, Any] = {
        **r,
        "ms_stored_ratio": r["stored_bytes"] / r["size_bytes"],
        "ms_rss_idle_mb": sampler.idle("VmRSS", t_call) / 1e6,
        "ms_rss_growth_mb": (sampler.peak("VmRSS", t_end, t_dur) - sampler.idle("VmRSS", t_call)) / 1e6,
        "ms_rss_growth_call_mb": (sampler.peak("VmRSS", t_call, t_end) - sampler.idle("VmRSS", t_call)) / 1e6,
        **{f"ms_{f.lower()}_growth_mb": (sampler.peak(f, t_end, t_dur) - sampler.idle(f, t_call)) / 1e6
           for f in ("RssAnon", "RssFile", "RssShmem")},
        "ms_drain_core_s": core_s,
        "ms_core_s_per_gib": core_s / gib,
        "ms_rss_samples": len(sampler.samples),
    }
    bench.kill(int(job.pid))
    rt = bench.memsnap_restore(d, ckpt_id, log)
    bench.kill(rt.pop("pid"))
    out.update({f"ms_restore_tier_{k}": v for k, v in rt.items()})
    with d.client() as c:
        c.evict(ckpt_id)
    drop_caches()
    with PageCachePeak() as cache:  # (what the fetch left in the page cache beside the tier copy)
        rs = bench.memsnap_restore(d, ckpt_id, log)
    out["ms_restore_store_cache_peak_mb"] = (cache.peak - cache.start) / 1e6
    out["ms_restore_store_cache_after_mb"] = (cache.last - cache.start) / 1e6
    bench.kill(rs.pop("pid"))
    out.update({f"ms_restore_store_{k}": v for k, v in rs.items()})
    with d.client() as c:
        c.delete(ckpt_id)
    out["ms_restore_tier_s"] = rt["first_tick_s"]
    out["ms_restore_store_s"] = rs["first_tick_s"]
    out["ms_fetch_s"] = rs["fetch_ms"] / 1000
    for k in ("drain_s", "fetch_s", "restore_store_s", "restore_tier_s"):
        out[f"ms_{k}_per_gib"] = out[f"ms_{k}"] / gib
    out["ms_ckpt_s_per_gib"] = r["ms_ckpt_rpc_ms"] / 1000 / gib
    return out


def leftovers(d: Daemon) -> list[str]:
    """Checkpoints and running jobs the daemon still has after a cycle (deleted and killed here)."""
    found = []
    with d.client() as c:
        for ck in c.list():
            found.append(f"checkpoint {ck.id}")
            c.delete(ck.id)
        for j in c.jobs():
            try:
                alive = j.running and psutil.Process(j.pid).status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                alive = False
            if alive:
                found.append(f"job {j.id} pid {j.pid}")
                bench.kill(int(j.pid))
    return found


def wipe() -> None:
    """The store, the plain copies, the raw dumps and the daemon's state (chunk cache included)."""
    for p in (STORE, PLAIN, RAW, DAEMON / "state"):
        shutil.rmtree(p, ignore_errors=True)


def cycle(name: str, tree: Path, mib: int, compressible: bool, extra: list[str]) -> dict[str, Any]:
    os.environ["BENCH_MEMSNAP_SRC"] = str(tree)
    wipe()
    STORE.mkdir(parents=True)
    rec: dict[str, Any] = {"tree": name, "mib": mib, "load_before": os.getloadavg()[0],
                           "other_daemons": other_daemons()}
    d = Daemon(STORE, extra)
    try:
        d.start()  # (inside the try: a daemon that never answered is stopped below)
        job, log = bench.start_job(d, bench.counter_argv(mib, compressible))
        pid = int(job.pid)
        rec["job_rss_bytes"] = tree_rss(pid)
        rec.update(plain(pid, log, f"{name}-{pid}"))
        time.sleep(0.2)
        rec.update(memsnap(d, job, log))
        rec["drain_ratio_run"] = rec["plain_cp_fsync_s"] / rec["ms_drain_s"]
        rec["store_ratio_run"] = (rec["plain_read_best_s"] + rec["ms_restore_tier_s"]) / rec["ms_restore_store_s"]
        rec["ckpt_ratio_run"] = rec["ms_ckpt_rpc_ms"] / rec["raw_dump_ms"]
        rec["leftovers"] = leftovers(d)
    finally:
        for p in list(bench._ALL_PIDS):
            bench.kill(p)
        d.stop()
        wipe()
        shutil.rmtree(TIER, ignore_errors=True)
    rec["load_after"] = os.getloadavg()[0]
    return rec


# -- summary -----------------------------------------------------------------------------------------------
PER_GIB = [  # (label, key, which rows: "plain" or "tree")
    ("raw `criu dump` into tmpfs", "raw_dump_s_per_gib", "plain"),
    ("cp + fsync onto the store's fs", "plain_cp_fsync_s_per_gib", "plain"),
    ("plain read after drop_caches, one thread", "plain_read_s_per_gib", "plain"),
    ("plain read after drop_caches, 8 threads", "plain_read_par_s_per_gib", "plain"),
    ("checkpoint call", "ms_ckpt_s_per_gib", "tree"),
    ("drain (end of the call to durable)", "ms_drain_s_per_gib", "tree"),
    ("restore from the tier", "ms_restore_tier_s_per_gib", "tree"),
    ("fetch from the store", "ms_fetch_s_per_gib", "tree"),
    ("restore from the store", "ms_restore_store_s_per_gib", "tree"),
]


def summarize(rows: list[dict[str, Any]], sizes: list[int], trees: list[str]) -> dict[str, Any]:
    keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    per_size: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    for mib in sizes:
        per_size[str(mib)] = {
            "plain": {k: stats(values(rows, k, mib)) for k in keys if k.startswith(("raw_", "plain_"))},
            **{t: {k: stats(values(rows, k, mib, t)) for k in keys if not k.startswith(("raw_", "plain_"))}
               for t in trees},
        }
        ratios[str(mib)] = {t: {
            "drain": div(med(rows, "plain_cp_fsync_s", mib), med(rows, "ms_drain_s", mib, t)),
            "store": div(_sum(med(rows, "plain_read_best_s", mib), med(rows, "ms_restore_tier_s", mib, t)),
                         med(rows, "ms_restore_store_s", mib, t)),
            "ckpt": div(med(rows, "ms_ckpt_rpc_ms", mib, t), med(rows, "raw_dump_ms", mib)),
        } for t in trees}
    flat: dict[str, Any] = {}
    for _label, key, kind in PER_GIB:
        for t in ["plain"] if kind == "plain" else trees:
            meds = [m for m in (med(rows, key, mib, None if kind == "plain" else t) for mib in sizes) if m]
            flat[f"{t}:{key}"] = max(meds) / min(meds) if len(meds) > 1 else None
    return {"per_size": per_size, "ratios": ratios, "flat": flat}


def _sum(a: float | None, b: float | None) -> float | None:
    return a + b if a is not None and b is not None else None


# -- markdown ----------------------------------------------------------------------------------------------
def cell(vals: list[float], nd: int, scale: float = 1.0) -> str:
    if not vals:
        return "—"
    m, lo, hi = statistics.median(vals) * scale, min(vals) * scale, max(vals) * scale
    return f"{m:.{nd}f}" if len(vals) == 1 else f"{m:.{nd}f} ({lo:.{nd}f}–{hi:.{nd}f})"


def num(v: float | None, nd: int = 2) -> str:
    return "—" if v is None else f"{v:.{nd}f}"


TABLES = [  # (title, memsnap key, plain baseline key or "", baseline label, decimals, scale)
    ("Checkpoint call, ms", "ms_ckpt_rpc_ms", "raw_dump_ms", "raw `criu dump --leave-running` into tmpfs", 0, 1),
    ("The job's downtime (largest gap between its ticks), ms", "ms_downtime_ms", "raw_downtime_ms",
     "raw `criu dump`", 0, 1),
    ("Drain: from the end of the checkpoint call to durable, s", "ms_drain_s", "plain_cp_fsync_s",
     "cp + fsync of the raw images", 2, 1),
    ("Restore from the tier, request to the first tick, s", "ms_restore_tier_s", "", "", 2, 1),
    ("Fetch from the store (memsnap's fetch_ms), s", "ms_fetch_s", "plain_read_best_s",
     "plain read of the copied images after drop_caches, the faster of one thread and 8", 2, 1),
    ("Restore from the store after evict + drop_caches, request to the first tick, s", "ms_restore_store_s",
     "plain_read_best_s", "plain read, the faster way (the goal adds the tree's restore from the tier)", 2, 1),
    ("Page cache (Cached less Shmem) held during the restore from the store: peak above its start, MB",
     "ms_restore_store_cache_peak_mb", "", "", 0, 1),
    ("... and still held at the restored job's first tick, MB", "ms_restore_store_cache_after_mb", "", "", 0, 1),
    ("memsnapd VmRSS growth during the drain (peak minus idle before the call), MB", "ms_rss_growth_mb", "", "", 0, 1),
    ("... of which RssAnon (the daemon's own allocations), MB", "ms_rssanon_growth_mb", "", "", 0, 1),
    ("... of which RssShmem (tmpfs pages mapped, e.g. tier files), MB", "ms_rssshmem_growth_mb", "", "", 0, 1),
    ("... of which RssFile, MB", "ms_rssfile_growth_mb", "", "", 0, 1),
    ("memsnapd RSS (VmRSS) growth during the checkpoint call, MB", "ms_rss_growth_call_mb", "", "", 0, 1),
    ("memsnapd core-seconds per GiB during the drain (utime + stime)", "ms_core_s_per_gib", "", "", 2, 1),
    ("Stored bytes / image bytes", "ms_stored_ratio", "", "", 3, 1),
]


def markdown(res: dict[str, Any]) -> str:
    rows, sizes, trees = res["runs"], res["config"]["sizes_mib"], list(res["trees"])
    m = res["machine"]
    lines: list[str] = []
    add = lines.append
    add("# Data plane: memsnap against the plain baselines (issue #30)\n")
    add(f"Generated by `{res['command']}` on {res['date_utc']} ({res['elapsed_s'] / 60:.1f} min). Every number is "
        f"the **median of the runs** with (min–max); {res['config']['reps']} rep(s) per tree and size; the plain "
        "baselines pool the cycles of every tree. Raw data: `dataplane.json`.\n")
    add("| tree | path | commit |\n|---|---|---|")
    for t, info in res["trees"].items():
        add(f"| {t} | `{info['path']}` | `{info['commit']}` |")
    add("")
    la0, la1 = res["loadavg_start"], res["loadavg_end"]
    loads = [r["load_before"] for r in rows]
    busy = sum(1 for r in rows if r.get("other_daemons"))
    add("| machine | |\n|---|---|")
    for label, val in (
        ("CPU", f"{m['cpu']}, {m['cores']} cores" + (f" ({m['hypervisor']})" if m["hypervisor"] else "")),
        ("memory", f"{m['mem_gib']} GiB, swap {m['swap_gib']} GiB; transparent huge pages: {m['thp']}"),
        ("OS / kernel", f"{m['os']} / {m['kernel']}"),
        ("CRIU / Python", f"{m['criu']} / {m['python']}"),
        ("memory tier", f"`{TIER}`, {m['tier_fs']}"),
        ("store", f"`{STORE}` (POSIX directory store), {m['store_fs']}"),
        ("load average (1/5/15 min)", " ; ".join(
            f"{w} {' / '.join(f'{x:.2f}' for x in la)}" for w, la in (("start", la0), ("end", la1)))),
        ("1-min load before each cycle", f"{min(loads):.2f}–{max(loads):.2f}" if loads else "—"),
        ("other memsnapd processes", f"{len(res['other_daemons_start'])} at the start, "
         f"{len(res['other_daemons_end'])} at the end, before {busy} of {len(rows)} cycles"),
        ("free page reporting (vm-memory.md)", res.get("free_page_reporting", "not recorded")),
        ("job memory", "compressible (a repeating 1 MiB pattern)" if res["config"]["compressible"]
         else "random (blake3 output, incompressible)"),
    ):
        add(f"| {label} | {val} |")
    flags = " ".join(res["config"]["daemon_args"])
    for t, info in res["trees"].items():
        cfg = ", ".join(f"{k} {v}" for k, v in info["config"].items()) or "(--print-config failed)"
        add(f"| memsnapd {t} | {cfg}{'; flags ' + flags if flags else ''} |")
    add("")
    add("## Method\n")
    add("One cycle is one tree, one size, one fresh memsnapd (`PYTHONPATH=<tree>`) and one job "
        "(`scripts/bench/workload_counter.py --mib N`, ticking every 5 ms with its own timestamps). On that job, "
        "first the plain baselines: `criu dump --leave-running` into a fresh tmpfs dir (wall time; the job's "
        "downtime from its ticks; with the mount options memsnapd gives CRIU for a job in a mount namespace of "
        "its own: `--external mnt[]:sm`, `--skip-mnt` for the mounts the job does not use, its log mount "
        "external, `--tcp-close`), cp of the image files onto the store's filesystem followed by an fsync of "
        "each file and of the directory (timed together), the tmpfs dump removed, `sync` and "
        "`echo 3 > /proc/sys/vm/drop_caches`, a plain read of every copied file (4 MiB reads, one thread), "
        "drop_caches again and the same read by 8 threads at once (4 MiB preads, as memsnap's fetch reads its "
        "packs; the goal takes the faster of the two). Then "
        "memsnap: the checkpoint call into the tier, the drain to durable (`durable_unix_ms` minus the end of "
        "the call) while memsnapd's /proc status (VmRSS, RssAnon, RssFile, RssShmem) and utime+stime are "
        "sampled every 50 ms (growth = peak during the drain minus the median before the call, per field; "
        "core-seconds between the end of the call and durable, interpolated between samples), the job killed, "
        "restore from the tier to the restored job's first tick, killed, evict, `sync` + drop_caches, restore "
        "from the store to the first tick (with memsnap's own fetch time, and the node's file page cache, "
        "/proc/meminfo Cached less Shmem, sampled every 20 ms: its peak and its value at the first tick above the "
        "start), killed, the checkpoint deleted; "
        "leftover checkpoints or jobs are looked for (none expected; found: "
        f"{sum(len(r.get('leftovers', [])) for r in rows)}), and store, tier and copies are wiped before the "
        "next cycle. At most the job and one image are in memory at a time. Free page reporting: see the "
        "machine table (held off, memory taken by a sitting stays warm, as on a bare-metal node; left on, each "
        "step's cost depends on how long ago the node freed memory: `vm-memory.md`). Reps are the outer loop, "
        "sizes the "
        "inner one, and in each (rep, size) the trees take turns going first. Ratios are of the medians per "
        "size; s/GiB are per run, over the image bytes.\n")
    errors = [r for r in rows if "error" in r]
    if errors:
        add(f"**{len(errors)} cycle(s) failed** (left out of every number): "
            + "; ".join(f"{r['tree']} {r['mib']} MiB rep {r['rep']}: {r['error'][:160]}" for r in errors) + "\n")
    if res.get("skipped_sizes"):
        add(f"Sizes left out for lack of memory or disk: {res['skipped_sizes']}.\n")

    add("## Goals (tree B)\n")
    goal_hdr = "| goal | target | size | B | met |" + (" A (for reference) |" if "A" in trees else "")
    add(goal_hdr + "\n|---|---|---|---|---|" + ("---|" if "A" in trees else ""))
    for label, sense, bound, key in (
        ("drain: plain cp+fsync s / memsnap drain s", "≥", GOAL_DRAIN, "drain"),
        ("restore from the store: (plain read s, the faster way, + restore from the tier s) / restore from the "
         "store s", "≥",
         GOAL_STORE, "store"),
        ("checkpoint call / raw criu dump wall", "≤", GOAL_CKPT, "ckpt"),
    ):
        for mib in sizes:
            rb = res["summary"]["ratios"][str(mib)].get("B", {}).get(key)
            ra = res["summary"]["ratios"][str(mib)].get("A", {}).get(key)
            met = rb is not None and (round(rb, 2) >= bound if sense == "≥" else round(rb, 2) <= bound)
            verdict = "—" if rb is None else ("met" if met else "**missed**")
            add(f"| {label} | {sense} {bound} | {mib} MiB | {num(rb)} | {verdict} |"
                + (f" {num(ra)} |" if "A" in trees else ""))
    for label, key in (("drain", "ms_drain_s_per_gib"), ("restore from the store", "ms_restore_store_s_per_gib"),
                       ("checkpoint call", "ms_ckpt_s_per_gib")):
        fb = res["summary"]["flat"].get(f"B:{key}")
        fa = res["summary"]["flat"].get(f"A:{key}")
        verdict = "— (one size)" if fb is None else ("met" if round(fb, 2) <= GOAL_FLAT else "**missed**")
        add(f"| {label} s/GiB flat across sizes: largest / smallest median | ≤ {GOAL_FLAT} | all | {num(fb)} | "
            f"{verdict} |" + (f" {num(fa)} |" if "A" in trees else ""))
    add("")

    add("## Seconds per GiB (medians; flat across sizes is the goal)\n")
    add("| path | " + " | ".join(f"{mib} MiB" for mib in sizes) + " | largest / smallest |\n|---|"
        + "---:|" * (len(sizes) + 1))
    for label, key, kind in PER_GIB:
        for t in ["plain"] if kind == "plain" else trees:
            who = "plain" if kind == "plain" else f"memsnap {t}"
            cells = [num(med(rows, key, mib, None if kind == "plain" else t), 3) for mib in sizes]
            add(f"| {who}: {label} | " + " | ".join(cells) + f" | {num(res['summary']['flat'].get(f'{t}:{key}'))} |")
    add("")

    add("## Ratios per size (of the medians)\n")
    add("| size | tree | drain ratio (≥ 0.8) | restore-from-store ratio (≥ 0.9) | checkpoint / raw dump (≤ 1.15) |"
        "\n|---|---|---:|---:|---:|")
    for mib in sizes:
        for t in trees:
            r = res["summary"]["ratios"][str(mib)][t]
            add(f"| {mib} MiB | {t} | {num(r['drain'])} | {num(r['store'])} | {num(r['ckpt'])} |")
    add("")

    add("## Every metric\n")
    for title, key, base, base_label, nd, scale in TABLES:
        add(f"**{title}**\n")
        hdr = ["size", *trees]
        if "A" in trees:
            hdr.append("B / A")
        if base:
            hdr.append(f"plain: {base_label}")
        add("| " + " | ".join(hdr) + " |\n|---|" + "---:|" * (len(hdr) - 1))
        for mib in sizes:
            cells = [f"{mib} MiB", *(cell(values(rows, key, mib, t), nd, scale) for t in trees)]
            if "A" in trees:
                cells.append(num(div(med(rows, key, mib, "B"), med(rows, key, mib, "A"))))
            if base:
                cells.append(cell(values(rows, base, mib), nd, scale))
            add("| " + " | ".join(cells) + " |")
        add("")

    add("## Runs\n")
    add("| rep | size | tree | load | raw dump ms | ckpt call ms | cp+fsync s | drain s | read s (1 / 8 threads) "
        "| tier restore s "
        "| fetch s | store restore s | VmRSS +MB | RssAnon +MB | core-s/GiB |\n|---|---|---|" + "---:|" * 12)
    for r in rows:
        if "error" in r:
            add(f"| {r['rep']} | {r['mib']} | {r['tree']} | {r['load_before']:.2f} | failed |" + " |" * 10)
            continue
        add(f"| {r['rep']} | {r['mib']} | {r['tree']} | {r['load_before']:.2f} | {r['raw_dump_ms']:.0f} | "
            f"{r['ms_ckpt_rpc_ms']:.0f} | {r['plain_cp_fsync_s']:.2f} | {r['ms_drain_s']:.2f} | "
            f"{r['plain_read_s']:.2f} / {r.get('plain_read_par_s', float('nan')):.2f} | "
            f"{r['ms_restore_tier_s']:.2f} | {r['ms_fetch_s']:.2f} | "
            f"{r['ms_restore_store_s']:.2f} | {r['ms_rss_growth_mb']:.0f} | {r['ms_rssanon_growth_mb']:.0f} | "
            f"{r['ms_core_s_per_gib']:.2f} |")
    add("")
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------------------------
def fits(mib: int) -> str:
    """Why a size does not fit this machine now, or ''."""
    gib = mib / 1024
    if psutil.virtual_memory().available / GiB < 2 * gib + 1:
        return "memory (job + one image + 1 GiB)"
    if shutil.disk_usage(TIER.parent).free / GiB < 1.1 * gib + 0.5:
        return f"tmpfs {TIER.parent}"
    if shutil.disk_usage(bench.BASE).free / GiB < 1.1 * gib + min(gib, 2) + 1:  # store + chunk cache (2G cap)
        return f"disk {bench.BASE}"
    return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", default="1024,2048,4096", help="job sizes, MiB, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--a", default="", help="the old tree (optional)")
    ap.add_argument("--b", default=str(bench.REPO), help="the new tree (default this repo)")
    ap.add_argument("--compressible", action="store_true", help="the job's memory is a repeating pattern")
    ap.add_argument("--daemon-arg", action="append", default=[],
                    help="extra memsnapd flag for both trees (repeat; e.g. --daemon-arg=--compression-level=1)")
    ap.add_argument("--no-warmup", action="store_true", help="no throwaway cycle before the measured ones")
    ap.add_argument("--free-page-reporting", choices=("hold", "leave"), default="hold",
                    help="hold (default): hold off a VM's free page reporting for the sitting, so that memory "
                         "touched once stays warm (bench.FreePageReportingHeld); leave: as the machine has it")
    ap.add_argument("--allow-others", action="store_true",
                    help="run even while another memsnapd runs here (its work skews every number)")
    ap.add_argument("--out", default=str(bench.REPO / "bench" / "results"),
                    help="directory for dataplane.json and dataplane.md")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (CRIU and drop_caches need it)", file=sys.stderr)
        return 1
    others = other_daemons()
    if others and not args.allow_others:
        print("another memsnapd runs on this machine (wait for it, or --allow-others):\n  " + "\n  ".join(others),
              file=sys.stderr)
        return 1
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    trees = {"A": Path(args.a).resolve()} if args.a else {}
    trees["B"] = Path(args.b).resolve()
    for t, p in trees.items():
        if not (p / "memsnap" / "daemon.py").exists():
            print(f"--{t.lower()} {p}: no memsnap/daemon.py there", file=sys.stderr)
            return 1
    extra = [a for arg in args.daemon_arg for a in shlex.split(arg)]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    bench.BASE.mkdir(parents=True, exist_ok=True, mode=0o700)
    sizes = [int(s) for s in args.mib.split(",") if s.strip()]
    skipped = {mib: why for mib in sizes if (why := fits(mib))}
    sizes = [mib for mib in sizes if mib not in skipped]
    for mib, why in skipped.items():
        say(f"{mib} MiB left out: not enough {why}")
    res: dict[str, Any] = {
        "command": "scripts/bench/dataplane.py " + shlex.join(sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "loadavg_start": os.getloadavg(),
        "other_daemons_start": others,
        "trees": {t: {"path": str(p), "commit": tree_commit(p), "config": daemon_config(p, extra)}
                  for t, p in trees.items()},
        "config": {"sizes_mib": sizes, "reps": args.reps, "compressible": args.compressible, "daemon_args": extra,
                   "store": str(STORE), "tier": str(TIER), "sample_s": SAMPLE_S},
        "skipped_sizes": {str(k): v for k, v in skipped.items()},
        "runs": [],
    }
    say(f"trees {res['trees']}; sizes {sizes} MiB x {args.reps} reps; load {res['loadavg_start']}")

    def save() -> None:
        (out_dir / "dataplane.json").write_text(json.dumps(res, indent=1, default=str))

    held = bench.FreePageReportingHeld(args.free_page_reporting == "hold")
    try:
        held.__enter__()
        res["free_page_reporting"] = held.describe()
        say(f"free page reporting: {res['free_page_reporting']}")
        if sizes:
            # (the job, its image in the tier and the page cache of a copy can be in memory at once)
            say("warm-up: touching the memory the largest cycle needs")
            res["warmup_touch_s"] = bench.warm_memory(3 * max(sizes) / 1024 + 1)
        if sizes and not args.no_warmup:
            say(f"warm-up: one throwaway cycle, B, {min(sizes)} MiB")
            try:
                cycle("B", trees["B"], min(sizes), args.compressible, extra)
            except Exception as exc:
                say(f"  warm-up cycle failed: {exc}")
        names = list(trees)
        for rep in range(args.reps):
            for i, mib in enumerate(sizes):
                order = names if (rep + i) % 2 == 0 else names[::-1]
                for name in order:
                    say(f"rep {rep + 1}/{args.reps}, {mib} MiB, tree {name}")
                    try:
                        r = cycle(name, trees[name], mib, args.compressible, extra)
                    except Exception as exc:
                        say(f"  ERROR: {exc}")
                        r = {"tree": name, "mib": mib, "load_before": os.getloadavg()[0], "error": str(exc),
                             "trace": traceback.format_exc()[-2000:]}
                    r["rep"] = rep
                    res["runs"].append(r)
                    if "error" not in r:
                        say(f"  raw dump {r['raw_dump_ms']:.0f} ms, call {r['ms_ckpt_rpc_ms']:.0f} ms; "
                            f"cp+fsync {r['plain_cp_fsync_s']:.2f} s, drain {r['ms_drain_s']:.2f} s; "
                            f"read {r['plain_read_s']:.2f} / {r['plain_read_par_s']:.2f} s, "
                            f"tier {r['ms_restore_tier_s']:.2f} s, "
                            f"store {r['ms_restore_store_s']:.2f} s (fetch {r['ms_fetch_s']:.2f} s, page cache "
                            f"+{r['ms_restore_store_cache_peak_mb']:.0f}/{r['ms_restore_store_cache_after_mb']:.0f} "
                            "MB); "
                            f"VmRSS +{r['ms_rss_growth_mb']:.0f} MB (anon +{r['ms_rssanon_growth_mb']:.0f}), "
                            f"{r['ms_core_s_per_gib']:.2f} core-s/GiB"
                            + (f"; LEFTOVERS {r['leftovers']}" if r["leftovers"] else ""))
                    save()
    finally:
        held.__exit__()
        for pid in list(bench._ALL_PIDS):
            bench.kill(pid)
        wipe()
        shutil.rmtree(TIER, ignore_errors=True)
        with contextlib.suppress(OSError):
            bench.RAWTMP.rmdir()  # (when empty)
        res["loadavg_end"] = os.getloadavg()
        res["other_daemons_end"] = other_daemons()
        res["elapsed_s"] = round(time.monotonic() - bench.T_START, 1)
        res["summary"] = summarize(res["runs"], sizes, list(trees))
        save()
        (out_dir / "dataplane.md").write_text(markdown(res))
    say(f"done in {res['elapsed_s'] / 60:.1f} min: {out_dir}/dataplane.json, {out_dir}/dataplane.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
