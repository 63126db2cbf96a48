"""Peers are not root, and the node token stays home: attacks run for real, as uid 65534 over the real
socket, against real daemons, with a fake gRPC peer that records what it is sent."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from memsnap.auth import peer_credential
from memsnap.client import ClientError, MemsnapClient, Target
from memsnap.move.peer import PeerClient
from memsnap.v1 import memsnap_pb2 as pb
from tests.helpers import (
    NOBODY,
    REPO,
    DaemonProc,
    free_port,
    kill_job,
    make_ca,
    make_cert,
    peer_token_for,
    secret_file,
    start_on_free_ports,
    token_daemon,
)

# This VM's Python lives under /root (0700), where uid 65534 cannot exec it: the attacker process starts
# as root, imports what it needs, then drops to uid/gid 65534 with no groups (and so no capabilities)
# before it touches the daemon. SO_PEERCRED then says 65534, exactly as for a process started as nobody.
_DROP = """
import json, os, socket, sys, tempfile, threading
import grpc
import google.protobuf.json_format
import memsnap.cli, memsnap.client
from memsnap.v1 import memsnap_pb2 as pb, memsnap_pb2_grpc as pb_grpc, peer_pb2, peer_pb2_grpc
try:
    import memsnap.slurm.cli
except ImportError:
    pass
grpc.insecure_channel("unix:/nonexistent").close()  # grpc imports its channel module on first use
os.setgroups([])
os.setgid(%(uid)d)
os.setuid(%(uid)d)
os.chdir("/")
"""


def run_as(uid: int, code: str, *args: str, env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Runs a Python snippet as uid (see _DROP), with this checkout importable."""
    return subprocess.run([sys.executable, "-c", _DROP % {"uid": uid} + code, *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def ctl_as(uid: int, d: DaemonProc, *args: str) -> subprocess.CompletedProcess[str]:
    """memsnapctl against d's socket, as uid."""
    return run_as(uid, "sys.argv = ['memsnapctl', *sys.argv[1:]]\nmemsnap.cli.main()\n", *args,
                  env={"MEMSNAP_SOCKET": d.socket}, timeout=300)


class FakePeer:
    """A real gRPC server on loopback that records the method and metadata of every call it gets, and
    answers Status with a full tier (so a move stops at its preflight)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((self,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def service(self, details: Any) -> Any:
        with self._lock:
            self.calls.append((details.method, {k: str(v) for k, v in details.invocation_metadata}))
        if details.method == "/memsnap.v1.Memsnap/Status":
            return grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: pb.StatusResponse(version="fake", tier_free_bytes=0),
                request_deserializer=pb.StatusRequest.FromString,
                response_serializer=pb.StatusResponse.SerializeToString)
        return None

    def seen(self) -> str:
        """Everything it was sent, as one string."""
        with self._lock:
            return json.dumps(self.calls)

    def stop(self) -> None:
        self.server.stop(0)


@pytest.fixture
def fake_peer() -> Iterator[FakePeer]:
    f = FakePeer()
    yield f
    f.stop()


@pytest.fixture
def guarded(make_daemon, tmp_path) -> Iterator[tuple[DaemonProc, str]]:
    """A daemon with a node token and no peers, listening on loopback, whose Unix socket any local user
    reaches (mode 0666 in a 0755 dir). Returns it and its node token."""
    token = secret_file(tmp_path / "node.token")
    cfg = tmp_path / "open.toml"
    cfg.write_text('[daemon]\nsocket_mode = "0666"\n')
    sockdir = Path(tempfile.mkdtemp(prefix="memsnap-open-"))
    os.chmod(sockdir, 0o755)

    def make(ports: list[int]) -> list[DaemonProc]:
        d = make_daemon("guarded", extra=["--config", str(cfg), "--listen", f"127.0.0.1:{ports[0]}",
                                          "--auth-token-file", str(token)], socket_path=str(sockdir / "d.sock"))
        d.address = f"127.0.0.1:{ports[0]}"
        return [d]

    (d,) = start_on_free_ports(1, make)
    yield d, token.read_text().strip()
    d.cleanup()
    shutil.rmtree(sockdir, ignore_errors=True)


def _sleeper(uid: int | None = None) -> subprocess.Popen[bytes]:
    kw: dict[str, Any] = {"user": uid, "group": uid, "extra_groups": [], "cwd": "/"} if uid is not None else {}
    return subprocess.Popen(["sleep", "600"], start_new_session=True, **kw)


def test_a_fake_peer_never_sees_the_node_token(guarded, fake_peer):
    d, node_token = guarded
    victim = _sleeper(NOBODY)
    readable = Path(tempfile.mkdtemp(prefix="memsnap-own-"))
    try:
        # As nobody, over the real socket: its own process, to an address of its choosing, with and
        # without a token of its own. Refused before anything is sent there.
        os.chmod(readable, 0o755)
        own = readable / "own.token"
        own.write_text(secrets.token_hex(32))
        os.chmod(own, 0o644)
        for extra in ([], ["--token-file", str(own)]):
            r = ctl_as(NOBODY, d, "migrate", str(victim.pid), "--to", fake_peer.address, *extra)
            assert r.returncode != 0
            assert "PERMISSION_DENIED" in r.stderr and "not a configured peer" in r.stderr, r.stderr
        assert fake_peer.calls == []

        # As root, to an address that is not a peer: refused too, unless root gives a credential of its
        # own, which is then all that the address gets.
        r = d.ctl("migrate", str(victim.pid), "--to", fake_peer.address)
        assert r.returncode != 0 and "not a configured peer" in r.stderr, r.stderr
        assert fake_peer.calls == []
        r = d.ctl("migrate", str(victim.pid), "--to", fake_peer.address, "--token-file", str(own))
        assert r.returncode != 0 and "preflight" in r.stderr, r.stderr
        assert fake_peer.calls, "the root move with its own token reached the fake peer"
        assert {md.get("authorization") for _, md in fake_peer.calls} == {f"Bearer {own.read_text().strip()}"}
        assert node_token not in fake_peer.seen()
        assert Path(f"/proc/{victim.pid}").exists()
    finally:
        kill_job(victim.pid)
        victim.wait()
        shutil.rmtree(readable, ignore_errors=True)


def test_a_fake_host_at_a_peer_address_gets_only_that_peers_credential(fake_peer, tmp_path):
    token = secret_file(tmp_path / "node.token")
    more = f'[[peers]]\nname = "impostor"\naddress = "{fake_peer.address}"\n'
    d = token_daemon(tmp_path / "d", token, more="")
    cfg = d.base / "memsnap.toml"
    cfg.write_text(cfg.read_text() + more)
    victim = _sleeper()
    try:
        d.start()
        r = d.ctl("migrate", str(victim.pid), "--to", "impostor")
        assert r.returncode != 0 and "preflight" in r.stderr, r.stderr
        derived = peer_credential(token.read_text().strip().encode(), "impostor")
        assert {md.get("authorization") for _, md in fake_peer.calls} == {f"Bearer {derived}"}
        assert token.read_text().strip() not in fake_peer.seen()
        # What it got authenticates nowhere else, not even at the node that sent it.
        with MemsnapClient(Target(address=d.address, token=derived)) as c:  # type: ignore[attr-defined]
            assert _code(lambda: c.status(timeout=10)) == "UNAUTHENTICATED"
    finally:
        kill_job(victim.pid)
        victim.wait()
        d.cleanup()


def _code(fn: Any) -> str:
    try:
        fn()
        return "OK"
    except ClientError as exc:
        return exc.code.name


@pytest.fixture(scope="module")
def cluster_node(tmp_path_factory) -> Iterator[tuple[DaemonProc, str, str]]:
    """A cluster daemon with an admin token: (daemon, the peer credential for it, the admin token)."""
    base = tmp_path_factory.mktemp("roles")
    token = secret_file(base / "node.token")
    admin = secret_file(base / "admin.token")
    d = token_daemon(base / "d", token, f'admin_token_file = "{admin}"').start()
    yield d, peer_token_for(d, token), admin.read_text().strip()
    d.cleanup()


def test_a_peer_token_cannot_run_jobs(cluster_node):
    d, peer, admin = cluster_node
    with d.client() as local:
        mine = local.run(["sleep", "600"], name="local-job")
    try:
        with MemsnapClient(Target(address=d.address, token=peer)) as c:
            assert _code(lambda: c.status(timeout=10)) == "OK"
            assert _code(lambda: c.run(["id", "-u"])) == "PERMISSION_DENIED"
            assert _code(lambda: c.checkpoint(mine.pid)) == "PERMISSION_DENIED"
            assert _code(lambda: c.restore("ck-nope")) == "PERMISSION_DENIED"
            assert _code(lambda: c.list()) == "PERMISSION_DENIED"
            assert _code(lambda: c.delete("ck-nope")) == "PERMISSION_DENIED"
            assert _code(lambda: c.migrate(pb.MigrateRequest(target=str(mine.pid), to="x:1"))) == "PERMISSION_DENIED"
            # A source that still sends the restore to the user service, as before the Peer service, finds
            # nothing there (the interceptor passes an unknown method on to gRPC's own answer).
            old = c.channel.unary_unary("/memsnap.v1.Memsnap/RestoreReceived")
            with pytest.raises(grpc.RpcError) as e:
                old(pb.RestoreReceivedRequest(checkpoint_id="ck-nope").SerializeToString(), timeout=10,
                    metadata=[("authorization", f"Bearer {peer}")])
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
            # ListJobs (a move's confirmation) shows a peer only the jobs that moves brought here.
            assert [j.id for j in c.jobs()] == []
        with MemsnapClient(Target(address=d.address, token=admin)) as c:
            assert mine.id in [j.id for j in c.jobs()]
            job = c.run(["sleep", "600"], name="admin-job")
            kill_job(int(job.pid))
    finally:
        kill_job(int(mine.pid))


def test_admin_over_tcp_is_off_by_default(guarded):
    d, node_token = guarded
    # Without daemon.admin_token_file nothing reaches RunJob over TCP: not the node token, not the
    # credential a peer holds for this node.
    derived = peer_credential(node_token.encode(), socket.gethostname())
    with MemsnapClient(Target(address=d.address, token=node_token)) as c:  # type: ignore[attr-defined]
        assert _code(lambda: c.run(["id", "-u"])) == "UNAUTHENTICATED"
    with MemsnapClient(Target(address=d.address, token=derived)) as c:  # type: ignore[attr-defined]
        assert _code(lambda: c.status(timeout=10)) == "OK"
        assert _code(lambda: c.run(["id", "-u"])) == "PERMISSION_DENIED"


def test_certificates_authorize_by_name_not_by_ca(tmp_path):
    pki = tmp_path / "pki"
    pki.mkdir()
    ca = make_ca(pki, "memsnap-ca")
    server = make_cert(pki, "node1", ca)
    peer = make_cert(pki, "node2", ca)
    admin = make_cert(pki, "ops", ca)
    stranger = make_cert(pki, "stranger", ca)
    cfg = tmp_path / "tls.toml"
    made: list[DaemonProc] = []
    port = 0

    def make(ports: list[int]) -> list[DaemonProc]:
        nonlocal port
        port = ports[0]
        cfg.write_text(f'[daemon]\nlisten = "127.0.0.1:{port}"\ntls_cert = "{server[1]}"\n'
                       f'tls_key = "{server[0]}"\ntls_ca = "{ca[1]}"\nadmin_identities = ["ops"]\n'
                       '[[peers]]\nname = "node2"\naddress = "127.0.0.1:1"\n')
        made.append(DaemonProc(tmp_path / "tls", extra=["--config", str(cfg)]))
        return made[-1:]

    def client(cert: tuple[Path, Path]) -> MemsnapClient:
        return MemsnapClient(Target(address=f"127.0.0.1:{port}", tls_ca=str(ca[1]), tls_cert=str(cert[1]),
                                    tls_key=str(cert[0])))

    try:
        start_on_free_ports(1, make)
        # Signed by the CA but not listed, or the server's own certificate: nothing at all.
        for cert in (stranger, server):
            with client(cert) as c:
                assert _code(lambda c=c: c.status(timeout=10)) == "PERMISSION_DENIED"
                assert _code(lambda c=c: c.run(["id", "-u"])) == "PERMISSION_DENIED"
        # A peer's certificate: the move RPCs only. And with no token it has no transfer key, so even an
        # image it sends is refused (no unsigned manifest is ever accepted).
        with client(peer) as c:
            assert _code(lambda: c.status(timeout=10)) == "OK"
            assert _code(lambda: c.run(["id", "-u"])) == "PERMISSION_DENIED"
            fut = PeerClient(c).receive_image(iter(_unsigned_image("ck-tls-unsigned")), timeout=30)
            with pytest.raises(grpc.RpcError) as e:
                fut.result()
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # An administrator's certificate: everything.
        with client(admin) as c:
            job = c.run(["sleep", "600"], name="tls-admin")
            kill_job(int(job.pid))
    finally:
        for m in made:
            m.cleanup()


@pytest.mark.parametrize("listen", ["unix-abstract:x", "unix-abstract:7", "unix:9", "vsock:5"])
def test_listen_on_a_non_ip_address_is_refused_at_start(listen, tmp_path):
    token = secret_file(tmp_path / "node.token")
    d = DaemonProc(tmp_path / "d", extra=["--listen", listen, "--auth-token-file", str(token)])
    try:
        with pytest.raises(AssertionError, match="memsnapd exited"):
            d.start(timeout=20)
        assert d.proc is not None and d.proc.returncode not in (0, None)
        lines = [ln for ln in d.log.read_text().splitlines() if ln.startswith("memsnapd:")]
        assert len(lines) == 1 and "daemon.listen" in lines[0], d.log.read_text()
    finally:
        d.cleanup()


FORGED_RELAY = r"""
public, private = sys.argv[1], sys.argv[2]
out = {}
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind("\0memsnap-peer/0/0/1/forged" + os.urandom(4).hex())
try:
    s.connect(private)
    out["private"] = "connected"
except OSError as exc:
    out["private"] = type(exc).__name__
s.close()

# A local relay of our own: gRPC connects to it, and it connects on to the daemon's public socket from a
# socket bound to the forged name (as the daemon's relay does towards its private socket).
here = tempfile.mkdtemp()
lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
lst.bind(here + "/s")
lst.listen(4)

def pump(a, b):
    while data := a.recv(65536):
        b.sendall(data)
    b.shutdown(socket.SHUT_WR)

def serve():
    while True:
        c, _ = lst.accept()
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        up.bind("\0memsnap-peer/0/0/1/forged" + os.urandom(4).hex())
        up.connect(public)
        threading.Thread(target=pump, args=(c, up), daemon=True).start()
        threading.Thread(target=pump, args=(up, c), daemon=True).start()

threading.Thread(target=serve, daemon=True).start()
ch = grpc.insecure_channel("unix:" + here + "/s")
stub = pb_grpc.MemsnapStub(ch)
for name, call in (("commit", lambda: peer_pb2_grpc.PeerStub(ch).CommitMove(
                       peer_pb2.CommitMoveRequest(checkpoint_id="ck-nope"), timeout=20)),
                   ("old_commit", lambda: ch.unary_unary("/memsnap.v1.Memsnap/RestoreReceived")(
                       # (an old source's commit bit: field 9, now reserved)
                       pb.RestoreReceivedRequest(checkpoint_id="ck-nope").SerializeToString() + b"\x48\x01",
                       timeout=20))):
    try:
        call()
        out[name] = "OK"
    except grpc.RpcError as exc:
        out[name] = exc.code().name
job = stub.RunJob(pb.RunJobRequest(argv=["sleep", "600"], name="forged"), timeout=20).job
out["job_uid"], out["job_pid"] = job.owner_uid, job.pid
print(json.dumps(out))
"""


def test_a_forged_relay_name_gets_no_root(guarded):
    d, _ = guarded
    r = run_as(NOBODY, FORGED_RELAY, d.socket, str(d.state / "private" / "grpc.sock"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    try:
        # The private socket (0700 dir) is out of reach; through the public one, the relay names the
        # caller from SO_PEERCRED whatever its own socket is called: nobody, not root.
        assert out["private"] == "PermissionError"
        assert out["commit"] == "PERMISSION_DENIED"  # root would get FAILED_PRECONDITION (no such move)
        assert out["old_commit"] == "UNIMPLEMENTED"  # the user service no longer carries the peer RPCs
        assert out["job_uid"] == NOBODY
    finally:
        kill_job(int(out["job_pid"]))


@pytest.mark.parametrize(("what", "mode"), [("auth-token-file", 0o644), ("admin-token-file", 0o640),
                                             ("tls-key", 0o604)])
def test_a_secret_file_others_can_read_is_refused_at_start(what, mode, tmp_path):
    secret = secret_file(tmp_path / "secret")
    os.chmod(secret, mode)
    extra = ["--listen", f"127.0.0.1:{free_port()}", f"--{what}", str(secret)]
    if what == "tls-key":
        pki = tmp_path / "pki"
        pki.mkdir()
        key, crt = make_cert(pki, "node1", make_ca(pki, "ca"))
        shutil.copy(key, secret)
        os.chmod(secret, mode)
        extra += ["--tls-cert", str(crt)]
    d = DaemonProc(tmp_path / "d", extra=extra)
    try:
        with pytest.raises(AssertionError, match="memsnapd exited"):
            d.start(timeout=20)
        lines = [ln for ln in d.log.read_text().splitlines() if ln.startswith("memsnapd:")]
        assert len(lines) == 1, d.log.read_text()
        assert str(secret) in lines[0] and f"mode {mode:04o}" in lines[0] and f"chmod 600 {secret}" in lines[0]
    finally:
        d.cleanup()


def _unsigned_image(ckpt_id: str) -> list[pb.ImageChunk]:
    import blake3

    data = b"#!/bin/sh\nid\n"
    body = {"id": ckpt_id, "uid": 0, "job": "forged", "files": {"x.img": {"size": len(data),
                                                                          "blake3": blake3.blake3(data).hexdigest()}}}
    return [pb.ImageChunk(checkpoint_id=ckpt_id, expected_bytes=len(data)),
            pb.ImageChunk(file="x.img", offset=0, data=data, blake3=blake3.blake3(data).digest(), file_done=True),
            pb.ImageChunk(manifest=json.dumps(body).encode())]


def test_receive_image_without_a_node_token_refuses_an_unsigned_manifest(make_daemon):
    d = make_daemon("plain").start()  # no node token, no TCP: only local root can even try
    with d.client() as c:
        fut = PeerClient(c).receive_image(iter(_unsigned_image("ck-unsigned-1")), timeout=30)
        with pytest.raises(grpc.RpcError) as e:
            fut.result()
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "token" in (e.value.details() or "")
        assert "ck-unsigned-1" not in [ck.id for ck in c.list()]
    assert not (d.tier / "ck-unsigned-1").exists()


def test_a_move_between_peers_under_mutual_tls(tmp_path, jobs_to_kill):
    # Each node has its own certificate; each lists the other as a peer (by name, address and certificate
    # identity) and both share the node token that their credentials and transfer keys derive from.
    from tests.helpers import counter_job as _counter
    from tests.helpers import ticking_with as _keeps_ticking_with

    pki = tmp_path / "pki"
    pki.mkdir()
    ca = make_ca(pki, "cluster-ca")
    certs = {name: make_cert(pki, name, ca) for name in ("node-a", "node-b")}
    token = secret_file(tmp_path / "node.token")
    ports: dict[str, int] = {}
    made: list[DaemonProc] = []

    def make(drawn: list[int]) -> list[DaemonProc]:
        ports.update(zip(certs, drawn, strict=True))
        for name, (key, crt) in certs.items():
            other = "node-b" if name == "node-a" else "node-a"
            cfg = tmp_path / f"{name}.toml"
            cfg.write_text(f'[daemon]\nlisten = "127.0.0.1:{ports[name]}"\nnode_name = "{name}"\n'
                           f'auth_token_file = "{token}"\ntls_cert = "{crt}"\ntls_key = "{key}"\n'
                           f'tls_ca = "{ca[1]}"\n[[peers]]\nname = "{other}"\n'
                           f'address = "127.0.0.1:{ports[other]}"\nidentity = "{other}"\n')
            made.append(DaemonProc(tmp_path / name, extra=["--config", str(cfg)]))
        return made[-2:]

    try:
        a, b = start_on_free_ports(2, make)
        job = _counter(a, jobs_to_kill, 16, "tls-mover")
        r = a.ctl("--json", "migrate", job["id"], "--to", "node-b", timeout=180)
        assert r.returncode == 0, r.stderr + a.log.read_text()[-2000:] + b.log.read_text()[-2000:]
        out = json.loads(r.stdout)
        jobs_to_kill.append(out["target_pid"])
        _keeps_ticking_with(job, out["target_pid"], job["digest"], fresh=5)
        # Node A's certificate is a peer's on node B: it moved the job, and it cannot run one there.
        with MemsnapClient(Target(address=f"127.0.0.1:{ports['node-b']}", tls_ca=str(ca[1]),
                                  tls_cert=str(certs["node-a"][1]), tls_key=str(certs["node-a"][0]))) as c:
            assert _code(lambda: c.run(["id", "-u"])) == "PERMISSION_DENIED"
    finally:
        for m in made:
            m.cleanup()
