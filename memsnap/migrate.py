"""Moving a running job to another node's daemon: the source side (Migrate) and the target side
(ReceiveImage, RestoreReceived).

Source: preflight (target reachable, authenticated, room in its tier) -> lock the job's TCP connections
(with --tcp-established) -> CRIU dumps the job into the tier and leaves it stopped, while every image
file streams to the target as soon as CRIU has closed it (pages-*.img while it grows) -> the manifest
goes last -> the target verifies and restores -> once the target says the job runs, the stopped copy
here is killed. Any failure before that resumes the job here and names the step that failed.

Trust: the source sends only to a configured peer ([[peers]]), with that peer's credential: the token
shared with it (peers.token_file) or one derived from the node token for it (remote.peer_credential);
the node token itself never leaves. Only root may name another address, with a credential of its own
(to_token). The manifest that crosses the wire is signed with a key derived from that credential
(remote.transfer_key), and every chunk and file carries a blake3 checksum. The target checks both, with
the key of the credential the call authenticated with (a move without one is refused), then re-signs
the manifest with its own node key: node HMAC keys never leave their node. A move via shared storage
(--via-store) reads the copy the drain wrote, signed with the source's node key, so both nodes must
share security.hmac_key_file for that path.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import queue
import re
import select
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import blake3
import grpc

from memsnap import failpoints, jobs, manifest, net
from memsnap.catalog import DUMPING, DURABLE, FAILED, STAGED, CheckpointRecord, now_ms
from memsnap.client import ClientError, MemsnapClient, Target
from memsnap.config import Config, parse_host_port
from memsnap.drain import bulk_transfer
from memsnap.engine import ROOT, Caller, DumpHooks, Engine, RestoreResult
from memsnap.errors import (
    FailedPrecondition,
    IntegrityFailure,
    InvalidArgument,
    MemsnapError,
    PermissionDenied,
    TierExhausted,
)
from memsnap.lazymove import TunnelHost, lazy_preflight, move_lazily
from memsnap.remote import RemoteConfigError, call_token, load_credentials, transfer_key
from memsnap.tier import INCOMING
from memsnap.v1 import memsnap_pb2 as pb

log = logging.getLogger("memsnap.migrate")

CHUNK_BYTES = 1 << 20
# At most this many chunks wait for the network: bounds the memory a slow peer can make us hold.
_QUEUE_CHUNKS = 64
_RESERVE_SLACK = 16 << 20
_CKPT_ID = re.compile(r"^ck-[A-Za-z0-9][A-Za-z0-9_.-]{0,80}$")
# How long a restored job must stay alive on the target before the source lets go of its copy.
CONFIRM_S = 0.2
# A restored job whose move the source does not commit within this time is killed on the target.
COMMIT_TIMEOUT_S = 120.0
# A move via the store waits this long (or this many failed drain attempts) for the durable copy.
_VIA_STORE_WAIT_S = 600.0
_VIA_STORE_ATTEMPTS = 3
# Codes that say the link broke, not that the target refused: what happened there must be asked.
_TRANSPORT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def _error(code: str, message: str) -> MemsnapError:
    """A MemsnapError with any gRPC status name (e.g. the one the target answered with)."""
    exc = MemsnapError(message)
    exc.code = code
    return exc


class _StreamBroken(Exception):
    """The call to the target ended (or was aborted) while chunks were still being produced."""

    def __init__(self, message: str, code: str = "UNAVAILABLE") -> None:
        super().__init__(message)
        self.code = code


# -- watching the staging dir -----------------------------------------------------------------------
_IN_MODIFY, _IN_CLOSE_WRITE, _IN_MOVED_TO, _IN_CREATE = 0x2, 0x8, 0x80, 0x100
_EVENT = struct.Struct("iIII")


class _Inotify:
    """The few inotify calls needed to learn when CRIU has closed an image file."""

    def __init__(self, path: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = int(self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        mask = _IN_CREATE | _IN_CLOSE_WRITE | _IN_MOVED_TO
        if self._libc.inotify_add_watch(self.fd, os.fsencode(path), mask) < 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"cannot watch {path}")

    def events(self, timeout: float) -> list[tuple[int, str]]:
        """(mask, file name) events, waiting up to timeout seconds for the first."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return []
        out: list[tuple[int, str]] = []
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return out
            off = 0
            while off + _EVENT.size <= len(buf):
                _wd, mask, _cookie, length = _EVENT.unpack_from(buf, off)
                name = buf[off + _EVENT.size: off + _EVENT.size + length].rstrip(b"\0")
                out.append((mask, os.fsdecode(name)))
                off += _EVENT.size + length

    def close(self) -> None:
        """Stops watching."""
        os.close(self.fd)


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


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class ImageStreamer:
    """Streams a staging dir to a peer while CRIU writes it.

    A file goes once CRIU has closed it (inotify IN_CLOSE_WRITE); pages-*.img goes while it grows,
    because CRIU appends page data strictly in order. After CRIU returns, whatever is left is sent,
    and a file that changed after it was sent (its inode, size, mtime or ctime moved) is sent again.
    """

    def __init__(self, client: MemsnapClient, expected_bytes: int, pipelined: bool = True) -> None:
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
        self._watch: _Inotify | None = None

    # DumpHooks.before_dump: the watch must exist before CRIU creates the first file.
    def start(self, staging: Path) -> None:
        """Starts watching staging and opens the stream to the peer."""
        self._dir = staging
        self.ckpt_id = staging.name
        self._watch = _Inotify(staging)
        self.future = self.client.receive_image(self._requests())
        self._thread = threading.Thread(target=self._run, name=f"stream-{self.ckpt_id}", daemon=True)
        self._thread.start()

    # DumpHooks.file_table: called by the engine right after CRIU returned.
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
            raise _StreamBroken(self.error, self.error_code)
        assert self.future is not None
        try:
            self._put(pb.ImageChunk(manifest=signed_manifest))
            self._put(None)
            return self.future.result(timeout=timeout)  # type: ignore[no-any-return]
        except grpc.RpcError as exc:
            raise _StreamBroken(*self._peer_error(exc)) from None
        except grpc.FutureTimeoutError:
            raise _StreamBroken(f"the target did not confirm the image within {timeout:.0f} s",
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
        yield pb.ImageChunk(checkpoint_id=self.ckpt_id, expected_bytes=self.expected_bytes)
        while True:
            item = self._q.get()
            if item is None:
                return
            yield item

    def _put(self, msg: pb.ImageChunk | None) -> None:
        assert self.future is not None
        while True:
            if self._abort.is_set():
                raise _StreamBroken("aborted")
            if self.future.done():
                exc = self.future.exception()
                if isinstance(exc, grpc.RpcError):
                    raise _StreamBroken(*self._peer_error(exc))
                raise _StreamBroken("the target ended the stream early")
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
        except _StreamBroken as exc:
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
        if st.done and (st.closes != st.closes_at_done or (final and _stat_key(os.fstat(st.fd)) != st.stat)):
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
            st.done, st.closes_at_done, st.stat = True, st.closes, _stat_key(os.fstat(st.fd))


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

    def __init__(self, engine: Engine, verify_key: bytes | None) -> None:
        self.engine = engine
        self.verify_key = verify_key
        self._reserved = 0
        self._received = 0
        self._reservations: list[Any] = []

    def receive(self, chunks: Iterator[pb.ImageChunk]) -> tuple[str, int]:
        """Consumes the stream; returns (checkpoint id, bytes) once the image is published here."""
        it = iter(chunks)
        try:
            first = next(it)
        except StopIteration:
            raise InvalidArgument("empty image stream") from None
        ckpt_id = first.checkpoint_id
        if not _CKPT_ID.match(ckpt_id):
            raise InvalidArgument(f"{ckpt_id!r} is not a checkpoint id")
        if self.engine.catalog.get_checkpoint(ckpt_id) is not None:
            raise FailedPrecondition(f"checkpoint {ckpt_id} already exists on this node")
        tier = self.engine.tier
        self._reserved = int(first.expected_bytes) + _RESERVE_SLACK
        self._received = 0
        self._reservations = [self.engine._reserve(self._reserved)]
        files: dict[str, _Incoming] = {}
        # Journal first: if this daemon dies mid-stream, recovery removes the partial image.
        self.engine.catalog.add_checkpoint(CheckpointRecord(id=ckpt_id, state=DUMPING, pid=0, owner_uid=0,
                                                            created_ms=now_ms(), name="incoming"))
        incoming = tier.new_staging(ckpt_id, area=INCOMING)
        try:
            signed: bytes = b""
            for chunk in _chain(first, it):
                if chunk.manifest:
                    signed = chunk.manifest
                    break
                if chunk.file:
                    self._write(incoming, files, chunk)
            if not signed:
                raise _error("ABORTED", "the image stream ended before its manifest; the source gave up")
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
            self.engine.catalog.delete_checkpoint(ckpt_id)
            raise
        finally:
            for r in self._reservations:
                r.release()
        rec = self.engine.catalog.get_checkpoint(ckpt_id)
        if self.engine.drain is not None and rec is not None and not rec.meta.get("pages_remote"):
            self.engine.drain.enqueue(ckpt_id)  # (the first half of a lazy move is never worth storing)
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
            more = max(_RESERVE_SLACK, self._received - self._reserved)
            self._reservations.append(self.engine._reserve(more))
            self._reserved += more

    def _verify(self, signed: bytes, files: dict[str, _Incoming], d: Path) -> dict[str, Any]:
        try:
            m = json.loads(signed)
        except ValueError as exc:
            raise IntegrityFailure("integrity check failed: the transfer manifest is not JSON") from exc
        if not isinstance(m, dict) or not isinstance(m.get("files"), dict):
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
        body["received_at"] = {"host": self.engine.hostname, "unix_ms": now_ms()}
        signed = manifest.sign(body, self.engine.key)
        manifest.write(d, signed)
        self.engine.tier.publish(d, ckpt_id)
        size = sum(int(x["size"]) for x in signed["files"].values())
        meta = {k: signed.get(k) for k in ("argv", "host", "criu_version", "own_pidns", "log_path", "gpus",
                                           "freezing_ms", "pages_remote")}
        # Every byte was hashed as it arrived: restore need not read the files again.
        meta["fingerprint"] = manifest.fingerprint(self.engine.tier.path(ckpt_id))
        self.engine.catalog.update_checkpoint(
            ckpt_id, state=STAGED, in_tier=True, size_bytes=size, pid=int(signed.get("pid", 0)),
            owner_uid=int(signed.get("uid", 0)), job=str(signed.get("job", "")),
            name=str(signed.get("name", "")),
            frozen_ms=int(signed.get("frozen_ms", 0)), dump_ms=int(signed.get("dump_ms", 0)),
            last_used_ms=now_ms(), meta=meta)
        return size


def _chain(first: pb.ImageChunk, rest: Iterator[pb.ImageChunk]) -> Iterator[pb.ImageChunk]:
    yield first
    yield from rest


# -- orchestration ----------------------------------------------------------------------------------
class _Phases:
    """Named durations, in order."""

    def __init__(self) -> None:
        self.items: list[tuple[str, float]] = []
        self._t = time.monotonic()

    def mark(self, name: str, now: float = 0.0) -> float:
        """Ends phase `name` now (or at `now`); the next phase starts there."""
        now = now or time.monotonic()
        self.items.append((name, (now - self._t) * 1000))
        self._t = now
        return now

    def pb(self) -> list[pb.Phase]:
        # A phase ended at a time taken on another thread (the last page can land before the resume is
        # heard) would be negative; the wire field is unsigned.
        return [pb.Phase(name=n, ms=max(0, int(ms))) for n, ms in self.items]


@dataclass
class _Move:
    """What a move on the source holds, so that a rollback can undo it."""

    pid: int
    job_id: str
    ckpt_id: str = ""
    lock: net.ConnectionLock | None = None
    moved_ip: net.IfAddr | None = None
    ip_removed_from: str = ""


class Migrator:
    """The Migrate, ReceiveImage and RestoreReceived RPCs of one daemon."""

    def __init__(self, engine: Engine, cfg: Config) -> None:
        self.engine = engine
        self.cfg = cfg
        self._commit_lock = threading.Lock()
        self._committed: dict[str, str] = {}
        self._in_doubt: dict[str, str] = {}  # ckpt id -> "JOB -> HOST:PORT"
        try:
            self.creds = load_credentials(cfg)
        except RemoteConfigError as exc:
            raise SystemExit(f"memsnapd: {exc}") from exc
        self.tunnels = TunnelHost(engine)

    # -- source ---------------------------------------------------------------------------------
    def _target_client(self, req: pb.MigrateRequest, caller: Caller) -> tuple[MemsnapClient, str]:
        """A client for the move's target and the credential it carries (which also keys the transfer).

        The target must be a configured peer (by name or address), and gets that peer's credential.
        Root alone may name another address, with a credential of its own (to_token): this node's own
        secrets never go to an address that a caller chose."""
        d = self.cfg.daemon
        peer = self.cfg.peer(req.to)
        address = peer.address if peer is not None else req.to
        try:
            parse_host_port(address)
        except ValueError as exc:
            raise InvalidArgument(f"--to {req.to[:200]!r} is neither a configured peer nor HOST:PORT") from exc
        if peer is None and not (caller.is_root and req.to_token):
            hint = ("add it to [[peers]] in memsnap.toml, or (root) pass a credential that it accepts with "
                    "--token-file" if caller.is_root else "ask the administrator to add it to [[peers]]")
            raise PermissionDenied(f"{req.to[:200]} is not a configured peer of this node: jobs move only to "
                                   f"peers; {hint}")
        token = req.to_token or (self.creds.outbound(peer) if peer is not None else "")
        if not token:
            raise FailedPrecondition(
                f"no credential for peer {req.to[:200]}: a move needs a secret shared with the target to sign "
                "the image; set daemon.auth_token_file (the same node token on both nodes) or peers.token_file")
        # Node certificates serve as client certificates between daemons (mutual TLS clusters).
        tls = {"tls_ca": d.tls_ca, "tls_cert": d.tls_cert, "tls_key": d.tls_key} if d.tls_ca else {}
        return MemsnapClient(Target(address=address, token=token, **tls)), token

    def migrate(self, caller: Caller, req: pb.MigrateRequest,
                context: grpc.ServicerContext) -> pb.MigrateResponse:
        """Moves a job to req.to; on failure the job runs on here and the error names the step."""
        t0 = time.monotonic()
        try:
            with bulk_transfer():
                resp = self._migrate(caller, req)
        except Exception:
            self.engine.observe("migrate", "error", time.monotonic() - t0)
            raise
        self.engine.observe("migrate", "ok", time.monotonic() - t0)
        return resp

    def _migrate(self, caller: Caller, req: pb.MigrateRequest) -> pb.MigrateResponse:
        phases = _Phases()
        pid, job = self.engine.resolve_pid(req.target, caller)
        try:
            owner = jobs.owner_uid(pid)
        except jobs.ProcessNotFound as exc:
            raise _error("NOT_FOUND", str(exc)) from exc
        if not caller.is_root and caller.uid != owner:
            raise PermissionDenied(f"uid {caller.uid} may not move pid {pid} owned by uid {owner}")
        if req.lazy:
            lazy_preflight(req)
        if self.engine.gpu is not None and self.engine.gpu.describe(pid):
            raise FailedPrecondition("jobs that use CUDA cannot be moved yet")
        moved_ip: net.IfAddr | None = None
        if req.move_ip:
            try:
                moved_ip = net.parse_interface(req.move_ip)
            except ValueError as exc:
                raise InvalidArgument(f"--move-ip: {exc}") from exc
            if not net.holder_of(moved_ip):
                raise InvalidArgument(f"--move-ip: {moved_ip.ip} is not configured on this node")
        if req.tcp_established and not net.nft_available():
            raise FailedPrecondition("--tcp-established needs nft (apt-get install nftables) to lock the "
                                     "connections during the move")
        # A lazy move puts only the small images into the target's tier; the memory goes to the job.
        estimate = 0 if req.lazy else int(jobs.tree_rss(pid) * (1 + self.cfg.tier.reserve_margin))
        client, token = self._target_client(req, caller)
        with client:
            try:
                st = client.status(timeout=10)
            except ClientError as exc:
                raise _error(exc.code.name, f"migration failed at preflight: target {req.to} said "
                             f"{exc.code.name}: {exc.message}; the job was not touched") from exc
            if st.tier_free_bytes < estimate + _RESERVE_SLACK:
                raise TierExhausted(
                    f"migration failed at preflight: the target's tier has {st.tier_free_bytes >> 20} MiB "
                    f"free but the job needs about {(estimate + _RESERVE_SLACK) >> 20} MiB; the job was not "
                    "touched")
            phases.mark("preflight")
            move = _Move(pid=pid, job_id=job.id if job else "", moved_ip=moved_ip)
            if req.lazy:
                return move_lazily(self, caller, req, client, token, move, phases)
            if req.via_store:
                return self._via_store(caller, req, client, move, phases)
            return self._streamed(caller, req, client, token, move, estimate, phases)

    def _dump_held(self, caller: Caller, req: pb.MigrateRequest, move: _Move,
                   hooks: DumpHooks) -> CheckpointRecord:
        """Dumps with the job left stopped; locks its connections and moves the address off this node."""
        if req.tcp_established:
            addrs = [str(move.moved_ip.ip)] if move.moved_ip else []
            conns = [] if move.moved_ip else net.tcp_connections(move.pid)
            move.lock = net.ConnectionLock(addresses=addrs, conns=conns)
            hooks.dump_opts["network_lock_skip"] = True

        def notify(script: str, _pid: int) -> bool:
            # post-dump: the image is complete and the tree still frozen; the address may leave now.
            if script == "post-dump" and move.moved_ip is not None:
                move.ip_removed_from = net.remove_address(move.moved_ip, req.move_ip_dev_source)
            return True

        hooks.notify = notify
        hooks.hold = True
        try:
            if move.lock is not None:
                move.lock.acquire()
            return self.engine.checkpoint(caller, str(move.pid), tcp_established=req.tcp_established,
                                          hooks=hooks)
        except Exception as exc:
            # CRIU resumed the job itself (a failed dump leaves it running); undo the network side.
            self._restore_network(move)
            if isinstance(exc, net.NetError):
                raise FailedPrecondition(f"migration failed at dump: {exc}; the job runs on here") from exc
            if isinstance(exc, MemsnapError):
                raise _error(exc.code, f"migration failed at dump: {exc}") from exc
            raise

    def _streamed(self, caller: Caller, req: pb.MigrateRequest, client: MemsnapClient, token: str,
                  move: _Move, estimate: int, phases: _Phases) -> pb.MigrateResponse:
        # MEMSNAP_MIGRATE_SERIAL=1 on the source turns pipelining off: the benchmark's baseline.
        streamer = ImageStreamer(client, estimate, pipelined=not os.environ.get("MEMSNAP_MIGRATE_SERIAL"))
        hooks = DumpHooks(before_dump=streamer.start, file_table=streamer.file_table)
        t_dump = time.monotonic()
        try:
            rec = self._dump_held(caller, req, move, hooks)
        except BaseException:
            streamer.abort()
            raise
        move.ckpt_id = rec.id
        t_criu_done = phases.mark("dump", streamer.t_criu_done)
        # CRIU's own timers say when the freeze began: freezing + frozen time before it returned.
        freeze_start = t_criu_done - (rec.frozen_ms + float(rec.meta.get("freezing_ms", 0) or 0)) / 1000
        if freeze_start < t_dump:
            freeze_start = t_dump
        try:
            body = {k: v for k, v in manifest.read(self.engine.tier.path(rec.id)).items() if k != "signature"}
            wire = manifest.sign(body, transfer_key(token)) if token else body
            received = streamer.finish(json.dumps(wire, sort_keys=True).encode(), timeout=600)
        except _StreamBroken as exc:
            streamer.abort()
            self._rollback(move, "transfer", str(exc), exc.code)
        except manifest.IntegrityError as exc:
            streamer.abort()
            self._rollback(move, "transfer", str(exc), "DATA_LOSS")
        phases.mark("transfer")
        log.info("streamed %d of %d bytes while CRIU was still dumping", streamer.bytes_at_criu_done,
                 received.bytes, extra={"checkpoint_id": rec.id})
        return self._restore_on_target(req, client, move, rec, phases, freeze_start, received.bytes)

    def _via_store(self, caller: Caller, req: pb.MigrateRequest, client: MemsnapClient, move: _Move,
                   phases: _Phases) -> pb.MigrateResponse:
        from memsnap.api import ckpt_pb

        if self.engine.drain is None:
            raise FailedPrecondition("--via-store needs a store on this node (store.dir or store.url)")
        t_dump = time.monotonic()
        rec = self._dump_held(caller, req, move, DumpHooks())
        move.ckpt_id = rec.id
        frozen_s = (rec.frozen_ms + float(rec.meta.get("freezing_ms", 0) or 0)) / 1000
        freeze_start = t_dump + max(0.0, rec.dump_ms / 1000 - frozen_s)
        phases.mark("dump")
        # The job is frozen meanwhile: give up after a few failed drain attempts rather than retry for long.
        deadline = time.monotonic() + _VIA_STORE_WAIT_S
        while True:
            cur = self.engine.catalog.get_checkpoint(rec.id)
            if cur is not None and cur.state == DURABLE:
                rec = cur
                break
            if (cur is None or cur.state == FAILED or time.monotonic() > deadline
                    or (cur.drain_attempts >= _VIA_STORE_ATTEMPTS and cur.last_error)):
                why = (cur.last_error or "it took too long") if cur else "the checkpoint vanished"
                self._rollback(move, "drain", f"the checkpoint did not become durable: {why}", "UNAVAILABLE")
            time.sleep(0.05)
        phases.mark("drain")
        return self._restore_on_target(req, client, move, rec, phases, freeze_start, 0,
                                       from_store=ckpt_pb(rec))

    def _restore_on_target(self, req: pb.MigrateRequest, client: MemsnapClient, move: _Move,
                           rec: CheckpointRecord, phases: _Phases, freeze_start: float, sent: int,
                           from_store: pb.CheckpointInfo | None = None) -> pb.MigrateResponse:
        # Early resume: the job runs on the target as soon as its state is back, and pages its memory in
        # from the target's verified copy; the reply comes once all of it is in place. Off for the
        # serial baseline, and with --tcp-established (kept to the plain path that its tests cover).
        early = not (req.plain_restore or req.tcp_established or os.environ.get("MEMSNAP_MIGRATE_SERIAL"))
        rreq = pb.RestoreReceivedRequest(checkpoint_id=rec.id, tcp_established=req.tcp_established,
                                         add_ip=str(move.moved_ip) if move.moved_ip else "",
                                         add_ip_dev=req.move_ip_dev_target, from_store=from_store,
                                         early_resume=early)
        paged_ms = 0
        try:
            res = client.restore_received(rreq, timeout=600)
            target_pid, target_job = int(res.pid), res.job.id
            paged_ms = int(res.paged_in_ms)
        except ClientError as exc:
            why = f"{exc.code.name}: {exc.message}"
            if exc.code not in _TRANSPORT_CODES:
                self._rollback(move, "restore on the target", why, exc.code.name)
            # The connection broke during the restore: the job may run there all the same.
            found = self._target_job(client, rec.id)
            if found is None:
                self._rollback(move, "restore on the target", why, exc.code.name)
            target_pid, target_job = int(found.pid), found.id
        t_reply = time.monotonic()
        t_running = phases.mark("restore", t_reply - paged_ms / 1000)
        if paged_ms:
            phases.mark("paging", t_reply)  # the job already ran on the target meanwhile
        downtime_ms = (t_running - freeze_start) * 1000
        time.sleep(CONFIRM_S)
        found = self._target_job(client, rec.id)
        if found is None or found.id != target_job:
            self._rollback(move, "confirm", f"the restored job {target_job} is not running on the target",
                           "FAILED_PRECONDITION")
        self._commit_on(client, move, rec.id, req.to)
        phases.mark("confirm")
        # The target runs the job and keeps it: journal that (a crash from here on must not resume the
        # copy here), and only then let the copy here go.
        self.engine.mark_moved(rec.id, req.to, target_job)
        self.engine.end_held(move.pid, move.job_id, rec.id)
        if move.lock is not None:
            move.lock.release()
        if self.engine.drain is None:
            # Nothing would ever drain or evict it, and the target holds a verified copy.
            try:
                self.engine.delete(ROOT, rec.id)
            except MemsnapError as exc:
                log.warning("could not drop the moved image %s: %s", rec.id, exc)
        phases.mark("cleanup")
        log.info("moved %s to %s as pid %d: downtime %.0f ms, %d bytes", move.job_id or move.pid, req.to,
                 target_pid, downtime_ms, sent, extra={"checkpoint_id": rec.id})
        return pb.MigrateResponse(target_pid=target_pid, checkpoint_id=rec.id, phases=phases.pb(),
                                  downtime_ms=int(downtime_ms), bytes_sent=sent, target_job=target_job)

    def _commit_on(self, client: MemsnapClient, move: _Move, ckpt_id: str, to: str) -> None:
        """Tells the target to keep the job. Refused: the job runs on here (and dies there). Unanswered:
        the move is in doubt (see _ask_commit); past daemon.move_in_doubt_s it runs on here too."""
        rec = self.engine.catalog.get_checkpoint(ckpt_id)
        if rec is not None:
            # A crash from here until moved_to is journaled leaves the question to the target (recovery).
            self.engine.catalog.update_checkpoint(ckpt_id, meta={**rec.meta, "committing_to": to})
        kept, why, code = self._ask_commit(client, ckpt_id, to, move.job_id or str(move.pid))
        if not kept:
            self._rollback(move, "commit", why, code)
        failpoints.hit("after-commit")

    def _ask_commit(self, client: MemsnapClient, ckpt_id: str, to: str, job: str) -> tuple[bool, str, str]:
        """Asks the target to keep the job restored from ckpt_id until it answers; (kept, why, code).

        The commit is idempotent and the target remembers it across its own restart, so asking again is
        always safe. While the target cannot be reached the move is in doubt: it may have applied the
        commit and run the job, so the copy here stays stopped and the question is repeated with backoff,
        for at most daemon.move_in_doubt_s (0 = until it answers).
        """
        try:
            return self._ask_until_answered(client, ckpt_id, to, job)
        finally:
            self._in_doubt.pop(ckpt_id, None)

    def moves_in_doubt(self) -> list[str]:
        """"JOB -> HOST:PORT" for every outgoing move whose commit is unanswered (status, metrics)."""
        return sorted(self._in_doubt.values())

    def _ask_until_answered(self, client: MemsnapClient, ckpt_id: str, to: str, job: str) -> tuple[bool, str, str]:
        limit = self.cfg.daemon.move_in_doubt_s
        deadline = time.monotonic() + limit if limit > 0 else float("inf")
        attempt = 0
        while True:
            try:
                client.restore_received(pb.RestoreReceivedRequest(checkpoint_id=ckpt_id, commit=True), timeout=10)
                return True, "", "OK"
            except ClientError as exc:
                why = f"{exc.code.name}: {exc.message}"
                if exc.code not in _TRANSPORT_CODES:
                    return False, why, exc.code.name  # the target answered: it does not keep the job
            if time.monotonic() >= deadline:
                return False, (f"{to} gave no answer for {limit:.0f} s ({why}); if it runs the job, it now runs "
                               "on both nodes: stop one copy"), "UNAVAILABLE"
            if attempt == 2:  # (a blip is retried quietly)
                self._in_doubt[ckpt_id] = f"{job} -> {to}"
                log.warning("the move of %s to %s is in doubt: the target cannot be reached (%s); the job stays "
                            "stopped here and memsnapd keeps asking (daemon.move_in_doubt_s)", job, to, why,
                            extra={"checkpoint_id": ckpt_id})
            time.sleep(min(30.0, 0.5 * 1.5 ** attempt, max(0.1, deadline - time.monotonic())))
            attempt += 1

    def recover(self) -> None:
        """At start, after Engine.recover: no move of this daemon is in flight any more.

        Network locks a killed memsnapd left would drop the moved addresses' TCP traffic for good: they go.
        Moves whose commit was unanswered when it died are settled in the background (settle_uncertain).
        """
        for table in net.remove_stale_locks():
            log.warning("removed network lock %s, left by a memsnapd that died during a move", table)
        self.settle_uncertain()

    def settle_uncertain(self) -> None:
        """After a crash mid-commit: asks each target again whether it keeps the job (_ask_commit: while
        it cannot be reached, the copy here stays stopped). Kept there -> the stopped copy here ends;
        refused, or no answer within daemon.move_in_doubt_s -> it runs on here. A thread per move."""
        ids, self.engine.uncertain_moves = list(self.engine.uncertain_moves), []
        for ckpt_id in ids:
            threading.Thread(target=self._settle, args=(ckpt_id,), name=f"settle-{ckpt_id}", daemon=True).start()

    def _settle(self, ckpt_id: str) -> None:
        rec = self.engine.catalog.get_checkpoint(ckpt_id)
        if rec is None:
            return
        to = str(rec.meta.get("committing_to", ""))
        kept, why = False, "no target recorded"
        try:
            with self._target_client(pb.MigrateRequest(to=to), ROOT)[0] as client:
                kept, why, _ = self._ask_commit(client, ckpt_id, to, rec.job)
        except MemsnapError as exc:
            why = str(exc)
            if to and self.cfg.peer(to) is None:
                # Moved with root's own credential to an address that is not a peer: that credential was
                # not kept, so nothing can ask it again. It is in doubt as if unreachable: the copy here stays
                # stopped for daemon.move_in_doubt_s (0 = until an operator resumes or ends it).
                self._in_doubt[ckpt_id] = f"{rec.job} -> {to}"
                limit = self.cfg.daemon.move_in_doubt_s
                log.warning("the interrupted move of %s to %s is in doubt: %s is not a configured peer, so it "
                            "cannot be asked; the job stays stopped here%s", rec.job, to, to,
                            f" for {limit:.0f} s" if limit > 0 else "", extra={"checkpoint_id": ckpt_id})
                if limit <= 0:
                    return
                time.sleep(limit)
                self._in_doubt.pop(ckpt_id, None)
        if kept:
            self.engine.mark_moved(ckpt_id, to)
            self.engine.end_held(rec.pid, rec.job, ckpt_id)
            log.info("the interrupted move of %s to %s was committed there; the copy here ended", rec.job,
                     to, extra={"checkpoint_id": ckpt_id})
        else:
            meta = {k: v for k, v in rec.meta.items() if k != "committing_to"}
            self.engine.catalog.update_checkpoint(ckpt_id, meta=meta)
            self.engine.resume_held(rec.pid, ckpt_id)
            log.warning("the interrupted move of %s to %s is not kept there (%s); the job runs on here",
                        rec.job, to, why, extra={"checkpoint_id": ckpt_id})
        if rec.meta.get("lazy_move"):
            self.engine.tier.discard_staging(ckpt_id)

    @staticmethod
    def _target_job(client: MemsnapClient, ckpt_id: str, tries: int = 3) -> pb.Job | None:
        """The running job restored from ckpt_id on the target, or None (a lost link is retried)."""
        for attempt in range(tries):
            try:
                for j in client.jobs(timeout=10):
                    if j.restored_from == ckpt_id and j.running:
                        return j
                return None
            except ClientError as exc:
                if exc.code not in _TRANSPORT_CODES or attempt == tries - 1:
                    log.warning("cannot ask the target about %s: %s", ckpt_id, exc)
                    return None
                time.sleep(1.0)
        return None

    def _restore_network(self, move: _Move) -> None:
        if move.ip_removed_from and move.moved_ip is not None:
            try:
                net.add_address(move.moved_ip, move.ip_removed_from)
                move.ip_removed_from = ""
            except net.NetError as exc:
                log.error("could not give %s back to %s: %s", move.moved_ip, move.ip_removed_from, exc)
        if move.lock is not None:
            move.lock.release()

    def _rollback(self, move: _Move, step: str, why: str, code: str) -> NoReturn:
        """Runs the job here again, then raises an error that names the failed step."""
        log.warning("migration failed at %s: %s; resuming the job here", step, why)
        try:
            where = self._resume_here(move)
        except Exception as exc:
            log.exception("rollback failed")
            raise _error("INTERNAL", f"migration failed at {step}: {why}; resuming the job here failed too "
                         f"({exc}); its image is checkpoint {move.ckpt_id}") from exc
        raise _error(code, f"migration failed at {step}: {why}; the job was resumed on this node{where}")

    def _resume_here(self, move: _Move) -> str:
        if move.ip_removed_from and move.moved_ip is not None:
            net.add_address(move.moved_ip, move.ip_removed_from)
            move.ip_removed_from = ""
        if move.lock is None:
            self.engine.resume_held(move.pid, move.ckpt_id)
            return ""
        # Its sockets stay in repair mode after the dump, so SIGCONT would leave the connections dead:
        # restore the image here instead (the stopped copy goes first, its sockets close silently).
        self.engine.end_held(move.pid, move.job_id, move.ckpt_id)
        lock = move.lock

        def notify(script: str, _pid: int) -> bool:
            if script == "post-restore":
                lock.release()
            return True

        try:
            res = self.engine.restore(ROOT, move.ckpt_id, tcp_established=True, notify=notify,
                                      restore_opts={"network_lock_skip": True})
        finally:
            lock.release()
        return f" from its image, as {res.job.id} (pid {res.pid})"

    # -- target ---------------------------------------------------------------------------------
    def receive(self, caller: Caller, chunks: Iterator[pb.ImageChunk],
                context: grpc.ServicerContext) -> pb.ReceiveImageResponse:
        """Peer side: receives and verifies an image into the tier."""
        if not caller.is_root:
            raise PermissionDenied("only a peer daemon (authenticated over TCP) or root may send images")
        token = call_token()
        if not token:
            raise FailedPrecondition(
                "images are received only from a peer that authenticated with a token over TCP: the manifest "
                "must be signed with a key from a secret shared with the source (daemon.auth_token_file or "
                "peers.token_file on both nodes)")
        key = transfer_key(token)
        with bulk_transfer():
            ckpt_id, total = ImageReceiver(self.engine, key).receive(chunks)
        log.info("received image %s: %d bytes", ckpt_id, total, extra={"checkpoint_id": ckpt_id})
        return pb.ReceiveImageResponse(checkpoint_id=ckpt_id, bytes=total)

    def restore_received(self, caller: Caller, req: pb.RestoreReceivedRequest,
                         context: grpc.ServicerContext) -> pb.RestoreResponse:
        """Peer side: takes the moved address, restores the received image, checks that the job runs."""
        from memsnap.api import job_pb

        if not caller.is_root:
            raise PermissionDenied("only a peer daemon (authenticated over TCP) or root may restore moves")
        if req.commit:
            return self._commit(req.checkpoint_id)
        tunnel = None
        early = req.early_resume and not req.lazy and not req.tcp_established
        if req.lazy:
            if req.tcp_established or req.HasField("from_store"):
                raise InvalidArgument("a lazy move keeps no TCP connections and reads nothing from the store")
            tunnel = self.tunnels.claim(req.lazy_tunnel, req.checkpoint_id)
        if req.HasField("from_store"):
            self._adopt_stored(req.from_store)
        ifa = None
        if req.add_ip:
            try:
                ifa = net.parse_interface(req.add_ip)
            except ValueError as exc:
                raise InvalidArgument(f"add_ip: {exc}") from exc
        lock = None
        if ifa is not None and req.tcp_established:
            lock = net.ConnectionLock(addresses=[str(ifa.ip)])
        added = ""

        def notify(script: str, _pid: int) -> bool:
            # post-restore: the sockets exist again (still in repair mode), so packets find them now.
            if script == "post-restore" and lock is not None:
                lock.release()
            return True

        try:
            try:
                if lock is not None:
                    lock.acquire()
                if ifa is not None:
                    added = net.add_address(ifa, req.add_ip_dev)
            except net.NetError as exc:
                raise FailedPrecondition(str(exc)) from exc
            opts = {"network_lock_skip": True} if req.tcp_established else None
            try:
                res = self.engine.restore(ROOT, req.checkpoint_id, tcp_established=req.tcp_established,
                                          notify=notify if lock is not None else None, restore_opts=opts,
                                          lazy=tunnel is not None or early,
                                          lazy_ps_socket=tunnel.criu_end.fileno() if tunnel else -1)
            finally:
                if tunnel is not None:
                    tunnel.criu_end.close()  # lazy-pages holds its own copy now
            # Journaled at once: if this daemon dies from here on, its restart kills the copy (the source,
            # which never heard back, resumes its own).
            self._journal_pending(req.checkpoint_id, res.job.id)
            paged_ms = self._wait_paged_in(res) if early else 0
            if not jobs.alive(res.pid):
                raise FailedPrecondition(f"the restored job (pid {res.pid}) exited at once; see its log")
        except BaseException as exc:
            if tunnel is not None:
                self.tunnels.failed(tunnel, f"the lazy restore failed: {exc}")
            self._journal_pending(req.checkpoint_id, "")  # (the copy here is dead: nothing to commit)
            if lock is not None:
                lock.release()
            if added and ifa is not None:
                try:
                    net.remove_address(ifa, added)
                except net.NetError as exc:
                    log.error("could not remove %s after a failed restore: %s", ifa, exc)
            raise
        if lock is not None:
            lock.release()
        if ifa is not None:
            net.announce(ifa, added)
        self._arm_expiry(req.checkpoint_id, res.job.id)
        if tunnel is not None:
            self.tunnels.watch(tunnel, res.lazy_server, res.pid, res.job.id)
        failpoints.hit("before-restore-reply")
        return pb.RestoreResponse(pid=res.pid, job=job_pb(res.job, True), restore_ms=int(res.restore_ms),
                                  verify_ms=int(res.verify_ms), fetch_ms=int(res.fetch_ms),
                                  from_store=res.from_store, paged_in_ms=paged_ms)

    # -- the commit step -------------------------------------------------------------------------
    def _journal_pending(self, ckpt_id: str, job_id: str) -> None:
        """Journals a restored, not yet committed move ("" clears it)."""
        rec = self.engine.catalog.get_checkpoint(ckpt_id)
        if rec is not None and (job_id or "move_pending" in rec.meta):
            meta = {k: v for k, v in rec.meta.items() if k != "move_pending"}
            if job_id:
                meta["move_pending"] = job_id
            self.engine.catalog.update_checkpoint(ckpt_id, meta=meta)

    def _arm_expiry(self, ckpt_id: str, job_id: str) -> None:
        """The move dies here unless the source commits within COMMIT_TIMEOUT_S of the reply (or of the
        last lazy page)."""
        timer = threading.Timer(COMMIT_TIMEOUT_S, self._expire, args=(ckpt_id, job_id))
        timer.daemon = True
        timer.start()

    def _commit(self, ckpt_id: str) -> pb.RestoreResponse:
        """The source confirmed and lets go of its copy: the job restored from ckpt_id stays (idempotent)."""
        from memsnap.api import job_pb

        failpoints.hit("before-commit")
        with self._commit_lock:
            rec = self.engine.catalog.get_checkpoint(ckpt_id)
            job_id = rec.meta.get("move_pending", "") if rec is not None else ""
            if not job_id:
                job_id = self._committed.get(ckpt_id, "") or self._kept_before(ckpt_id)
            job = self.engine.catalog.get_job(job_id) if job_id else None
            if job is None or job.ended or not jobs.alive(job.pid, job.pid_start):
                raise FailedPrecondition(f"no job moved from {ckpt_id} runs here; the source keeps its copy")
            self._committed[ckpt_id] = job_id  # (a retried commit whose reply was lost is answered too)
            while len(self._committed) > 256:
                self._committed.pop(next(iter(self._committed)))
            if rec is not None:
                meta = {k: v for k, v in rec.meta.items() if k != "move_pending"}
                self.engine.catalog.update_checkpoint(ckpt_id, meta=meta)
                if meta.get("pages_remote"):
                    self.tunnels.committed(ckpt_id)
        failpoints.hit("commit-then-die")  # (the reply is lost)
        return pb.RestoreResponse(pid=job.pid, job=job_pb(job, True))

    def _kept_before(self, ckpt_id: str) -> str:
        """The job a commit kept here before this daemon restarted (the source asks again after a crash).

        A restored move that is not pending any more was either committed (its job runs on) or abandoned
        (its job was killed and ended), so a live job restored from ckpt_id means the commit happened.
        """
        live = self.engine.live_jobs_restored_from(ckpt_id)
        return live[0].id if live else ""

    def _expire(self, ckpt_id: str, job_id: str) -> None:
        if self.tunnels.busy(ckpt_id):
            self._arm_expiry(ckpt_id, job_id)  # a lazy move still brings pages: the source commits after
            return
        with self._commit_lock:
            rec = self.engine.catalog.get_checkpoint(ckpt_id)
            if rec is None or rec.meta.get("move_pending") != job_id:
                return
            log.warning("the source never committed the move of %s: killing it here (the source runs it)",
                        job_id, extra={"checkpoint_id": ckpt_id})
            self.engine.abandon_move(rec)

    def _wait_paged_in(self, res: RestoreResult) -> int:
        """Early resume: waits until lazy-pages has put every page in place; ms the job ran meanwhile."""
        t0 = time.monotonic()
        failpoints.hit("paging-in")
        rc = res.lazy_server.wait()
        self.engine.reap_lazy()
        if rc != 0:
            # Its supervisor killed the job already (missing pages would read as zeros).
            jobs.kill_tree(res.pid)
            self.engine.catalog.update_job(res.job.id, ended=True)
            raise FailedPrecondition(f"paging in the restored job's memory failed (lazy-pages exit {rc}, see "
                                     f"{res.work_dir}/lazy-pages.log); the copy there was killed")
        return max(1, int((time.monotonic() - t0) * 1000))

    def _adopt_stored(self, info: pb.CheckpointInfo) -> None:
        """Catalogs a durable checkpoint another node wrote to the shared store, so restore can fetch it."""
        if not _CKPT_ID.match(info.id):
            raise InvalidArgument(f"{info.id!r} is not a checkpoint id")
        if self.engine.catalog.get_checkpoint(info.id) is not None:
            return
        if self.engine.drain is None:
            raise FailedPrecondition("this node has no store configured, so it cannot fetch a stored "
                                     "checkpoint")
        meta = {"argv": list(info.argv), "host": info.hostname, "criu_version": info.criu_version}
        self.engine.catalog.add_checkpoint(CheckpointRecord(
            id=info.id, state=DURABLE, pid=int(info.pid), owner_uid=int(info.owner_uid),
            created_ms=int(info.created_unix_ms), job=info.job, name=info.name,
            size_bytes=int(info.size_bytes),
            frozen_ms=int(info.frozen_ms), dump_ms=int(info.dump_ms), in_tier=False, in_store=True,
            stored_bytes=int(info.stored_bytes), durable_ms=int(info.durable_unix_ms), meta=meta))


__all__ = ["CHUNK_BYTES", "ImageReceiver", "ImageStreamer", "Migrator"]
