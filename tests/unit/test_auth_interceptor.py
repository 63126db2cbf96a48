"""The TCP interceptor's verdict on every kind of caller, with a fake gRPC context (fast, no daemon).

The same decisions are exercised over real sockets in tests/e2e/test_remote.py and test_security_peers.py;
these run in milliseconds, so that scripts/mutation.sh can check every branch of the decision."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from memsnap import auth as remote
from memsnap.auth import ADMIN, LOCAL, PEER, AuthInterceptor, CallAuth, Credentials, peer_credential

NODE_TOKEN = b"n" * 64
ADMIN_TOKEN = "a" * 64
PEER_TOKEN = "p" * 64
STATUS = "/memsnap.v1.Memsnap/Status"
RECEIVE = "/memsnap.v1.Peer/ReceiveImage"
RESTORE = "/memsnap.v1.Memsnap/Restore"
LIST_JOBS = "/memsnap.v1.Memsnap/ListJobs"


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class Ctx:
    def __init__(self, peer: str = "ipv4:10.0.0.2:5000", token: str | None = None, raw: str | None = None,
                 cert: dict[str, list[bytes]] | None = None) -> None:
        self._peer = peer
        self._md: list[tuple[str, str]] = []
        if token is not None:
            self._md.append(("authorization", f"Bearer {token}"))
        if raw is not None:
            self._md.append(("authorization", raw))
        self._cert = cert

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._md

    def auth_context(self) -> dict[str, list[bytes]] | None:
        return self._cert

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def creds(**kw: Any) -> Credentials:
    base: dict[str, Any] = {"node_name": "this", "node_token": NODE_TOKEN}
    return Credentials(**{**base, **kw})


def check(c: Credentials, ctx: Ctx, method: str = STATUS, forged: bool = False) -> CallAuth:
    return AuthInterceptor(c)._check(ctx, method, forged)  # type: ignore[arg-type]


def refused(c: Credentials, ctx: Ctx, method: str = STATUS, forged: bool = False) -> Aborted:
    with pytest.raises(Aborted) as e:
        check(c, ctx, method, forged)
    return e.value


DERIVED = peer_credential(NODE_TOKEN, "this")


def test_local_calls_come_through_the_private_socket() -> None:
    for peer in ("unix:/run/memsnap/private.sock", "unix-abstract:x"):
        assert check(creds(), Ctx(peer), RESTORE) == CallAuth(LOCAL)
        assert check(Credentials(), Ctx(peer), RESTORE).role == LOCAL  # no TCP credentials needed


def test_the_forged_header_is_refused_from_anyone() -> None:
    for peer in ("unix:/x", "ipv4:1.2.3.4:5"):
        e = refused(creds(), Ctx(peer, token=DERIVED), forged=True)
        assert e.code == grpc.StatusCode.UNAUTHENTICATED and remote.FORGED_HEADER in e.details


def test_other_transports_are_refused() -> None:
    e = refused(creds(), Ctx("inproc:x", token=DERIVED))
    assert e.code == grpc.StatusCode.UNAUTHENTICATED and "Unix socket or TCP only" in e.details


def test_no_tcp_caller_without_credentials_configured() -> None:
    e = refused(Credentials(), Ctx(token=""))
    assert e.code == grpc.StatusCode.UNAUTHENTICATED and "accepts no TCP callers" in e.details


@pytest.mark.parametrize("peer", ["ipv4:10.0.0.2:1", "ipv6:[::1]:1"])
def test_the_derived_credential_is_a_peer_for_the_move_rpcs_only(peer: str) -> None:
    for method in sorted(remote.PEER_METHODS):
        auth = check(creds(), Ctx(peer, token=DERIVED), method)
        assert auth.role == PEER and auth.token == DERIVED and "derived" in auth.who
    e = refused(creds(), Ctx(peer, token=DERIVED), RESTORE)
    assert e.code == grpc.StatusCode.PERMISSION_DENIED and e.details.startswith("Restore: a peer may only move")


def test_the_node_token_itself_and_other_nodes_credentials_are_refused() -> None:
    for token in (NODE_TOKEN.decode(), peer_credential(NODE_TOKEN, "other"), "", DERIVED[:-1], DERIVED + "0"):
        e = refused(creds(), Ctx(token=token))
        assert e.code == grpc.StatusCode.UNAUTHENTICATED and "missing or wrong bearer token" in e.details


def test_no_or_malformed_authorization_is_refused() -> None:
    for ctx in (Ctx(), Ctx(raw=DERIVED), Ctx(raw=f"bearer {DERIVED}"), Ctx(raw=f"Basic {DERIVED}")):
        assert refused(creds(), ctx).code == grpc.StatusCode.UNAUTHENTICATED


def test_the_admin_token_may_call_everything() -> None:
    c = creds(admin_token=ADMIN_TOKEN)
    for method in (RESTORE, STATUS, LIST_JOBS):
        auth = check(c, Ctx(token=ADMIN_TOKEN), method)
        assert auth.role == ADMIN and auth.token == ADMIN_TOKEN and auth.who == "the admin token"
    assert check(c, Ctx(token=DERIVED), STATUS).role == PEER  # the peer credential stays a peer's


def test_a_peers_own_token_file_is_a_peer() -> None:
    c = creds(node_token=b"", peer_tokens={"b": PEER_TOKEN})
    auth = check(c, Ctx(token=PEER_TOKEN), RECEIVE)
    assert auth.role == PEER and auth.who == "peer b"
    assert refused(c, Ctx(token=PEER_TOKEN), RESTORE).code == grpc.StatusCode.PERMISSION_DENIED
    assert refused(c, Ctx(token=DERIVED)).code == grpc.StatusCode.UNAUTHENTICATED  # no node token here


def _tls(**kw: Any) -> Credentials:
    return creds(mutual_tls=True, peer_identities=frozenset({"node-b"}), admin_identities=frozenset({"ops"}),
                 **kw)


def test_mutual_tls_certificate_names_decide_the_role() -> None:
    auth = check(_tls(), Ctx(cert={"x509_common_name": [b"node-b"]}), RECEIVE)
    assert auth.role == PEER and auth.token == "" and auth.who == "certificate node-b"
    assert check(_tls(), Ctx(cert={"x509_subject_alternative_name": [b"ops", b"x"]}), RESTORE).role == ADMIN
    e = refused(_tls(), Ctx(cert={"x509_common_name": [b"node-b"]}), RESTORE)
    assert e.code == grpc.StatusCode.PERMISSION_DENIED
    for cert in ({"x509_common_name": [b"stranger"]}, {}, None):
        e = refused(_tls(), Ctx(cert=cert), STATUS)
        assert e.code == grpc.StatusCode.PERMISSION_DENIED and "not a peer's identity" in e.details


def test_with_mutual_tls_a_token_sent_must_be_valid_and_the_lesser_role_wins() -> None:
    admin_cert = Ctx(cert={"x509_common_name": [b"ops"]}, token=DERIVED)
    assert check(_tls(), admin_cert, STATUS).role == PEER
    assert refused(_tls(), admin_cert, RESTORE).code == grpc.StatusCode.PERMISSION_DENIED
    bad = Ctx(cert={"x509_common_name": [b"ops"]}, token="wrong")
    assert refused(_tls(), bad, STATUS).code == grpc.StatusCode.UNAUTHENTICATED
    admin_both = Ctx(cert={"x509_common_name": [b"ops"]}, token=ADMIN_TOKEN)
    auth = check(_tls(admin_token=ADMIN_TOKEN), admin_both, RESTORE)
    assert auth.role == ADMIN and auth.who == "certificate ops, the admin token"


def test_a_peer_sees_only_the_jobs_moves_brought_here() -> None:
    from memsnap.v1 import memsnap_pb2 as pb

    def listing() -> Any:
        r = pb.ListJobsResponse()
        r.jobs.add(id="job-local")
        r.jobs.add(id="job-moved", restored_from="ck-1")
        return r

    assert [j.id for j in remote._peer_view(LIST_JOBS, CallAuth(PEER), listing()).jobs] == ["job-moved"]
    assert len(remote._peer_view(LIST_JOBS, CallAuth(ADMIN), listing()).jobs) == 2
    assert len(remote._peer_view(STATUS, CallAuth(PEER), listing()).jobs) == 2


def test_the_verdict_is_in_scope_only_during_the_call() -> None:
    seen: list[tuple[bool, str]] = []

    class Handler:
        request_streaming = False
        response_streaming = False
        request_deserializer = None
        response_serializer = None
        unary_stream = stream_unary = stream_stream = None

        @staticmethod
        def unary_unary(req: Any, ctx: Any) -> str:
            seen.append((remote.tcp_authenticated(), remote.call_token()))
            return "ok"

    wrapped = remote._wrap(Handler, lambda ctx: CallAuth(PEER, "tok", "p"), STATUS)
    assert wrapped.unary_unary(None, None) == "ok"
    assert seen == [(True, "tok")]
    assert (remote.tcp_authenticated(), remote.call_token()) == (False, "")
    local = remote._wrap(Handler, lambda ctx: CallAuth(LOCAL), STATUS)
    local.unary_unary(None, None)
    assert seen[-1] == (False, "")


class _Details:
    def __init__(self, method: str, md: list[tuple[str, str]]) -> None:
        self.method = method
        self.invocation_metadata = md


class _Handler:
    request_streaming = False
    response_streaming = False
    request_deserializer = None
    response_serializer = None
    unary_stream = stream_unary = stream_stream = None

    @staticmethod
    def unary_unary(req: Any, ctx: Any) -> str:
        return "served"


@pytest.mark.parametrize("header", ["x-memsnap-authenticated", "X-Memsnap-Authenticated"])
def test_the_interceptor_refuses_the_forged_header_before_serving(header: str) -> None:
    icpt = AuthInterceptor(creds())
    wrapped = icpt.intercept_service(lambda d: _Handler, _Details(STATUS, [(header, "tcp")]))
    with pytest.raises(Aborted) as e:
        wrapped.unary_unary(None, Ctx("unix:/x"))
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_the_interceptor_checks_every_call_with_its_method() -> None:
    icpt = AuthInterceptor(creds())
    wrapped = icpt.intercept_service(lambda d: _Handler, _Details(RESTORE, [("other", "x")]))
    assert wrapped.unary_unary(None, Ctx("unix:/x")) == "served"
    with pytest.raises(Aborted) as e:
        wrapped.unary_unary(None, Ctx(token=DERIVED))  # a peer, but Restore is not a move RPC
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    ok = icpt.intercept_service(lambda d: _Handler, _Details(STATUS, []))
    assert ok.unary_unary(None, Ctx(token=DERIVED)) == "served"
    assert icpt.intercept_service(lambda d: None, _Details(STATUS, [])) is None  # unknown method: grpc's answer


def test_streaming_replies_are_produced_with_the_verdict_in_scope() -> None:
    class Streaming(_Handler):
        response_streaming = True
        unary_unary = None  # type: ignore[assignment]

        @staticmethod
        def unary_stream(req: Any, ctx: Any) -> Any:  # type: ignore[override]
            for _ in range(2):
                yield remote.call_token()

    wrapped = remote._wrap(Streaming, lambda ctx: CallAuth(PEER, "tok", "p"), RECEIVE)
    assert list(wrapped.unary_stream(None, None)) == ["tok", "tok"]
    assert remote.call_token() == ""


class _Server:
    def __init__(self, port: int = 7070) -> None:
        self.port = port
        self.added: list[tuple[str, bool]] = []

    def add_insecure_port(self, address: str) -> int:
        self.added.append((address, False))
        return self.port

    def add_secure_port(self, address: str, creds: Any) -> int:
        self.added.append((address, True))
        return self.port


def test_tcp_is_never_served_without_a_way_to_authenticate(tmp_path: Any) -> None:
    import os

    from memsnap.auth import RemoteConfigError, add_tcp_port
    from memsnap.config import Config, DaemonConfig

    server = _Server()
    with pytest.raises(RemoteConfigError, match="^refusing to listen on 127.0.0.1:7070 without authentication"):
        add_tcp_port(server, Config(daemon=DaemonConfig(listen="127.0.0.1:7070")))  # type: ignore[arg-type]
    assert server.added == []
    token = tmp_path / "node.token"
    token.write_text("t" * 40)
    os.chmod(token, 0o600)
    cfg = Config(daemon=DaemonConfig(listen="127.0.0.1:7070", auth_token_file=str(token)))
    assert add_tcp_port(server, cfg) == 7070  # type: ignore[arg-type]
    assert server.added == [("127.0.0.1:7070", False)]
    with pytest.raises(RemoteConfigError, match="the address is in use or not local"):
        add_tcp_port(_Server(port=0), cfg)  # type: ignore[arg-type]


def test_credentials_are_read_from_the_configured_files_only(tmp_path: Any) -> None:
    import os

    from memsnap import safefs
    from memsnap.auth import RemoteConfigError, load_credentials
    from memsnap.config import Config, DaemonConfig, PeerConfig
    from tests.helpers import make_ca, make_cert

    node = tmp_path / "node.token"
    node.write_text("n" * 40)
    os.chmod(node, 0o600)
    c = load_credentials(Config(daemon=DaemonConfig(auth_token_file=str(node), node_name="me")))
    assert (c.node_token, c.admin_token, c.peer_tokens, c.mutual_tls) == (b"n" * 40, "", {}, False)
    assert c.tls_cert == c.tls_key == c.tls_ca == b""
    assert set(c.accepted_tokens.values()) == {(PEER, "a peer (derived from the node token)")}
    ca = make_ca(tmp_path, "ca")
    key, crt = make_cert(tmp_path, "me", ca)
    tls = DaemonConfig(tls_cert=str(crt), tls_key=str(key), tls_ca=str(ca[1]), admin_identities=("ops",))
    c = load_credentials(Config(daemon=tls, peers=(PeerConfig(name="b", address="10.0.0.2:1", identity="node-b"),)))
    assert c.mutual_tls and c.tls_cert == crt.read_bytes() and c.tls_key == key.read_bytes()
    assert c.tls_ca == ca[1].read_bytes() and c.node_token == b"" and c.accepted_tokens == {}
    assert c.peer_identities == frozenset({"node-b"}) and c.admin_identities == frozenset({"ops"})
    only_cert = load_credentials(Config(daemon=DaemonConfig(tls_cert=str(crt), tls_key=str(key))))
    assert not only_cert.mutual_tls and not only_cert.any  # TLS without a CA authenticates nobody
    os.chmod(key, 0o640)
    with pytest.raises((RemoteConfigError, safefs.UnsafePath)):
        load_credentials(Config(daemon=tls))


def test_without_a_node_token_no_derived_credential_is_sent() -> None:
    from memsnap.config import PeerConfig

    b = PeerConfig(name="b", address="10.0.0.2:1")
    assert Credentials().outbound(b) == ""
    assert creds().outbound(b) == peer_credential(NODE_TOKEN, "b")
    assert creds(peer_tokens={"b": PEER_TOKEN}).outbound(b) == PEER_TOKEN
