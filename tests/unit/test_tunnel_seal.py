"""The seal on page-tunnel messages: pure logic, no CRIU (the real lazy move with a flipped bit is in
tests/e2e/test_migrate_lazy.py)."""

from __future__ import annotations

import pytest

from memsnap.errors import IntegrityFailure
from memsnap.move.tunnel import Seal
from memsnap.v1 import memsnap_pb2 as pb

TUNNEL = "0123456789abcdef" * 2


def _msgs() -> list[pb.TunnelChunk]:
    return [pb.TunnelChunk(tunnel_id=TUNNEL, data=b"ck-1"), pb.TunnelChunk(data=b"page" * 1024),
            pb.TunnelChunk(data=b"more"), pb.TunnelChunk(done=True, ok=True)]


def _sealed(token: str = "node-token", direction: str = "to-target") -> list[pb.TunnelChunk]:
    seal = Seal(token, TUNNEL, direction)
    return [seal.seal(m) for m in _msgs()]


def test_sealed_messages_check_in_order():
    check = Seal("node-token", TUNNEL, "to-target")
    for m in _sealed():
        assert check.check(m) == m.data
        assert len(m.tag) == 16


@pytest.mark.parametrize("spoil", ["bit", "drop", "swap", "replay", "verdict", "untagged"])
def test_any_change_on_the_way_fails_the_check(spoil: str):
    msgs = _sealed()
    if spoil == "bit":
        msgs[1].data = bytes([msgs[1].data[0] ^ 1]) + msgs[1].data[1:]
    elif spoil == "drop":
        del msgs[1]
    elif spoil == "swap":
        msgs[1], msgs[2] = msgs[2], msgs[1]
    elif spoil == "replay":
        msgs.insert(2, msgs[1])
    elif spoil == "verdict":
        msgs[3].ok = False  # a forged "not ok" (or "ok") verdict
    else:
        msgs[2].tag = b""
    check = Seal("node-token", TUNNEL, "to-target")
    with pytest.raises(IntegrityFailure, match="integrity check failed: page tunnel message"):
        for m in msgs:
            check.check(m)


@pytest.mark.parametrize("other", [("other-token", TUNNEL, "to-target"), ("node-token", "f" * 32, "to-target"),
                                   ("node-token", TUNNEL, "to-source"), ("", TUNNEL, "to-target")])
def test_another_token_tunnel_or_direction_does_not_check(other: tuple[str, str, str]):
    with pytest.raises(IntegrityFailure):
        Seal(*other).check(_sealed()[0])


def test_without_a_token_the_tag_still_catches_corruption():
    msgs = _sealed(token="")
    check = Seal("", TUNNEL, "to-target")
    assert check.check(msgs[0]) == b"ck-1"
    msgs[1].data = b"x" + msgs[1].data[1:]
    with pytest.raises(IntegrityFailure):
        check.check(msgs[1])
