"""Who may call what: local users on the Unix socket, peers and administrators over TCP.

- A call that arrives on a Unix socket is local. The only Unix listener is the private socket in the
  state dir (0700, root only), which the peer-credential relay connects to; `daemon.listen` is an IP
  address (validated in config and resolved to IP literals here), so no TCP listener can ever carry a
  relay name. The caller's uid then comes from SO_PEERCRED (api.caller_of).
- A call over TCP must authenticate, and gets a role:
  - peer: a configured peer's credential, that is the bearer token derived for this node from the node
    token (peer_credential), a `peers.token_file`, or a client certificate whose name (SAN or CN) is a
    peer's identity. A peer may call only PEER_METHODS, the move RPCs.
  - admin: `daemon.admin_token_file` or a client certificate named in `daemon.admin_identities`:
    every RPC, as root. Off unless configured.
  With mutual TLS on, the certificate is required and its name decides; a bearer token, when sent, must
  be valid too, and the call gets the lesser of the two roles. A certificate signed by the CA but not
  listed gets nothing.
- The node token itself never leaves this node: a peer gets HMAC(node token, its name), which only
  that peer accepts, or the token shared with it alone.

Only the interceptor decides this. It records the verdict in a context variable for the duration of the
call (api.caller_of and the move code read it); no header can set it. A request that carries the old
`x-memsnap-authenticated` header is refused outright, from any peer.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import os
import socket
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from memsnap.config import Config, PeerConfig, ip_host_port
from memsnap.logs import Quieted

log = logging.getLogger("memsnap.auth")
strangers = Quieted(log)  # (refused TCP calls: anyone who reaches the port can make them)

# A client must never be able to claim authentication; this header did that once, so it is refused.
FORGED_HEADER = "x-memsnap-authenticated"

LOCAL, PEER, ADMIN = "local", "peer", "admin"
_SERVICE = "/memsnap.v1.Memsnap/"
_PEER_SERVICE = "/memsnap.v1.Peer/"
# What a peer needs to move a job here: the preflight (Status), the image and page transfer, the restore
# and commit (the Peer service), and ListJobs (which shows a peer only the jobs that moves brought here).
PEER_METHODS = frozenset({
    _SERVICE + "Status", _SERVICE + "ListJobs", "/grpc.health.v1.Health/Check",
    _PEER_SERVICE + "ReceiveImage", _PEER_SERVICE + "PageTunnel", _PEER_SERVICE + "RestoreReceived",
    _PEER_SERVICE + "CommitMove",
})
_LIST_JOBS = _SERVICE + "ListJobs"


class RemoteConfigError(Exception):
    """TCP is set up without a way to authenticate, or a credential file is unreadable or unsafe."""


@dataclass(frozen=True)
class CallAuth:
    """The interceptor's verdict on one call."""

    role: str = ""
    token: str = ""  # the bearer credential that authenticated a TCP call ("" when none was sent)
    who: str = ""


_CALL: contextvars.ContextVar[CallAuth | None] = contextvars.ContextVar("memsnap_call_auth", default=None)
_NONE = CallAuth()


def tcp_authenticated() -> bool:
    """Whether the current call came over TCP and passed the checks (as a peer or an administrator)."""
    return (_CALL.get() or _NONE).role in (PEER, ADMIN)


def call_token() -> str:
    """The bearer credential the current TCP call authenticated with; "" for none (local, or TLS only).
    Both ends of a move derive the manifest and page-tunnel keys from it (transfer_key)."""
    auth = _CALL.get() or _NONE
    return auth.token if auth.role in (PEER, ADMIN) else ""


def transfer_key(token: str | bytes) -> bytes:
    """The key that signs image manifests between daemons, derived from the credential of the move."""
    raw = token.encode() if isinstance(token, str) else token
    return hmac.new(raw.strip(), b"memsnap transfer manifest v1", hashlib.sha256).digest()


def peer_credential(node_token: bytes, peer_name: str) -> str:
    """The bearer token for the peer named peer_name: only it accepts it, and it reveals nothing of the
    node token (a fake or compromised host at that address learns a credential for that peer only)."""
    return hmac.new(node_token, b"memsnap peer credential v1\0" + peer_name.encode(), hashlib.sha256).hexdigest()


def read_secret(path: str, what: str) -> bytes:
    """A token or private key file's bytes; refused unless a regular file of this uid that the group and
    others cannot access (one line that names the file, its mode and the fix)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise RemoteConfigError(f"cannot read {what} {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RemoteConfigError(f"{what} {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise RemoteConfigError(f"{what} {path} is owned by uid {st.st_uid}, not by memsnapd's uid "
                                    f"{os.geteuid()}: chown {os.geteuid()} {path}")
        if st.st_mode & 0o077:
            raise RemoteConfigError(f"{what} {path} is accessible by group or others (mode "
                                    f"{stat.S_IMODE(st.st_mode):04o}): chmod 600 {path}")
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _read_public(path: str, what: str) -> bytes:
    """A certificate file (public, any mode)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise RemoteConfigError(f"cannot read {what} {path}: {exc.strerror}") from exc


def read_token(path: str, what: str = "token file") -> str:
    """A token file's content without surrounding whitespace (checked like read_secret): at least 16
    printable ASCII characters, as a bearer header carries it."""
    raw = read_secret(path, what).strip()
    try:
        token = raw.decode("ascii")
    except UnicodeDecodeError:
        token = "\n"
    if not token.isprintable() or " " in token:
        raise RemoteConfigError(f"the token in {path} must be printable ASCII without spaces; use e.g. "
                                "`openssl rand -hex 32`")
    if len(token) < 16:
        raise RemoteConfigError(f"the token in {path} is shorter than 16 bytes; use e.g. `openssl rand -hex 32`")
    return token


@dataclass(frozen=True)
class Credentials:
    """What this node accepts over TCP and what it sends to its peers, read once at start."""

    node_name: str = ""
    node_token: bytes = b""  # the cluster secret: never sent anywhere
    admin_token: str = ""
    admin_identities: frozenset[str] = frozenset()
    peer_tokens: dict[str, str] = field(default_factory=dict)  # peer name -> its token_file's token
    peer_identities: frozenset[str] = frozenset()
    mutual_tls: bool = False
    tls_cert: bytes = b""
    tls_key: bytes = b""
    tls_ca: bytes = b""

    @property
    def accepted_tokens(self) -> dict[str, tuple[str, str]]:
        """Bearer token -> (role, who) for every token that this node accepts."""
        out: dict[str, tuple[str, str]] = {}
        if self.node_token:
            out[peer_credential(self.node_token, self.node_name)] = (PEER, "a peer (derived from the node token)")
        for name, token in self.peer_tokens.items():
            out[token] = (PEER, f"peer {name}")
        if self.admin_token:
            out[self.admin_token] = (ADMIN, "the admin token")
        return out

    @property
    def any(self) -> bool:
        """At least one way for a TCP caller to authenticate is configured."""
        return bool(self.accepted_tokens) or self.mutual_tls

    def outbound(self, peer: PeerConfig) -> str:
        """The bearer token to send to a configured peer; "" when there is none."""
        if peer.name in self.peer_tokens:
            return self.peer_tokens[peer.name]
        return peer_credential(self.node_token, peer.name) if self.node_token else ""


def node_name(cfg: Config) -> str:
    """This node's name in its peers' lists."""
    return cfg.daemon.node_name or socket.gethostname()


def load_credentials(cfg: Config) -> Credentials:
    """Reads the token and TLS files named by [daemon] and [[peers]]; raises RemoteConfigError when one is
    unreadable or readable by others."""
    d = cfg.daemon
    node_token = read_token(d.auth_token_file, "daemon.auth_token_file").encode() if d.auth_token_file else b""
    admin = read_token(d.admin_token_file, "daemon.admin_token_file") if d.admin_token_file else ""
    peer_tokens = {p.name: read_token(p.token_file, f"the token_file of peer {p.name}")
                   for p in cfg.peers if p.token_file}
    if admin and (admin in peer_tokens.values() or (node_token and admin.encode() == node_token)):
        raise RemoteConfigError(f"daemon.admin_token_file {d.admin_token_file} holds a peer's token or the node "
                                "token: give administrators a token of their own")
    cert = _read_public(d.tls_cert, "daemon.tls_cert") if d.tls_cert else b""
    key = read_secret(d.tls_key, "daemon.tls_key") if d.tls_key else b""
    ca = _read_public(d.tls_ca, "daemon.tls_ca") if d.tls_ca else b""
    return Credentials(node_name=node_name(cfg), node_token=node_token, admin_token=admin,
                       admin_identities=frozenset(d.admin_identities), peer_tokens=peer_tokens,
                       peer_identities=frozenset(p.cert_identity for p in cfg.peers),
                       mutual_tls=bool(cert and key and ca), tls_cert=cert, tls_key=key, tls_ca=ca)


def _cert_names(context: grpc.ServicerContext) -> set[str]:
    """The verified client certificate's names: its subject alternative names and common name."""
    auth = context.auth_context() or {}
    names = set()
    for prop in ("x509_subject_alternative_name", "x509_common_name"):
        for value in auth.get(prop, ()):
            names.add(value.decode(errors="replace") if isinstance(value, bytes) else str(value))
    return names


def _short(names: set[str]) -> str:
    text = ", ".join(sorted(names)) or "none"
    return text if len(text) <= 200 else text[:200] + "..."


class AuthInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Authenticates and authorizes TCP callers on every call; refuses the forged header from anyone."""

    def __init__(self, creds: Credentials) -> None:
        self.creds = creds
        self._tokens = creds.accepted_tokens

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        forged = any(k.lower() == FORGED_HEADER for k, _ in (details.invocation_metadata or ()))
        method = str(details.method)
        return _wrap(handler, lambda ctx: self._check(ctx, method, forged), method)

    def _check(self, context: grpc.ServicerContext, method: str, forged: bool) -> CallAuth:
        """The call's role; aborts the call when it has none, or may not call method."""
        if forged:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"the {FORGED_HEADER} header is reserved to memsnapd; remove it from the request")
        peer = context.peer()
        if peer.startswith(("unix:", "unix-abstract:")):
            # The private socket, reached through the relay (daemon.listen is an IP address, never Unix).
            return CallAuth(LOCAL)
        if not peer.startswith(("ipv4:", "ipv6:")):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "calls come over the Unix socket or TCP only")
        if not self.creds.any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this daemon accepts no TCP callers")
        roles: list[str] = []
        whos: list[str] = []
        if self.creds.mutual_tls:
            names = _cert_names(context)
            if names & self.creds.admin_identities:
                roles.append(ADMIN)
            elif names & self.creds.peer_identities:
                roles.append(PEER)
            else:
                strangers.warning("refused a TCP call from %s: client certificate names %s are not listed", peer,
                                  _short(names))
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"the client certificate ({_short(names)}) is not a peer's identity nor in "
                              "daemon.admin_identities on this node")
            whos.append(f"certificate {_short(names)}")
        got = dict(context.invocation_metadata()).get("authorization", "")
        token = got[len("Bearer "):] if got.startswith("Bearer ") else ""
        if got or not self.creds.mutual_tls:
            match = ("", "")
            for accepted, verdict in self._tokens.items():
                if hmac.compare_digest(token.encode(), accepted.encode()):
                    match = verdict
            if not match[0]:
                strangers.warning("refused a TCP call from %s: %s bearer token", peer, "wrong" if got else "no")
                context.abort(grpc.StatusCode.UNAUTHENTICATED,
                              "missing or wrong bearer token: a peer sends the credential for this node (its "
                              "[[peers]] entry names this node's daemon.node_name), an administrator the "
                              "admin token (daemon.admin_token_file)")
            roles.append(match[0])
            whos.append(match[1])
        role = PEER if PEER in roles else ADMIN
        if role == PEER and method not in PEER_METHODS:
            strangers.warning("refused %s from %s: a peer credential (%s) may only move jobs", method, peer,
                              ", ".join(whos))
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{method.rsplit('/', 1)[-1]}: a peer may only move jobs here (its credential allows "
                          "the move RPCs); administration over TCP needs daemon.admin_token_file or "
                          "daemon.admin_identities")
        return CallAuth(role, token, ", ".join(whos))


def _peer_view(method: str, auth: CallAuth, result: Any) -> Any:
    """What a peer sees of a reply: ListJobs shows it only the jobs that moves brought here."""
    if auth.role == PEER and method == _LIST_JOBS:
        jobs = [j for j in result.jobs if j.restored_from]
        del result.jobs[:]
        result.jobs.extend(jobs)
    return result


def _wrap(handler: Any, check: Callable[[grpc.ServicerContext], CallAuth], method: str) -> Any:
    """The same handler, with check() run first and its verdict held in the context variable."""

    def guard(behavior: Callable[..., Any], streaming_response: bool) -> Callable[..., Any]:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            auth = check(context)
            token = _CALL.set(auth)
            try:
                result = behavior(request, context)
            finally:
                _CALL.reset(token)
            return _scoped(result, auth) if streaming_response else _peer_view(method, auth, result)

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


def _scoped(results: Iterator[Any], auth: CallAuth) -> Iterator[Any]:
    """A response stream whose items are produced with the caller's verdict in scope."""
    it = iter(results)
    while True:
        token = _CALL.set(auth)
        try:
            item = next(it)
        except StopIteration:
            return
        finally:
            _CALL.reset(token)
        yield item


def interceptors(cfg: Config) -> list[grpc.ServerInterceptor]:
    """The server interceptors memsnapd installs: authentication and roles (credentials read once at start)."""
    return [AuthInterceptor(load_credentials(cfg))]


def bind_addresses(listen: str) -> list[str]:
    """daemon.listen as the IP literals gRPC should bind ("IP:PORT", "[IPv6]:PORT"): a host name is
    resolved here, so gRPC never sees a name it could read as a Unix or other socket."""
    try:
        host, port = ip_host_port(listen)
    except ValueError as exc:
        raise RemoteConfigError(f"daemon.listen {listen!r}: {exc}; give an IP address or host name and a port") from exc
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise RemoteConfigError(f"daemon.listen {listen!r}: cannot resolve {host}: {exc}") from exc
    out: list[str] = []
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        text = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}" if family == socket.AF_INET else ""
        if text and text not in out:
            out.append(text)
    if not out:
        raise RemoteConfigError(f"daemon.listen {listen!r}: {host} has no IPv4 or IPv6 address")
    return out


def add_tcp_port(server: grpc.Server, cfg: Config) -> int:
    """Adds daemon.listen to server; refuses to listen without a way to authenticate. Returns the port."""
    d = cfg.daemon
    creds = load_credentials(cfg)
    if not creds.any:
        raise RemoteConfigError(
            f"refusing to listen on {d.listen} without authentication: set daemon.auth_token_file "
            "(--auth-token-file, the node token its [[peers]] credentials derive from), "
            "daemon.admin_token_file and/or mutual TLS (--tls-cert, --tls-key, --tls-ca)")
    port = 0
    for address in bind_addresses(d.listen):
        if creds.tls_cert:
            server_creds = grpc.ssl_server_credentials([(creds.tls_key, creds.tls_cert)],
                                                       root_certificates=creds.tls_ca or None,
                                                       require_client_auth=creds.mutual_tls)
            port = int(server.add_secure_port(address, server_creds))
        else:
            port = int(server.add_insecure_port(address))
        if port == 0:
            raise RemoteConfigError(f"cannot listen on {d.listen} ({address}): the address is in use or not local")
    if not creds.tls_cert:
        log.warning("listening on %s without TLS: bearer tokens and images travel in clear; "
                    "configure tls_cert/tls_key (and tls_ca) on untrusted networks", d.listen)
    methods = [m for m, on in (("peer tokens", bool(creds.node_token or creds.peer_tokens)),
                               ("admin token", bool(creds.admin_token)), ("mutual TLS", creds.mutual_tls)) if on]
    log.info("serving the API on %s (%s; %d peers, admin over TCP %s)", d.listen, " + ".join(methods),
             len(cfg.peers), "on" if creds.admin_token or creds.admin_identities else "off")
    return port
