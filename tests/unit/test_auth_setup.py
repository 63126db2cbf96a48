"""memsnap.auth decisions the mutation run found unchecked (docs/mutation.md): the key that signs moved
images, and which secret files are accepted."""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import pytest

from memsnap.auth import RemoteConfigError, read_secret, read_token, transfer_key

TOKEN = "0123456789abcdef0123456789abcdef"


def test_the_transfer_key_is_the_documented_derivation_of_the_token() -> None:
    # Both ends of a move derive it on their own, possibly from different memsnap versions: it is a format.
    want = hmac.new(TOKEN.encode(), b"memsnap transfer manifest v1", hashlib.sha256).digest()
    assert transfer_key(TOKEN) == transfer_key(TOKEN.encode()) == transfer_key(f" {TOKEN}\n") == want
    assert len(want) == 32


def test_each_token_has_its_own_transfer_key() -> None:
    assert transfer_key(TOKEN) != transfer_key(TOKEN[:-1] + "0")
    assert transfer_key(TOKEN) != TOKEN.encode()  # never the token itself


def test_a_token_that_is_not_ascii_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "token"
    p.write_bytes("é".encode() * 16)
    p.chmod(0o600)
    with pytest.raises(RemoteConfigError, match="printable ASCII"):
        read_token(str(p))


def test_a_fifo_as_secret_is_refused_without_blocking_on_it(tmp_path: Path) -> None:
    p = tmp_path / "token"
    os.mkfifo(p, 0o600)
    with pytest.raises(RemoteConfigError, match="not a regular file"):
        read_secret(str(p), "token file")


def test_a_secret_larger_than_one_read_is_read_whole(tmp_path: Path) -> None:
    p = tmp_path / "key.pem"
    data = bytes(range(256)) * 1024
    p.write_bytes(data)
    p.chmod(0o600)
    assert read_secret(str(p), "TLS key") == data
