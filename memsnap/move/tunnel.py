"""The page tunnel of a lazy move: CRIU's page-server protocol carried inside the peers' gRPC channel.

    source (SourceTunnel)                            target (TunnelHost)
    CRIU page server <-> socketpair <-> PageTunnel <-> socketpair <-> criu lazy-pages --ps-socket
    every message sealed (Seal: keyed blake3 over a per-direction sequence number and the bytes)
    silence while pages are due (stall_limit) ends the move on both sides
    the target's last message is its verdict: done{ok} once lazy-pages got every page

On the target, PageFlow checks the conversation: lazy-pages gets a byte (or the end of the stream) only when it
waits for one; anything else, a source that ends early, a broken seal or a stall, breaks the tunnel: the
restored (or restoring) tasks are killed first, then lazy-pages (memsnap.lazyguard), so no task reads a page
that is not its own and lazy-pages never meets the EOF that crashes it.

CRIU's page-server protocol has no checksums: a flipped bit, a lost, reordered or replayed message, or a
forged one fails its seal, ends the move, and the job runs on at the source.
"""

from __future__ import annotations

import hmac
import logging
import re
import shutil
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import blake3
import grpc

from memsnap import background, containers, failpoints, knobs, lifecycle, proc
from memsnap.auth import call_token, transfer_key
from memsnap.backoff import retrying
from memsnap.engine import Caller
from memsnap.errors import FailedPrecondition, IntegrityFailure, InvalidArgument, NotFound, PermissionDenied
from memsnap.lazyguard import LazyGuard
from memsnap.move.peer import PeerClient
from memsnap.move.plan import MoveHost
from memsnap.move.psflow import PageFlow
from memsnap.pageserver.wire import iov_layout
from memsnap.v1 import memsnap_pb2 as pb

log = logging.getLogger("memsnap.move")

_TUNNEL_ID = re.compile(r"^[0-9a-f]{32}$")
_CHUNK = 1 << 20
# How long the source waits for the target's verdict after CRIU returned, and the target for lazy-pages.
VERDICT_S = 30.0
VERDICT_RETRY_S = (1.0, 2.0)  # between the 3 tries at asking the target for a lost verdict
_KEEP_VERDICTS = 64


def stall_limit() -> float:
    """Seconds without a byte through a page tunnel, while pages are due, before a lazy move gives up.

    Pages flow all the time until the last one arrived (lazy-pages pushes the rest in the background), so
    silence means a hung peer or a black-holed link: the source resumes its frozen copy, and the target
    kills its half-restored one. MEMSNAP_TUNNEL_STALL_S overrides it (tests).
    """
    return knobs.tunnel_stall_s()


def watch_stall(name: str, last: Any, done: Any, give_up: Any) -> None:
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


class _QuickHandoff:
    """While a page tunnel is open, the interpreter hands the GIL over every 0.5 ms instead of every 5 ms.

    A fault crosses four relay threads (two per node); each waits for the GIL whenever another thread of
    the daemon (gRPC, a drain's bookkeeping) runs Python code, up to the switch interval each time. The
    default 5 ms interval put up to ~20 ms on a fault round trip on a busy node."""

    FAST_S = 0.0005

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._saved = 0.0

    def enter(self) -> None:
        with self._lock:
            if self._open == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, self.FAST_S))
            self._open += 1

    def leave(self) -> None:
        with self._lock:
            if self._open == 0:
                return
            self._open -= 1
            if self._open == 0:
                sys.setswitchinterval(self._saved)


quick_handoff = _QuickHandoff()


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


TO_TARGET, TO_SOURCE = "to-target", "to-source"

# -- source ---------------------------------------------------------------------------------------
class SourceTunnel:
    """The source end: CRIU's page server on one end of a socketpair, a PageTunnel call on the other."""

    def __init__(self, client: PeerClient, tunnel_id: str, ckpt_id: str, token: str) -> None:
        self.tunnel_id = tunnel_id
        self._out, self._in = Seal(token, tunnel_id, TO_TARGET), Seal(token, tunnel_id, TO_SOURCE)
        self.criu_end, self._end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.bytes_out = self.bytes_in = self.msgs_out = self.msgs_in = 0
        self.last_activity = time.monotonic()
        self.verdict: tuple[bool, str] | None = None  # (ok, error) from the target's last message
        self.error = ""
        self.done = threading.Event()
        self._closed = False
        quick_handoff.enter()
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
            shutdown(self._end)

    def abort(self, why: str) -> None:
        """Gives up on the peer: CRIU's page server sees the end of the stream, the call is cancelled."""
        log.warning("page tunnel %s: %s", self.tunnel_id[:8], why)
        self.error = why
        shutdown(self._end)
        self._call.cancel()

    def close(self) -> None:
        """Ends the call and both sockets (idempotent)."""
        shutdown(self._end)
        self._call.cancel()
        self._reader.join(10)
        for s in (self.criu_end, self._end):
            s.close()
        if not self._closed:
            self._closed = True
            quick_handoff.leave()


def shutdown(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def ask_verdict(client: PeerClient, tunnel_id: str, token: str) -> tuple[bool, str] | None:
    """Asks the target, on a fresh (freshly sealed) call, how the lazy transfer ended (its verdict got lost)."""
    def ask() -> tuple[bool, str] | None:
        query = Seal(token, tunnel_id, TO_TARGET).seal(pb.TunnelChunk(tunnel_id=tunnel_id, done=True))
        answer = Seal(token, tunnel_id, TO_SOURCE)
        for msg in client.page_tunnel(iter([query]), timeout=VERDICT_S + 10):
            answer.check(msg)
            if msg.done:
                return bool(msg.ok), msg.error
        return None

    def no_answer(_: int, exc: Exception) -> None:
        log.warning("cannot ask the target how the lazy transfer ended: %s", exc)

    try:
        return retrying(ask, grpc.RpcError, VERDICT_RETRY_S, on_retry=no_answer)
    except IntegrityFailure as exc:
        log.warning("the target's verdict on the lazy transfer: %s", exc)
    except grpc.RpcError as exc:
        no_answer(0, exc)
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
    flow: PageFlow  # checks the conversation, in the page-server layout of this node's CRIU (lazy-pages')
    restore_started: bool = False
    verdict: tuple[bool, str] | None = None
    last_activity: float = field(default_factory=time.monotonic)
    forwarded: int = 0
    broken: str = ""  # why the tunnel was cut on our side (a message failed its check)
    settled: threading.Event = field(default_factory=threading.Event)
    guard: LazyGuard = field(default_factory=lambda: LazyGuard("move"))


class TunnelHost:
    """The PageTunnel RPC and the lazy half of RestoreReceived, on the target."""

    def __init__(self, host: MoveHost) -> None:
        self.engine = host
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
        seal_in = Seal(token, first.tunnel_id, TO_TARGET)
        seal_out = Seal(token, first.tunnel_id, TO_SOURCE)
        seal_in.check(first)
        if first.done:
            return iter([seal_out.seal(self._verdict_for(first.tunnel_id))])
        ckpt_id = first.data.decode(errors="replace")
        flow = PageFlow(iov_layout(self.engine.criu.version()))
        with self._lock:
            if first.tunnel_id in self._tunnels or first.tunnel_id in self._verdicts:
                raise FailedPrecondition("that page tunnel exists already")
            criu_end, pump = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            t = self._tunnels[first.tunnel_id] = _Tunnel(first.tunnel_id, ckpt_id, criu_end, pump, seal_in,
                                                         seal_out, flow, guard=LazyGuard(ckpt_id))
        # Foreground work from now until the verdict (the source dumps next, then the job restores here and
        # pages in): drains on this node step aside (memsnap.background).
        background.gate().hold_while("lazy move", lambda: t.tunnel_id in self._tunnels and not t.settled.is_set())
        feeder = threading.Thread(target=self._feed, args=(t, it), name=f"tunnel-in-{t.tunnel_id[:8]}",
                                  daemon=True)
        feeder.start()
        return self._pump_out(t, feeder)

    def _pump_out(self, t: _Tunnel, feeder: threading.Thread) -> Iterator[pb.TunnelChunk]:
        quick_handoff.enter()
        try:
            while True:
                try:
                    data = t.pump.recv(_CHUNK)
                except OSError:
                    data = b""
                if not data:
                    break  # lazy-pages exited (or never started and the source went away)
                t.last_activity = time.monotonic()
                if bad := t.flow.sent(data, t.last_activity):
                    self._cut(t, bad)
                    break
                yield t.seal_out.seal(pb.TunnelChunk(data=data), data)
            if t.restore_started:
                t.settled.wait(VERDICT_S)
            ok, why = t.verdict or (False, "no lazy restore ran on the target")
            yield t.seal_out.seal(pb.TunnelChunk(done=True, ok=ok, error=why))
        finally:
            quick_handoff.leave()
            shutdown(t.pump)
            feeder.join(5)
            if timed := t.flow.summary():
                log.info("page tunnel %s fault latency: %s", t.tunnel_id[:8], timed, extra={"checkpoint_id": t.ckpt_id})
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
                    now = time.monotonic()
                    if bad := t.flow.received(data, now):  # (checked before a byte of it passes)
                        self._cut(t, bad)
                        return
                    t.pump.sendall(data)
                    t.forwarded += len(data)
                    t.last_activity = now
            if bad := t.flow.ended():  # the source's CRIU closed its end
                self._cut(t, bad)
            else:
                t.pump.shutdown(socket.SHUT_WR)  # (lazy-pages has its close answered: it ends by itself)
        except IntegrityFailure as exc:  # not one more byte reaches lazy-pages
            self._cut(t, str(exc))
        except grpc.RpcError as exc:
            code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
            self._cut(t, f"the source ended the page tunnel ({code}) before lazy-pages had every page")
        except (OSError, ValueError) as exc:
            self._cut(t, f"the page tunnel broke: {exc}")

    def _cut(self, t: _Tunnel, why: str) -> None:
        """Ends the lazy transfer: the tasks die first, then lazy-pages (never an EOF it does not expect). Once
        every page arrived (lazy-pages ended well), a late error of the tunnel's own threads ends nothing."""
        if t.settled.is_set() and ok_now(t):
            log.info("page tunnel %s: %s, after every page arrived: ignored", t.tunnel_id[:8], why,
                     extra={"checkpoint_id": t.ckpt_id})
            return
        t.broken = t.broken or why
        log.warning("page tunnel %s: %s; ending the lazy transfer", t.tunnel_id[:8], why,
                    extra={"checkpoint_id": t.ckpt_id})
        if t.restore_started:
            t.guard.fail(why)
        shutdown(t.pump)
        if not t.restore_started:
            shutdown(t.criu_end)  # nothing will ever read the other end: let serve() finish

    def _verdict_for(self, tunnel_id: str) -> pb.TunnelChunk:
        deadline = time.monotonic() + VERDICT_S
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

        watch_stall(f"stall-{t.ckpt_id}", lambda: t.last_activity, t.settled.is_set, lambda why: self._cut(t, why))

        def run() -> None:
            rc = server.wait()
            if rc == 0 and not t.broken:
                t.verdict = (True, "")
                log.info("lazy move complete: every page of %s arrived", job_id,
                         extra={"checkpoint_id": t.ckpt_id})
            else:
                # Killed before lazy-pages ended (LazyGuard), or by its supervisor shell; make sure, and say so.
                t.guard.fail(t.broken or f"lazy-pages failed (exit {rc})")
                proc.kill_tree(pid)
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
        shutdown(t.pump)
        self._forget_image(t.ckpt_id)

    def _forget_image(self, ckpt_id: str) -> None:
        rec = self.engine.catalog.get_checkpoint(ckpt_id)
        if rec is not None and rec.meta.get("pages_remote"):
            forget_lazy_image(self.engine, ckpt_id)


def ok_now(t: _Tunnel) -> bool:
    return t.verdict is not None and t.verdict[0]


def forget_lazy_image(host: MoveHost, ckpt_id: str) -> None:
    """Drops the small first half of a lazy move on the target (its memory never was here) and its work
    dirs (and a container's placeholder)."""
    containers.drop_journaled(host.catalog, ckpt_id)
    lifecycle.forget(host.catalog, ckpt_id)
    host.tier.remove(ckpt_id)
    if not knobs.keep_logs():
        for work in host.work_root.glob(f"{ckpt_id}.restore-*"):
            shutil.rmtree(work, ignore_errors=True)


__all__ = ["Seal", "SourceTunnel", "TunnelHost", "ask_verdict", "forget_lazy_image", "shutdown",
           "stall_limit", "watch_stall"]
