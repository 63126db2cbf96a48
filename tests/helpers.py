"""Shared test helpers: a real memsnapd in a subprocess, and readers for the counter workload's log."""

from __future__ import annotations

import ctypes
import itertools
import json
import mmap
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from memsnap.client import ClientError, MemsnapClient

REPO = Path(__file__).resolve().parent.parent
COUNTER = REPO / "tests" / "workloads" / "counter.py"
TICK = re.compile(r"^tick (\d+) (\d+) ([0-9a-f]+)( fresh)?$")
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
    fresh: bool = False  # the digest was computed from memory on this tick, not carried over from before


def ticks(log_path: str | Path, hostpid: int | None = None) -> list[Tick]:
    """The counter workload's ticks, optionally only those printed by one host pid, from the job's log and
    the logs of its restored copies."""
    out = []
    for line in job_output(log_path).splitlines():
        m = TICK.match(line.strip())
        if m and (hostpid is None or int(m.group(2)) == hostpid):
            out.append(Tick(int(m.group(1)), int(m.group(2)), m.group(3), bool(m.group(4))))
    return out


# The job log dirs of every daemon this test session started: a job that moved writes to a log of its own in the
# target's log dir, named after its parent like a restored copy's (Engine.restore_own_log, moved=True).
LOG_DIRS: set[Path] = set()


def guard_table(state_dir: str | Path) -> dict[str, Any]:
    """The memory guard's job table, read from the daemon's catalog (read-only, beside the running daemon)."""
    import sqlite3

    db = Path(state_dir) / "catalog.db"
    if not db.exists():
        return {}
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        rows = con.execute("SELECT job_id, data FROM guard_jobs").fetchall()
    except sqlite3.OperationalError:  # (no table yet)
        return {}
    finally:
        con.close()
    return {k: json.loads(v) for k, v in rows}


def resident_pages(path: Path) -> int:
    """Pages of path in the page cache (mincore over a mapping of it)."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        try:
            vec = ctypes.create_string_buffer(pages)
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def job_output(log_path: str | Path) -> str:
    """A job's log followed by the logs of its restored copies: each restore writes to a log of its own
    next to its parent's, <stem>.restore-<checkpoint>-<x>.log (memsnap.engine.Engine.restore_own_log), and a
    moved copy to one of that name in the target daemon's log dir."""
    path = Path(log_path)
    text = ""
    copies = {p for d in {path.parent, *LOG_DIRS} for p in d.glob(f"{path.stem}.restore-*.log")}
    for p in [path, *sorted(copies, key=lambda p: p.stat().st_mtime)]:
        try:
            text += p.read_text(errors="replace")
        except FileNotFoundError:
            pass
    return text


def keeps_ticking_with(log_path: str | Path, pid: int, digest: str, more: int = 3, timeout: float = 60) -> None:
    """pid prints `more` more ticks, and at least one digest freshly computed from its memory after now;
    every tick it ever printed carries digest. (A digest carried over in a variable proves nothing about
    the memory of a restored copy: the variable is restored too.)"""
    n0 = len(ticks(log_path, pid))

    def enough() -> bool:
        new = ticks(log_path, pid)[n0:]
        return len(new) >= more and any(t.fresh for t in new)

    wait_for(enough, timeout, 0.1, f"pid {pid} to print {more} more ticks and a freshly computed digest")
    got = ticks(log_path, pid)
    assert all(t.digest == digest for t in got), \
        f"pid {pid} printed other memory digests: {sorted({t.digest for t in got} - {digest})}"


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
    wrap: list[str] = field(default_factory=list)  # a command that execs the daemon's argv (e.g. unshare)

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
        LOG_DIRS.add(self.state / "jobs")
        env = {**os.environ, "PYTHONPATH": str(REPO), **self.env}
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen([*self.wrap, *self.args()], stdout=logf, stderr=subprocess.STDOUT, env=env,
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
        """Runs memsnapctl against this daemon; as uid `user` (gid the same, no groups) when given. A read-only
        query as root (what tests poll) runs in this process (ctl_here)."""
        if user is None and _queries_only(args):
            r = self.ctl_here(*args)
        else:
            env = {**os.environ, "PYTHONPATH": str(REPO), "MEMSNAP_SOCKET": self.socket}
            argv = [sys.executable, "-m", "memsnap.cli", *args]
            if user is not None:
                argv = [*_as_user_argv(user, "sys.argv[0] = 'memsnapctl'; memsnap.cli.main()"), *args]
            r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"memsnapctl {' '.join(args)} failed ({r.returncode}): {r.stderr}"
                                 + self.stacks_if_stuck(r.stderr))
        return r

    def ctl_here(self, *args: str) -> subprocess.CompletedProcess[str]:
        """memsnapctl's main() in this process, as root, its output captured: what a new interpreter would print
        and exit with, without its imports (about 0.25 s of CPU a call: a poll every 0.1 s kept most of one of
        this VM's two cores busy beside the daemon and CRIU it waits for)."""
        import contextlib
        import io

        import memsnap.cli

        out, err = io.StringIO(), io.StringIO()
        code = 0
        with _CTL_HERE:  # (stdout, stderr and the environment are the process's)
            old = os.environ.get("MEMSNAP_SOCKET")
            os.environ["MEMSNAP_SOCKET"] = self.socket
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    memsnap.cli.main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            finally:
                if old is None:
                    os.environ.pop("MEMSNAP_SOCKET", None)
                else:
                    os.environ["MEMSNAP_SOCKET"] = old
        return subprocess.CompletedProcess(["memsnapctl", *args], code, out.getvalue(), err.getvalue())

    def stacks_if_stuck(self, stderr: str) -> str:
        """After a call ran out of time: the daemon's thread stacks (SIGUSR1) and the end of its log, for the
        failure message."""
        if "DEADLINE_EXCEEDED" not in stderr or self.wrap or self.proc is None or self.proc.poll() is not None:
            return ""
        before = self.log.read_text(errors="replace").splitlines()
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(1)
        stacks = self.log.read_text(errors="replace").splitlines()[len(before):]
        return ("\n--- the end of memsnapd's log ---\n" + "\n".join(before[-60:])
                + "\n--- memsnapd's threads (SIGUSR1) ---\n" + "\n".join(stacks[:600]))


NOBODY = 65534

# The interpreter may live where other uids cannot read it (pyenv under a 0700 /root here), so a snippet
# "as uid N" starts as root, imports what it needs, then drops to uid N (gid N, no groups) before it does
# anything else: every connection and file access it makes is the unprivileged uid's.
_DROP = """
import importlib, os, pkgutil, sys
import grpc, google.protobuf, click, json, memsnap  # noqa: F401  (imported while still root)
import google.protobuf.json_format  # noqa: F401  (memsnapctl status, show, -o json: loaded lazily)
import encodings.idna  # noqa: F401  (a socket address given as text: loaded lazily)
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


_CTL_HERE = threading.Lock()
# memsnapctl commands that only read (no stream, no follow): DaemonProc.ctl runs these in the test's process.
_QUERIES = {"jobs", "show", "list", "status"}


def _queries_only(args: tuple[str, ...]) -> bool:
    rest = [a for a in args if a != "--json"]
    return bool(rest) and rest[0] in _QUERIES and not any(a in ("-f", "--follow", "-w", "--watch") for a in rest)


def _as_user_argv(uid: int, code: str) -> list[str]:
    return [sys.executable, "-c", _DROP + code, str(uid)]


def run_as(uid: int, code: str, *args: str, timeout: float = 120,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs a Python snippet as uid (e.g. an attack as nobody), with this checkout importable."""
    return subprocess.run([*_as_user_argv(uid, code), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def with_proc_sys_value(name: str, value: str, where: Path) -> list[str]:
    """A DaemonProc.wrap that shows the daemon /proc/sys/NAME as value, in a mount namespace of its own:
    the host's setting (fs.pipe-max-size, ...) is never changed, not even for a moment."""
    fake = where / ("sysctl-" + name.replace("/", "."))
    fake.write_text(value + "\n")
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'mount --bind "$0" /proc/sys/{name} && exec "$@"', str(fake)]


def kill_job(pid: int) -> None:
    """SIGKILLs a job root (its PID namespace goes with it)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


METRICS_LINE = re.compile(r"metrics on http://[^:]+:(\d+)/metrics")


def metrics_port(d: DaemonProc) -> int:
    """The port a daemon started with --metrics-listen 127.0.0.1:0 bound (it logs it): no free-port race."""
    def find() -> int:  # the last start's port: a restarted daemon binds a new one
        found = METRICS_LINE.findall(d.log.read_text(errors="replace"))
        return int(found[-1]) if found else 0
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


# -- the loopback test cluster: daemons that listen on TCP and know each other as peers ------------------
def free_port() -> int:
    """A loopback port below the ephemeral range (no outgoing connection takes it) that nothing listens on
    right now. It is not reserved: start a daemon that listens on it with start_on_free_ports, which
    draws new ports when one was taken before the daemon bound it. (A daemon that refuses to start before
    it binds needs nothing more.)"""
    return _fresh_ports(1)[0]


def _fresh_ports(n: int) -> list[int]:
    """n free loopback ports, none of the test cluster's."""
    return [p for p in _port_pool(n + len(CLUSTER_PORTS)) if p not in CLUSTER_PORTS][:n]


def start_on_free_ports(n: int, make: Callable[[list[int]], list[DaemonProc]],
                        attempts: int = 5) -> list[DaemonProc]:
    """Starts the daemons make(ports) builds on n free loopback ports (they must listen on them). A port
    taken between the draw and the bind ("the address is in use") stops them all, and they start again
    on newly drawn ports."""
    for attempt in range(attempts):
        daemons = make(_fresh_ports(n))
        seen = {id(d): d.log.stat().st_size if d.log.exists() else 0 for d in daemons}
        try:
            for d in daemons:
                d.start()
            return daemons
        except AssertionError:
            for d in daemons:
                if d.proc is not None and d.proc.poll() is None:
                    d.stop(signal.SIGKILL)
            taken = any(d.log.exists() and b"the address is in use" in d.log.read_bytes()[seen[id(d)]:]
                        for d in daemons)
            if not taken or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _port_pool(n: int = 48) -> list[int]:
    """n loopback ports below the ephemeral range (so no outgoing connection takes one), free right now."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = random.randrange(10000, max(10001, low - 4 * n))
    pool: list[int] = []
    for port in range(first, low):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        pool.append(port)
        if len(pool) == n:
            return pool
    raise AssertionError("no free loopback ports for the test cluster")


# Every test daemon that listens on TCP is a node of one loopback cluster: it takes the next port of this
# pool, is named after it, and lists every port of the pool as a peer (jobs move only to peers).
CLUSTER_PORTS = _port_pool()
_next_port = itertools.cycle(CLUSTER_PORTS)


def node_name(port: int) -> str:
    """The node name of the cluster daemon on a port."""
    return f"n{port}"


def cluster_toml(port: int, token_file: Path | None, more: str = "") -> str:
    """memsnap.toml of the cluster daemon on port: its node token, and every cluster port as a peer."""
    if token_file:
        os.chmod(token_file, 0o600)
    lines = ["[daemon]", f'listen = "127.0.0.1:{port}"', f'node_name = "{node_name(port)}"']
    if token_file:
        lines.append(f'auth_token_file = "{token_file}"')
    lines.append(more)
    for p in CLUSTER_PORTS:
        lines += ["[[peers]]", f'name = "{node_name(p)}"', f'address = "127.0.0.1:{p}"']
    return "\n".join(lines) + "\n"


@dataclass
class ClusterDaemon(DaemonProc):
    """A daemon of the loopback test cluster (token_daemon); start() moves to the next pool port if its
    port was taken since the pool was drawn (a port found free at import time is not reserved)."""

    token_file: Path | None = None
    more: str = ""
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def write_config(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        (self.base / "memsnap.toml").write_text(cluster_toml(self.port, self.token_file, self.more))

    def start(self, timeout: float = 30.0) -> ClusterDaemon:
        for attempt in range(len(CLUSTER_PORTS)):
            if attempt:  # (the first start keeps the config as written, with any lines a test added)
                self.write_config()
            try:
                super().start(timeout)
                return self
            except AssertionError:
                if "the address is in use" not in self.log.read_text() or attempt == len(CLUSTER_PORTS) - 1:
                    raise
                self.port = next(_next_port)
        return self


def token_daemon(base: Path, token_file: Path | None, more: str = "", extra: tuple[str, ...] = (),
                 **kw: object) -> ClusterDaemon:
    """A daemon that also listens on loopback TCP, a node of the test cluster whose node token is in
    token_file; `more` adds [daemon] lines (e.g. admin_token_file = ...), `extra` memsnapd flags."""
    d = ClusterDaemon(base, extra=["--config", str(base / "memsnap.toml"), *extra], token_file=token_file,
                      more=more, port=next(_next_port), **kw)  # type: ignore[arg-type]
    d.write_config()
    return d


def peer_token_for(d: DaemonProc, token_file: Path) -> str:
    """The credential a peer sends to the cluster daemon d: derived from the node token for d's name."""
    from memsnap.auth import peer_credential

    port = int(d.address.rsplit(":", 1)[1])  # type: ignore[attr-defined]
    return peer_credential(token_file.read_text().strip().encode(), node_name(port))


def secret_file(path: Path, text: str = "") -> Path:
    """A 0600 token file."""
    path.write_text((text or secrets.token_hex(32)) + "\n")
    os.chmod(path, 0o600)
    return path


# -- a test PKI for mutual TLS ------------------------------------------------------------------------
def openssl(*args: str) -> None:
    """Runs openssl; fails the test on error."""
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    """A test CA in d: (key, certificate)."""
    key, crt = d / f"{name}.key", d / f"{name}.crt"
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(crt), "-subj", f"/CN={name}", "-days", "2",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
    return key, crt


def make_cert(d: Path, name: str, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    """A certificate named name (CN; SAN 127.0.0.1) signed by ca: (key, certificate)."""
    key, csr, crt, ext = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.crt", d / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                   "extendedKeyUsage=serverAuth,clientAuth\n")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[1]), "-CAkey", str(ca[0]), "-CAcreateserial",
             "-out", str(crt), "-days", "2", "-extfile", str(ext))
    os.chmod(key, 0o600)
    return key, crt


# -- moves between two cluster daemons ---------------------------------------------------------------
@dataclass
class Pair:
    """Two cluster daemons (a: where jobs start, b: where they move) sharing one node token."""

    a: DaemonProc
    b: DaemonProc
    token_file: Path
    base: Path


def two_daemons(tmp_path_factory: Any) -> Iterator[Pair]:
    """Two daemons with one node token but each with its own HMAC key: moves must not need a shared key."""
    if os.geteuid() != 0:
        raise AssertionError("the e2e tests run real CRIU and must run as root (CI does)")
    base = tmp_path_factory.mktemp("migrate")
    token = base / "token"
    token.write_text(secrets.token_hex(32))
    a = token_daemon(base / "a", token, extra=("--metrics-listen", "127.0.0.1:0")).start()
    b = token_daemon(base / "b", token, extra=("--metrics-listen", "127.0.0.1:0")).start()
    yield Pair(a, b, token, base)
    a.cleanup()
    b.cleanup()


def counter_job(d: DaemonProc, jobs_to_kill: list[int], mib: int, name: str) -> dict[str, Any]:
    """A counter job for moves (digest recomputed every 10 ticks), as a dict: id, pid, log, digest."""
    with d.client() as c:
        job = c.run(counter_argv(mib, 0.1, "--digest-every", "10"), name=name)
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: len(ticks(job.log_path)) >= 3, 60, what="the job to tick")
    return {"id": job.id, "pid": int(job.pid), "log": job.log_path, "digest": start_digest(job.log_path)}


def ticking_with(job: dict[str, Any], pid: int, digest: str, fresh: int = 12) -> None:
    """pid prints `fresh` more ticks, including a digest computed from its memory since now, all equal to digest."""
    keeps_ticking_with(job["log"], pid, digest, more=fresh)


def migrate(d: DaemonProc, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """memsnapctl --json migrate ARGS on d."""
    return d.ctl("--json", "migrate", *args, timeout=timeout)



def migrate_in_background(d: DaemonProc, *args: str) -> subprocess.Popen[str]:
    """`memsnapctl --json migrate ARGS` on d, not waited for."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MEMSNAP_SOCKET": d.socket}
    return subprocess.Popen([sys.executable, "-m", "memsnap.cli", "--json", "migrate", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_target_then_expect_rollback(victim: DaemonProc, mig: subprocess.Popen[str], step: str) -> None:
    """kill -9 the target; the move must fail at `step` and resume the job on the source."""
    assert victim.proc is not None
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    _, err = mig.communicate(timeout=120)
    assert mig.returncode != 0
    assert f"migration failed at {step}" in err and "resumed on this node" in err, err



def lazy_pages_of(d: DaemonProc) -> list[int]:
    """Pids of the criu lazy-pages processes (and their supervisors) working in d's state dir."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "lazy-pages" in cmd and any(str(d.state) in a for a in cmd):
            out.append(p.pid)
    return out


def kill_counters_started_since(t0: float) -> None:
    """Kills every counter workload started after t0 (copies restored on some node whose pid a failed test
    never learned: jobs outlive their daemons), but not the unit tier's (uid 65534: scripts/test.sh runs it
    beside the root tier)."""
    for p in psutil.process_iter(["cmdline", "create_time", "uids"]):
        try:
            if p.info["create_time"] >= t0 and str(COUNTER) in (p.info["cmdline"] or []) and \
                    p.info["uids"].real != 65534:
                kill_job(p.pid)
        except psutil.Error:
            pass


def restore_refused(d: DaemonProc, key: str, jobs_to_kill: list[int], *flags: str) -> subprocess.CompletedProcess[str]:
    """memsnapctl --json restore that the test expects to fail; should it succeed after all, the restored
    copy is registered for teardown (never left running unnoticed) and the caller's assertion fails."""
    import json

    r = d.ctl("--json", "restore", *flags, key)
    if r.returncode == 0:
        jobs_to_kill.append(int(json.loads(r.stdout)["pid"]))
    return r


def stored_chunk(store_root: Path, manifest: dict[str, Any], cid: str) -> tuple[Path, int, int]:
    """Where a POSIX store keeps chunk cid of a stored manifest: (file, offset, stored length): its loose
    object whole, or its slice of a pack (memsnap.store.packs)."""
    from memsnap.store import chunks

    for ref in _chunk_refs(manifest):
        if ref.id == cid:
            if ref.loc is None:
                p = store_root / chunks.chunk_key(cid)
                return p, 0, p.stat().st_size
            return store_root / chunks.pack_key(ref.loc[0]), ref.loc[1], ref.loc[2]
    raise KeyError(cid)


def missing_chunks(store_root: Path, manifest: dict[str, Any]) -> list[str]:
    """The chunks a stored manifest references whose object (loose, or the pack holding it) is not in the
    POSIX store at store_root."""
    from memsnap.store import chunks

    return [r.id for r in _chunk_refs(manifest)
            if not (store_root / (chunks.chunk_key(r.id) if r.loc is None else chunks.pack_key(r.loc[0]))).is_file()]


def _chunk_refs(manifest: dict[str, Any]) -> list[Any]:
    """The chunks of the files of a chunked stored manifest's JSON (memsnap.store.chunks.ChunkRef), in order."""
    from memsnap.store import chunks

    st = chunks.chunked_storage(manifest)
    assert st is not None, "not a chunked stored manifest"
    return [r for lay in st.files.values() for r in lay.chunks]


def flip_stored_chunk_byte(store_root: Path, manifest: dict[str, Any], cid: str) -> None:
    """Changes one byte in the middle of chunk cid's stored bytes (tampering)."""
    p, off, n = stored_chunk(store_root, manifest, cid)
    with open(p, "r+b") as f:
        f.seek(off + n // 2)
        b = f.read(1)
        f.seek(off + n // 2)
        f.write(bytes([b[0] ^ 1]))


# -- the node stays healthy after every step of a sequence (tests/e2e/test_sequences.py, tests/soak) -------------
RESTORABLE_STATES = {"staged", "draining", "durable"}


def restorable_ids(d: DaemonProc) -> set[str]:
    """The checkpoints d lists as restorable (staged, draining or durable)."""
    import json

    return {c["id"] for c in json.loads(d.ctl("--json", "list", check=True).stdout)
            if c["state"] in RESTORABLE_STATES}


def criu_of(d: DaemonProc) -> list[str]:
    """CRIU processes working for d: its criu children (swrk) and lazy-pages servers in its state dir."""
    found = []
    if d.proc is not None and d.proc.poll() is None:
        try:
            for p in psutil.Process(d.proc.pid).children(recursive=True):
                try:
                    if p.name() == "criu":
                        found.append(f"{p.pid} {' '.join(p.cmdline())}")
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
    return found + [f"{pid} lazy-pages" for pid in lazy_pages_of(d)]


def stopped_in(pids: list[int]) -> list[str]:
    """Processes in the trees of pids that are stopped or traced (a job left frozen)."""
    out = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                st = p.status()
            except psutil.Error:
                continue
            if st in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                out.append(f"{p.pid} ({p.name()}) {st}")
    return out


def assert_node_healthy(d: DaemonProc, restorable: set[str] | None = None, jobs: list[int] | None = None,
                        settle_s: float = 30.0) -> None:
    """After a step: no CRIU left working for d, drains not paused, no job of `jobs` (or d's running jobs)
    frozen, and (when given) exactly `restorable` restorable checkpoints. Polls up to settle_s for work that
    ends on its own (a lazy restore paging in, a drain's pause)."""
    import json

    left: set[str] = set()

    def problems() -> list[str]:
        bad = [f"criu left: {c}" for c in criu_of(d)]
        st = json.loads(d.ctl("--json", "status", check=True).stdout)
        if st.get("drains_paused"):
            bad.append(f"drains paused: {st.get('drains_paused_reason')} {st.get('drains_held')}")
        pids = jobs if jobs is not None else sorted(running_job_pids(d))
        bad += [f"frozen: {s}" for s in stopped_in(pids)]
        left.clear()
        if restorable is not None:
            got = restorable_ids(d)
            left.update(got - restorable)
            if got != restorable:
                bad.append(f"restorable: extra {sorted(got - restorable)}, missing {sorted(restorable - got)}")
        return bad

    deadline = time.monotonic() + settle_s
    while True:
        bad = problems()
        if not bad:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"node {d.base.name} unhealthy: " + "; ".join(bad) + _whence(d, left))
        time.sleep(0.2)


def _whence(d: DaemonProc, ids: set[str]) -> str:
    """For checkpoints left over: their rows and what the daemon's log said of them (a failure in CI is all we
    see)."""
    import json

    if not ids:
        return ""
    rows = [c for c in json.loads(d.ctl("--json", "list", check=True).stdout) if c["id"] in ids]
    try:
        said = [ln[:300] for ln in d.log.read_text(errors="replace").splitlines() if any(i in ln for i in ids)]
    except OSError:
        said = []
    return f"\nleft over: {json.dumps(rows)[:3000]}\nits log lines:\n" + "\n".join(said[-30:])


# -- real programs (tests/e2e/test_private_tmp.py, tests/soak) -------------------------------------------------
def need(*programs: str) -> None:
    """Fails (never skips) the test when a real program it runs is not installed."""
    import pytest

    missing = [p for p in programs if not shutil.which(p) and not shutil.which(p, path="/usr/sbin:/sbin")]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: scripts/setup.sh --test installs them (CI runs it)")


ROUNDS_JAVA = REPO / "tests" / "workloads" / "Rounds.java"
ROUND = re.compile(r"^round (\d+) ([0-9a-f]+)$")


def rounds_classpath() -> str:
    """A directory holding the compiled JVM workload (tests/workloads/Rounds.java), compiled once per source."""
    import hashlib

    tag = hashlib.sha256(ROUNDS_JAVA.read_bytes()).hexdigest()[:12]
    out = Path("/var/tmp") / f"memsnap-rounds-{tag}"
    if not (out / "Rounds.class").exists():
        tmp = Path(f"{out}.{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        subprocess.run(["javac", "-d", str(tmp), str(ROUNDS_JAVA)], check=True, capture_output=True, timeout=120)
        os.chmod(tmp, 0o755)
        try:
            tmp.rename(out)
        except OSError:  # (another test compiled it meanwhile)
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def jvm_argv(mib: int = 16, interval_ms: int = 200) -> list[str]:
    """argv of the JVM workload: MIB MiB of heap whose digest it prints every round."""
    return ["java", "-Xmx512m", "-cp", rounds_classpath(), "Rounds", str(mib), str(interval_ms)]


def jvm_rounds(log_path: str | Path) -> list[tuple[int, str]]:
    """(round, digest) of every round line in a JVM job's log and its restored copies' logs."""
    return [(int(m.group(1)), m.group(2)) for line in job_output(log_path).splitlines()
            if (m := ROUND.match(line.strip()))]
