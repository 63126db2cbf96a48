"""The transfer manifest a peer sends with a moved image is parsed with the store's bounds: a hostile or broken
peer gets an integrity failure (the move rolls back), never an internal error."""

from __future__ import annotations

from pathlib import Path

import pytest

from memsnap.errors import IntegrityFailure
from memsnap.move.stream import ImageReceiver


def _receiver() -> ImageReceiver:
    r = ImageReceiver.__new__(ImageReceiver)  # (only _verify is exercised: it reads verify_key)
    r.verify_key = None
    return r


@pytest.mark.parametrize("signed", [b"[" * 200_000 + b"]" * 200_000, b'{"files": ' * 50_000 + b"{}" + b"}" * 50_000,
                                    b"\xff\xfe not json", b'{"files": {}, "x": NaN}', b"[]"],
                         ids=["deep-list", "deep-object", "not-utf8", "nan", "not-an-object"])
def test_a_transfer_manifest_that_nests_too_deep_or_does_not_parse_is_an_integrity_failure(signed: bytes) -> None:
    with pytest.raises(IntegrityFailure, match="transfer manifest"):
        _receiver()._verify(signed, {}, Path("/nonexistent/ck-1"))
