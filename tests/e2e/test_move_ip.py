"""A move keeps the job's network identity: its service address and an established TCP connection.

Two "nodes" are network namespaces, joined with a client namespace through a bridge that lives in a
namespace of its own, so the test never touches the host's network. Each node runs its own memsnapd.
A TCP server job on node A streams a numbered sequence to the client; after
`migrate --tcp-established --move-ip`, the same client connection keeps receiving it on node B,
with no reconnect and no gap.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pyroute2 import NetNS, netns

from tests.helpers import DaemonProc, wait_for
from tests.netlab import NsDaemon, bridge, node_args

SUBNET = "10.213.77"
SERVICE = f"{SUBNET}.100"
PORT = 7000

SERVER = textwrap.dedent(f"""
    import socket, time
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(({SERVICE!r}, {PORT}))
    srv.listen(1)
    print("listening", flush=True)
    conn, _ = srv.accept()
    n = 0
    while True:
        n += 1
        conn.sendall(f"{{n}}\\n".encode())
        time.sleep(0.01)
""")

CLIENT = textwrap.dedent(f"""
    import socket, sys, time
    out = open(sys.argv[1], "w", buffering=1)
    for _ in range(200):
        try:
            s = socket.create_connection(({SERVICE!r}, {PORT}), timeout=1)
            break
        except OSError:
            time.sleep(0.05)
    else:
        out.write("error connect\\n"); sys.exit(1)
    s.settimeout(60)
    out.write(f"connected {{s.getsockname()[1]}}\\n")
    buf = b""
    expect = 1
    while True:
        try:
            data = s.recv(65536)
        except OSError as exc:
            out.write(f"error {{exc}}\\n"); sys.exit(1)
        if not data:
            out.write("error eof\\n"); sys.exit(1)
        buf += data
        *lines, buf = buf.split(b"\\n")
        for line in lines:
            n = int(line)
            if n != expect:
                out.write(f"error gap expected {{expect}} got {{n}}\\n"); sys.exit(1)
            expect += 1
        out.write(f"n {{expect - 1}} {{time.monotonic():.3f}}\\n")
""")


@dataclass
class Lan:
    """Namespaces a (node A), b (node B), c (client) on one bridge in namespace sw."""

    a: str
    b: str
    c: str
    sw: str

    def addresses(self, ns: str) -> set[str]:
        with NetNS(ns) as n:
            return {str(x.get_attr("IFA_ADDRESS")) for x in n.get_addr(family=socket.AF_INET)}


def _build_lan() -> Lan:
    tag = secrets.token_hex(3)
    lan = Lan(a=f"ms-a-{tag}", b=f"ms-b-{tag}", c=f"ms-c-{tag}", sw=f"ms-sw-{tag}")
    bridge(lan.sw, [(lan.a, f"{SUBNET}.1"), (lan.b, f"{SUBNET}.2"), (lan.c, f"{SUBNET}.3")])
    with NetNS(lan.a) as n:
        n.addr("add", index=n.link_lookup(ifname="eth0")[0], address=SERVICE, prefixlen=24)
    return lan


def _in_ns(ns: str, argv: list[str], **kw: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", *argv], **kw)  # type: ignore[call-overload]


def criu_dumps_tcp() -> str:
    """'' when the CRIU memsnap uses can dump a TCP socket on this kernel, else CRIU's reason."""
    from memsnap.criu import Criu, CriuError, DumpOptions

    code = ("import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); print(1, flush=True); "
            "input()")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                start_new_session=True)
        try:
            assert proc.stdout is not None
            proc.stdout.readline()
            (Path(tmp) / "img").mkdir()
            (Path(tmp) / "work").mkdir()
            Criu().dump(proc.pid, Path(tmp) / "img", Path(tmp) / "work", DumpOptions(leave_running=True))
            return ""
        except CriuError as exc:
            return exc.reason
        finally:
            proc.kill()
            proc.wait()


@pytest.fixture
def lan() -> Iterator[Lan]:
    if not os.path.exists("/usr/sbin/nft") and not os.path.exists("/usr/bin/nft"):
        pytest.fail("nft is not installed: apt-get install nftables (CI does)")
    why = criu_dumps_tcp()
    if why:
        pytest.fail("CRIU cannot dump TCP sockets on this kernel (CRIU <= 4.1.1 on Linux >= 6.16, "
                    "checkpoint-restore/criu#2718): build it with scripts/criu-patches/ applied, or point "
                    f"MEMSNAP_CRIU at such a build. CRIU said: {why}")
    made = _build_lan()
    try:
        yield made
    finally:
        for ns in (made.a, made.b, made.c, made.sw):
            try:
                netns.remove(ns)
            except OSError:
                pass


def _numbers(path: Path) -> list[int]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        if line.startswith("n "):
            out.append(int(line.split()[1]))
    return out


@dataclass
class BlindNsDaemon(NsDaemon):
    """A node daemon that also lives in its own mount namespace, where `hide` is an empty tmpfs."""

    hide: str = ""

    def args(self) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--mount", "--propagation", "private",
                "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', self.hide, *DaemonProc.args(self)]


@dataclass
class Scene:
    """Two node daemons, a streaming server job on node A and its client, connected."""

    a: NsDaemon
    b: NsDaemon
    job_id: str
    job_pid: int
    got: Path
    client: subprocess.Popen[bytes]
    first_line: str

    def move(self) -> subprocess.CompletedProcess[str]:
        return self.a.ctl("--json", "migrate", self.job_id, "--to", f"{SUBNET}.2:7443", "--tcp-established",
                          "--move-ip", f"{SERVICE}/24", timeout=120)

    def goes_on_without_a_gap(self, more: int = 100) -> float:
        """The same connection receives `more` numbers in order; returns the longest stall (s)."""
        at = _numbers(self.got)[-1]
        wait_for(lambda: _numbers(self.got)[-1] > at + more, 30, what="numbers after the move")
        text = self.got.read_text()
        assert "error" not in text, text[-500:]
        assert text.splitlines()[0] == self.first_line and text.count("connected") == 1
        assert self.client.poll() is None
        stamps = [float(line.split()[2]) for line in text.splitlines() if line.startswith("n ")]
        return max(y - x for x, y in zip(stamps, stamps[1:], strict=False))


def _run_server(a: NsDaemon, tmp_path: Path, name: str, code: str, jobs_to_kill: list[int], cwd: str = "",
                private_tmp: bool | None = None) -> Any:
    """Runs `code` as a managed job on node A (in cwd) and waits until it listens."""
    server = tmp_path / f"{name}.py"
    server.write_text(code)
    with a.client() as c:
        job = c.run([sys.executable, str(server)], name=name, cwd=cwd, private_tmp=private_tmp)
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: "listening" in Path(job.log_path).read_text(), 20, what="the server to listen")
    return job


def _node_args(host: int, token: Path) -> list[str]:
    return node_args(SUBNET, host, token)


@pytest.fixture
def scene(lan, tmp_path, jobs_to_kill, request) -> Iterator[Scene]:
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    a = NsDaemon(tmp_path / "node-a", netns=lan.a, extra=_node_args(1, token))
    b_extra = _node_args(2, token)
    b: NsDaemon
    cwd = tmp_path / "job-cwd"
    cwd.mkdir()
    if getattr(request, "param", "") == "blind-target":
        # Node B cannot see the job's working directory (no shared file system): restores there fail. (Not its
        # log: a moved job writes to a log of its own on the target.)
        b = BlindNsDaemon(tmp_path / "node-b", netns=lan.b, extra=b_extra, hide=str(cwd))
    else:
        b = NsDaemon(tmp_path / "node-b", netns=lan.b, extra=b_extra)
    client = None
    try:
        a.start()
        b.start()
        # (blind target: the job keeps the host's mount namespace, where node B's daemon hides its cwd; a job with
        # a mount namespace of its own would see the directory under the daemon's mount all the same)
        blind = getattr(request, "param", "") == "blind-target"
        job = _run_server(a, tmp_path, "streamer", SERVER, jobs_to_kill, cwd=str(cwd),
                          private_tmp=False if blind else None)
        got = tmp_path / "client.out"
        cscript = tmp_path / "client.py"
        cscript.write_text(CLIENT)
        client = _in_ns(lan.c, [sys.executable, str(cscript), str(got)])
        wait_for(lambda: len(_numbers(got)) > 20, 20, what="the client to receive numbers")
        yield Scene(a, b, job.id, int(job.pid), got, client, got.read_text().splitlines()[0])
    finally:
        if client is not None:
            client.send_signal(signal.SIGKILL)
            client.wait()
        for d in (a, b):
            d.cleanup()
        time.sleep(0.1)


def _no_locks_left(lan: Lan) -> None:
    for ns in (lan.a, lan.b):
        rules = subprocess.run(["nsenter", f"--net=/run/netns/{ns}", "nft", "list", "tables"],
                               capture_output=True, text=True, check=True).stdout
        assert "memsnap_lock" not in rules, (ns, rules)


def test_move_ip_keeps_the_same_tcp_connection_without_a_gap(lan, scene, jobs_to_kill):
    r = scene.move()
    assert r.returncode == 0, r.stderr + scene.a.log.read_text()[-3000:] + scene.b.log.read_text()[-3000:]
    out = json.loads(r.stdout)
    jobs_to_kill.append(out["target_pid"])
    stall = scene.goes_on_without_a_gap()
    print(f"move: {out['phases']}, downtime {out['downtime_ms']} ms; longest stall seen by the client "
          f"{stall * 1000:.0f} ms")
    # The address moved; the source's copy is gone; the target's runs in node B.
    assert SERVICE not in lan.addresses(lan.a)
    assert SERVICE in lan.addresses(lan.b)
    assert not os.path.exists(f"/proc/{scene.job_pid}")
    assert scene.b.proc is not None
    assert os.readlink(f"/proc/{out['target_pid']}/ns/net") == os.readlink(f"/proc/{scene.b.proc.pid}/ns/net")
    assert out["downtime_ms"] > 0 and {"dump", "transfer", "restore"} <= set(out["phases"])
    _no_locks_left(lan)


@pytest.mark.parametrize("scene", ["blind-target"], indirect=True)
def test_failed_move_gives_address_and_connection_back_to_the_source(lan, scene, jobs_to_kill):
    r = scene.move()
    assert r.returncode != 0
    assert "migration failed at restore on the target" in r.stderr, r.stderr
    # The dump left the sockets in repair mode, so the source restored the job from its own image.
    assert "resumed on this node from its image" in r.stderr, r.stderr
    new_pid = int(r.stderr.split("(pid ")[1].split(")")[0])
    jobs_to_kill.append(new_pid)
    stall = scene.goes_on_without_a_gap()
    print(f"rolled back; longest stall seen by the client {stall * 1000:.0f} ms")
    assert SERVICE in lan.addresses(lan.a)
    assert SERVICE not in lan.addresses(lan.b)
    _no_locks_left(lan)


LISTENER = textwrap.dedent(f"""
    import socket
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(({SERVICE!r}, {PORT + 1}))
    srv.listen(8)
    print("listening", flush=True)
    n = 0
    while True:
        conn, _ = srv.accept()
        n += 1
        conn.sendall(f"visitor {{n}}\\n".encode())
        conn.close()
""")


def _visit(lan: Lan) -> str:
    p = _in_ns(lan.c, [sys.executable, "-c", textwrap.dedent(f"""
        import socket
        s = socket.create_connection(({SERVICE!r}, {PORT + 1}), timeout=5)
        print(s.makefile().readline().strip())
    """)], stdout=subprocess.PIPE)
    out, _ = p.communicate(timeout=20)
    return out.decode().strip()


def test_lazy_move_takes_the_service_address_along(lan, tmp_path, jobs_to_kill):
    # A post-copy move of a listening service: the address leaves node A while the job is frozen, and
    # the next visitor reaches the same process (its counter goes on) on node B.
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    a = NsDaemon(tmp_path / "node-a", netns=lan.a, extra=_node_args(1, token))
    b = NsDaemon(tmp_path / "node-b", netns=lan.b, extra=_node_args(2, token))
    try:
        a.start()
        b.start()
        job = _run_server(a, tmp_path, "listener", LISTENER, jobs_to_kill)
        assert _visit(lan) == "visitor 1"
        assert _visit(lan) == "visitor 2"
        r = a.ctl("--json", "migrate", job.id, "--to", f"{SUBNET}.2:7443", "--lazy", "--move-ip",
                  f"{SERVICE}/24", timeout=120)
        assert r.returncode == 0, r.stderr + a.log.read_text()[-3000:] + b.log.read_text()[-3000:]
        out = json.loads(r.stdout)
        jobs_to_kill.append(out["target_pid"])
        assert "pages" in out["phases"]
        assert SERVICE not in lan.addresses(lan.a) and SERVICE in lan.addresses(lan.b)
        assert _visit(lan) == "visitor 3"
        assert not os.path.exists(f"/proc/{job.pid}")
        assert b.proc is not None
        assert os.readlink(f"/proc/{out['target_pid']}/ns/net") == os.readlink(f"/proc/{b.proc.pid}/ns/net")
    finally:
        for d in (a, b):
            d.cleanup()
        time.sleep(0.1)


def test_a_stale_network_lock_table_is_removed_at_start_and_only_it(lan, tmp_path):
    # A memsnapd killed during a --tcp-established move leaves its nftables lock behind (planted here as it
    # would be left, not by killing a daemon mid-move), which would drop
    # the moved address's TCP traffic on that node for good: the next start removes it, and only it.
    stale, other = "memsnap_lock_0badc0de", "someone_elses_table"

    def nft(*args: str, script: str = "") -> str:
        return subprocess.run(["nsenter", f"--net=/run/netns/{lan.a}", "nft", *args], input=script,
                              capture_output=True, text=True, check=True).stdout

    nft("-f", "-", script=f"table inet {stale} {{\n chain input {{\n  type filter hook input priority -300; "
                          f"policy accept;\n  ip daddr {SERVICE} meta l4proto tcp drop\n }}\n}}\n"
                          f"table inet {other} {{\n}}\n")
    assert stale in nft("list", "tables")
    d = NsDaemon(tmp_path / "node-a", netns=lan.a)
    try:
        d.start()
        _no_locks_left(lan)
        assert other in nft("list", "tables")
        assert f"removed network lock {stale}" in d.log.read_text()
    finally:
        d.cleanup()
