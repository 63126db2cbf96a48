"""An in-process peer transport for move tests: httpx's MockTransport, for the daemons' gRPC.

    source Mover --dial--> PeerClient -> MemsnapClient (both real) -> InProcessChannel
        request: the stub's SerializeToString -> bytes -> faults (fail the Nth call, cut a stream)
        -> the target's interceptors (auth.AuthInterceptor: the bearer credential, the peer role; rpc_decode)
        -> MemsnapServicer / PeerServicer (real) on the target's Engine and Mover, on a thread of their own
        reply: the handler's serializer -> bytes -> the stub's FromString; an abort -> grpc.RpcError(code)

No socket and no gRPC server: only the channel is fake, so what the source catches is what PeerClient
makes of a grpc.RpcError (ClientError), or what ImageStreamer makes of a failed future (StreamBroken).
A call whose handler returned is answered; a call the client cancelled, that ran past its deadline or
whose stream a fault cut ends with CANCELLED, DEADLINE_EXCEEDED or UNAVAILABLE, and the target's
handler then reads an error from its request stream, as with a real server.

Not modelled: message size limits, compression, TLS identities (the caller is always a TCP peer with a
bearer token), and flow control beyond a window of 8 messages per client stream.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from memsnap.api import MemsnapServicer, PeerServicer
from memsnap.auth import interceptors
from memsnap.client import MemsnapClient, Target
from memsnap.config import Config, DaemonConfig, PeerConfig
from memsnap.engine import Engine
from memsnap.move.facade import Mover
from memsnap.move.peer import PeerClient
from memsnap.rpc_decode import DecodeInterceptor
from memsnap.v1 import memsnap_pb2_grpc, peer_pb2_grpc

PORT = 7070
_END = object()  # the end of a message stream
_POLL_S = 0.02


class Timers:
    """A fake timer (MoveTarget's): records (seconds, fn); they run only when the test says time passed."""

    def __init__(self) -> None:
        self.armed: list[tuple[float, Callable[[], None]]] = []

    def __call__(self, seconds: float, fn: Callable[[], None]) -> None:
        self.armed.append((seconds, fn))

    def run_out(self) -> None:
        """Every armed timer runs out (and those they arm meanwhile stay armed)."""
        armed, self.armed = self.armed, []
        for _, fn in armed:
            fn()


@dataclass
class Fault:
    """Calls nth .. nth+times-1 of a method (counted from when the fault was armed) fail with code; with
    lose_reply the target handles the call first and only its reply is lost; with cut_after a client
    stream breaks (UNAVAILABLE) once that many messages reached the target."""

    method: str  # the RPC's name: "ReceiveImage", "CommitMove", "ListJobs", ...
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    nth: int = 1
    times: int = 1
    lose_reply: bool = False
    cut_after: int = -1
    seen: int = 0

    def applies(self) -> bool:
        """Counts one call of the method; whether this one is faulted."""
        self.seen += 1
        return self.nth <= self.seen < self.nth + self.times


class _Handlers:
    """Where add_*Servicer_to_server registers a service's handlers (the part of grpc.Server it uses)."""

    def __init__(self) -> None:
        self.generic: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        pass  # (the same handlers, also given to add_generic_rpc_handlers)

    def lookup(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        for h in self.generic:
            found = h.service(details)
            if found is not None:
                return found
        return None


@dataclass
class _Details:
    """grpc.HandlerCallDetails."""

    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


class Node:
    """A daemon: its Engine, its Mover (it sends moves through the net too) and the servicers of both its
    services, behind memsnapd's own interceptors. Its MoveTarget's timers are fake (self.timers)."""

    def __init__(self, net: PeerNet, name: str, engine: Engine, cfg: Config) -> None:
        self.name, self.address, self.engine, self.cfg = name, f"{name}:{PORT}", engine, cfg
        self.mover = Mover(engine, cfg, dial=net.dial)
        self.timers = Timers()
        self.mover.target._timer = self.timers  # (Mover builds its MoveTarget with real timers)
        self.handlers = _Handlers()
        user = MemsnapServicer(engine, lambda: {"moves_in_doubt": self.mover.moves_in_doubt()}, migrator=self.mover)
        memsnap_pb2_grpc.add_MemsnapServicer_to_server(user, self.handlers)  # type: ignore[no-untyped-call]
        peer_pb2_grpc.add_PeerServicer_to_server(PeerServicer(self.mover), self.handlers)  # type: ignore[no-untyped-call]
        self.interceptors: list[Any] = [*interceptors(cfg), DecodeInterceptor()]  # (as memsnapd installs them)

    def handler(self, details: _Details) -> grpc.RpcMethodHandler | None:
        """The method's handler through the interceptors, outermost first (None: no such method)."""
        def through(i: int) -> Callable[[Any], Any]:
            if i == len(self.interceptors):
                return self.handlers.lookup
            return lambda d: self.interceptors[i].intercept_service(through(i + 1), d)
        return through(0)(details)


class PeerNet:
    """Nodes that know each other as [[peers]] (one node token, per-peer credentials derived from it), their
    calls (method names, in order) and the faults armed on them. dial is a Mover's seam (peer.Dial)."""

    def __init__(self, tmp: Path, names: Sequence[str]) -> None:
        self.names = list(names)
        self.token_file = tmp / "node.token"
        self.token_file.write_text("n" * 32 + "\n")
        self.token_file.chmod(0o600)
        self.nodes: dict[str, Node] = {}
        self.calls: list[str] = []
        self.faults: list[Fault] = []
        self._served: list[threading.Thread] = []
        self._lock = threading.Lock()

    def add(self, name: str, engine: Engine, **daemon: Any) -> Node:
        """A node (a daemon named name, at name:7070) over engine; daemon: its [daemon] settings."""
        cfg = Config(daemon=DaemonConfig(node_name=name, auth_token_file=str(self.token_file), **daemon),
                     peers=tuple(PeerConfig(name=n, address=f"{n}:{PORT}") for n in self.names if n != name))
        node = self.nodes[f"{name}:{PORT}"] = Node(self, name, engine, cfg)
        return node

    def dial(self, target: Target) -> PeerClient:
        """A real PeerClient whose channel reaches the node at target.address in-process."""
        return PeerClient(_InProcessClient(target, InProcessChannel(self, target.address)))

    def fail(self, method: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE, nth: int = 1, times: int = 1,
             lose_reply: bool = False) -> Fault:
        """Arms a Fault: the nth call of method from now (and times-1 more) fails with code."""
        fault = Fault(method, code, nth, times, lose_reply)
        self.faults.append(fault)
        return fault

    def cut(self, method: str, after: int, nth: int = 1) -> Fault:
        """Arms a Fault: the nth call of a client-streaming method from now breaks after `after` messages."""
        fault = Fault(method, grpc.StatusCode.UNAVAILABLE, nth, 1, cut_after=after)
        self.faults.append(fault)
        return fault

    def settle(self, timeout: float = 10.0) -> None:
        """Waits for every handler started on a target to return (a cut or cancelled call's too)."""
        deadline = time.monotonic() + timeout
        for t in list(self._served):
            t.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for t in self._served if t.is_alive()]
        assert not left, f"handlers still running on a target after {timeout} s: {left}"

    def _start(self, method: str) -> Fault | None:
        short = method.rsplit("/", 1)[-1]
        with self._lock:
            self.calls.append(short)
            hits = [f for f in self.faults if f.method == short and f.applies()]  # (each fault counts the call)
            return hits[0] if hits else None

    def _serve(self, call: _Call) -> None:
        t = threading.Thread(target=call.serve, name=f"serve-{call.method.rsplit('/', 1)[-1]}", daemon=True)
        with self._lock:
            self._served.append(t)
        t.start()


class _InProcessClient(MemsnapClient):
    """A MemsnapClient over a channel it is given (MemsnapClient.__init__ opens one of its own)."""

    def __init__(self, target: Target, channel: grpc.Channel) -> None:  # (no super().__init__: no real channel)
        self.target = target
        self.channel = channel
        self.stub = memsnap_pb2_grpc.MemsnapStub(channel)  # type: ignore[no-untyped-call]
        self._md = [("authorization", f"Bearer {target.token}")] if target.token else []


class _ServerContext(grpc.ServicerContext):  # type: ignore[misc]
    """The target handler's view of one call."""

    def __init__(self, call: _Call, metadata: tuple[tuple[str, str], ...]) -> None:
        self._call = call
        self._metadata = metadata
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.aborted = False

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return "ipv4:10.0.0.1:50000"  # (over TCP, as peers call; which node does not matter here)

    def peer_identities(self) -> None:
        return None

    def peer_identity_key(self) -> None:
        return None

    def auth_context(self) -> dict[str, Any]:
        return {}

    def abort(self, code: grpc.StatusCode, details: str) -> Any:
        self._code = code if code != grpc.StatusCode.OK else grpc.StatusCode.UNKNOWN
        self._details, self.aborted = details, True
        raise _Aborted(details)

    def abort_with_status(self, status: Any) -> Any:
        self.abort(status.code, status.details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def is_active(self) -> bool:
        return not self._call.finished.is_set()

    def time_remaining(self) -> float | None:
        return None if self._call.deadline is None else max(0.0, self._call.deadline - time.monotonic())

    def cancel(self) -> None:
        self._call.end(grpc.StatusCode.CANCELLED, "cancelled by the server")

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self._call.callbacks.append(callback)
        return True

    def send_initial_metadata(self, initial_metadata: Any) -> None:
        pass

    def set_trailing_metadata(self, trailing_metadata: Any) -> None:
        pass


class _Aborted(Exception):
    """context.abort() ends the handler (gRPC raises a bare Exception there)."""


class _StreamEnded(grpc.RpcError):  # type: ignore[misc]
    """What the target's request iterator raises once the call ended (cancelled, cut, past its deadline)."""


def _same(x: Any) -> Any:
    return x


class _Call(grpc.RpcError, grpc.Future, grpc.Call):  # type: ignore[misc]
    """One call, both ends: the client's future, response iterator and error (as grpc's own call object is);
    the target's run of the handler (serve, on a thread of the net's)."""

    def __init__(self, channel: InProcessChannel, method: str, serialize: Callable[[Any], bytes],
                 deserialize: Callable[[bytes], Any], streaming: tuple[bool, bool], timeout: float | None,
                 metadata: Sequence[tuple[str, str]] | None) -> None:
        super().__init__()
        self.net, self.address, self.method = channel.net, channel.address, method
        self._serialize, self._deserialize = serialize, deserialize
        self.request_streaming, self.response_streaming = streaming
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.ctx = _ServerContext(self, tuple((str(k), str(v)) for k, v in metadata or ()))
        self.finished = threading.Event()
        self.callbacks: list[Callable[[], None]] = []  # the server's (context.add_callback)
        self._done_callbacks: list[Callable[[Any], None]] = []
        self._code = grpc.StatusCode.OK
        self._details = ""
        self._reply: Any = None
        self._cancelled = False
        self._lock = threading.Lock()
        self._requests: queue.Queue[Any] = queue.Queue(maxsize=8)  # (a flow-control window: the client waits)
        self._responses: queue.Queue[Any] = queue.Queue()
        self._unary: Any = None
        self._handler: grpc.RpcMethodHandler | None = None
        self._cut = -1
        self._lost: Fault | None = None
        self._timer: threading.Timer | None = None

    # -- starting ------------------------------------------------------------------------------------
    def begin(self, request: Any) -> _Call:
        """Sends the call: it fails at once (no node, an injected fault, no such method) or a handler runs."""
        fault = self.net._start(self.method)
        node = self.net.nodes.get(self.address)
        if node is None:
            self.end(grpc.StatusCode.UNAVAILABLE, f"failed to connect to all addresses (no node at {self.address})")
            return self
        if fault is not None and not fault.lose_reply and fault.cut_after < 0:
            self.end(fault.code, f"injected by the test: call {fault.seen} of {fault.method} failed")
            return self
        if fault is not None:
            self._cut, self._lost = fault.cut_after, (fault if fault.lose_reply else None)
        self._handler = node.handler(_Details(self.method, self.ctx.invocation_metadata()))
        if self._handler is None:
            self.end(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            return self
        if self.deadline is not None:
            self._timer = threading.Timer(max(0.0, self.deadline - time.monotonic()),
                                          lambda: self.end(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self._timer.daemon = True
            self._timer.start()
        if self.request_streaming:
            threading.Thread(target=self._send, args=(iter(request),), name="send-requests", daemon=True).start()
        else:
            self._unary = self._serialize(request)
        self.net._serve(self)
        return self

    def _send(self, requests: Iterator[Any]) -> None:
        """The client's request stream, serialized, into the window (grpc's own sender thread does this)."""
        try:
            for msg in requests:
                if not self._offer(self._serialize(msg)):
                    return
            self._offer(_END)
        except Exception:
            self.end(grpc.StatusCode.UNKNOWN, "Exception iterating requests!")

    def _offer(self, item: Any) -> bool:
        while not self.finished.is_set():
            try:
                self._requests.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    # -- the target's side -----------------------------------------------------------------------
    def _server_requests(self, decode: Callable[[bytes], Any]) -> Iterator[Any]:
        """The request stream as the handler reads it: an error once the call ended, and at a cut."""
        got = 0
        while True:
            if self.finished.is_set():
                raise _StreamEnded()
            try:
                item = self._requests.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is _END:
                return
            if 0 <= self._cut <= got:
                self.end(grpc.StatusCode.UNAVAILABLE, f"injected by the test: the connection broke after {got} "
                         "messages")
                raise _StreamEnded()
            got += 1
            yield decode(item)

    def serve(self) -> None:
        """Runs the handler and ends the call with its reply or its error."""
        h = self._handler
        assert h is not None
        decode = h.request_deserializer or _same
        encode = h.response_serializer or _same
        behavior = {(False, False): h.unary_unary, (False, True): h.unary_stream, (True, False): h.stream_unary,
                    (True, True): h.stream_stream}[(bool(h.request_streaming), bool(h.response_streaming))]
        reply: Any = None
        try:
            arg = self._server_requests(decode) if h.request_streaming else decode(self._unary)
            result = behavior(arg, self.ctx)
            if h.response_streaming:
                try:
                    for item in result:
                        if self.finished.is_set():
                            break
                        self._responses.put(encode(item))
                finally:
                    getattr(result, "close", lambda: None)()
            else:
                reply = encode(result)
        except Exception as exc:
            code = self.ctx.code()
            if code is None or code == grpc.StatusCode.OK:
                self.end(grpc.StatusCode.UNKNOWN, f"Exception calling application: {exc}")
            else:
                self.end(code, self.ctx.details())
            return
        code = self.ctx.code()
        if code is not None and code != grpc.StatusCode.OK:
            self.end(code, self.ctx.details())
        elif self._lost is not None:
            self.end(self._lost.code, f"injected by the test: the reply to call {self._lost.seen} of "
                     f"{self._lost.method} got lost")
        else:
            self.end(grpc.StatusCode.OK, "", reply)

    def end(self, code: grpc.StatusCode, details: str, reply: Any = None) -> bool:
        """Ends the call (once: later ends are ignored); False if it had ended already."""
        with self._lock:
            if self.finished.is_set():
                return False
            self._code, self._details, self._reply = code, details, reply
            self.finished.set()
        if self._timer is not None:
            self._timer.cancel()
        self._responses.put(_END)
        for cb in self.callbacks:
            cb()
        for done in self._done_callbacks:
            done(self)
        return True

    # -- the client's side: grpc.Call, grpc.Future, and an iterator of responses -------------------
    def code(self) -> grpc.StatusCode:
        self.finished.wait()
        return self._code

    def details(self) -> str:
        self.finished.wait()
        return self._details

    def initial_metadata(self) -> tuple[()]:
        return ()

    def trailing_metadata(self) -> tuple[()]:
        return ()

    def is_active(self) -> bool:
        return not self.finished.is_set()

    def time_remaining(self) -> float | None:
        return self.ctx.time_remaining()

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self._done_callbacks.append(lambda _: callback())
        return True

    def cancel(self) -> bool:
        self._cancelled = self.end(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        return self._cancelled

    def cancelled(self) -> bool:
        return self._cancelled

    def running(self) -> bool:
        return not self.finished.is_set()

    def done(self) -> bool:
        return self.finished.is_set()

    def result(self, timeout: float | None = None) -> Any:
        if not self.finished.wait(timeout):
            raise grpc.FutureTimeoutError()
        if self._cancelled:
            raise grpc.FutureCancelledError()
        if self._code != grpc.StatusCode.OK:
            raise self
        return self._deserialize(self._reply)

    def exception(self, timeout: float | None = None) -> Exception | None:
        if not self.finished.wait(timeout):
            raise grpc.FutureTimeoutError()
        if self._cancelled:
            raise grpc.FutureCancelledError()
        return None if self._code == grpc.StatusCode.OK else self

    def traceback(self, timeout: float | None = None) -> None:
        return None

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        with self._lock:
            if not self.finished.is_set():
                self._done_callbacks.append(fn)
                return
        fn(self)

    def __iter__(self) -> _Call:
        return self

    def __next__(self) -> Any:
        item = self._responses.get()  # (what arrived before the call ended comes first, as with grpc)
        if item is _END:
            self._responses.put(_END)  # (asked again: the same end)
            if self._code == grpc.StatusCode.OK:
                raise StopIteration
            raise self
        return self._deserialize(item)

    def __str__(self) -> str:
        return f"{self.method} {self._code.name}: {self._details}"


class _Method:
    """A channel's multicallable (unary or streaming, either way)."""

    def __init__(self, channel: InProcessChannel, method: str, serialize: Callable[[Any], bytes] | None,
                 deserialize: Callable[[bytes], Any] | None, streaming: tuple[bool, bool]) -> None:
        self.channel, self.method, self.streaming = channel, method, streaming
        self.serialize, self.deserialize = serialize or _same, deserialize or _same

    def future(self, request: Any, timeout: float | None = None,
               metadata: Sequence[tuple[str, str]] | None = None, **_: Any) -> _Call:
        return _Call(self.channel, self.method, self.serialize, self.deserialize, self.streaming, timeout,
                     metadata).begin(request)

    def with_call(self, request: Any, timeout: float | None = None,
                  metadata: Sequence[tuple[str, str]] | None = None, **_: Any) -> tuple[Any, _Call]:
        call = self.future(request, timeout, metadata)
        return call.result(), call

    def __call__(self, request: Any, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] | None = None, **_: Any) -> Any:
        call = self.future(request, timeout, metadata)
        return call if self.streaming[1] else call.result()


class InProcessChannel(grpc.Channel):  # type: ignore[misc]
    """A grpc.Channel to the node at address in a PeerNet (looked up at each call: it may come and go)."""

    def __init__(self, net: PeerNet, address: str) -> None:
        self.net, self.address = net, address
        self.closed = False

    def unary_unary(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                    _registered_method: bool = False) -> _Method:
        return _Method(self, method, request_serializer, response_deserializer, (False, False))

    def unary_stream(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                     _registered_method: bool = False) -> _Method:
        return _Method(self, method, request_serializer, response_deserializer, (False, True))

    def stream_unary(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                     _registered_method: bool = False) -> _Method:
        return _Method(self, method, request_serializer, response_deserializer, (True, False))

    def stream_stream(self, method: str, request_serializer: Any = None, response_deserializer: Any = None,
                      _registered_method: bool = False) -> _Method:
        return _Method(self, method, request_serializer, response_deserializer, (True, True))

    def subscribe(self, callback: Any, try_to_connect: bool = False) -> None:
        pass

    def unsubscribe(self, callback: Any) -> None:
        pass

    def close(self) -> None:
        self.closed = True
