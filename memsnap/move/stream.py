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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import grpc

from memsnap import lifecycle, manifest
from memsnap.catalog import DUMPING, CheckpointRecord, now_ms
from memsnap.dumphash import Inotify, stat_key
from memsnap.errors import FailedPrecondition, IntegrityFailure, InvalidArgument
from memsnap.move.peer import PeerClient
from memsnap.move.plan import MoveHost, chain, move_error
from memsnap.store.errors import BadObject
from memsnap.store.parse import MANIFEST_MAX, load_json
from memsnap.tier import INCOMING, TierReservation
from memsnap.tiers import publish_image
from memsnap.v1 import memsnap_pb2 as pb

log = logging.getLogger("memsnap.move")

CHUNK_BYTES = 1 << 20
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

    def __init__(self, client: PeerClient, expected_bytes: int, pipelined: bool = True) -> None:
        self.client = client
        self.expected_bytes = expected_bytes
        self.pipelined = pipelined
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

    # DumpExtras.before_dump: the watch must exist before CRIU creates the first file.
    def start(self, staging: Path) -> None:
        """Starts watching staging and opens the stream to the peer."""
        self._dir = staging
        self.ckpt_id = staging.name
        self._watch = Inotify(staging)
        self.future = self.client.receive_image(self._requests())
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
            self._put(pb.ImageChunk(manifest=signed_manifest))
            self._put(None)
            return self.future.result(timeout=timeout)  # type: ignore[no-any-return]
        except grpc.RpcError as exc:
            raise StreamBroken(*self._peer_error(exc)) from None
        except grpc.FutureTimeoutError:
            raise StreamBroken(f"the target did not confirm the image within {timeout:.0f} s",
                                "DEADLINE_EXCEEDED") from None

    def abort(self) -> None:
        """Stops reading and cancels the call (idempotent)."""
        self._abort.set()
        self._dump_done.set()
        if self.future is not None:
            self.future.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)

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
        yield pb.ImageChunk(checkpoint_id=self.ckpt_id, expected_bytes=self.expected_bytes)
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

    def __init__(self, host: MoveHost, verify_key: bytes | None) -> None:
        self.host = host
        self.verify_key = verify_key
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
            signed: bytes = b""
            for chunk in chain(first, it):
                if chunk.manifest:
                    signed = chunk.manifest
                    break
                if chunk.file:
                    self._write(incoming, files, chunk)
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
            tier.discard_staging(ckpt_id)
            log.warning("receiving %s failed: %s", ckpt_id, exc)
            lifecycle.forget(self.host.catalog, ckpt_id)
            raise
        finally:
            for r in self._reservations:
                r.release()
        # Not drained yet: the image is the job's only once the source commits the move (MoveTarget.commit
        # queues its drain); a move that fails takes it away again (move.target.drop_incoming).
        return ckpt_id, total

    def _write(self, d: Path, files: dict[str, _Incoming], chunk: pb.ImageChunk) -> None:
        name = chunk.file
        if "/" in name or name.startswith(".") or name == manifest.MANIFEST or len(name) > 255:
            raise InvalidArgument(f"bad image file name {name!r}")
        f = files.get(name)
        if f is None:
            f = files[name] = _Incoming(os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                                0o600))
        if chunk.offset == 0 and f.size and (chunk.data or chunk.file_done):
            os.ftruncate(f.fd, 0)  # the source sends a file again when it changed after being sent
            f.size, f.done, f.hasher = 0, False, blake3.blake3()
        if chunk.offset != f.size:
            raise IntegrityFailure(f"integrity check failed: {name} chunk at offset {chunk.offset}, "
                                   f"expected {f.size}")
        if chunk.data:
            self._charge(len(chunk.data))
            if blake3.blake3(chunk.data).digest() != chunk.blake3:
                raise IntegrityFailure(f"integrity check failed: checksum mismatch in {name} at offset "
                                       f"{chunk.offset}")
            view = memoryview(chunk.data)
            while view:
                view = view[os.write(f.fd, view):]
            f.hasher.update(chunk.data)
            f.size += len(chunk.data)
        if chunk.file_done:
            f.done = True

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
