"""The API over TCP: always authenticated, by a shared bearer token and/or mutual TLS.

Only the interceptor decides that a TCP caller is authenticated. It records that in a context
variable for the duration of the call (api.caller_of reads it); no header can set it. A request
that carries the old `x-memsnap-authenticated` header is refused outright, from any peer.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

log = logging.getLogger("memsnap.remote")

# A client must never be able to claim authentication; this header did that once, so it is refused.
FORGED_HEADER = "x-memsnap-authenticated"
_TCP_AUTHENTICATED: contextvars.ContextVar[bool] = contextvars.ContextVar("memsnap_tcp_authenticated",
                                                                         default=False)


class RemoteConfigError(Exception):
    """daemon.listen is set without a way to authenticate callers, or a credential file is unreadable."""


def tcp_authenticated() -> bool:
    """Whether the current call came over TCP and passed the token / client-certificate check."""
    return _TCP_AUTHENTICATED.get()


@dataclass(frozen=True)
class Credentials:
    """What a TCP caller must present: the token (if configured) and a verified client cert (if mTLS)."""

    token: bytes = b""
    mutual_tls: bool = False
    tls_cert: bytes = b""
    tls_key: bytes = b""
    tls_ca: bytes = b""

    @property
    def any(self) -> bool:
        """At least one authentication method is configured."""
        return bool(self.token) or self.mutual_tls


def read_token(path: str) -> str:
    """A token file's content without surrounding whitespace."""
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def load_credentials(daemon_cfg: Any) -> Credentials:
    """Reads the token and TLS files named by [daemon]; raises RemoteConfigError when unusable."""

    def read(path: str, what: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise RemoteConfigError(f"cannot read {what} {path}: {exc.strerror}") from exc

    token = b""
    if daemon_cfg.auth_token_file:
        token = read(daemon_cfg.auth_token_file, "daemon.auth_token_file").strip()
        if len(token) < 16:
            raise RemoteConfigError(f"the token in {daemon_cfg.auth_token_file} is shorter than 16 bytes; "
                                    "use e.g. `openssl rand -hex 32`")
    cert = read(daemon_cfg.tls_cert, "daemon.tls_cert") if daemon_cfg.tls_cert else b""
    key = read(daemon_cfg.tls_key, "daemon.tls_key") if daemon_cfg.tls_key else b""
    ca = read(daemon_cfg.tls_ca, "daemon.tls_ca") if daemon_cfg.tls_ca else b""
    return Credentials(token=token, mutual_tls=bool(cert and key and ca), tls_cert=cert, tls_key=key,
                       tls_ca=ca)


def transfer_key(token: str | bytes) -> bytes:
    """The key that signs image manifests between daemons, derived from the shared node token."""
    raw = token.encode() if isinstance(token, str) else token
    return hmac.new(raw.strip(), b"memsnap transfer manifest v1", hashlib.sha256).digest()


def _is_tcp(peer: str) -> bool:
    return peer.startswith(("ipv4:", "ipv6:"))


class AuthInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Authenticates TCP peers on every call and refuses the forged header from anyone."""

    def __init__(self, creds: Credentials) -> None:
        self.creds = creds
        self._want = b"Bearer " + creds.token if creds.token else b""

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        forged = any(k.lower() == FORGED_HEADER for k, _ in (details.invocation_metadata or ()))
        return _wrap(handler, lambda ctx: self._check(ctx, forged))

    def _check(self, context: grpc.ServicerContext, forged: bool) -> bool:
        """True for an authenticated TCP call, False for a local (Unix socket) one; aborts otherwise."""
        if forged:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"the {FORGED_HEADER} header is reserved to memsnapd; remove it from the request")
        peer = context.peer()
        if not _is_tcp(peer):
            return False
        if not self.creds.any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this daemon accepts no TCP callers")
        if self.creds.token:
            got = dict(context.invocation_metadata()).get("authorization", "")
            if not hmac.compare_digest(got.encode(), self._want):
                log.warning("refused a TCP call from %s: %s bearer token", peer, "wrong" if got else "no")
                context.abort(grpc.StatusCode.UNAUTHENTICATED,
                              "missing or wrong bearer token; pass --token-file with the node token")
        if self.creds.mutual_tls and not context.peer_identities():
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "a client certificate signed by the node CA is required")
        return True


def _wrap(handler: Any, check: Callable[[grpc.ServicerContext], bool]) -> Any:
    """The same handler, with check() run first and its verdict held in the context variable."""

    def guard(behavior: Callable[..., Any], streaming_response: bool) -> Callable[..., Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            ok = check(context)
            token = _TCP_AUTHENTICATED.set(ok)
            try:
                result = behavior(request, context)
            finally:
                _TCP_AUTHENTICATED.reset(token)
            return _scoped(result, ok) if streaming_response else result

        return call

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    key = (bool(handler.request_streaming), bool(handler.response_streaming))
    behavior = {
        (False, False): handler.unary_unary, (False, True): handler.unary_stream,
        (True, False): handler.stream_unary, (True, True): handler.stream_stream,
    }[key]
    return kinds[key](guard(behavior, key[1]), request_deserializer=handler.request_deserializer,
                      response_serializer=handler.response_serializer)


def _scoped(results: Iterator[Any], ok: bool) -> Iterator[Any]:
    """A response stream whose items are produced with the caller's authentication in scope."""
    it = iter(results)
    while True:
        token = _TCP_AUTHENTICATED.set(ok)
        try:
            item = next(it)
        except StopIteration:
            return
        finally:
            _TCP_AUTHENTICATED.reset(token)
        yield item


def interceptors(daemon_cfg: Any) -> list[grpc.ServerInterceptor]:
    """The server interceptors memsnapd installs: TCP authentication (credentials read once at start)."""
    creds = load_credentials(daemon_cfg) if daemon_cfg.listen else Credentials()
    return [AuthInterceptor(creds)]


def add_tcp_port(server: grpc.Server, daemon_cfg: Any) -> int:
    """Adds daemon.listen to server; refuses to listen without a token or mutual TLS. Returns the port."""
    creds = load_credentials(daemon_cfg)
    if not creds.any:
        raise RemoteConfigError(
            f"refusing to listen on {daemon_cfg.listen} without authentication: set daemon.auth_token_file "
            "(--auth-token-file) and/or mutual TLS (--tls-cert, --tls-key, --tls-ca)")
    if creds.tls_cert:
        server_creds = grpc.ssl_server_credentials([(creds.tls_key, creds.tls_cert)],
                                                   root_certificates=creds.tls_ca or None,
                                                   require_client_auth=creds.mutual_tls)
        port = int(server.add_secure_port(daemon_cfg.listen, server_creds))
    else:
        log.warning("listening on %s without TLS: the bearer token and images travel in clear; "
                    "configure tls_cert/tls_key (and tls_ca) on untrusted networks", daemon_cfg.listen)
        port = int(server.add_insecure_port(daemon_cfg.listen))
    if port == 0:
        raise RemoteConfigError(f"cannot listen on {daemon_cfg.listen}: the address is in use or not local")
    methods = [m for m, on in (("token", bool(creds.token)), ("mutual TLS", creds.mutual_tls)) if on]
    log.info("serving the API on %s (%s)", daemon_cfg.listen, " + ".join(methods))
    return port
