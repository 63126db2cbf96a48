"""add_tcp_port with TLS, in process (a real gRPC server on loopback, no daemon): under mutual TLS the
handshake itself refuses a client without a certificate of the configured CA (docs/mutation.md)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from memsnap.auth import add_tcp_port
from memsnap.config import Config, DaemonConfig
from tests.helpers import make_ca, make_cert

METHOD = "/memsnap.test.Nothing/Call"  # not served: UNIMPLEMENTED once the handshake is through


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = make_ca(d, "memsnap-ca"), make_ca(d, "rogue-ca")
    return {"ca": ca, "node": make_cert(d, "node", ca), "client": make_cert(d, "client", ca),
            "rogue": make_cert(d, "rogue", rogue)}


@pytest.fixture
def mutual(pki: dict[str, tuple[Path, Path]]) -> Iterator[str]:
    """A server that add_tcp_port set up for mutual TLS (and nothing else): its address."""
    d = DaemonConfig(listen="127.0.0.1:0", tls_cert=str(pki["node"][1]), tls_key=str(pki["node"][0]),
                     tls_ca=str(pki["ca"][1]), admin_identities=("client",))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = add_tcp_port(server, Config(daemon=d))
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def _call(address: str, pki: dict[str, tuple[Path, Path]], client: str = "") -> grpc.StatusCode:
    key, crt = pki[client] if client else (None, None)
    creds = grpc.ssl_channel_credentials(root_certificates=pki["ca"][1].read_bytes(),
                                         private_key=key.read_bytes() if key else None,
                                         certificate_chain=crt.read_bytes() if crt else None)
    with grpc.secure_channel(address, creds) as ch:
        try:
            ch.unary_unary(METHOD)(b"", timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_mutual_tls_lets_a_certificate_of_the_ca_through_the_handshake(mutual: str, pki) -> None:
    assert _call(mutual, pki, "client") == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("client", ["", "rogue"], ids=["no certificate", "another CA"])
def test_mutual_tls_refuses_other_clients_in_the_handshake(client: str, mutual: str, pki) -> None:
    assert _call(mutual, pki, client) == grpc.StatusCode.UNAVAILABLE

