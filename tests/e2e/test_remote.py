"""The API over TCP is always authenticated: a shared node token and/or mutual TLS; no header can fake it."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

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


def token_daemon(base: Path, token_file: Path, **kw: object) -> DaemonProc:
    """A daemon that also listens on loopback TCP, authenticated by the token in token_file."""
    port = free_port()
    d = DaemonProc(base, extra=["--listen", f"127.0.0.1:{port}", "--auth-token-file", str(token_file)],
                   **kw)  # type: ignore[arg-type]
    d.address = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
    return d


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, str]]:
    if os.geteuid() != 0:
        pytest.fail("the e2e tests run real CRIU and must run as root (CI does)")
    base = tmp_path_factory.mktemp("remote")
    token = secrets.token_hex(32)
    (base / "token").write_text(token + "\n")
    d = token_daemon(base / "d", base / "token").start()
    yield d, token
    d.cleanup()


def _status_code(target: Target) -> str:
    try:
        with MemsnapClient(target) as c:
            c.status(timeout=5)
        return "OK"
    except ClientError as exc:
        return exc.code.name


def test_tcp_status_needs_the_node_token(node, tmp_path):
    d, token = node
    addr = d.address
    assert _status_code(Target(address=addr)) == "UNAUTHENTICATED"
    assert _status_code(Target(address=addr, token="0" * 64)) == "UNAUTHENTICATED"
    assert _status_code(Target(address=addr, token=token[:-1])) == "UNAUTHENTICATED"
    assert _status_code(Target(address=addr, token=token)) == "OK"
    # An authenticated peer acts as root: it may list everything.
    with MemsnapClient(Target(address=addr, token=token)) as c:
        assert c.status().version and isinstance(c.jobs(), list)

    # memsnapctl --address/--token-file.
    tf = tmp_path / "t"
    tf.write_text(token)
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
    d, token = node
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
    return key, crt


def test_mutual_tls_without_token(tmp_path):
    pki = tmp_path / "pki"
    pki.mkdir()
    ca = _make_ca(pki, "memsnap-ca")
    node_key, node_crt = _make_cert(pki, "node", ca)
    cli_key, cli_crt = _make_cert(pki, "client", ca)
    rogue = _make_ca(pki, "rogue-ca")
    rogue_key, rogue_crt = _make_cert(pki, "rogue", rogue)
    port = free_port()
    d = DaemonProc(tmp_path / "tls", extra=["--listen", f"127.0.0.1:{port}", "--tls-cert", str(node_crt),
                                           "--tls-key", str(node_key), "--tls-ca", str(ca[1])])
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
