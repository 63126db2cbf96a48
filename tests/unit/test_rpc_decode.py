"""Request bytes that are no request message get INVALID_ARGUMENT with one line saying what to do, for unary
and streaming methods of both services, before any servicer runs; without memsnap.rpc_decode grpcio answers
INTERNAL "Exception deserializing request!" (issue #28 item 2)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from memsnap.auth import AuthInterceptor, Credentials
from memsnap.rpc_decode import DecodeInterceptor
from memsnap.v1 import memsnap_pb2 as pb
from memsnap.v1 import memsnap_pb2_grpc as pb_grpc
from memsnap.v1 import peer_pb2_grpc

# A bad tag, a varint that never ends, a length past the end, bad UTF-8 in a string, an unknown wire type, an
# unterminated group, a 4 GiB length prefix, a truncated varint, an end-group with no start.
BAD = [b"\xff", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x0a\x05ab", b"\x0a\x02\xff\xfe",
       b"\x0f", b"\x0b", b"\x12\xff\xff\xff\xff\x0f" + b"x" * 10, b"\x08\x80", b"\x0c"]


class Servicer(pb_grpc.MemsnapServicer):
    """Answers every request it decodes; reads whole streams."""

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        return pb.StatusResponse(version="ok")

    def RunJob(self, request: pb.RunJobRequest, context: grpc.ServicerContext) -> pb.RunJobResponse:
        return pb.RunJobResponse()

    def WatchCheckpoint(self, request: pb.WatchCheckpointRequest,
                        context: grpc.ServicerContext) -> Iterator[pb.CheckpointInfo]:
        yield pb.CheckpointInfo(id=request.id)


class Peer(peer_pb2_grpc.PeerServicer):
    def ReceiveImage(self, request_iterator: Iterator[pb.ImageChunk],
                     context: grpc.ServicerContext) -> pb.ReceiveImageResponse:
        for _ in request_iterator:
            pass
        return pb.ReceiveImageResponse()

    def PageTunnel(self, request_iterator: Iterator[pb.TunnelChunk],
                   context: grpc.ServicerContext) -> Iterator[pb.TunnelChunk]:
        yield from request_iterator


def _serve(interceptors: list[Any]) -> tuple[grpc.Server, grpc.Channel, str]:
    d = tempfile.mkdtemp(prefix="memsnap-decode-")
    sock = os.path.join(d, "s.sock")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=interceptors)
    pb_grpc.add_MemsnapServicer_to_server(Servicer(), server)  # type: ignore[no-untyped-call]
    peer_pb2_grpc.add_PeerServicer_to_server(Peer(), server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    return server, grpc.insecure_channel(f"unix:{sock}"), d


@pytest.fixture(params=["decoding", "plain grpcio"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[grpc.Channel, bool]]:
    decoding = request.param == "decoding"
    inner = [AuthInterceptor(Credentials()), DecodeInterceptor()] if decoding else []
    server, ch, d = _serve(inner)
    yield ch, decoding
    ch.close()
    server.stop(None)
    os.rmdir(d)


def _code(call: Any) -> tuple[str, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""
    return "OK", ""


def test_bytes_that_do_not_decode_get_invalid_argument_never_internal(served: tuple[grpc.Channel, bool]) -> None:
    ch, decoding = served
    raw = {"unary": ch.unary_unary("/memsnap.v1.Memsnap/RunJob"),
           "unary-stream": ch.unary_stream("/memsnap.v1.Memsnap/WatchCheckpoint"),
           "stream-unary": ch.stream_unary("/memsnap.v1.Peer/ReceiveImage"),
           "stream-stream": ch.stream_stream("/memsnap.v1.Peer/PageTunnel")}
    for data in BAD:
        if not decoding:  # what fuzzing found: grpcio's own answer (its streams are left out: a handler reading a
            # stream that does not decode can hang, and the server with it)
            assert _code(lambda d=data: raw["unary"](d, timeout=5)) == ("INTERNAL", "Exception deserializing request!")
            continue
        calls = {"unary": lambda d=data: raw["unary"](d, timeout=5),
                 "unary-stream": lambda d=data: list(raw["unary-stream"](d, timeout=5)),
                 "stream-unary": lambda d=data: raw["stream-unary"](iter([b"", d]), timeout=5),
                 "stream-stream": lambda d=data: list(raw["stream-stream"](iter([b"", d]), timeout=5))}
        got = {kind: _code(call) for kind, call in calls.items()}
        for kind, (code, msg) in got.items():
            assert code == "INVALID_ARGUMENT", (kind, data, code, msg)
            assert msg.startswith("the request is not a valid memsnap.v1.") and "memsnapctl" in msg, msg
            assert "\n" not in msg and len(msg) < 400


def test_well_formed_requests_still_reach_the_servicer(served: tuple[grpc.Channel, bool]) -> None:
    ch, _ = served
    assert pb_grpc.MemsnapStub(ch).Status(pb.StatusRequest(), timeout=5).version == "ok"
    assert [c.id for c in pb_grpc.MemsnapStub(ch).WatchCheckpoint(pb.WatchCheckpointRequest(id="x"), timeout=5)] \
        == ["x"]
    chunks = [pb.TunnelChunk(tunnel_id="t", data=b"d")]
    assert [c.data for c in peer_pb2_grpc.PeerStub(ch).PageTunnel(iter(chunks), timeout=5)] == [b"d"]
    assert _code(lambda: pb_grpc.MemsnapStub(ch).Checkpoint(pb.CheckpointRequest(), timeout=5))[0] == \
        "UNIMPLEMENTED"
