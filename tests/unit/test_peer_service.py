"""The Peer service (daemon-to-daemon calls of a move) is exactly what a peer credential may call on it."""

from __future__ import annotations

from memsnap.auth import PEER_METHODS
from memsnap.v1 import memsnap_pb2, peer_pb2


def test_a_peer_may_call_every_peer_rpc() -> None:
    service = peer_pb2.DESCRIPTOR.services_by_name["Peer"]
    methods = {f"/{service.full_name}/{m.name}" for m in service.methods}
    assert methods == {"/memsnap.v1.Peer/ReceiveImage", "/memsnap.v1.Peer/PageTunnel",
                       "/memsnap.v1.Peer/RestoreReceived", "/memsnap.v1.Peer/CommitMove"}
    assert methods <= PEER_METHODS


def test_a_peer_may_call_no_user_rpc_but_the_preflight_ones() -> None:
    service = memsnap_pb2.DESCRIPTOR.services_by_name["Memsnap"]
    allowed = {m.name for m in service.methods if f"/{service.full_name}/{m.name}" in PEER_METHODS}
    assert allowed == {"Status", "ListJobs"}


def test_the_user_service_no_longer_carries_the_peer_rpcs() -> None:
    service = memsnap_pb2.DESCRIPTOR.services_by_name["Memsnap"]
    assert not {"ReceiveImage", "PageTunnel", "RestoreReceived", "CommitMove"} & {m.name for m in service.methods}
    assert {m for m in PEER_METHODS if m.startswith("/memsnap.v1.Memsnap/")} == {
        "/memsnap.v1.Memsnap/Status", "/memsnap.v1.Memsnap/ListJobs"}  # (no entry left for a removed RPC)
