"""The image channel of a move (memsnap.move.channel) on real loopback sockets: a connection belongs to the call
that names its ticket and to no other; anything else is closed; frames that do not parse break the channel;
a file the source sends again is written again from its first byte, over the channel and inside gRPC."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import blake3
import grpc
import pytest

from memsnap.errors import FailedPrecondition
from memsnap.move import channel as ch
from memsnap.move.channel import ChannelError, ChannelSender, ImageChannel
from memsnap.move.stream import ImageReceiver, ImageStreamer
from memsnap.v1 import memsnap_pb2 as pb


@pytest.fixture
def listening(monkeypatch: pytest.MonkeyPatch) -> Iterator[ImageChannel]:
    monkeypatch.setattr(ch, "HELLO_WAIT_S", 0.5)
    c = ImageChannel([("127.0.0.1", 0)])
    c.start()
    yield c
    c.stop()


def _closed(s: socket.socket, within: float = 5.0) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_connection_presenting_a_claimed_ticket_carries_data_done_and_manifest(listening, tmp_path):
    payload = os.urandom(3 * 1024 * 1024 + 17)
    src = tmp_path / "pages-1.img"
    src.write_bytes(payload)
    sender = ChannelSender("127.0.0.1", listening.port)
    reader = listening.claim(sender.ticket, lambda: False)

    def send() -> None:
        fd = os.open(src, os.O_RDONLY)
        try:
            sender.data(b"pages-1.img", 0, fd, len(payload))
        finally:
            os.close(fd)
        sender.done(b"pages-1.img", len(payload))
        sender.manifest(b'{"files": {}}')

    t = threading.Thread(target=send)
    t.start()
    fr = reader.frame(255, 1 << 20)
    assert (fr.kind, fr.name, fr.offset, fr.length) == (ch.DATA, "pages-1.img", 0, len(payload))
    got = b"".join(bytes(p) for p in reader.pieces(fr.length))
    assert got == payload
    fr = reader.frame(255, 1 << 20)
    assert (fr.kind, fr.name, fr.offset) == (ch.DONE, "pages-1.img", len(payload))
    fr = reader.frame(255, 1 << 20)
    assert fr.kind == ch.MANIFEST and reader.read_all(fr.length) == b'{"files": {}}'
    t.join()
    sender.close()
    reader.close()


def test_a_connection_with_another_ticket_is_closed_and_the_claim_names_the_port(listening):
    sender = ChannelSender("127.0.0.1", listening.port)
    with pytest.raises(FailedPrecondition, match=f"TCP port {listening.port}"):
        listening.claim(os.urandom(ch.TICKET_BYTES), lambda: False, wait_s=0.3)
    assert _closed(sender.sock)


def test_a_claim_ends_at_once_when_its_call_is_cancelled(listening):
    t0 = time.monotonic()
    with pytest.raises(FailedPrecondition, match="did not arrive"):
        listening.claim(os.urandom(ch.TICKET_BYTES), lambda: True, wait_s=30)
    assert time.monotonic() - t0 < 5


def test_silent_and_garbage_connections_are_closed_and_a_real_sender_still_gets_through(listening):
    silent = [socket.create_connection(("127.0.0.1", listening.port)) for _ in range(3)]
    garbage = socket.create_connection(("127.0.0.1", listening.port))
    garbage.sendall(b"x" * 40)
    sender = ChannelSender("127.0.0.1", listening.port)
    reader = listening.claim(sender.ticket, lambda: False)
    sender.manifest(b"{}")
    fr = reader.frame(255, 100)
    assert fr.kind == ch.MANIFEST and reader.read_all(fr.length) == b"{}"
    assert _closed(garbage)
    assert all(_closed(s, 10) for s in silent)  # (the hello times out after 5 s)
    reader.close()
    sender.close()


@pytest.mark.parametrize("frame", [
    struct.pack("!BHQQ", 9, 0, 0, 0),                                     # an unknown kind
    struct.pack("!BHQQ", ch.MANIFEST, 0, 0, (1 << 20) + 1),                # a manifest over its bound
    struct.pack("!BHQQ", ch.DONE, 1, 0, 5) + b"a",                         # DONE with bytes
    struct.pack("!BHQQ", ch.DATA, 300, 0, 1) + b"a" * 300,                 # a name over 255 bytes
    struct.pack("!BHQQ", ch.DATA, 2, 0, 1) + b"\xff\xfe",                  # a name that is not UTF-8
    struct.pack("!BHQQ", ch.DATA, 1, 0, 10) + b"a" + b"12345",             # bytes cut short
], ids=["kind", "manifest-size", "done-with-bytes", "long-name", "not-utf8", "short"])
def test_a_frame_that_does_not_parse_breaks_the_channel(listening, frame):
    sender = ChannelSender("127.0.0.1", listening.port)
    reader = listening.claim(sender.ticket, lambda: False)
    sender.sock.sendall(frame)
    sender.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(ChannelError):
        fr = reader.frame(255, 1 << 20)
        b"".join(bytes(p) for p in reader.pieces(fr.length))
    reader.close()
    sender.close()


# -- a file sent again ------------------------------------------------------------------------------------
def _receiver(channel: ImageChannel | None = None) -> ImageReceiver:
    r = ImageReceiver.__new__(ImageReceiver)  # (only the writing is exercised: no tier, no catalog)
    r.channel, r.cancelled, r._cancelled, r.reader = channel, (lambda: False), False, None
    r._received, r._reserved = 0, 1 << 30
    return r


def test_a_file_sent_again_inside_grpc_is_written_again_from_its_first_byte(tmp_path: Path) -> None:
    first, again = b"A" * 10, b"yz"
    chunks = [pb.ImageChunk(file="core-1.img", offset=0, data=first, blake3=blake3.blake3(first).digest()),
              pb.ImageChunk(file="core-1.img", offset=10, file_done=True),
              pb.ImageChunk(file="core-1.img", offset=0, data=again, blake3=blake3.blake3(again).digest()),
              pb.ImageChunk(file="core-1.img", offset=2, file_done=True),
              pb.ImageChunk(manifest=b"{}")]
    files: dict = {}
    assert _receiver()._from_stream(iter(chunks), tmp_path, files) == b"{}"
    os.close(files["core-1.img"].fd)
    assert (tmp_path / "core-1.img").read_bytes() == again
    assert files["core-1.img"].hasher.hexdigest() == blake3.blake3(again).hexdigest()


def test_a_file_sent_again_over_the_channel_is_written_again_from_its_first_byte(listening, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"A" * 10)
    (src / "b").write_bytes(b"yz")
    sender = ChannelSender("127.0.0.1", listening.port)
    for name, size in (("a", 10), ("b", 2)):
        fd = os.open(src / name, os.O_RDONLY)
        sender.data(b"core-1.img", 0, fd, size)
        os.close(fd)
        sender.done(b"core-1.img", size)
    sender.manifest(b"{}")
    dst = tmp_path / "dst"
    dst.mkdir()
    files: dict = {}
    r = _receiver(listening)
    assert r._from_channel(sender.ticket, dst, files) == b"{}"
    os.close(files["core-1.img"].fd)
    r.reader.close()
    sender.close()
    assert (dst / "core-1.img").read_bytes() == b"yz"


# -- the source side ---------------------------------------------------------------------------------------
class _Refused(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.FAILED_PRECONDITION

    def details(self) -> str:
        return "checkpoint ck-x already exists on this node"


class _RefusedCall:
    """A ReceiveImage call the target answered with an error at once, before reading the image."""

    def __init__(self, requests: Iterator[pb.ImageChunk]) -> None:
        self.first = next(requests)

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        fn(self)

    def done(self) -> bool:
        return True

    def exception(self, timeout: float | None = None) -> BaseException:
        return _Refused()

    def cancel(self) -> bool:
        return False


def test_a_target_that_refuses_the_image_before_reading_it_ends_the_stream_at_once(tmp_path: Path) -> None:
    deaf = socket.socket()  # accepts the channel and never reads it (as a target that refused the call)
    deaf.bind(("127.0.0.1", 0))
    deaf.listen(1)
    client = SimpleNamespace(receive_image=lambda reqs: _RefusedCall(reqs))
    staging = tmp_path / "ck-1"
    staging.mkdir()
    streamer = ImageStreamer(client, 0, channel=("127.0.0.1", deaf.getsockname()[1]))  # type: ignore[arg-type]
    streamer.start(staging)
    (staging / "pages-1.img").write_bytes(os.urandom(64 << 20))  # more than the socket buffers hold
    done = threading.Thread(target=streamer.file_table)
    done.start()
    done.join(10)
    assert not done.is_alive(), "the stream waited on a channel nobody reads"
    assert "FAILED_PRECONDITION" in streamer.error and "already exists" in streamer.error
    assert streamer.future.first.channel_ticket == streamer.sender.ticket
    deaf.close()
