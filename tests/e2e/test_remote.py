"""The API over TCP is always authenticated: peers by a credential derived from the node token (or
their own token, or certificate), administrators by an admin credential; no header can fake it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest

from memsnap.auth import peer_credential
from memsnap.client import ClientError, MemsnapClient, Target
from memsnap.v1 import memsnap_pb2 as pb
from memsnap.v1 import memsnap_pb2_grpc as pb_grpc
from tests.helpers import (
    REPO,
    DaemonProc,
    free_port,
    make_ca,
    make_cert,
    peer_token_for,
    secret_file,
    start_on_free_ports,
    token_daemon,
)

FORGED = ("x-memsnap-authenticated", "tcp")


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


def test_mutual_tls_without_token(tmp_path):
    # The client certificate is named in daemon.admin_identities: it is an administrator.
    pki = tmp_path / "pki"
    pki.mkdir()
    ca = make_ca(pki, "memsnap-ca")
    node_key, node_crt = make_cert(pki, "node", ca)
    cli_key, cli_crt = make_cert(pki, "client", ca)
    rogue = make_ca(pki, "rogue-ca")
    rogue_key, rogue_crt = make_cert(pki, "rogue", rogue)
    cfg = tmp_path / "tls.toml"
    cfg.write_text('[daemon]\nadmin_identities = ["client"]\n')
    made: list[DaemonProc] = []

    def make(ports: list[int]) -> list[DaemonProc]:
        made.append(DaemonProc(tmp_path / "tls", extra=["--config", str(cfg), "--listen", f"127.0.0.1:{ports[0]}",
                                                        "--tls-cert", str(node_crt), "--tls-key", str(node_key),
                                                        "--tls-ca", str(ca[1])]))
        return made[-1:]

    try:
        (d,) = start_on_free_ports(1, make)
        addr = d.extra[d.extra.index("--listen") + 1]
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
        for m in made:
            m.cleanup()
