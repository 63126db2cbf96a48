"""The image channel of a move: the image's bytes over a plain TCP connection (sendfile), beside its gRPC call.

    source (ChannelSender)                           target (ImageChannel, on daemon.listen's address)
    connect, HELLO + ticket (32 random bytes) -----> held until a ReceiveImage call names the ticket
    ReceiveImage(first chunk: channel_ticket) -----> the call takes that connection (one use)
    DATA name offset length, then the bytes  ------> written as they come; each file hashed once
    DONE name size                                   (a file sent again starts at offset 0)
    MANIFEST length, then the signed manifest -----> verified as over gRPC: size and blake3 of every file,
                                                     the signature by the move's credential
    <----------------------------------------------- the verdict: the call's reply (or its error)

Python gRPC moves ~1.2 GB/s over loopback and spends ~1.3 core-seconds per GiB doing it, and a message-per-chunk
stream hashes every byte twice on each side. Here the source's bytes go by sendfile from the tier's page cache,
and each side hashes each byte once. What a move verifies is unchanged: the ticket only says which call a
connection belongs to; every file must match the manifest signed with the move's credential, so a forged or
altered byte fails the move as before (at the end, rather than at its chunk). The channel carries the image in
clear, like gRPC without TLS: a daemon with TLS opens no channel, and its images stay inside gRPC.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

from memsnap.errors import FailedPrecondition
from memsnap.logs import Quieted

log = logging.getLogger("memsnap.move")
strangers = Quieted(log)  # (what anyone who reaches the port can make us say)

HELLO = b"MSIMG/1\n"
TICKET_BYTES = 32
# kind (DATA, DONE, MANIFEST), name length, offset, length
_FRAME = struct.Struct("!BHQQ")
DATA, DONE, MANIFEST = 1, 2, 3
# How long a connection may wait for its call (the source connects first, then calls), and how many may wait.
HELLO_WAIT_S = 10.0
_WAITING_MAX = 32
# A call waits this long for its connection.
CLAIM_WAIT_S = 15.0
# Silence on an open channel (either way) longer than this ends the move.
IDLE_S = 300.0


class ChannelError(Exception):
    """The channel broke: the peer closed it, sent something malformed, or went silent."""


def _timeouts(sock: socket.socket, seconds: float) -> None:
    """Blocking socket whose every send and receive gives up after seconds (SO_SNDTIMEO/SO_RCVTIMEO):
    os.sendfile needs a blocking socket, and a peer that stops reading must not hold a thread forever."""
    sock.setblocking(True)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        try:
            n = sock.recv_into(view)
        except (BlockingIOError, TimeoutError):
            raise ChannelError(f"the source sent nothing for {IDLE_S:.0f} s") from None
        except OSError as exc:
            raise ChannelError(f"the channel broke: {exc.strerror or exc}") from None
        if n == 0:
            raise ChannelError("the source closed the image channel early")
        view = view[n:]


# -- the source side ------------------------------------------------------------------------------------
class ChannelSender:
    """One move's connection to the target's image channel."""

    def __init__(self, host: str, port: int, timeout: float = 10.0) -> None:
        self.ticket = os.urandom(TICKET_BYTES)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _timeouts(self.sock, IDLE_S)
            self.sock.sendall(HELLO + self.ticket)
        except OSError:
            self.sock.close()
            raise

    def data(self, name: bytes, offset: int, fd: int, length: int) -> None:
        """Sends [offset, offset+length) of fd, by sendfile."""
        self._send(_FRAME.pack(DATA, len(name), offset, length) + name)
        sent = 0
        while sent < length:
            try:
                n = os.sendfile(self.sock.fileno(), fd, offset + sent, length - sent)
            except (BlockingIOError, TimeoutError):
                raise ChannelError(f"the target read nothing for {IDLE_S:.0f} s") from None
            except OSError as exc:
                raise ChannelError(f"the image channel broke: {exc.strerror or exc}") from None
            if n == 0:
                raise ChannelError(f"the image file shrank while it was sent ({name.decode(errors='replace')})")
            sent += n

    def done(self, name: bytes, size: int) -> None:
        self._send(_FRAME.pack(DONE, len(name), size, 0) + name)

    def manifest(self, signed: bytes) -> None:
        self._send(_FRAME.pack(MANIFEST, 0, 0, len(signed)) + signed)

    def _send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BlockingIOError, TimeoutError):
            raise ChannelError(f"the target read nothing for {IDLE_S:.0f} s") from None
        except OSError as exc:
            raise ChannelError(f"the image channel broke: {exc.strerror or exc}") from None

    def shutdown(self) -> None:
        """Unblocks a send in another thread (abort); the socket stays open until close()."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


# -- the target side ------------------------------------------------------------------------------------
class Frame:
    """One frame read from a channel: DATA (its bytes still to read), DONE, or MANIFEST."""

    __slots__ = ("kind", "name", "offset", "length")

    def __init__(self, kind: int, name: str, offset: int, length: int) -> None:
        self.kind, self.name, self.offset, self.length = kind, name, offset, length


class ChannelReader:
    """Reads frames from a claimed connection; DATA's bytes come in pieces through one reused buffer."""

    PIECE = 4 << 20

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray(self.PIECE)
        self._view = memoryview(self._buf)
        self._hdr = bytearray(_FRAME.size)

    def frame(self, max_name: int, max_manifest: int) -> Frame:
        _recv_exact(self.sock, memoryview(self._hdr))
        kind, name_len, offset, length = _FRAME.unpack(self._hdr)
        if kind not in (DATA, DONE, MANIFEST):
            raise ChannelError(f"unknown frame kind {kind} on the image channel")
        if name_len > max_name or (kind == MANIFEST and (name_len or length > max_manifest)) or \
                (kind == DONE and length):
            raise ChannelError("malformed frame on the image channel")
        raw = bytearray(name_len)
        _recv_exact(self.sock, memoryview(raw))
        try:
            name = raw.decode()
        except UnicodeDecodeError:
            raise ChannelError("a file name on the image channel is not UTF-8") from None
        return Frame(kind, name, offset, length)

    def pieces(self, length: int) -> Iterator[memoryview]:
        """DATA's bytes, in pieces of at most PIECE bytes (each valid until the next is read)."""
        while length:
            n = min(length, self.PIECE)
            _recv_exact(self.sock, self._view[:n])
            yield self._view[:n]
            length -= n

    def read_all(self, length: int) -> bytes:
        out = bytearray(length)
        _recv_exact(self.sock, memoryview(out))
        return bytes(out)

    def shutdown(self) -> None:
        """Ends a read blocked in another thread (the call was cancelled)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


class _Waiting:
    __slots__ = ("sock", "event")

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.event = threading.Event()


class ImageChannel:
    """Listens beside the gRPC port; hands each connection to the ReceiveImage call that names its ticket."""

    def __init__(self, addresses: list[tuple[str, int]], on_listen: Callable[[int], None] | None = None) -> None:
        self._socks: list[socket.socket] = []
        self.port = 0
        for host, port in addresses:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind((host, self.port or port))
            except OSError:
                s.close()
                for o in self._socks:
                    o.close()
                raise
            s.listen(16)
            self.port = s.getsockname()[1]
            self._socks.append(s)
        self._lock = threading.Condition()
        self._claims: dict[bytes, _Waiting] = {}  # tickets a ReceiveImage call waits for
        self._slots = threading.BoundedSemaphore(_WAITING_MAX)
        self._stopped = False

    def start(self) -> None:
        for s in self._socks:
            threading.Thread(target=self._accept, args=(s,), name="image-channel", daemon=True).start()

    def stop(self) -> None:
        self._stopped = True
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        with self._lock:
            self._lock.notify_all()

    def _accept(self, s: socket.socket) -> None:
        while not self._stopped:
            try:
                conn, peer = s.accept()
            except OSError:
                if self._stopped:
                    return
                time.sleep(0.1)
                continue
            if not self._slots.acquire(blocking=False):
                strangers.warning("image channel: refused a connection from %s (%d already wait for their call)",
                                  peer[0], _WAITING_MAX)
                conn.close()
                continue
            threading.Thread(target=self._hello, args=(conn, peer[0]), name="image-channel-hello",
                             daemon=True).start()

    def _hello(self, conn: socket.socket, peer: str) -> None:
        """Reads HELLO + ticket, then waits (bounded) for the call that names the ticket."""
        handed = False
        try:
            _timeouts(conn, 5.0)
            buf = bytearray(len(HELLO) + TICKET_BYTES)
            try:
                _recv_exact(conn, memoryview(buf))
            except ChannelError:
                strangers.warning("image channel: %s sent no hello; closed", peer)
                return
            if bytes(buf[:len(HELLO)]) != HELLO:
                strangers.warning("image channel: %s is not a memsnap peer (bad hello); closed", peer)
                return
            ticket = bytes(buf[len(HELLO):])
            deadline = time.monotonic() + HELLO_WAIT_S
            with self._lock:
                while not self._stopped:
                    w = self._find(ticket)
                    if w is not None:
                        w.sock, handed = conn, True
                        w.event.set()
                        return
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._lock.wait(left)
            strangers.warning("image channel: no move call named the ticket %s presented; closed", peer)
        finally:
            self._slots.release()
            if not handed:
                conn.close()

    def _find(self, ticket: bytes) -> _Waiting | None:
        for t, w in self._claims.items():
            if hmac.compare_digest(t, ticket) and w.sock is None:
                return w
        return None

    def claim(self, ticket: bytes, cancelled: Callable[[], bool], wait_s: float = CLAIM_WAIT_S) -> ChannelReader:
        """The connection that presents ticket (one use); FailedPrecondition if none comes in time."""
        w = _Waiting()
        with self._lock:
            if ticket in self._claims:
                raise FailedPrecondition("this image channel ticket is in use already")
            self._claims[ticket] = w
            self._lock.notify_all()
        try:
            deadline = time.monotonic() + wait_s
            while not w.event.wait(0.2):
                if cancelled() or time.monotonic() > deadline:
                    break
        finally:
            with self._lock:
                self._claims.pop(ticket, None)
                sock = w.sock
        if sock is None:
            raise FailedPrecondition(
                f"the source's image channel connection did not arrive within {wait_s:.0f} s (is TCP port "
                f"{self.port} reachable from it?); it may move with daemon.image_port = -1 on this node")
        _timeouts(sock, IDLE_S)
        return ChannelReader(sock)


__all__ = ["DATA", "DONE", "MANIFEST", "ChannelError", "ChannelReader", "ChannelSender", "ImageChannel"]
