"""Credentials for TCP: secret files must be private, peers get derived or own tokens, listen is IP only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from memsnap.auth import (
    ADMIN,
    PEER,
    RemoteConfigError,
    bind_addresses,
    load_credentials,
    peer_credential,
    read_token,
)
from memsnap.config import Config, DaemonConfig, PeerConfig


def secret(path: Path, text: str = "t" * 32, mode: int = 0o600) -> str:
    path.write_text(text + "\n")
    os.chmod(path, mode)
    return str(path)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602])
def test_a_token_others_can_access_is_refused(tmp_path: Path, mode: int) -> None:
    path = secret(tmp_path / "token", mode=mode)
    with pytest.raises(RemoteConfigError) as err:
        read_token(path)
    assert str(err.value) == (f"token file {path} is accessible by group or others (mode {mode:04o}): "
                              f"chmod 600 {path}")


def test_a_private_token_is_read(tmp_path: Path) -> None:
    assert read_token(secret(tmp_path / "token", "  abcdefghijklmnop  ")) == "abcdefghijklmnop"
    with pytest.raises(RemoteConfigError, match="shorter than 16"):
        read_token(secret(tmp_path / "short", "abc"))
    with pytest.raises(RemoteConfigError, match="printable ASCII"):
        read_token(secret(tmp_path / "spaces", "abcdefgh ijklmnopq"))
    with pytest.raises(RemoteConfigError, match="not a regular file"):
        read_token(str(tmp_path))


def test_peer_credentials_are_per_peer_and_never_the_node_token(tmp_path: Path) -> None:
    node = secret(tmp_path / "node", "n" * 40)
    own = secret(tmp_path / "own", "o" * 40)
    admin = secret(tmp_path / "admin", "a" * 40)
    cfg = Config(daemon=DaemonConfig(auth_token_file=node, admin_token_file=admin, node_name="me"),
                 peers=(PeerConfig(name="b", address="10.0.0.2:1"),
                        PeerConfig(name="c", address="10.0.0.3:1", token_file=own)))
    creds = load_credentials(cfg)
    b, c = cfg.peers
    assert creds.outbound(b) == peer_credential(b"n" * 40, "b") != peer_credential(b"n" * 40, "c")
    assert creds.outbound(c) == "o" * 40
    assert "n" * 40 not in (creds.outbound(b), creds.outbound(c))
    accepted = creds.accepted_tokens
    assert accepted[peer_credential(b"n" * 40, "me")][0] == PEER
    assert accepted["o" * 40][0] == PEER and accepted["a" * 40][0] == ADMIN
    assert "n" * 40 not in accepted and creds.outbound(b) not in accepted


def test_an_admin_token_equal_to_a_peer_token_is_refused(tmp_path: Path) -> None:
    same = secret(tmp_path / "same", "s" * 40)
    cfg = Config(daemon=DaemonConfig(admin_token_file=same),
                 peers=(PeerConfig(name="b", address="10.0.0.2:1", token_file=same),))
    with pytest.raises(RemoteConfigError, match="token of their own"):
        load_credentials(cfg)


def test_listen_binds_ip_literals_only() -> None:
    assert bind_addresses("127.0.0.1:7443") == ["127.0.0.1:7443"]
    assert bind_addresses("[::1]:7443") == ["[::1]:7443"]
    assert set(bind_addresses("localhost:7443")) <= {"127.0.0.1:7443", "[::1]:7443"}
    for bad in ("unix-abstract:7", "unix:9", "vsock:5", ":7443", "unix-abstract:memsnap-peer/0/0/1/x"):
        with pytest.raises(RemoteConfigError, match="daemon.listen"):
            bind_addresses(bad)
