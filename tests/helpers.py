"""Shared test helpers: a real memsnapd in a subprocess, and readers for the counter workload's log."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from memsnap.client import ClientError, MemsnapClient

REPO = Path(__file__).resolve().parent.parent
COUNTER = REPO / "tests" / "workloads" / "counter.py"
TICK = re.compile(r"^tick (\d+) (\d+) ([0-9a-f]+)$")
START = re.compile(r"^start (\d+) ([0-9a-f]+)$")


def wait_for(pred: Callable[[], object], timeout: float = 30.0, interval: float = 0.05, what: str = "") -> object:
    """Polls pred until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or pred}")
        time.sleep(interval)


@dataclass
class Tick:
    n: int
    hostpid: int
    digest: str


def ticks(log_path: str | Path, hostpid: int | None = None) -> list[Tick]:
    """The counter workload's ticks, optionally only those printed by one host pid."""
    out = []
    try:
        text = Path(log_path).read_text(errors="replace")
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        m = TICK.match(line.strip())
        if m and (hostpid is None or int(m.group(2)) == hostpid):
            out.append(Tick(int(m.group(1)), int(m.group(2)), m.group(3)))
    return out


def start_digest(log_path: str | Path) -> str:
    """The digest the workload printed right after filling its memory."""
    for line in Path(log_path).read_text().splitlines():
        m = START.match(line.strip())
        if m:
            return m.group(2)
    raise AssertionError("workload printed no start line")


def counter_argv(mib: int = 32, interval: float = 0.1, *extra: str) -> list[str]:
    """argv for the counter workload."""
    return [sys.executable, str(COUNTER), "--mib", str(mib), "--interval", str(interval), *extra]


@dataclass
class DaemonProc:
    """A real memsnapd subprocess with its own socket, tier, store and state dirs."""

    base: Path
    tier: Path = field(default_factory=lambda: Path(f"/dev/shm/memsnap-test-{uuid.uuid4().hex[:8]}"))
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    socket_path: str = ""

    @property
    def socket(self) -> str:
        return self.socket_path or str(self.base / "memsnapd.sock")

    @property
    def state(self) -> Path:
        return self.base / "state"

    @property
    def store(self) -> Path:
        return self.base / "store"

    @property
    def log(self) -> Path:
        return self.base / "memsnapd.log"

    def args(self) -> list[str]:
        return [sys.executable, "-m", "memsnap.daemon", "--socket", self.socket, "--tier-dir", str(self.tier),
                "--store-dir", str(self.store), "--state-dir", str(self.state), "--config", "/dev/null",
                *self.extra]

    def start(self, timeout: float = 30.0) -> DaemonProc:
        self.base.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(REPO), **self.env}
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(self.args(), stdout=logf, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"memsnapd exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                with self.client() as c:
                    c.status(timeout=2)
                return True
            except ClientError:
                return False

        wait_for(up, timeout, 0.1, "memsnapd to answer")
        return self

    def client(self) -> MemsnapClient:
        return MemsnapClient(socket=self.socket)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        return rc

    def cleanup(self) -> None:
        self.stop(signal.SIGKILL)
        shutil.rmtree(self.tier, ignore_errors=True)

    def ctl(self, *args: str, user: int | None = None, check: bool = False,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Runs memsnapctl against this daemon; as uid `user` (gid the same, no groups) when given."""
        env = {**os.environ, "PYTHONPATH": str(REPO), "MEMSNAP_SOCKET": self.socket}
        argv = [sys.executable, "-m", "memsnap.cli", *args]
        if user is not None:
            argv = [*_as_user_argv(user, "sys.argv[0] = 'memsnapctl'; memsnap.cli.main()"), *args]
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"memsnapctl {' '.join(args)} failed ({r.returncode}): {r.stderr}")
        return r


NOBODY = 65534

# The interpreter may live where other uids cannot read it (pyenv under a 0700 /root here), so a snippet
# "as uid N" starts as root, imports what it needs, then drops to uid N (gid N, no groups) before it does
# anything else: every connection and file access it makes is the unprivileged uid's.
_DROP = """
import importlib, os, pkgutil, sys
import grpc, google.protobuf, click, json, memsnap  # noqa: F401  (imported while still root)
for _pkg in (grpc, memsnap):  # lazy imports would fail once the interpreter is out of reach
    for _m in pkgutil.walk_packages(_pkg.__path__, _pkg.__name__ + "."):
        try:
            importlib.import_module(_m.name)
        except Exception:
            pass
_uid = int(sys.argv.pop(1))
os.setgroups([]); os.setgid(_uid); os.setuid(_uid)
os.chdir("/")
"""


def as_user_kwargs(uid: int | None) -> dict[str, object]:
    """subprocess keyword arguments that run a child (not this interpreter) as uid, gid uid, no groups."""
    if uid is None:
        return {}
    return {"user": uid, "group": uid, "extra_groups": [], "cwd": "/"}


def _as_user_argv(uid: int, code: str) -> list[str]:
    return [sys.executable, "-c", _DROP + code, str(uid)]


def run_as(uid: int, code: str, *args: str, timeout: float = 120,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs a Python snippet as uid (e.g. an attack as nobody), with this checkout importable."""
    return subprocess.run([*_as_user_argv(uid, code), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def kill_job(pid: int) -> None:
    """SIGKILLs a job root (its PID namespace goes with it)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


METRICS_LINE = re.compile(r"metrics on http://[^:]+:(\d+)/metrics")


def metrics_port(d: DaemonProc) -> int:
    """The port a daemon started with --metrics-listen 127.0.0.1:0 bound (it logs it): no free-port race."""
    def find() -> int:
        m = METRICS_LINE.search(d.log.read_text(errors="replace"))
        return int(m.group(1)) if m else 0
    return int(wait_for(find, 10, what="the metrics port in the daemon log"))  # type: ignore[arg-type]


def scrape_metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics, parsed: {(sample name, sorted labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def sample(scraped: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """One sample's value from scrape_metrics (0 when absent)."""
    return scraped.get((name, tuple(sorted(labels.items()))), 0.0)


@dataclass
class CounterJob:
    """A counter workload run by a daemon: its job id, root pid, log and the digest of its memory."""

    id: str
    pid: int
    log: str
    digest: str


def start_counter(d: DaemonProc, jobs_to_kill: list[int], mib: int = 8, name: str = "", *extra: str,
                  min_ticks: int = 2, interval: float = 0.1) -> CounterJob:
    """Runs the counter workload through d (memsnapctl run), registered for teardown; waits for min_ticks."""
    with d.client() as c:
        job = c.run(counter_argv(mib, interval, *extra), name=name)
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: len(ticks(job.log_path)) >= min_ticks, 60, what="the job to tick")
    return CounterJob(job.id, int(job.pid), job.log_path, start_digest(job.log_path))


def checkpoint_json(d: DaemonProc, target: str | int, *flags: str) -> dict[str, object]:
    """memsnapctl --json checkpoint TARGET FLAGS, which must succeed; its JSON answer."""
    import json

    return dict(json.loads(d.ctl("--json", "checkpoint", str(target), *flags, check=True).stdout))


def running_job_pids(d: DaemonProc) -> set[int]:
    """Root pids of the jobs d reports running."""
    with d.client() as c:
        return {int(j.pid) for j in c.jobs() if j.running}


def file_names(*roots: Path) -> set[str]:
    """Every path under roots (names only): to show that an operation left no file behind."""
    return {str(p) for r in roots if r.exists() for p in r.rglob("*")}
