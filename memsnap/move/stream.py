"""Image streaming between daemons: ImageStreamer (source) sends a staging dir while CRIU writes it;
ImageReceiver (target) writes it into the tier's incoming area, checking every chunk, then every file.

    source (ImageStreamer)                          target (ImageReceiver)
    inotify on staging; a file goes once CRIU
      closed it, pages-*.img while it grows  ----> chunk: blake3 per chunk, offsets in order,
                                                    reserved tier room grows with the bytes
    CRIU returned: the rest, and files that
      changed after they went are sent again
    the signed manifest, last  -----------------> every listed file complete and matching, the
                                                    signature by the move's credential; re-signed
                                                    with this node's key and published
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import grpc

from memsnap import failpoints, lifecycle, manifest
from memsnap.catalog import DUMPING, CheckpointRecord, now_ms
from memsnap.dumphash import Inotify, stat_key
from memsnap.errors import FailedPrecondition, IntegrityFailure, InvalidArgument
from memsnap.move.channel import DONE, MANIFEST, TICKET_BYTES, ChannelError, ChannelReader, ChannelSender, ImageChannel
from memsnap.move.peer import PeerClient
from memsnap.move.plan import MoveHost, chain, move_error
from memsnap.store.errors import BadObject
from memsnap.store.parse import MANIFEST_MAX, load_json
from memsnap.tier import INCOMING, TierReservation
from memsnap.tiers import publish_image
from memsnap.v1 import memsnap_pb2 as pb

log = logging.getLogger("memsnap.move")

CHUNK_BYTES = 1 << 20
CHANNEL_PIECE = 4 << 20  # bytes read (and hashed) at a time before they go by sendfile
# At most this many chunks wait for the network: bounds the memory a slow peer can make us hold.
_QUEUE_CHUNKS = 64
RESERVE_SLACK = 16 << 20
CKPT_ID = re.compile(r"^ck-[A-Za-z0-9][A-Za-z0-9_.-]{0,80}$")


class StreamBroken(Exception):
    """The call to the target ended (or was aborted) while chunks were still being produced."""

    def __init__(self, message: str, code: str = "UNAVAILABLE") -> None:
        super().__init__(message)
        self.code = code


_IN_CLOSE_WRITE, _IN_MOVED_TO = 0x8, 0x80  # (memsnap.dumphash.Inotify's events)


@dataclass
class _FileState:
    """How much of one image file has been read, hashed and queued."""

    name: str
    fd: int = -1
    offset: int = 0
    closes: int = 0
    closes_at_done: int = -1
    done: bool = False
    stat: tuple[int, int, int, int] = (0, 0, 0, 0)
    hasher: Any = field(default_factory=blake3.blake3)

    def restart(self) -> None:
        """The file changed after we sent it: send it again from the start."""
        self.offset, self.done, self.hasher = 0, False, blake3.blake3()


class ImageStreamer:
    """Streams a staging dir to a peer while CRIU writes it.

    A file goes once CRIU has closed it (inotify IN_CLOSE_WRITE); pages-*.img goes while it grows,
    because CRIU appends page data strictly in order. After CRIU returns, whatever is left is sent,
    and a file that changed after it was sent (its inode, size, mtime or ctime moved) is sent again.
    """

    def __init__(self, client: PeerClient, expected_bytes: int, pipelined: bool = True,
                 channel: tuple[str, int] | None = None) -> None:
        self.client = client
        self.expected_bytes = expected_bytes
        self.pipelined = pipelined
        self.channel = channel  # the target's image channel (host, port), if it has one
        self.sender: ChannelSender | None = None
        self.ckpt_id = ""
        self.bytes_sent = 0
        self.bytes_at_criu_done = 0
        self.t_criu_done = 0.0
        self.error = ""
        self.error_code = "UNAVAILABLE"
        self.future: grpc.Future | None = None
        self._dir = Path()
        self._q: queue.Queue[pb.ImageChunk | None] = queue.Queue(maxsize=_QUEUE_CHUNKS)
        self._files: dict[str, _FileState] = {}
        self._dump_done = threading.Event()
        self._abort = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Inotify | None = None
        self._piece: memoryview | None = None

    # DumpExtras.before_dump: the watch must exist before CRIU creates the first file.
    def start(self, staging: Path) -> None:
        """Starts watching staging and opens the stream to the peer."""
        self._dir = staging
        self.ckpt_id = staging.name
        self._watch = Inotify(staging)
        if self.channel is not None:
            host, port = self.channel
            try:  # (connected first: the target holds the connection until the call names its ticket)
                self.sender = ChannelSender(host, port)
            except OSError as exc:
                log.warning("the target's image channel %s:%d is unreachable (%s): the image goes inside the "
                            "gRPC call", host, port, exc.strerror or exc, extra={"checkpoint_id": self.ckpt_id})
        self.future = self.client.receive_image(self._requests())
        if self.sender is not None:
            self.future.add_done_callback(self._call_ended)
        self._thread = threading.Thread(target=self._run, name=f"stream-{self.ckpt_id}", daemon=True)
        self._thread.start()

    # DumpExtras.file_table: called by the engine right after CRIU returned.
    def file_table(self) -> dict[str, dict[str, Any]] | None:
        """Waits until every file was read; returns {name: {size, blake3}}, or None if the stream broke."""
        self.t_criu_done = time.monotonic()
        self.bytes_at_criu_done = self.bytes_sent
        self._dump_done.set()
        if self._thread is not None:
            self._thread.join()
        if self.error:
            return None
        return {s.name: {"size": s.offset, "blake3": s.hasher.hexdigest()}
                for s in sorted(self._files.values(), key=lambda s: s.name)}

    def finish(self, signed_manifest: bytes, timeout: float) -> pb.ReceiveImageResponse:
        """Sends the manifest last and waits for the peer to verify and publish the image."""
        if self.error:
            raise StreamBroken(self.error, self.error_code)
        assert self.future is not None
        try:
            if self.sender is not None:
                try:
                    self.sender.manifest(signed_manifest)
                except ChannelError as exc:
                    raise StreamBroken(*self._channel_error(exc)) from None
            else:
                self._put(pb.ImageChunk(manifest=signed_manifest))
                self._put(None)
            return self.future.result(timeout=timeout)  # type: ignore[no-any-return]
        except grpc.RpcError as exc:
            raise StreamBroken(*self._peer_error(exc)) from None
        except grpc.FutureTimeoutError:
            raise StreamBroken(f"the target did not confirm the image within {timeout:.0f} s",
                                "DEADLINE_EXCEEDED") from None
        finally:
            if self.sender is not None:
                self.sender.close()

    def _call_ended(self, future: grpc.Future) -> None:
        """The call ended: after the manifest (nothing is left to send), or because the target refused the image
        before it read any of it; then a send blocked on the channel ends now, not when the target closes a
        connection it never read."""
        if self.sender is not None:
            self.sender.shutdown()

    def _channel_error(self, exc: ChannelError) -> tuple[str, str]:
        """Why the image channel broke: the target's own answer when it ended the call (a full tier, a bad
        file), else the channel's error."""
        assert self.future is not None
        try:
            err = self.future.exception(timeout=5)
        except (grpc.FutureTimeoutError, grpc.FutureCancelledError):
            err = None
        if isinstance(err, grpc.RpcError):
            return self._peer_error(err)
        return f"UNAVAILABLE: {exc}", "UNAVAILABLE"

    def abort(self) -> None:
        """Stops reading and cancels the call (idempotent)."""
        self._abort.set()
        self._dump_done.set()
        if self.future is not None:
            self.future.cancel()
        if self.sender is not None:
            self.sender.shutdown()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)
        if self.sender is not None:
            self.sender.close()

    @staticmethod
    def _peer_error(exc: grpc.RpcError) -> tuple[str, str]:
        """(message, status name) for a failed call to the target."""
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
        if code == grpc.StatusCode.UNAVAILABLE:
            return f"UNAVAILABLE: the target stopped answering ({details})", code.name
        return f"{code.name}: {details}", code.name

    def _requests(self) -> Iterator[pb.ImageChunk]:
        """The call's request stream (gRPC's sender thread iterates it): ends at the closing None, or once the move
        aborted or the call ended (a failed move puts nothing more; waiting on would hold that thread forever)."""
        yield pb.ImageChunk(checkpoint_id=self.ckpt_id, expected_bytes=self.expected_bytes,
                            channel_ticket=self.sender.ticket if self.sender is not None else b"")
        if self.sender is not None:
            return  # (the rest goes over the image channel)
        while True:
            try:
                item = self._q.get(timeout=0.2)
            except queue.Empty:
                if self._abort.is_set() or (self.future is not None and self.future.done()):
                    return
                continue
            if item is None:
                return
            yield item

    def _put(self, msg: pb.ImageChunk | None) -> None:
        assert self.future is not None
        while True:
            if self._abort.is_set():
                raise StreamBroken("aborted")
            if self.future.done():
                exc = self.future.exception()
                if isinstance(exc, grpc.RpcError):
                    raise StreamBroken(*self._peer_error(exc))
                raise StreamBroken("the target ended the stream early")
            try:
                self._q.put(msg, timeout=0.05)
                return
            except queue.Full:
                continue

    def _run(self) -> None:
        assert self._watch is not None
        try:
            while True:
                final = self._dump_done.is_set()  # read first: anything written before it is seen below
                if not final and not self.pipelined:
                    self._dump_done.wait(0.05)  # serial mode (for comparison): send only after CRIU
                    continue
                for mask, name in self._watch.events(0 if final else 0.005):
                    if not name:
                        continue
                    st = self._files.setdefault(name, _FileState(name))
                    if mask & (_IN_CLOSE_WRITE | _IN_MOVED_TO):
                        st.closes += 1
                if final:
                    present = {p.name for p in self._dir.iterdir() if p.is_file()}
                    for name in present:
                        self._files.setdefault(name, _FileState(name))
                    for name in set(self._files) - present:
                        self._forget(name)
                for st in list(self._files.values()):
                    self._pump(st, final)
                if final:
                    break
        except StreamBroken as exc:
            self.error, self.error_code = str(exc), exc.code
        except ChannelError as exc:
            self.error, self.error_code = self._channel_error(exc)
        except Exception as exc:  # a vanished staging dir (failed dump) or an I/O error
            self.error = f"reading the image failed: {exc}"
        finally:
            for st in self._files.values():
                if st.fd >= 0:
                    os.close(st.fd)
                    st.fd = -1
            self._watch.close()

    def _forget(self, name: str) -> None:
        st = self._files.pop(name)
        if st.fd >= 0:
            os.close(st.fd)

    def _pump(self, st: _FileState, final: bool) -> None:
        closed = st.closes > 0
        if not (final or closed or st.name.startswith("pages-")):
            return
        if st.fd < 0:
            try:
                st.fd = os.open(self._dir / st.name, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return
        if st.done and (st.closes != st.closes_at_done or (final and stat_key(os.fstat(st.fd)) != st.stat)):
            log.info("image file %s changed after it was sent; sending it again", st.name)
            st.restart()
        size = os.fstat(st.fd).st_size
        if self.sender is not None:
            self._send(st, size, closed or final)
            return
        while st.offset < size:
            data = os.pread(st.fd, min(CHUNK_BYTES, size - st.offset), st.offset)
            if not data:
                break
            st.hasher.update(data)
            digest = blake3.blake3(data).digest()
            self._put(pb.ImageChunk(file=st.name, offset=st.offset, data=data, blake3=digest))
            st.offset += len(data)
            self.bytes_sent += len(data)
        if (closed or final) and not st.done and st.offset == size:
            self._put(pb.ImageChunk(file=st.name, offset=st.offset, file_done=True))
            st.done, st.closes_at_done, st.stat = True, st.closes, stat_key(os.fstat(st.fd))

    def _send(self, st: _FileState, size: int, closed: bool) -> None:
        """_pump over the image channel: each piece read once (to hash it), then sent by sendfile."""
        if self._abort.is_set():
            raise StreamBroken("aborted")
        assert self.sender is not None
        name = st.name.encode()
        buf = self._buf()
        while st.offset < size:
            n = os.preadv(st.fd, [buf[:min(len(buf), size - st.offset)]], st.offset)
            if not n:
                break
            st.hasher.update(buf[:n])
            self.sender.data(name, st.offset, st.fd, n)
            st.offset += n
            self.bytes_sent += n
            failpoints.hit("image-channel-sent")  # (tests: the source dies with the image half sent)
        if closed and not st.done and st.offset == size:
            self.sender.done(name, st.offset)
            st.done, st.closes_at_done, st.stat = True, st.closes, stat_key(os.fstat(st.fd))

    def _buf(self) -> memoryview:
        if self._piece is None:
            self._piece = memoryview(bytearray(CHANNEL_PIECE))
        return self._piece


# -- the target side ----------------------------------------------------------------------------------
@dataclass
class _Incoming:
    """One file being received."""

    fd: int
    size: int = 0
    done: bool = False
    hasher: Any = field(default_factory=blake3.blake3)


class ImageReceiver:
    """Writes a streamed image into the tier's incoming area, checking every chunk, then every file."""

    def __init__(self, host: MoveHost, verify_key: bytes | None, channel: ImageChannel | None = None,
                 cancelled: Callable[[], bool] = lambda: False) -> None:
        self.host = host
        self.verify_key = verify_key
        self.channel = channel
        self.cancelled = cancelled
        self._cancelled = False
        self.reader: ChannelReader | None = None
        self._reserved = 0
        self._received = 0
        self._reservations: list[TierReservation] = []

    def receive(self, chunks: Iterator[pb.ImageChunk]) -> tuple[str, int]:
        """Consumes the stream; returns (checkpoint id, bytes) once the image is published here."""
        it = iter(chunks)
        try:
            first = next(it)
        except StopIteration:
            raise InvalidArgument("empty image stream") from None
        ckpt_id = first.checkpoint_id
        if not CKPT_ID.match(ckpt_id):
            raise InvalidArgument(f"{ckpt_id!r} is not a checkpoint id")
        if self.host.catalog.get_checkpoint(ckpt_id) is not None:
            raise FailedPrecondition(f"checkpoint {ckpt_id} already exists on this node")
        tier = self.host.tier
        self._reserved = int(first.expected_bytes) + RESERVE_SLACK
        self._received = 0
        self._reservations = [self.host.reserve(self._reserved)]
        files: dict[str, _Incoming] = {}
        # Journal first: if this daemon dies mid-stream, recovery removes the partial image.
        lifecycle.begin(self.host.catalog, CheckpointRecord(id=ckpt_id, state=DUMPING, pid=0, owner_uid=0,
                                                            created_ms=now_ms(), name="incoming",
                                                            meta={"move_incoming": "streamed"}))
        incoming = tier.new_staging(ckpt_id, area=INCOMING)
        try:
            if first.channel_ticket:
                signed = self._from_channel(first.channel_ticket, incoming, files)
            else:
                signed = self._from_stream(chain(first, it), incoming, files)
            if not signed:
                raise move_error("ABORTED", "the image stream ended before its manifest; the source gave up")
            body = self._verify(signed, files, incoming)
            for f in files.values():
                os.close(f.fd)
                f.fd = -1
            total = self._publish(ckpt_id, body, incoming)
        except BaseException as exc:
            for f in files.values():
                if f.fd >= 0:
                    os.close(f.fd)
            broke = move_error("ABORTED", f"the image channel broke: {exc}; the source gave up") \
                if isinstance(exc, ChannelError) else None
            tier.discard_staging(ckpt_id)
            log.warning("receiving %s failed: %s", ckpt_id, broke or exc)
            lifecycle.forget(self.host.catalog, ckpt_id)
            if broke is not None:
                raise broke from None
            raise
        finally:
            if self.reader is not None:
                self.reader.close()
            for r in self._reservations:
                r.release()
        # Not drained yet: the image is the job's only once the source commits the move (MoveTarget.commit
        # queues its drain); a move that fails takes it away again (move.target.drop_incoming).
        return ckpt_id, total

    def cancel(self) -> None:
        """The call ended (the source cancelled it): a read on the image channel returns at once."""
        self._cancelled = True
        if self.reader is not None:
            self.reader.shutdown()

    def _from_stream(self, chunks: Iterator[pb.ImageChunk], d: Path, files: dict[str, _Incoming]) -> bytes:
        """The image inside the gRPC call (ImageChunk messages); returns the signed manifest (b"" if none came)."""
        for chunk in chunks:
            if chunk.manifest:
                return bytes(chunk.manifest)
            if not chunk.file:
                continue
            f = self._file(d, files, chunk.file, chunk.offset, bool(chunk.data or chunk.file_done))
            if chunk.data:
                if blake3.blake3(chunk.data).digest() != chunk.blake3:
                    raise IntegrityFailure(f"integrity check failed: checksum mismatch in {chunk.file} at offset "
                                           f"{chunk.offset}")
                self._append(f, chunk.data)
            if chunk.file_done:
                f.done = True
        return b""

    def _from_channel(self, ticket: bytes, d: Path, files: dict[str, _Incoming]) -> bytes:
        """The image over the image channel (memsnap.move.channel): frames, then the signed manifest. Each file
        is checked once, whole, against that manifest (no per-chunk digests: the signed one covers them)."""
        if self.channel is None:
            raise FailedPrecondition("this node has no image channel (daemon.image_port = -1, TLS, or no "
                                     "daemon.listen); the source must send the image inside the call")
        if len(ticket) != TICKET_BYTES:
            raise InvalidArgument(f"channel_ticket must be {TICKET_BYTES} bytes")
        reader = self.reader = self.channel.claim(ticket, lambda: self._cancelled or self.cancelled())
        if self._cancelled:
            raise move_error("ABORTED", "the source cancelled the move")
        while True:
            fr = reader.frame(255, MANIFEST_MAX)
            if fr.kind == MANIFEST:
                return reader.read_all(fr.length)
            f = self._file(d, files, fr.name, fr.offset, True)
            if fr.kind == DONE:
                f.done = True
                continue
            for piece in reader.pieces(fr.length):
                self._append(f, piece)

    def _file(self, d: Path, files: dict[str, _Incoming], name: str, offset: int, restarts: bool) -> _Incoming:
        """The file a chunk at offset belongs to, opened on its first chunk; a chunk at 0 of a file that has
        bytes already starts it again (the source sends a file again when it changed after being sent)."""
        if not name or "/" in name or name.startswith(".") or name == manifest.MANIFEST or len(name) > 255:
            raise InvalidArgument(f"bad image file name {name[:300]!r}")
        f = files.get(name)
        if f is None:
            f = files[name] = _Incoming(os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                                0o600))
        if offset == 0 and f.size and restarts:
            os.ftruncate(f.fd, 0)
            os.lseek(f.fd, 0, os.SEEK_SET)
            f.size, f.done, f.hasher = 0, False, blake3.blake3()
        if offset != f.size:
            raise IntegrityFailure(f"integrity check failed: {name} chunk at offset {offset}, expected {f.size}")
        return f

    def _append(self, f: _Incoming, data: bytes | memoryview) -> None:
        self._charge(len(data))
        view = memoryview(data)
        while view:
            view = view[os.write(f.fd, view):]
        f.hasher.update(data)
        f.size += len(data)

    def _charge(self, n: int) -> None:
        """Counts received bytes against the tier reservation, growing it (or refusing) past the estimate."""
        self._received += n
        if self._received > self._reserved:
            more = max(RESERVE_SLACK, self._received - self._reserved)
            self._reservations.append(self.host.reserve(more))
            self._reserved += more

    def _verify(self, signed: bytes, files: dict[str, _Incoming], d: Path) -> dict[str, Any]:
        try:  # (bounded like every manifest read from a store: a peer's bytes are untrusted too)
            m = load_json(signed, "transfer manifest", d.name, MANIFEST_MAX)
        except BadObject as exc:
            raise IntegrityFailure(f"integrity check failed: {exc}") from exc
        if not isinstance(m.get("files"), dict):
            raise IntegrityFailure("integrity check failed: the transfer manifest has no file list")
        if self.verify_key is not None:
            try:
                manifest.verify_signature(m, self.verify_key)
            except manifest.IntegrityError as exc:
                raise IntegrityFailure(f"{exc} (transfer manifest: is the node token the same on both "
                                       "nodes?)") from exc
        if m.get("id") != d.name:  # bound to the checkpoint it was announced as (restore checks id/job/uid)
            raise IntegrityFailure(f"integrity check failed: the transfer manifest is for checkpoint "
                                   f"{str(m.get('id'))[:80]!r}, not {d.name}")
        listed: dict[str, Any] = m["files"]
        for name, meta in listed.items():
            f = files.get(name)
            if f is None or not f.done:
                raise IntegrityFailure(f"integrity check failed: {name} was not received completely")
            if f.size != meta.get("size") or f.hasher.hexdigest() != meta.get("blake3"):
                raise IntegrityFailure(f"integrity check failed: {name} does not match the manifest")
        for name in set(files) - set(listed):
            # Not part of the image (a temporary file CRIU removed): the signed manifest decides.
            os.close(files.pop(name).fd)
            os.unlink(d / name)
        return {k: v for k, v in m.items() if k != "signature"}

    def _publish(self, ckpt_id: str, body: dict[str, Any], d: Path) -> int:
        body["received_at"] = {"host": self.host.hostname, "unix_ms": now_ms()}
        try:
            man = manifest.Manifest.from_dict(body)
        except manifest.IntegrityError as exc:
            raise IntegrityFailure(str(exc)) from exc
        # Re-signed with this node's key; every byte was hashed as it arrived, so restore need not read
        # the files again (publish_image records their fingerprint).
        return publish_image(self.host.tier, self.host.catalog, self.host.key, d, man,
                             keep_meta={"move_incoming": "streamed"}, pid=int(man.pid),
                             owner_uid=int(man.uid), job=str(man.job), name=str(man.name),
                             frozen_ms=int(man.frozen_ms), dump_ms=int(man.dump_ms))


__all__ = ["CHUNK_BYTES", "ImageReceiver", "ImageStreamer", "StreamBroken"]
