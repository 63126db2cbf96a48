"""memsnap.logs.Quieted: warnings an outsider can cause, each kind at most once per interval."""

from __future__ import annotations

import logging

import pytest

from memsnap.logs import Quieted


def test_a_flood_of_one_kind_logs_once_per_interval_and_then_says_how_many_were_left_out(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    q = Quieted(logging.getLogger("memsnap.test.quiet"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="memsnap.test.quiet"):
        for i in range(500):
            q.warning("refused a call from %s", f"10.0.0.{i % 250}")
        q.warning("bad hello from %s", "10.0.0.9")  # (another kind: its own line)
        now[0] += 10.0
        q.warning("refused a call from %s", "10.0.0.7")
        q.warning("refused a call from %s", "10.0.0.8")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a call from 10.0.0.0",
        "bad hello from 10.0.0.9",
        "refused a call from 10.0.0.7 (499 more like it left out since the last)",
    ]
