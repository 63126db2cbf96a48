"""Lazy (post-copy) moves: the job runs on the target before its memory has arrived.

    source                                         target
    preflight, then PageTunnel(tunnel, ckpt) ----> a socketpair waits for lazy-pages
    CRIU lazy dump, tree left stopped; its page
      server talks over a socketpair whose other
      end feeds the tunnel (no TCP port opens)
    post-dump: the small images (no pages)  -----> ReceiveImage: a "pages_remote" image
               RestoreReceived(lazy_tunnel) -----> supervised `criu lazy-pages --ps-socket`,
                                                   then a lazy restore: the job runs
    CRIU serves faults and pushes the rest  <----> through the tunnel
    CRIU returns once lazy-pages closed     <----- done{ok}: every page arrived
    ok: kill the stopped copy here                 drop the small image
    not ok: SIGCONT it here                        the supervisor killed the half-restored job

Until the target says every page arrived, the source keeps its frozen copy, so any failure (target
refuses or dies, the link drops, the source daemon dies) leaves the job running on the source. The
target's half-restored copy is killed by a supervisor shell around lazy-pages that outlives memsnapd:
once userfaultfd is gone, missing pages would read as zeros. What the job did on the target before a
failure (output, network traffic) is not undone: that is post-copy's price.

Page bytes travel inside the peers' authenticated gRPC channel (token or mutual TLS), like the images.
CRIU's page-server protocol has no checksums, so every tunnel message is sealed (see Seal): a keyed
blake3 tag over its sequence number and content. A flipped bit, a lost, reordered or replayed message,
or a forged one ends the move, and the job runs on at the source. The small images
and their signed manifest are checked as for any move.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3
import grpc

from memsnap import failpoints, jobs, manifest, net
from memsnap.catalog import DUMPING, CheckpointRecord, now_ms
from memsnap.client import ClientError, MemsnapClient
from memsnap.criu import pipe_size_problem
from memsnap.errors import (
    FailedPrecondition,
    IntegrityFailure,
    InvalidArgument,
    MemsnapError,
    NotFound,
    PermissionDenied,
)
from memsnap.remote import call_token, transfer_key
from memsnap.v1 import memsnap_pb2 as pb

if TYPE_CHECKING:
    from memsnap.engine import Caller, Engine
    from memsnap.migrate import Migrator, _Move, _Phases

log = logging.getLogger("memsnap.lazymove")

_TUNNEL_ID = re.compile(r"^[0-9a-f]{32}$")
_CHUNK = 1 << 20
# How long the source waits for the target's verdict after CRIU returned, and the target for lazy-pages.
_VERDICT_S = 30.0
_KEEP_VERDICTS = 64


def stall_limit() -> float:
    """Seconds without a byte through a page tunnel, while pages are due, before a lazy move gives up.

    Pages flow all the time until the last one arrived (lazy-pages pushes the rest in the background), so
    silence means a hung peer or a black-holed link: the source resumes its frozen copy, and the target
    kills its half-restored one. MEMSNAP_TUNNEL_STALL_S overrides it (tests).
    """
    try:
        return float(os.environ.get("MEMSNAP_TUNNEL_STALL_S", "30"))
    except ValueError:
        return 30.0


def _watch_stall(name: str, last: Any, done: Any, give_up: Any) -> None:
    """Calls give_up(why) once last() is older than stall_limit() and done() is still false."""

    def run() -> None:
        limit = stall_limit()
        while not done():
            idle = time.monotonic() - last()
            if idle > limit:
                give_up(f"no page traffic for {idle:.0f} s (the peer or the link hangs)")
                return
            time.sleep(min(1.0, limit / 4))

    threading.Thread(target=run, name=name, daemon=True).start()


class Seal:
    """Seals (source) or checks (target) one direction of a page tunnel, message by message, in order.

    The key comes from the tunnel id and the transfer key of the move's credential, the one that signs the
    manifest (so only the peer holding that credential can forge a message). The tag covers a
    per-direction sequence number, so a message lost, reordered or replayed fails the check as surely as
    a flipped bit.
    """

    def __init__(self, token: str, tunnel_id: str, direction: str) -> None:
        material = (transfer_key(token) if token else b"") + bytes.fromhex(tunnel_id)
        self._key = blake3.blake3(material, derive_key_context=f"memsnap page tunnel v1 {direction}").digest()
        self._seq = 0

    def _next_tag(self, msg: pb.TunnelChunk, data: bytes) -> bytes:
        err = msg.error.encode()
        h = blake3.blake3(struct.pack("<QBBI", self._seq, msg.done, msg.ok, len(err)) + err, key=self._key)
        h.update(data)
        self._seq += 1
        return bytes(h.digest(length=16))

    def seal(self, msg: pb.TunnelChunk, data: bytes | None = None) -> pb.TunnelChunk:
        """Tags msg; pass data when the caller holds msg.data already (each read of it copies)."""
        msg.tag = self._next_tag(msg, msg.data if data is None else data)
        return msg

    def check(self, msg: pb.TunnelChunk) -> bytes:
        """msg.data, if the message's tag is right; IntegrityFailure otherwise."""
        seq, data = self._seq, msg.data
        if not hmac.compare_digest(self._next_tag(msg, data), msg.tag):
            raise IntegrityFailure(f"integrity check failed: page tunnel message {seq} ({len(data)} bytes) "
                                   "does not match its tag (corrupted, lost or forged on the way; is the node "
                                   "token the same on both nodes?)")
        return data


_TO_TARGET, _TO_SOURCE = "to-target", "to-source"


class _Error(MemsnapError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# -- source ---------------------------------------------------------------------------------------
class SourceTunnel:
    """The source end: CRIU's page server on one end of a socketpair, a PageTunnel call on the other."""

    def __init__(self, client: MemsnapClient, tunnel_id: str, ckpt_id: str, token: str) -> None:
        self.tunnel_id = tunnel_id
        self._out, self._in = Seal(token, tunnel_id, _TO_TARGET), Seal(token, tunnel_id, _TO_SOURCE)
        self.criu_end, self._end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.bytes_out = self.bytes_in = self.msgs_out = self.msgs_in = 0
        self.last_activity = time.monotonic()
        self.verdict: tuple[bool, str] | None = None  # (ok, error) from the target's last message
        self.error = ""
        self.done = threading.Event()
        self._call = client.page_tunnel(self._requests(ckpt_id))
        self._reader = threading.Thread(target=self._read, name=f"tunnel-{tunnel_id[:8]}", daemon=True)
        self._reader.start()

    def _requests(self, ckpt_id: str) -> Iterator[pb.TunnelChunk]:
        yield self._out.seal(pb.TunnelChunk(tunnel_id=self.tunnel_id, data=ckpt_id.encode()))
        while True:
            try:
                data = self._end.recv(_CHUNK)
            except OSError:
                return
            if not data:
                return  # CRIU closed its end: half-close the call
            self.bytes_out += len(data)
            self.msgs_out += 1
            self.last_activity = time.monotonic()
            msg = self._out.seal(pb.TunnelChunk(data=data), data)
            if self.bytes_out > 8 << 20 and failpoints.armed("corrupt-tunnel"):
                msg.data = bytes([msg.data[0] ^ 1]) + msg.data[1:]  # a bit flips on the way
            yield msg

    def _read(self) -> None:
        try:
            for msg in self._call:
                data = self._in.check(msg)
                if msg.done:
                    self.verdict = (bool(msg.ok), msg.error)
                    break
                if data:
                    self._end.sendall(data)
                    self.bytes_in += len(data)
                    self.msgs_in += 1
                    self.last_activity = time.monotonic()
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            self.error = f"{code.name}: {exc.details() if hasattr(exc, 'details') else exc}"
        except OSError as exc:
            self.error = f"the page server's socket failed: {exc}"
        except IntegrityFailure as exc:
            self.error = str(exc)
            log.warning("page tunnel %s: %s", self.tunnel_id[:8], exc)
            self._call.cancel()
        finally:
            if self.verdict is None and not self.error:
                self.error = "the target ended the page tunnel without a verdict"
            self.done.set()
            # The target is gone or done: CRIU's page server must see the end of the stream.
            _shutdown(self._end)

    def abort(self, why: str) -> None:
        """Gives up on the peer: CRIU's page server sees the end of the stream, the call is cancelled."""
        log.warning("page tunnel %s: %s", self.tunnel_id[:8], why)
        self.error = why
        _shutdown(self._end)
        self._call.cancel()

    def close(self) -> None:
        """Ends the call and both sockets (idempotent)."""
        _shutdown(self._end)
        self._call.cancel()
        self._reader.join(10)
        for s in (self.criu_end, self._end):
            s.close()


def _shutdown(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


@dataclass
class _SourceState:
    """What the post-dump callback learned, for the code after CRIU returned."""

    t_freeze: float = 0.0
    t_post_dump: float = 0.0
    t_images: float = 0.0
    t_resumed: float = 0.0
    image_bytes: int = 0
    failed_step: str = ""
    failure: str = ""
    failure_code: str = "UNAVAILABLE"
    restored: pb.RestoreResponse | None = None
    restore_done: threading.Event = field(default_factory=threading.Event)


def move_lazily(mig: Migrator, caller: Caller, req: pb.MigrateRequest, client: MemsnapClient, token: str,
                move: _Move, phases: _Phases) -> pb.MigrateResponse:
    """The source side of `migrate --lazy` (preflight already done)."""
    from memsnap.migrate import ImageStreamer, _StreamBroken

    engine = mig.engine
    pid = move.pid
    job = engine.catalog.get_job(move.job_id) if move.job_id else None
    owner = jobs.owner_uid(pid)
    ckpt_id = "ck-" + time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
    tunnel_id = secrets.token_hex(16)
    state = _SourceState()
    argv, own_ns = jobs.cmdline(pid), jobs.in_own_pidns(pid)
    rec = CheckpointRecord(id=ckpt_id, state=DUMPING, pid=pid, owner_uid=owner, created_ms=now_ms(),
                           job=job.id if job else "", name=job.name if job else "", meta={"lazy_move": req.to})
    move.ckpt_id = ckpt_id

    def restore_there() -> None:
        rreq = pb.RestoreReceivedRequest(checkpoint_id=ckpt_id, lazy=True, lazy_tunnel=tunnel_id,
                                         add_ip=str(move.moved_ip) if move.moved_ip else "",
                                         add_ip_dev=req.move_ip_dev_target)
        try:
            state.restored = client.restore_received(rreq, timeout=600)
            state.t_resumed = time.monotonic()
            log.info("%s resumed on %s as pid %d; its pages follow from here", move.job_id or move.pid, req.to,
                     state.restored.pid, extra={"checkpoint_id": ckpt_id})
            failpoints.hit("lazy-pages-flowing")
        except ClientError as exc:
            state.failed_step, state.failure_code = "restore on the target", exc.code.name
            state.failure = f"{exc.code.name}: {exc.message}"
        finally:
            state.restore_done.set()

    def post_dump(staging: Path, stats_ms: float) -> None:
        if move.moved_ip is not None:
            move.ip_removed_from = net.remove_address(move.moved_ip, req.move_ip_dev_source)
        files = manifest.describe_files(staging)
        body = engine.manifest_body(rec, argv, own_ns, job, files, dump_ms=stats_ms, pages_remote=True)
        state.image_bytes = sum(int(f["size"]) for f in files.values())
        streamer = ImageStreamer(client, state.image_bytes, pipelined=False)
        streamer.start(staging)
        streamer.file_table()
        wire = manifest.sign(body, transfer_key(token)) if token else body
        try:
            streamer.finish(json.dumps(wire, sort_keys=True).encode(), timeout=120)
        except _StreamBroken:
            streamer.abort()
            raise
        state.t_images = time.monotonic()
        # Not awaited: the restore faults on pages that CRIU serves only once this callback returned.
        threading.Thread(target=restore_there, name=f"lazy-restore-{ckpt_id}", daemon=True).start()
        tunnel.last_activity = time.monotonic()
        _watch_stall(f"stall-{ckpt_id}", lambda: tunnel.last_activity,
                     lambda: criu_done.is_set() or tunnel.done.is_set(), tunnel.abort)

    tunnel = SourceTunnel(client, tunnel_id, ckpt_id, token)
    criu_done = threading.Event()
    t_dump = time.monotonic()

    def notify(script: str, staging: Path) -> bool:
        if script == "pre-dump":
            state.t_freeze = time.monotonic()
        elif script == "post-dump":
            state.t_post_dump = time.monotonic()
            try:
                post_dump(staging, (state.t_post_dump - t_dump) * 1000)
            except Exception as exc:
                code = getattr(exc, "code", "UNAVAILABLE")
                state.failed_step, state.failure = "transfer", str(exc)
                state.failure_code = code if isinstance(code, str) else "UNAVAILABLE"
                _shutdown(tunnel.criu_end)  # CRIU's page server starts anyway; let it end at once
                return False  # CRIU resumes the tree
        return True

    try:
        dump_error = engine.lazy_dump(rec, tunnel.criu_end.fileno(), notify)
    except MemsnapError as exc:  # busy, or no room for even the small images: the job was not touched
        tunnel.close()
        raise _Error(exc.code, f"migration failed at dump: {exc}; the job runs on here") from exc
    finally:
        criu_done.set()
        tunnel.criu_end.close()
    t_criu_done = time.monotonic()
    state.restore_done.wait(_VERDICT_S if state.t_images else 0)
    tunnel.done.wait(_VERDICT_S)
    verdict = tunnel.verdict or _ask_verdict(client, tunnel_id, token)
    tunnel.close()

    def give_back(step: str, why: str, code: str) -> None:
        engine.end_lazy_dump(ckpt_id, error=f"{step}: {why}")  # (keeps CRIU's logs)
        mig._rollback(move, step, why, code)

    if dump_error is not None:
        if state.failed_step:
            # Our post-dump callback refused: CRIU let the tree run on by itself.
            mig._restore_network(move)
            engine.resume_held(pid, ckpt_id)
            engine.end_lazy_dump(ckpt_id, error=state.failure)
            raise _Error(state.failure_code, f"migration failed at {state.failed_step}: {state.failure}; "
                         "the job was resumed on this node")
        if not state.t_post_dump:
            mig._restore_network(move)
            engine.end_lazy_dump(ckpt_id, error=dump_error.reason)
            raise FailedPrecondition(f"migration failed at dump: {dump_error.reason} (log: "
                                     f"{dump_error.log_path}); the job was not moved and runs on here")
        give_back("pages", f"CRIU's page server failed: {dump_error.reason} (log: {dump_error.log_path})",
                  "UNAVAILABLE")
    if state.failed_step:
        give_back(state.failed_step, state.failure, state.failure_code)
    if verdict is None or not verdict[0]:
        why = verdict[1] if verdict else (tunnel.error or "the target gave no verdict")
        give_back("pages", f"not every page reached the target ({why})", "UNAVAILABLE")
    assert state.restored is not None
    phases.mark("dump", state.t_post_dump)
    phases.mark("transfer", state.t_images)
    phases.mark("restore", state.t_resumed)
    phases.mark("pages", t_criu_done)
    target_pid, target_job = int(state.restored.pid), state.restored.job.id
    found = mig._target_job(client, ckpt_id)
    if found is None or found.id != target_job:
        give_back("confirm", f"the restored job {target_job} is not running on the target", "FAILED_PRECONDITION")
    try:
        mig._commit_on(client, move, ckpt_id, req.to)
    except MemsnapError:
        engine.end_lazy_dump(ckpt_id, error="the target could not be told to keep it")
        raise
    phases.mark("confirm")
    # The target has every page, runs the job and keeps it: journal that, then let the frozen copy go.
    engine.mark_moved(ckpt_id, req.to, target_job)
    engine.end_held(pid, move.job_id, ckpt_id)
    engine.end_lazy_dump(ckpt_id)
    phases.mark("cleanup")
    resume_ms = (state.t_resumed - (state.t_freeze or t_dump)) * 1000
    sent = state.image_bytes + tunnel.bytes_out
    log.info("moved %s lazily to %s as pid %d: resumed after %.0f ms, all %d bytes after %.0f ms (page tunnel: "
             "%d messages out, %d in carrying %d bytes)", move.job_id or pid, req.to, target_pid, resume_ms, sent,
             (t_criu_done - (state.t_freeze or t_dump)) * 1000, tunnel.msgs_out, tunnel.msgs_in, tunnel.bytes_in,
             extra={"checkpoint_id": ckpt_id})
    return pb.MigrateResponse(target_pid=target_pid, checkpoint_id=ckpt_id, phases=phases.pb(),
                              downtime_ms=int(resume_ms), bytes_sent=sent, target_job=target_job)


def _ask_verdict(client: MemsnapClient, tunnel_id: str, token: str) -> tuple[bool, str] | None:
    """Asks the target, on a fresh (freshly sealed) call, how the lazy transfer ended (its verdict got lost)."""
    for attempt in range(3):
        query = Seal(token, tunnel_id, _TO_TARGET).seal(pb.TunnelChunk(tunnel_id=tunnel_id, done=True))
        answer = Seal(token, tunnel_id, _TO_SOURCE)
        try:
            for msg in client.page_tunnel(iter([query]), timeout=_VERDICT_S + 10):
                answer.check(msg)
                if msg.done:
                    return bool(msg.ok), msg.error
            return None
        except IntegrityFailure as exc:
            log.warning("the target's verdict on the lazy transfer: %s", exc)
            return None
        except grpc.RpcError as exc:
            log.warning("cannot ask the target how the lazy transfer ended: %s", exc)
            time.sleep(1.0 + attempt)
    return None


# -- target ---------------------------------------------------------------------------------------
@dataclass
class _Tunnel:
    """The target end of one lazy move."""

    tunnel_id: str
    ckpt_id: str
    criu_end: socket.socket
    pump: socket.socket
    seal_in: Seal  # checks what the source sends
    seal_out: Seal  # seals what goes back
    restore_started: bool = False
    verdict: tuple[bool, str] | None = None
    last_activity: float = field(default_factory=time.monotonic)
    forwarded: int = 0
    broken: str = ""  # why the tunnel was cut on our side (a message failed its check)
    settled: threading.Event = field(default_factory=threading.Event)


class TunnelHost:
    """The PageTunnel RPC and the lazy half of RestoreReceived, on the target."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._tunnels: dict[str, _Tunnel] = {}
        self._verdicts: dict[str, tuple[bool, str]] = {}

    def serve(self, caller: Caller, chunks: Iterator[pb.TunnelChunk],
              context: grpc.ServicerContext) -> Iterator[pb.TunnelChunk]:
        """Bridges the call and a socket that the lazy-pages daemon will get (or answers a verdict query)."""
        if not caller.is_root:
            raise PermissionDenied("only a peer daemon (authenticated over TCP) or root may open page tunnels")
        it = iter(chunks)
        try:
            first = next(it)
        except StopIteration:
            raise InvalidArgument("empty page tunnel") from None
        if not _TUNNEL_ID.match(first.tunnel_id):
            raise InvalidArgument("bad tunnel id")
        # Keyed by the credential this call authenticated with: the one the source sealed with.
        token = call_token()
        if not token:
            raise FailedPrecondition("page tunnels are opened only by a peer that authenticated with a token "
                                     "over TCP (daemon.auth_token_file or peers.token_file on both nodes)")
        seal_in = Seal(token, first.tunnel_id, _TO_TARGET)
        seal_out = Seal(token, first.tunnel_id, _TO_SOURCE)
        seal_in.check(first)
        if first.done:
            return iter([seal_out.seal(self._verdict_for(first.tunnel_id))])
        ckpt_id = first.data.decode(errors="replace")
        with self._lock:
            if first.tunnel_id in self._tunnels or first.tunnel_id in self._verdicts:
                raise FailedPrecondition("that page tunnel exists already")
            criu_end, pump = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            t = self._tunnels[first.tunnel_id] = _Tunnel(first.tunnel_id, ckpt_id, criu_end, pump, seal_in,
                                                         seal_out)
        feeder = threading.Thread(target=self._feed, args=(t, it), name=f"tunnel-in-{t.tunnel_id[:8]}",
                                  daemon=True)
        feeder.start()
        return self._pump_out(t, feeder)

    def _pump_out(self, t: _Tunnel, feeder: threading.Thread) -> Iterator[pb.TunnelChunk]:
        try:
            while True:
                try:
                    data = t.pump.recv(_CHUNK)
                except OSError:
                    data = b""
                if not data:
                    break  # lazy-pages exited (or never started and the source went away)
                t.last_activity = time.monotonic()
                yield t.seal_out.seal(pb.TunnelChunk(data=data), data)
            if t.restore_started:
                t.settled.wait(_VERDICT_S)
            ok, why = t.verdict or (False, "no lazy restore ran on the target")
            yield t.seal_out.seal(pb.TunnelChunk(done=True, ok=ok, error=why))
        finally:
            _shutdown(t.pump)
            feeder.join(5)
            with self._lock:
                self._tunnels.pop(t.tunnel_id, None)
                self._verdicts[t.tunnel_id] = t.verdict or (False, "the page tunnel ended early")
                while len(self._verdicts) > _KEEP_VERDICTS:
                    self._verdicts.pop(next(iter(self._verdicts)))
            t.pump.close()
            if not t.restore_started:
                t.criu_end.close()
                self._forget_image(t.ckpt_id)

    def _feed(self, t: _Tunnel, it: Iterator[pb.TunnelChunk]) -> None:
        try:
            for msg in it:
                data = t.seal_in.check(msg)
                if data:
                    failpoints.delay("slow-tunnel")
                    if t.forwarded > 8 << 20 and failpoints.armed("stall-tunnel"):
                        continue  # a black hole, once the job runs here and pages flow
                    t.pump.sendall(data)
                    t.forwarded += len(data)
                    t.last_activity = time.monotonic()
            t.pump.shutdown(socket.SHUT_WR)  # the source's CRIU closed its end
        except IntegrityFailure as exc:
            # Not one more byte reaches lazy-pages: it fails, and its supervisor kills the half-restored job.
            t.broken = str(exc)
            log.warning("page tunnel %s: %s; ending the lazy transfer", t.tunnel_id[:8], exc,
                        extra={"checkpoint_id": t.ckpt_id})
            _shutdown(t.pump)
        except (grpc.RpcError, OSError, ValueError):
            _shutdown(t.pump)
        if not t.restore_started:
            # Nothing will ever read the other end: let serve() finish.
            _shutdown(t.criu_end)

    def _verdict_for(self, tunnel_id: str) -> pb.TunnelChunk:
        deadline = time.monotonic() + _VERDICT_S
        while time.monotonic() < deadline:
            with self._lock:
                v = self._verdicts.get(tunnel_id)
                live = self._tunnels.get(tunnel_id)
            if v is not None:
                return pb.TunnelChunk(done=True, ok=v[0], error=v[1])
            if live is None:
                break
            time.sleep(0.1)
        return pb.TunnelChunk(done=True, ok=False, error="this node knows no such lazy transfer")

    def claim(self, tunnel_id: str, ckpt_id: str) -> _Tunnel:
        """The tunnel a lazy RestoreReceived names; it must carry that checkpoint."""
        with self._lock:
            t = self._tunnels.get(tunnel_id)
            if t is None:
                raise NotFound("no such page tunnel; the source must open it before the lazy restore")
            if t.ckpt_id != ckpt_id or t.restore_started:
                raise InvalidArgument("that page tunnel belongs to another lazy move")
            t.restore_started = True
        return t

    def watch(self, t: _Tunnel, server: Any, pid: int, job_id: str) -> None:
        """Waits for lazy-pages in the background; records the verdict and cleans up."""
        t.last_activity = time.monotonic()

        def give_up(why: str) -> None:
            log.warning("page tunnel %s: %s; ending the lazy transfer", t.tunnel_id[:8], why,
                        extra={"checkpoint_id": t.ckpt_id})
            _shutdown(t.pump)  # lazy-pages fails, and its supervisor kills the half-restored job

        _watch_stall(f"stall-{t.ckpt_id}", lambda: t.last_activity, t.settled.is_set, give_up)

        def run() -> None:
            rc = server.wait()
            if rc == 0 and not t.broken:
                t.verdict = (True, "")
                log.info("lazy move complete: every page of %s arrived", job_id,
                         extra={"checkpoint_id": t.ckpt_id})
            else:
                # The supervisor shell killed the job already; make sure, and say so.
                jobs.kill_tree(pid)
                self.engine.catalog.update_job(job_id, ended=True)
                cause = t.broken or f"lazy-pages failed on the target (exit {rc})"
                t.verdict = (False, f"{cause}; the half-restored job there was killed")
                log.warning("lazy move of %s failed: lazy-pages exit %d", job_id, rc,
                            extra={"checkpoint_id": t.ckpt_id})
            self.engine.reap_lazy()
            if not ok_now(t):
                self._forget_image(t.ckpt_id)  # (on success the commit drops it: it journals the move)
            t.settled.set()

        threading.Thread(target=run, name=f"lazy-watch-{t.ckpt_id}", daemon=True).start()

    def busy(self, ckpt_id: str) -> bool:
        """Whether a lazy transfer into the job restored from ckpt_id is still going on."""
        with self._lock:
            return any(t.ckpt_id == ckpt_id and not t.settled.is_set() for t in self._tunnels.values())

    def committed(self, ckpt_id: str) -> None:
        """The source committed a lazy move whose pages all arrived: the small image has served its turn."""
        self._forget_image(ckpt_id)

    def failed(self, t: _Tunnel, why: str) -> None:
        """The lazy restore never got going."""
        t.verdict = (False, why)
        t.settled.set()
        _shutdown(t.pump)
        self._forget_image(t.ckpt_id)

    def _forget_image(self, ckpt_id: str) -> None:
        rec = self.engine.catalog.get_checkpoint(ckpt_id)
        if rec is not None and rec.meta.get("pages_remote"):
            self.engine.forget_lazy_image(ckpt_id)


def ok_now(t: _Tunnel) -> bool:
    return t.verdict is not None and t.verdict[0]


def lazy_preflight(req: pb.MigrateRequest) -> None:
    """What a lazy move cannot do, refused before the job is touched."""
    if req.via_store:
        raise InvalidArgument("--lazy and --via-store exclude each other: a lazy move serves the memory from "
                              "this node, not from the store")
    if req.tcp_established:
        raise InvalidArgument("--lazy cannot keep TCP connections (--tcp-established): a failed lazy move "
                              "could not give them back here; move without --lazy")
    problem = pipe_size_problem()
    if problem:
        raise FailedPrecondition(f"migration failed at preflight: {problem}; the job was not touched")


__all__ = ["SourceTunnel", "TunnelHost", "lazy_preflight", "move_lazily"]
