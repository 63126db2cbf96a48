"""Test-only knobs: memsnapd names each one that is set, so none is left on in production unnoticed."""

from __future__ import annotations

import logging

import pytest

from memsnap import failpoints


def test_every_test_knob_set_is_warned_about(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    for k in failpoints.TEST_KNOBS:
        monkeypatch.setenv(k, "1")
    with caplog.at_level(logging.WARNING):
        found = failpoints.warn_if_set(logging.getLogger("t"))
    assert found == list(failpoints.TEST_KNOBS)
    assert all(any(k in r.getMessage() for r in caplog.records) for k in failpoints.TEST_KNOBS)


def test_no_warning_without_knobs(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    for k in failpoints.TEST_KNOBS:
        monkeypatch.delenv(k, raising=False)
    with caplog.at_level(logging.WARNING):
        assert failpoints.warn_if_set(logging.getLogger("t")) == []
    assert not caplog.records
