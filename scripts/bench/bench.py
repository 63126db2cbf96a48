#!/usr/bin/env python3
"""memsnap benchmark (issues #7 and #3): memsnap against raw CRIU, measured from the job's point of view.

Run as root through scripts/bench/run.sh [--quick]. What it does, in order:

  1. machine description; a rate-limited network store (scripts/bench/netstore.py: sshd in a netns, veth
     shaped with tc tbf to 1 Gbit/s, mounted with sshfs) whose real throughput is checked with and without
     the limit;
  2. warm-up: touch the memory the largest case needs (the VM backs guest memory on first touch), then one
     throwaway cycle;
  3. the size sweep (random memory, 256 MiB .. 4 GiB; reps interleaved across sizes): for each job
       - memsnap checkpoint into the tier (job keeps running), then wait until the drain made it durable;
       - raw `criu dump --leave-running` into a tmpfs dir and straight onto the network store;
       - restores: raw CRIU from tmpfs and from the network store; memsnap from the tier, lazily from the
         tier, and from the store after an evict;
  4. the link sweep (time to durable at lower link rates) and the --drain-bandwidth cap sweep (issue #3:
     256 MiB .. 2 GiB, random and compressible memory);
  5. the PyTorch CPU training job through the same cycle;
  6. the daemon's idle CPU and RSS over a window after all that work;
  7. bench/results/bench.json, bench.md and bench.png (scripts/bench/report.py renders the last two).

Downtime is the largest gap between two consecutive ticks of the job (each tick carries the job's own
wall-clock timestamp; the job ticks every 5 ms); restore time is from the request to the restored job's
first tick. No number here comes from memsnap's or CRIU's own timers (those are recorded alongside).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import psutil  # noqa: E402
from netstore import NetStore  # noqa: E402

from memsnap.client import MemsnapClient  # noqa: E402
from memsnap.proc import tree_rss  # noqa: E402
from memsnap.v1 import memsnap_pb2 as pb  # noqa: E402

CRIU = os.environ.get("MEMSNAP_CRIU", "/usr/local/sbin/criu")
BASE = Path("/var/tmp/memsnap-bench")
TIER = Path("/dev/shm/memsnap-bench-tier")
RAWTMP = Path("/dev/shm/memsnap-bench-raw")
TICK_S = 0.005
MiB = 1 << 20
T_START = time.monotonic()


def say(msg: str) -> None:
    el = time.monotonic() - T_START
    print(f"[{int(el // 60):02d}:{el % 60:04.1f}] {msg}", flush=True)


# -- the job's own log ------------------------------------------------------------------------------
class JobLog:
    """Incremental reader of a workload log: 'ready HOSTPID T' and 'tick N HOSTPID T ...' lines."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.off = 0
        self.rest = b""
        self.ticks: dict[int, list[tuple[int, float]]] = defaultdict(list)
        self.ready: dict[int, float] = {}

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.off)
                data = f.read()
        except FileNotFoundError:
            return
        self.off += len(data)
        lines = (self.rest + data).split(b"\n")
        self.rest = lines.pop()
        for ln in lines:
            p = ln.split()
            try:
                if p and p[0] == b"tick":
                    self.ticks[int(p[2])].append((int(p[1]), float(p[3])))
                elif p and p[0] == b"ready":
                    self.ready[int(p[1])] = float(p[2])
            except (IndexError, ValueError):
                pass

    def wait_tick(self, hostpid: int, after: float = 0.0, timeout: float = 120.0) -> float:
        """Timestamp of the first tick of hostpid later than `after`."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            for _n, ts in self.ticks.get(hostpid, ()):
                if ts > after:
                    return ts
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no tick from pid {hostpid} after {after} within {timeout}s ({self.path})"
                )
            if not psutil.pid_exists(hostpid):
                raise RuntimeError(f"pid {hostpid} is gone without ticking; see {self.path}")
            time.sleep(0.002)

    def max_gap_ms(self, hostpid: int, t0: float, t1: float) -> float:
        """The largest gap between consecutive ticks of hostpid around [t0, t1] (the job's downtime)."""
        self.wait_tick(hostpid, after=t1 + 0.05)
        ts = [t for _n, t in self.ticks[hostpid] if t0 - 0.3 <= t <= t1 + 0.3]
        if len(ts) < 2:
            raise RuntimeError(f"too few ticks of {hostpid} around the checkpoint")
        return max(b - a for a, b in zip(ts, ts[1:], strict=False)) * 1000


# -- processes ---------------------------------------------------------------------------------------
_ALL_PIDS: set[int] = set()


def kill(pid: int, timeout: float = 20.0) -> None:
    """SIGKILLs one job root (its PID namespace goes with it) and waits until it is gone."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    _ALL_PIDS.discard(pid)


class Daemon:
    """A memsnapd subprocess with its own socket, tier, state dir and (network) store dir."""

    def __init__(self, store_dir: Path, extra: list[str] | None = None) -> None:
        self.base = BASE / "daemon"
        self.sock = str(self.base / "memsnapd.sock")
        self.store_dir = store_dir
        self.extra = extra or []
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        shutil.rmtree(self.base / "state", ignore_errors=True)
        shutil.rmtree(TIER, ignore_errors=True)
        self.base.mkdir(parents=True, exist_ok=True)
        args = [
            sys.executable,
            "-m",
            "memsnap.daemon",
            "--config",
            "/dev/null",
            "--socket",
            self.sock,
            "--tier-dir",
            str(TIER),
            "--store-dir",
            str(self.store_dir),
            "--state-dir",
            str(self.base / "state"),
            *self.extra,
        ]
        src = os.environ.get("BENCH_MEMSNAP_SRC", str(REPO))  # another tree's memsnap, for A/B runs
        env = {**os.environ, "PYTHONPATH": src}
        with open(self.base / "memsnapd.log", "ab") as logf:
            self.proc = subprocess.Popen(
                args, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=src
            )
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"memsnapd exited: see {self.base / 'memsnapd.log'}")
            try:
                with self.client() as c:
                    c.status(timeout=2)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        return self

    def client(self) -> MemsnapClient:
        return MemsnapClient(socket=self.sock)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def lazy_servers(self, ckpt_id: str) -> list[psutil.Process]:
        out = []
        if self.proc is None:
            return out
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return out
        for k in kids:
            try:
                cmd = k.cmdline()
            except psutil.Error:
                continue
            if "lazy-pages" in cmd and any(ckpt_id in a for a in cmd):
                out.append(k)
        return out


# -- raw CRIU ------------------------------------------------------------------------------------------
_EMPTY_LIBDIR = BASE / "criu-empty-libdir"  # memsnapd also gives CRIU an empty plugin dir


def criu_common(work: Path) -> list[str]:
    return ["-W", str(work), "--ext-unix-sk", "--file-locks", "-v2", "-L", str(_EMPTY_LIBDIR)]


def raw_dump(pid: int, images: Path) -> float:
    """`criu dump --leave-running` of a job tree into images; returns the wall time in seconds."""
    work = BASE / "rawwork" / f"dump-{images.name}"
    shutil.rmtree(work, ignore_errors=True)
    for d in (images, work, _EMPTY_LIBDIR):
        d.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    r = subprocess.run(
        [
            CRIU,
            "dump",
            "-t",
            str(pid),
            "-D",
            str(images),
            "--leave-running",
            "-o",
            "dump.log",
            *criu_common(work),
        ],
        capture_output=True,
        text=True,
    )
    dt = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"criu dump failed: {r.stderr.strip()[-300:]} (log {work}/dump.log)")
    return dt


def raw_restore(images: Path) -> int:
    """`criu restore -d` of images; returns the host pid of the restored root."""
    work = BASE / "rawwork" / f"restore-{images.name}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    pidfile = work / "root.pid"
    r = subprocess.run(
        [
            CRIU,
            "restore",
            "-D",
            str(images),
            "-d",
            "--pidfile",
            str(pidfile),
            "-o",
            "restore.log",
            *criu_common(work),
        ],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"criu restore failed: {r.stderr.strip()[-300:]} (log {work}/restore.log)")
    pid = int(pidfile.read_text().strip())
    _ALL_PIDS.add(pid)
    return pid


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


# -- one job -------------------------------------------------------------------------------------------
def counter_argv(mib: int, compressible: bool = False) -> list[str]:
    argv = [sys.executable, str(HERE / "workload_counter.py"), "--mib", str(mib), "--interval", str(TICK_S)]
    return argv + (["--compressible"] if compressible else [])


def train_argv() -> list[str]:
    return [sys.executable, str(HERE / "workload_train.py")]


def start_job(d: Daemon, argv: list[str]) -> tuple[Any, JobLog]:
    with d.client() as c:
        job = c.run(argv, name="bench")
    pid = int(job.pid)
    _ALL_PIDS.add(pid)
    log = JobLog(job.log_path)
    deadline = time.monotonic() + 300
    while pid not in log.ready:
        log.poll()
        if time.monotonic() > deadline or not psutil.pid_exists(pid):
            raise RuntimeError(f"job did not get ready; see {job.log_path}")
        time.sleep(0.02)
    log.wait_tick(pid, after=log.ready[pid] + 0.5)  # let it tick for a while first
    return job, log


def quiet_gap_ms(log: JobLog, pid: int, seconds: float = 0.5) -> float:
    """The job's largest tick gap with nothing happening (the noise floor of the downtime numbers)."""
    t0 = time.time()
    time.sleep(seconds)
    return log.max_gap_ms(pid, t0 + 0.3, time.time() - 0.3)


def wait_durable(c: MemsnapClient, ckpt_id: str, timeout: float = 1800) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        info = c.show(ckpt_id)
        if info.state == pb.CHECKPOINT_STATE_DURABLE:
            return info
        if info.state == pb.CHECKPOINT_STATE_FAILED:
            raise RuntimeError(f"checkpoint {ckpt_id} failed: {info.last_error}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{ckpt_id} not durable after {timeout}s ({info.last_error})")
        time.sleep(0.05)


def memsnap_checkpoint(d: Daemon, job: Any, log: JobLog, link_MBps: float | None) -> dict[str, Any]:
    """Checkpoint into the tier with the job running; downtime from its ticks; then time to durable."""
    pid = int(job.pid)
    out: dict[str, Any] = {}
    with d.client() as c:
        t0 = time.time()
        info = c.checkpoint(job.id)
        t1 = time.time()
        out["ckpt_id"] = info.id
        out["ms_downtime_ms"] = log.max_gap_ms(pid, t0, t1)
        out["ms_ckpt_rpc_ms"] = (t1 - t0) * 1000
        out["ms_criu_frozen_ms"] = info.frozen_ms
        out["ms_criu_dump_ms"] = info.dump_ms
        out["size_bytes"] = info.size_bytes
        dur = wait_durable(c, info.id)
        out["stored_bytes"] = dur.stored_bytes
        out["ms_durable_s"] = dur.durable_unix_ms / 1000 - t0
        out["ms_drain_s"] = dur.durable_unix_ms / 1000 - t1
        out["ms_drain_MBps"] = info.size_bytes / out["ms_drain_s"] / 1e6  # raw image bytes per second
        out["stored_MBps"] = dur.stored_bytes / out["ms_drain_s"] / 1e6  # what crossed the link
        if link_MBps:
            out["link_MBps"] = link_MBps
            out["ms_drain_link_fraction"] = out["stored_MBps"] / link_MBps
    return out


def memsnap_restore(d: Daemon, ckpt_id: str, log: JobLog, lazy: bool = False) -> dict[str, Any]:
    with d.client() as c:
        t0 = time.time()
        r = c.restore(ckpt_id, lazy=lazy)
        t1 = time.time()
    pid = int(r.pid)
    _ALL_PIDS.add(pid)
    if r.job.log_path and r.job.log_path != log.path:  # (a restored job writes to a log of its own)
        log = JobLog(r.job.log_path)
    first = log.wait_tick(pid, after=0.0)
    out = {
        "first_tick_s": first - t0,
        "rpc_s": t1 - t0,
        "criu_restore_ms": r.restore_ms,
        "verify_ms": r.verify_ms,
        "fetch_ms": r.fetch_ms,
        "from_store": r.from_store,
        "pid": pid,
    }
    if lazy:
        deadline = time.monotonic() + 600
        while d.lazy_servers(ckpt_id) and time.monotonic() < deadline:
            time.sleep(0.01)
        out["all_pages_s"] = time.time() - t0
    return out


def full_cycle(d: Daemon, ns: NetStore, argv: list[str], label: str, raw_first: bool = False) -> dict[str, Any]:
    """Every case on one job; at most job + two image copies are in memory at any time.

    raw_first: the raw tmpfs dump comes before memsnap's (reps alternate, so neither always dumps first).
    """
    rec: dict[str, Any] = {"workload": label, "raw_first": raw_first}
    link = ns.rate_mbit * 1e6 / 8 / 1e6 if ns.rate_mbit else None
    job, log = start_job(d, argv)
    pid = int(job.pid)
    tag = f"{label}-{pid}"
    raw_tmp = RAWTMP / tag
    raw_net = ns.mount / "raw" / tag
    try:
        rec["rss_bytes"] = tree_rss(pid)  # the job and its init
        rec["quiet_gap_ms"] = quiet_gap_ms(log, pid)

        def raw_tmpfs() -> None:  # b: raw CRIU into tmpfs
            t0 = time.time()
            rec["raw_tmpfs_wall_ms"] = raw_dump(pid, raw_tmp) * 1000
            rec["raw_tmpfs_downtime_ms"] = log.max_gap_ms(pid, t0, time.time())
            rec["raw_bytes"] = dir_bytes(raw_tmp)
            time.sleep(0.2)

        if raw_first:
            raw_tmpfs()
        # a/b/c: memsnap into the tier, durable over the link
        rec.update(memsnap_checkpoint(d, job, log, link))
        ckpt_id = rec["ckpt_id"]
        time.sleep(0.2)
        if not raw_first:
            raw_tmpfs()
        # a: raw CRIU straight onto the network store
        t0 = time.time()
        rec["raw_net_wall_ms"] = raw_dump(pid, raw_net) * 1000
        rec["raw_net_downtime_ms"] = log.max_gap_ms(pid, t0, time.time())
        kill(pid)
        # d: restores, raw first
        t0 = time.time()
        rpid = raw_restore(raw_tmp)
        rec["raw_restore_tmpfs_s"] = log.wait_tick(rpid) - t0
        kill(rpid)
        shutil.rmtree(raw_tmp, ignore_errors=True)
        t0 = time.time()
        rpid = raw_restore(raw_net)
        rec["raw_restore_net_s"] = log.wait_tick(rpid) - t0
        kill(rpid)
        shutil.rmtree(raw_net, ignore_errors=True)
        # d: memsnap from the tier
        r = memsnap_restore(d, ckpt_id, log)
        kill(r.pop("pid"))
        rec.update({f"ms_restore_tier_{k}": v for k, v in r.items()})
        # e: lazy from the tier
        r = memsnap_restore(d, ckpt_id, log, lazy=True)
        kill(r.pop("pid"))
        rec.update({f"ms_restore_lazy_{k}": v for k, v in r.items()})
        # d: from the store after an evict
        with d.client() as c:
            c.evict(ckpt_id)
        r = memsnap_restore(d, ckpt_id, log)
        kill(r.pop("pid"))
        rec.update({f"ms_restore_store_{k}": v for k, v in r.items()})
        with d.client() as c:
            c.delete(ckpt_id)
    finally:
        kill(pid)
        shutil.rmtree(raw_tmp, ignore_errors=True)
        shutil.rmtree(raw_net, ignore_errors=True)
    return rec


def drain_series(
    d: Daemon,
    argv: list[str],
    reps: int,
    link_MBps: float | None,
    extra: dict[str, Any],
) -> list[dict[str, Any]]:
    """reps checkpoints of one job, each drained alone: time to durable (issue #3 and the link sweep)."""
    out = []
    job, log = start_job(d, argv)
    try:
        for rep in range(reps):
            r = memsnap_checkpoint(d, job, log, link_MBps)
            with d.client() as c:
                c.delete(r["ckpt_id"])
            out.append({**extra, "rep": rep, **r})
            say(
                f"    {extra} rep {rep}: durable {r['ms_durable_s']:.2f}s, drain {r['ms_drain_MBps']:.1f} MB/s"
            )
    finally:
        kill(int(job.pid))
    return out


def cli_wall(d: Daemon, n: int = 3) -> float:
    """Median wall time of `memsnapctl status`: what the CLI adds on top of the RPC times measured here."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MEMSNAP_SOCKET": d.sock}
    walls = []
    for _ in range(n):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "memsnap.cli", "status"], env=env, capture_output=True, check=True)
        walls.append(time.monotonic() - t0)
    return statistics.median(walls)


# -- idle ----------------------------------------------------------------------------------------------
def idle(d: Daemon, seconds: float) -> dict[str, Any]:
    assert d.proc is not None
    p = psutil.Process(d.proc.pid)
    p.cpu_percent(None)
    c0 = p.cpu_times()
    t0 = time.monotonic()
    rss = []
    while time.monotonic() - t0 < seconds:
        time.sleep(1)
        rss.append(p.memory_info().rss)
    c1 = p.cpu_times()
    wall = time.monotonic() - t0
    cpu = c1.user - c0.user + c1.system - c0.system
    full = p.memory_full_info()
    return {
        "seconds": round(wall, 1),
        "cpu_percent": 100 * cpu / wall,
        "rss_mb_max": max(rss) / 1e6,
        "rss_mb_end": rss[-1] / 1e6,
        "uss_mb": full.uss / 1e6,
        "threads": p.num_threads(),
    }


# -- machine -------------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    cpu = ""
    for ln in Path("/proc/cpuinfo").read_text().splitlines():
        if ln.startswith("model name"):
            cpu = ln.split(":", 1)[1].strip()
            break
    criu = subprocess.run([CRIU, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    ssh = subprocess.run(["ssh", "-V"], capture_output=True, text=True).stderr.strip()
    sshfs = next(
        (
            ln
            for ln in subprocess.run(
                ["sshfs", "--version"], capture_output=True, text=True
            ).stdout.splitlines()
            if ln.startswith("SSHFS")
        ),
        "",
    )
    hyp = ""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    for ln in lscpu.splitlines():
        if ln.startswith("Hypervisor vendor"):
            hyp = ln.split(":", 1)[1].strip()
    git = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "memsnap"], capture_output=True, text=True
        ).stdout.strip()
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "hypervisor": hyp,
        "mem_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "kernel": platform.release(),
        "criu": criu.replace("Version: ", ""),
        "python": platform.python_version(),
        "os": _os_release(),
        "openssh": ssh,
        "sshfs": sshfs,
        "tier_fs": "tmpfs (/dev/shm)",
        "store_backing_fs": _fstype(BASE),
        "git": git + ("+dirty" if dirty else ""),
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg_start": os.getloadavg(),
    }


def _os_release() -> str:
    try:
        for ln in Path("/etc/os-release").read_text().splitlines():
            if ln.startswith("PRETTY_NAME="):
                return ln.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return ""


def _fstype(p: Path) -> str:
    best, fs = "", ""
    for part in psutil.disk_partitions(all=True):
        if str(p).startswith(part.mountpoint) and len(part.mountpoint) > len(best):
            best, fs = part.mountpoint, part.fstype
    return f"{fs} ({best})"


def warm_memory(gib: float) -> float:
    """Touches gib GiB in a child process so that the VM has backed it before anything is timed (at most 0.8 of
    the memory available now: more would only push the node into reclaim)."""
    gib = min(gib, psutil.virtual_memory().available / (1 << 30) * 0.8)
    t0 = time.monotonic()
    code = (
        "import sys\nb=bytearray(int(float(sys.argv[1])*(1<<30)))\nmv=memoryview(b)\n"
        "for i in range(0,len(b),1<<26): mv[i:i+(1<<26)]=b'\\x01'*min(1<<26,len(b)-i)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(gib)], check=True)
    return time.monotonic() - t0


class FreePageReportingHeld:
    """Holds off virtio-balloon free page reporting while a sitting runs, so that its memory stays warm.

    A VM whose guest reports free pages to its host (bench/results/vm-memory.md) has every free 2 MiB block
    taken back within seconds, and the next touch waits while the host backs it again: a step's cost then
    depends on how long ago the node freed memory, and the baselines swing 2-4x between sittings. Raising
    /sys/module/page_reporting/parameters/page_reporting_order above the largest buddy order (/proc/buddyinfo)
    makes no free block big enough to report; memory touched once after that (warm_memory) stays backed,
    as on a bare-metal node. The old order is written back on exit. A no-op (held False) where the kernel has
    no free page reporting, and with hold=False.
    """

    ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")

    def __init__(self, hold: bool = True) -> None:
        self.hold = hold
        self.old = ""
        self.held = False

    @staticmethod
    def max_order() -> int:
        """The largest order the buddy allocator frees (columns of /proc/buddyinfo, from order 0)."""
        cols = [len(ln.split()) - 4 for ln in Path("/proc/buddyinfo").read_text().splitlines() if ln.strip()]
        return max(cols) - 1

    def __enter__(self) -> FreePageReportingHeld:
        if self.hold and self.ORDER.exists():
            self.old = self.ORDER.read_text().strip()
            want = str(self.max_order() + 1)
            self.ORDER.write_text(want + "\n")
            self.held = self.ORDER.read_text().strip() == want
        return self

    def __exit__(self, *exc: object) -> None:
        if self.old:
            self.ORDER.write_text(self.old + "\n")

    def describe(self) -> str:
        if self.held:
            return (f"held off for the sitting (page_reporting_order {self.old} -> {self.max_order() + 1}, "
                    "written back after)")
        if self.old or self.ORDER.exists():
            return f"left on (page_reporting_order {self.ORDER.read_text().strip()}): numbers swing with it"
        return "none (the kernel does not report free pages)"


# -- aggregation ---------------------------------------------------------------------------------------
def med(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return statistics.median(vals) if vals else None


def summarize(rows: list[dict[str, Any]], group: Callable[[dict[str, Any]], Any]) -> list[dict[str, Any]]:
    groups: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if "error" not in r:
            groups[group(r)].append(r)
    out = []
    for g, rs in groups.items():
        keys = sorted(
            {k for r in rs for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        )
        s: dict[str, Any] = {"group": g, "n": len(rs)}
        for k in keys:
            s[k] = med(rs, k)
            vals = [r[k] for r in rs if isinstance(r.get(k), (int, float))]
            s[k + "__min"], s[k + "__max"] = min(vals), max(vals)
        out.append(s)
    return out


# -- main ----------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="a ~5 minute subset (results go to bench/results/tmp/)"
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--sizes", default="", help="MiB list for the size sweep (default 256,512,1024,2048,4096)"
    )
    ap.add_argument("--out", default="", help="output directory (default bench/results)")
    ap.add_argument("--only", default="", help="comma list of parts: sweep,link,cap,torch,idle")
    ap.add_argument("--idle-seconds", type=float, default=0)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (CRIU, network namespaces and tc need it)", file=sys.stderr)
        return 1
    # Ctrl-C or a plain kill still tear down the namespace, mount, daemon and jobs (the finally below);
    # a background job of a non-interactive shell inherits SIGINT ignored, hence the explicit handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    quick = args.quick
    sizes = (
        [int(s) for s in args.sizes.split(",")]
        if args.sizes
        else ([256, 1024] if quick else [256, 512, 1024, 2048, 4096])
    )
    reps = max(1, args.reps)
    cap_sizes = [256] if quick else [256, 512, 1024, 2048]
    caps = ["100M"] if quick else ["50M", "100M"]
    link_rates = [] if quick else [250, 500]
    link_sweep_mib = 512
    idle_s = args.idle_seconds or (15 if quick else 60)
    parts = set(args.only.split(",")) if args.only else {"sweep", "link", "cap", "torch", "idle"}
    out_dir = Path(args.out) if args.out else (REPO / "bench" / "results" / ("tmp" if quick else ""))
    name = "quick" if quick else "bench"
    out_dir.mkdir(parents=True, exist_ok=True)

    for tool in ("sshfs", "/usr/sbin/sshd", "tc", "ip", CRIU):
        if not shutil.which(tool) and not os.access(tool, os.X_OK):
            print(
                f"missing {tool}: apt-get install -y sshfs openssh-server iproute2 (and CRIU)",
                file=sys.stderr,
            )
            return 1
    need_gib = 3 * max(sizes) / 1024 + 2
    avail_gib = psutil.virtual_memory().available / (1 << 30)
    if avail_gib < need_gib:
        say(
            f"only {avail_gib:.1f} GiB available, {need_gib:.1f} GiB needed for {max(sizes)} MiB: dropping it"
        )
        while sizes and 3 * max(sizes) / 1024 + 2 > avail_gib:
            sizes.remove(max(sizes))

    results: dict[str, Any] = {
        "machine": machine(),
        "quick": quick,
        "reps": reps,
        "tick_interval_s": TICK_S,
        "config": {
            "sizes_mib": sizes,
            "caps": caps,
            "cap_sizes_mib": cap_sizes,
            "link_rates_mbit": link_rates + [1000],
            "link_sweep_mib": link_sweep_mib,
            "idle_seconds": idle_s,
            "drain": "memsnapd defaults: zstd level 3, 2 drain workers",
        },
        "sweep": [],
        "link": [],
        "cap": [],
        "torch": [],
        "idle": {},
        "errors": [],
    }
    say(f"machine: {results['machine']}")
    BASE.mkdir(parents=True, exist_ok=True, mode=0o700)
    ns = NetStore(BASE / "net", 1000)
    d: Daemon | None = None

    def save() -> None:
        (out_dir / f"{name}.json").write_text(json.dumps(results, indent=1, default=str))

    def attempt(part: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # record it, clean up, carry on with the next case
            say(f"  ERROR in {part}: {exc}")
            results["errors"].append(
                {"part": part, "error": str(exc), "trace": traceback.format_exc()[-2000:]}
            )
            for pid in list(_ALL_PIDS):
                kill(pid)
            return None

    try:
        ns.setup()
        ns.set_rate(None)
        results["link_check_unlimited"] = ns.check(512)
        ns.set_rate(1000)
        results["link_check_1gbit"] = ns.check(512)
        results["link_qdisc"] = ns.qdisc()
        say(
            f"network store: unlimited {results['link_check_unlimited']}, 1 Gbit/s {results['link_check_1gbit']}"
        )
        store = ns.mount / "store"
        d = Daemon(store).start()
        results["daemon_rss_mb_fresh"] = psutil.Process(d.proc.pid).memory_info().rss / 1e6  # type: ignore[union-attr]
        results["cli_status_s"] = cli_wall(d)

        say(f"warm-up: touching {need_gib:.1f} GiB, then one throwaway cycle")
        results["warmup_touch_s"] = warm_memory(need_gib)
        attempt("warmup", lambda: full_cycle(d, ns, counter_argv(min(sizes)), "warmup"))  # type: ignore[arg-type]

        if "sweep" in parts:
            for rep in range(reps):
                for mib in sizes:
                    say(f"sweep rep {rep + 1}/{reps}: {mib} MiB random")
                    r = attempt(
                        f"sweep {mib} rep {rep}",
                        lambda mib=mib, rep=rep: full_cycle(d, ns, counter_argv(mib), "random", rep % 2 == 1),
                    )  # type: ignore
                    if r:
                        r.update({"mib": mib, "rep": rep})
                        results["sweep"].append(r)
                        say(
                            f"  downtime memsnap {r['ms_downtime_ms']:.0f} ms, raw tmpfs {r['raw_tmpfs_downtime_ms']:.0f}"
                            f" ms, raw net {r['raw_net_downtime_ms']:.0f} ms; durable {r['ms_durable_s']:.1f}s "
                            f"({r.get('ms_drain_link_fraction', 0):.2f} of link); restore tier "
                            f"{r['ms_restore_tier_first_tick_s']:.2f}s store {r['ms_restore_store_first_tick_s']:.2f}s "
                            f"lazy {r['ms_restore_lazy_first_tick_s']:.3f}s"
                        )
                    save()
        if "link" in parts and link_rates:
            for rate in link_rates:
                ns.set_rate(rate)
                say(f"link sweep: {rate} Mbit/s, {link_sweep_mib} MiB random")
                rows = attempt(
                    f"link {rate}",
                    lambda rate=rate: drain_series(  # type: ignore
                        d,
                        counter_argv(link_sweep_mib),
                        reps,
                        rate / 8,
                        {"link_mbit": rate, "mib": link_sweep_mib},
                    ),
                )
                results["link"] += rows or []
                save()
            ns.set_rate(1000)
        if "cap" in parts:
            for cap in caps:
                d.stop()
                d = Daemon(store, ["--drain-bandwidth", cap]).start()
                from memsnap.store import parse_size

                cap_MBps = parse_size(cap) / 1e6
                for comp in (False, True):
                    for mib in cap_sizes:
                        kind = "compressible" if comp else "random"
                        say(f"cap sweep: --drain-bandwidth {cap}, {mib} MiB {kind}")
                        extra = {"cap": cap, "cap_MBps": cap_MBps, "mib": mib, "data": kind}
                        rows = attempt(
                            f"cap {cap} {mib} {kind}",
                            lambda d=d, mib=mib, comp=comp, extra=extra: drain_series(
                                d, counter_argv(mib, comp), reps, None, extra
                            ),
                        )
                        for r in rows or []:
                            r["cap_fraction_stored"] = r["stored_bytes"] / r["ms_drain_s"] / 1e6 / cap_MBps
                            r["cap_fraction_raw"] = r["ms_drain_MBps"] / cap_MBps
                        results["cap"] += rows or []
                        save()
            d.stop()
            d = Daemon(store).start()
        if "torch" in parts:
            for rep in range(reps):
                say(f"pytorch training job, rep {rep + 1}/{reps}")
                r = attempt(f"torch rep {rep}", lambda rep=rep: full_cycle(d, ns, train_argv(), "pytorch", rep % 2 == 1))  # type: ignore[arg-type]
                if r:
                    r["rep"] = rep
                    results["torch"].append(r)
                    say(
                        f"  downtime memsnap {r['ms_downtime_ms']:.0f} ms, raw tmpfs {r['raw_tmpfs_downtime_ms']:.0f}"
                        f" ms, raw net {r['raw_net_downtime_ms']:.0f} ms, image {r['size_bytes'] >> 20} MiB"
                    )
                save()
        if "idle" in parts:
            say(f"daemon idle for {idle_s:.0f}s (after the work above)")
            results["idle"] = idle(d, idle_s)
            say(f"  {results['idle']}")
    finally:
        for pid in list(_ALL_PIDS):
            kill(pid)
        if d is not None:
            d.stop()
        ns.teardown()
        shutil.rmtree(TIER, ignore_errors=True)
        shutil.rmtree(RAWTMP, ignore_errors=True)
        results["machine"]["loadavg_end"] = os.getloadavg()
        results["elapsed_s"] = round(time.monotonic() - T_START, 1)
        results["summary"] = {
            "sweep": summarize(results["sweep"], lambda r: r["mib"]),
            "link": summarize(results["link"], lambda r: r["link_mbit"]),
            "cap": summarize(results["cap"], lambda r: f"{r['cap']}|{r['data']}|{r['mib']}"),
            "torch": summarize(results["torch"], lambda r: "pytorch"),
        }
        save()
    from report import render

    render(results, out_dir, name)
    say(f"done in {results['elapsed_s'] / 60:.1f} min: {out_dir}/{name}.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
