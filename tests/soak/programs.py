"""The real programs of the soak, each run as a memsnap job on a node, with how to check that its own data
survived an operation.

    redis      redis-server, populated, written through one connection (SET w:N) -> DBSIZE + DEBUG DIGEST
    memcached  memcached, written through one connection (set w:N)              -> every acknowledged key
    nginx      nginx (keep-alive client + wrk and ab as load)                     -> GET /data digest
    sqlite     a writer committing rows (WAL or rollback journal)                -> integrity_check, rows 1..N
    jvm        Java: a heap array whose digest it prints every round              -> one digest, rounds go on
    torch      PyTorch training with DataLoader workers                          -> every step's loss as the
                                                                                    reference run's, the final too
Before an operation the program is quiesced (its client paused) and its state read; after it, the state must
be the same, the program must make progress, and where connections were to be kept (--tcp-established) the
client's own connection must go on without an error.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.helpers import REPO, job_output, jvm_argv, jvm_rounds, wait_for
from tests.soak.cluster import Cluster, NodeDaemon

WORKLOADS = REPO / "tests" / "workloads"


class DataLost(AssertionError):
    """A program's own data did not survive an operation."""


@dataclass
class Client:
    """A tests.soak.client process in the client's network namespace."""

    proc: subprocess.Popen[str]
    errors: list[str] = field(default_factory=list)

    def ask(self, cmd: str, timeout: float = 60) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        import select

        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if r:
                line = self.proc.stdout.readline()
                if not line:
                    raise DataLost(f"the client exited ({self.proc.poll()})")
                return line.strip()
        raise DataLost(f"the client did not answer {cmd!r} within {timeout} s")

    def stats(self) -> dict[str, float]:
        _, *v = self.ask("stats").split()
        keys = ("requests", "errors", "reconnects", "p50_ms", "p99_ms", "gap_ms", "first_ms")
        return dict(zip(keys, map(float, v), strict=False))

    def close(self) -> None:
        try:
            self.ask("quit", 5)
        except (DataLost, OSError, ValueError):
            pass
        self.proc.kill()
        self.proc.wait()


@dataclass
class Program:
    """One real program run as a job; subclasses say how to start and check it."""

    name: str
    cluster: Cluster
    base: Path
    service_ip: str = ""
    port: int = 0
    node: NodeDaemon | None = None
    job: str = ""
    pid: int = 0
    log: str = ""
    memory_limit: int = 0  # bytes; a guarded program (park + resume)
    client: Client | None = None
    state: str = ""  # what quiesce() read

    tcp = False  # reached over TCP from the client namespace: moves take its address along
    parkable = False  # started with a memory limit; it can be made to reach it

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def argv(self) -> list[str]:
        raise NotImplementedError

    def start(self, node: NodeDaemon) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self.node = node
        if self.service_ip:
            self.cluster.add_service_ip(node, self.service_ip)
        flags = ["--memory-limit", f"{self.memory_limit >> 20}M"] if self.memory_limit else []
        out = json.loads(node.ctl("--json", "run", "--name", self.name, *flags, "--", *self.argv(),
                                  check=True).stdout)
        self.job, self.pid, self.log = out["job"], int(out["pid"]), out["log"]
        self.ready()
        if self.tcp:
            self.client = Client(self.cluster.in_client_ns(
                [sys.executable, "-m", "tests.soak.client", self.client_kind(), self.service_ip, str(self.port)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE))
            wait_for(lambda: self.client is not None and self.client.stats()["requests"] > 0, 30,
                     what=f"{self.name}'s client to write")

    def ready(self) -> None:
        """Waits until the program serves (its first output, its port)."""

    def client_kind(self) -> str:
        return ""

    def adopt(self, node: NodeDaemon, job: str, pid: int) -> None:
        """The program runs as another job now (a restore, a move, a resume)."""
        self.node, self.job, self.pid = node, job, pid
        jobs = json.loads(node.ctl("--json", "jobs", check=True).stdout)
        log = next(j["log_path"] for j in jobs if j["id"] == job) or self.log
        # A restored copy's log is named after the first job's (<stem>.restore-<checkpoint>-<x>.log), and
        # job_output() of the first log reads them all in order. Reading the copy's log alone would see none of
        # what the program printed before: right after a resume it can be empty.
        if not Path(log).name.startswith(Path(self.log).stem + ".restore-"):
            self.log = log

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.service_ip:
            self.cluster.remove_service_ip(self.service_ip)

    def first_answer(self) -> float:
        """Right after an operation brought the program back: seconds until it answers (a TCP program a request on
        a new connection, any other new output)."""
        t0 = time.monotonic()
        if self.tcp:
            wait_for(lambda: _answers(self), 60, 0.005, f"{self.name} to answer")
        else:
            n = len(job_output(self.log))
            wait_for(lambda: len(job_output(self.log)) > n, 60, 0.005, f"{self.name} to write")
        return time.monotonic() - t0

    # -- around an operation ---------------------------------------------------------------------------------
    def quiesce(self) -> None:
        """Stops the program's writes (its client) and reads its state."""
        if self.client is not None:
            ans = self.client.ask("pause")
            assert ans.startswith("paused"), ans
            self.client.ask("reset")
        self.state = self.read_state()

    def read_state(self) -> str:
        return ""

    def check(self, kept_connections: bool) -> dict[str, float]:
        """After an operation: the state read by quiesce() is still there, the program goes on, and its client
        (if connections were to be kept) saw no error. Returns the client's numbers for the operation."""
        now = self.read_state()
        if now != self.state:
            raise DataLost(f"{self.name}: state before the operation {self.state!r}, after it {now!r}")
        self.progresses()
        stats: dict[str, float] = {}
        if self.client is not None:
            self.client.ask("resume")
            client = self.client
            wait_for(lambda: client.stats()["requests"] >= 3, 60, what=f"{self.name}'s client to write again")
            stats = self.client.stats()
            self.client.ask("reset")
            if kept_connections and (stats["errors"] or stats["reconnects"]):
                raise DataLost(f"{self.name}: the client's connection was to be kept, but it saw "
                               f"{int(stats['errors'])} errors and reconnected {int(stats['reconnects'])} times")
        return stats

    def progresses(self) -> None:
        """Waits until the program shows it runs on (new output)."""

    def grow(self, mib: int) -> None:
        """Makes a parkable program allocate mib MiB (it then reaches its memory limit)."""
        (self.base / "grow").write_text(str(mib))
        kids = psutil.Process(self.pid).children()
        os.kill(kids[0].pid if kids else self.pid, signal.SIGUSR1)

    def finish(self) -> None:
        """At the end of a sequence: a last check of everything the program did."""


class Redis(Program):
    tcp = True

    def argv(self) -> list[str]:
        return [shutil.which("redis-server") or "redis-server", "--bind", self.service_ip, "--port", str(self.port),
                "--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir", str(self.base),
                "--daemonize", "no"]

    def client_kind(self) -> str:
        return "redis"

    def _cli(self, *args: str) -> str:
        p = self.cluster.in_client_ns(["redis-cli", "-h", self.service_ip, "-p", str(self.port), *args],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = p.communicate(timeout=60)
        return out.strip()

    def ready(self) -> None:
        wait_for(lambda: self._cli("PING") == "PONG", 30, what="redis to answer")
        self._cli("DEBUG", "POPULATE", "20000", "pop", "64")

    def read_state(self) -> str:
        return f"{self._cli('DBSIZE')} {self._cli('DEBUG', 'DIGEST')}"


class Memcached(Program):
    tcp = True

    def argv(self) -> list[str]:
        return [shutil.which("memcached") or "memcached", "-l", self.service_ip, "-p", str(self.port), "-U", "0",
                "-m", "64", "-t", "1", "-u", "root"]

    def client_kind(self) -> str:
        return "memcached"

    def read_state(self) -> str:
        assert self.client is not None
        ans = self.client.ask("snapshot")
        if not ans.startswith("snapshot"):
            raise DataLost(f"memcached: {ans}")
        return ans


class Nginx(Program):
    tcp = True

    def argv(self) -> list[str]:
        root = self.base / "www"
        root.mkdir(parents=True, exist_ok=True)
        (root / "index.html").write_text("ok\n")
        (root / "data").write_bytes(random.Random(self.port).randbytes(256 << 10))
        conf = self.base / "nginx.conf"
        # user root: here CRIU cannot dump a process of another uid (root lacks CAP_SYS_RESOURCE).
        conf.write_text(textwrap.dedent(f"""
            user root;
            worker_processes 1;
            daemon off;
            error_log stderr warn;
            pid {self.base}/nginx.pid;
            events {{ worker_connections 256; }}
            http {{
              access_log off;
              keepalive_requests 1000000;
              keepalive_timeout 3600s;
              client_body_temp_path {self.base}/body;
              proxy_temp_path {self.base}/proxy;
              fastcgi_temp_path {self.base}/fastcgi;
              uwsgi_temp_path {self.base}/uwsgi;
              scgi_temp_path {self.base}/scgi;
              server {{ listen {self.service_ip}:{self.port}; root {root}; }}
            }}
        """))
        return [shutil.which("nginx") or "/usr/sbin/nginx", "-c", str(conf)]

    def client_kind(self) -> str:
        return "http"

    def start(self, node: NodeDaemon) -> None:
        super().start(node)
        url = f"http://{self.service_ip}:{self.port}/"
        # Load that keeps connections in flight all the time (ab: a new one per request), the way real clients do.
        self.loaders = [self.cluster.in_client_ns(["wrk", "-t1", "-c2", "-d3600s", url],
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                        self.cluster.in_client_ns(["ab", "-q", "-c", "2", "-n", "100000000", url],
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]

    def stop(self) -> None:
        for p in getattr(self, "loaders", []):
            p.kill()
            p.wait()
        super().stop()

    def read_state(self) -> str:
        assert self.client is not None
        ans = self.client.ask("snapshot")
        if not ans.startswith("snapshot status=200"):
            raise DataLost(f"nginx: {ans}")
        return ans


class Sqlite(Program):
    """The database lives on the host's disk, as a real one would (in the job's private /tmp it would come back
    with new inode numbers, which SQLite in rollback-journal mode takes for a moved file: 'attempt to write a
    readonly database'). On this one host both nodes see it, so a move that freezes the writer holding a lock
    is refused, by design (the stopped source keeps the lock); the job runs on at the source."""

    parkable = True
    journal = "wal"

    def argv(self) -> list[str]:
        return [sys.executable, str(WORKLOADS / "sqlite_rows.py"), "--db", str(self.base / "rows.db"),
                "--journal", self.journal, "--grow-file", str(self.base / "grow")]

    def committed(self) -> int:
        found = re.findall(r"^committed (\d+)$", job_output(self.log), re.M)
        return int(found[-1]) if found else 0

    def ready(self) -> None:
        wait_for(lambda: self.committed() >= 5, 60, what="the sqlite writer to commit")

    def _rows(self) -> dict[str, Any]:
        """integrity_check and every row, read by a second connection while the writer goes on."""
        import hashlib
        import sqlite3

        db = sqlite3.connect(f"file:{self.base / 'rows.db'}?mode=ro", uri=True, timeout=30)
        try:
            ok = db.execute("PRAGMA integrity_check").fetchone()[0]
            rows = db.execute("SELECT n, sum FROM t ORDER BY n").fetchall()
        finally:
            db.close()
        return {"ok": ok, "count": len(rows), "contiguous": [n for n, _ in rows] == list(range(1, len(rows) + 1)),
                "bad": [n for n, s in rows if s != hashlib.sha1(str(n).encode()).hexdigest()][:5]}

    def read_state(self) -> str:
        # (it keeps writing: what must hold is that nothing committed was lost, checked in progresses())
        self.committed_before = self.committed()
        return ""

    def progresses(self) -> None:
        before = self.committed_before
        wait_for(lambda: self.committed() > before + 3, 60, what="the sqlite writer to commit again")
        got = self._rows()
        if got["ok"] != "ok":
            raise DataLost(f"sqlite integrity_check: {got['ok']}")
        if not got["contiguous"] or got["count"] < before:
            raise DataLost(f"sqlite: {got['count']} rows (contiguous: {got['contiguous']}), but {before} were "
                           "committed before the operation")
        if got["bad"]:
            raise DataLost(f"sqlite: rows {got['bad']} do not hold what was written")


class Jvm(Program):
    def argv(self) -> list[str]:
        return jvm_argv(32, 100)

    def ready(self) -> None:
        wait_for(lambda: len(jvm_rounds(self.log)) >= 2, 60, what="the JVM to print rounds")

    def progresses(self) -> None:
        n = jvm_rounds(self.log)[-1][0]
        wait_for(lambda: jvm_rounds(self.log)[-1][0] >= n + 3, 60, what="the JVM to go on")
        digests = {d for _, d in jvm_rounds(self.log)}
        if len(digests) != 1:
            raise DataLost(f"jvm: its heap digest changed: {sorted(digests)}")


class Torch(Program):
    parkable = True

    def argv(self) -> list[str]:
        return [sys.executable, str(WORKLOADS / "train_loader.py"), "--stop-at", str(self.base / "stop-at"),
                "--workers", "2", "--sleep", "0.05", "--grow-file", str(self.base / "grow")]

    def steps(self) -> dict[int, str]:
        return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+) (\S+)$", job_output(self.log), re.M)}

    def ready(self) -> None:
        wait_for(lambda: len(self.steps()) >= 3, 180, what="training to start")

    def progresses(self) -> None:
        n = max(self.steps())
        wait_for(lambda: max(self.steps()) >= n + 3, 120, what="training to go on")

    def finish(self) -> None:
        last = max(self.steps()) + 5
        (self.base / "stop-at").write_text(str(last))
        final = wait_for(lambda: re.search(r"^final (\d+) (\S+)$", job_output(self.log), re.M), 300,
                         what="training to finish")
        got = self.steps()
        ref = subprocess.run([sys.executable, str(WORKLOADS / "train_loader.py"), "--steps", str(last),
                              "--workers", "2", "--sleep", "0"], capture_output=True, text=True, timeout=900,
                             check=True).stdout
        want = {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+) (\S+)$", ref, re.M)}
        wrong = [s for s in got if got[s] != want.get(s)]
        if wrong:
            raise DataLost(f"torch: steps {wrong[:5]} lost bit-identity with the reference run")
        want_final = re.search(r"^final (\d+) (\S+)$", ref, re.M)
        assert want_final is not None and isinstance(final, re.Match)
        if final.group(2) != want_final.group(2):
            raise DataLost(f"torch: final loss {final.group(2)}, reference {want_final.group(2)}")
        self.pid = 0  # (it ended)


def _answers(p: Program) -> bool:
    try:
        p.read_state()
        return True
    except (DataLost, OSError, subprocess.SubprocessError):
        return False


KINDS: dict[str, type[Program]] = {"redis": Redis, "memcached": Memcached, "nginx": Nginx, "sqlite": Sqlite,
                                   "jvm": Jvm, "torch": Torch}


def make(kind: str, cluster: Cluster, index: int, **kw: Any) -> Program:
    """The program `kind`, the index-th of the sequence: its own service address and port."""
    cls = KINDS[kind]
    p = cls(name=f"{kind}-{index}", cluster=cluster, base=cluster.base / "programs" / f"{kind}-{index}", **kw)
    if cls.tcp:
        p.service_ip, p.port = f"{cluster_subnet()}.{100 + index}", 6000 + index
    if cls.parkable and not p.memory_limit:
        p.memory_limit = (2048 if kind == "torch" else 192) << 20
    return p


def cluster_subnet() -> str:
    from tests.soak.cluster import SUBNET

    return SUBNET
