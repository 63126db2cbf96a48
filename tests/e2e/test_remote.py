"""The API over TCP is always authenticated: peers by a credential derived from the node token (or
their own token, or certificate), administrators by an admin credential; no header can fake it."""

from __future__ import annotations

import itertools
import json
import os
import random
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from memsnap.auth import peer_credential
from memsnap.client import ClientError, MemsnapClient, Target
from memsnap.v1 import memsnap_pb2 as pb
from memsnap.v1 import memsnap_pb2_grpc as pb_grpc
from tests.helpers import REPO, DaemonProc

FORGED = ("x-memsnap-authenticated", "tcp")


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def token_daemon(base: Path, token_file: Path | None, more: str = "", extra: tuple[str, ...] = (),
                 **kw: object) -> DaemonProc:
    """A daemon that also listens on loopback TCP, a node of the test cluster whose node token is in
    token_file; `more` adds [daemon] lines (e.g. admin_token_file = ...), `extra` memsnapd flags."""
    port = next(_next_port)
    base.mkdir(parents=True, exist_ok=True)
    cfg = base / "memsnap.toml"
    cfg.write_text(cluster_toml(port, token_file, more))
    d = DaemonProc(base, extra=["--config", str(cfg), *extra], **kw)  # type: ignore[arg-type]
    d.address = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
    return d


def peer_token_for(d: DaemonProc, token_file: Path) -> str:
    """The credential a peer sends to the cluster daemon d: derived from the node token for d's name."""
    port = int(d.address.rsplit(":", 1)[1])  # type: ignore[attr-defined]
    return peer_credential(token_file.read_text().strip().encode(), node_name(port))


def secret_file(path: Path, text: str = "") -> Path:
    """A 0600 token file."""
    path.write_text((text or secrets.token_hex(32)) + "\n")
    os.chmod(path, 0o600)
    return path


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, str, str]]:
    """A cluster daemon with an admin token: (daemon, the peer credential for it, the admin token)."""
    if os.geteuid() != 0:
        pytest.fail("the e2e tests run real CRIU and must run as root (CI does)")
    base = tmp_path_factory.mktemp("remote")
    token = secret_file(base / "token")
    admin = secret_file(base / "admin")
    d = token_daemon(base / "d", token, f'admin_token_file = "{admin}"').start()
    yield d, peer_token_for(d, token), admin.read_text().strip()
    d.cleanup()


def _status_code(target: Target) -> str:
    try:
        with MemsnapClient(target) as c:
            c.status(timeout=5)
        return "OK"
    except ClientError as exc:
        return exc.code.name


def test_tcp_status_needs_a_peer_or_admin_credential(node, tmp_path):
    d, peer, admin = node
    addr = d.address
    node_token = (d.base.parent / "token").read_text().strip()
    assert _status_code(Target(address=addr)) == "UNAUTHENTICATED"
    assert _status_code(Target(address=addr, token="0" * 64)) == "UNAUTHENTICATED"
    assert _status_code(Target(address=addr, token=peer[:-1])) == "UNAUTHENTICATED"
    # The node token itself is never a credential: it never leaves its node.
    assert _status_code(Target(address=addr, token=node_token)) == "UNAUTHENTICATED"
    # Nor is the credential derived for another peer.
    assert _status_code(Target(address=addr, token=peer_credential(node_token.encode(), "n1"))) == "UNAUTHENTICATED"
    assert _status_code(Target(address=addr, token=peer)) == "OK"
    assert _status_code(Target(address=addr, token=admin)) == "OK"
    # An administrator acts as root: it may list everything.
    with MemsnapClient(Target(address=addr, token=admin)) as c:
        assert c.status().version and isinstance(c.jobs(), list)

    # memsnapctl --address/--token-file.
    tf = secret_file(tmp_path / "t", admin)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ctl = [sys.executable, "-m", "memsnap.cli", "--address", addr]
    r = subprocess.run([*ctl, "--token-file", str(tf), "--json", "status"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["version"]
    r = subprocess.run([*ctl, "status"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode != 0 and "UNAUTHENTICATED" in r.stderr and r.stderr.count("\n") == 1


def _raw_status(channel: grpc.Channel, metadata: list[tuple[str, str]]) -> str:
    try:
        pb_grpc.MemsnapStub(channel).Status(pb.StatusRequest(), metadata=metadata, timeout=5)
        return "OK"
    except grpc.RpcError as exc:
        return str(exc.code().name)


def test_forged_authenticated_header_is_refused(node):
    d, token, _ = node
    with grpc.insecure_channel(d.address) as ch:
        assert _raw_status(ch, [FORGED]) == "UNAUTHENTICATED"
        # Even with the right token, a request that claims authentication itself is refused.
        assert _raw_status(ch, [FORGED, ("authorization", f"Bearer {token}")]) == "UNAUTHENTICATED"
        assert _raw_status(ch, [("authorization", f"Bearer {token}")]) == "OK"
        # Every service on the TCP port is behind the check, the health service too.
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # On the Unix socket too: peer credentials decide there, and the header is refused.
    with grpc.insecure_channel(f"unix:{d.socket}") as ch:
        assert _raw_status(ch, [FORGED]) == "UNAUTHENTICATED"
        assert _raw_status(ch, []) == "OK"


def test_tcp_listener_without_authentication_is_refused(tmp_path):
    d = DaemonProc(tmp_path / "open", extra=["--listen", f"127.0.0.1:{free_port()}"])
    try:
        with pytest.raises(AssertionError) as e:
            d.start(timeout=20)
        assert "refusing to listen" in str(e.value) and "auth_token_file" in str(e.value)
        assert d.proc is not None and d.proc.returncode not in (0, None)
    finally:
        d.cleanup()


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _make_ca(d: Path, name: str) -> tuple[Path, Path]:
    key, crt = d / f"{name}.key", d / f"{name}.crt"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(crt), "-subj", f"/CN={name}", "-days", "2",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
    return key, crt


def _make_cert(d: Path, name: str, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    key, csr, crt, ext = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.crt", d / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                   "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[1]), "-CAkey", str(ca[0]), "-CAcreateserial",
             "-out", str(crt), "-days", "2", "-extfile", str(ext))
    os.chmod(key, 0o600)
    return key, crt


def test_mutual_tls_without_token(tmp_path):
    # The client certificate is named in daemon.admin_identities: it is an administrator.
    pki = tmp_path / "pki"
    pki.mkdir()
    ca = _make_ca(pki, "memsnap-ca")
    node_key, node_crt = _make_cert(pki, "node", ca)
    cli_key, cli_crt = _make_cert(pki, "client", ca)
    rogue = _make_ca(pki, "rogue-ca")
    rogue_key, rogue_crt = _make_cert(pki, "rogue", rogue)
    port = free_port()
    cfg = tmp_path / "tls.toml"
    cfg.write_text('[daemon]\nadmin_identities = ["client"]\n')
    d = DaemonProc(tmp_path / "tls", extra=["--config", str(cfg), "--listen", f"127.0.0.1:{port}",
                                           "--tls-cert", str(node_crt), "--tls-key", str(node_key),
                                           "--tls-ca", str(ca[1])])
    try:
        d.start()
        addr = f"127.0.0.1:{port}"
        ok = Target(address=addr, tls_ca=str(ca[1]), tls_cert=str(cli_crt), tls_key=str(cli_key))
        assert _status_code(ok) == "OK"
        # No client certificate, one from another CA, or no TLS at all: the handshake fails.
        assert _status_code(Target(address=addr, tls_ca=str(ca[1]))) == "UNAVAILABLE"
        assert _status_code(Target(address=addr, tls_ca=str(ca[1]), tls_cert=str(rogue_crt),
                                   tls_key=str(rogue_key))) == "UNAVAILABLE"
        assert _status_code(Target(address=addr, token="x" * 64)) == "UNAVAILABLE"
        with MemsnapClient(ok) as c:
            assert isinstance(c.jobs(), list)
    finally:
        d.cleanup()
