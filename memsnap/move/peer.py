"""The source's view of a move's target: its Peer service (peer.proto), plus the two user RPCs a move
also needs there (Status for the preflight, ListJobs to confirm the job runs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from memsnap.client import LONG_S, QUICK_S, ClientError, MemsnapClient, Target
from memsnap.v1 import memsnap_pb2 as pb
from memsnap.v1 import peer_pb2, peer_pb2_grpc


class PeerClient:
    """Calls to a move's target over one MemsnapClient's channel and credential; ClientError on failure."""

    def __init__(self, client: MemsnapClient) -> None:
        self.client = client
        self.stub = peer_pb2_grpc.PeerStub(client.channel)  # type: ignore[no-untyped-call]
        token = client.target.token
        self._md = [("authorization", f"Bearer {token}")] if token else []

    def status(self, timeout: float = QUICK_S) -> pb.StatusResponse:
        """The target's status (room in its tier)."""
        return self.client.status(timeout=timeout)

    def jobs(self, timeout: float = QUICK_S) -> list[pb.Job]:
        """The jobs moves brought to the target."""
        return self.client.jobs(timeout=timeout)

    def receive_image(self, chunks: Iterator[pb.ImageChunk], timeout: float = LONG_S) -> grpc.Future:
        """Streams image chunks; the future's result() is a ReceiveImageResponse."""
        return self.stub.ReceiveImage.future(chunks, timeout=timeout, metadata=self._md)

    def page_tunnel(self, chunks: Iterator[pb.TunnelChunk], timeout: float = LONG_S) -> Any:
        """A bidirectional stream of page-server bytes (an iterator and a call)."""
        return self.stub.PageTunnel(chunks, timeout=timeout, metadata=self._md)

    def restore_received(self, req: pb.RestoreReceivedRequest, timeout: float = LONG_S) -> pb.RestoreResponse:
        """Restores the image sent (or stored) for this move."""
        return self._call("RestoreReceived", req, timeout)  # type: ignore[return-value]

    def commit_move(self, ckpt_id: str, timeout: float = 10.0) -> pb.Job:
        """Tells the target to keep the job restored from ckpt_id."""
        resp = self._call("CommitMove", peer_pb2.CommitMoveRequest(checkpoint_id=ckpt_id), timeout)
        return resp.job  # type: ignore[attr-defined,no-any-return]

    def _call(self, method: str, request: object, timeout: float) -> object:
        try:
            return getattr(self.stub, method)(request, timeout=timeout, metadata=self._md)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            details = exc.details() if hasattr(exc, "details") else str(exc)
            raise ClientError(code, details or code.name) from None

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()


def dial(target: Target) -> PeerClient:
    """A PeerClient over a new gRPC channel to target (what Mover uses unless told otherwise)."""
    return PeerClient(MemsnapClient(target))


# How a Mover reaches a move's target: dial, or an in-process transport in tests (tests/unit/fake_peer.py).
Dial = Callable[[Target], PeerClient]
