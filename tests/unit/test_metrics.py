"""Metrics: increments show up in a real HTTP scrape of the exporter."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from memsnap.metrics import Metrics, serve


def scrape(port: int) -> str:
    """GET /metrics from the exporter."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        return bytes(resp.read()).decode()


def test_counters_histograms_and_gauges_appear_in_a_scrape() -> None:
    metrics = Metrics()
    server = serve(metrics, "127.0.0.1", 0)
    try:
        before = scrape(server.port)
        assert 'memsnap_checkpoints_total{result="ok"} 0.0' in before
        metrics.checkpoints.labels(result="ok").inc()
        metrics.checkpoints.labels(result="ok").inc()
        metrics.restores.labels(result="error").inc()
        metrics.migrations.labels(result="ok").inc()
        metrics.storage_errors.labels(op="put").inc()
        metrics.observe_phase("dump", 0.003)
        metrics.observe_phase("freeze", 0.002)
        metrics.drained_bytes.inc(4096)
        metrics.drain_queue_depth.set(3)
        metrics.bind_tier(used=lambda: 1024.0, capacity=lambda: 8192.0)
        body = scrape(server.port)
    finally:
        server.shutdown()
    assert 'memsnap_checkpoints_total{result="ok"} 2.0' in body
    assert 'memsnap_restores_total{result="error"} 1.0' in body
    assert 'memsnap_migrations_total{result="ok"} 1.0' in body
    assert 'memsnap_storage_errors_total{op="put"} 1.0' in body
    assert 'memsnap_phase_seconds_bucket{le="0.005",phase="dump"} 1.0' in body
    assert 'memsnap_phase_seconds_count{phase="freeze"} 1.0' in body
    assert 'memsnap_phase_seconds_count{phase="fetch"} 0.0' in body  # every phase exported before its first
    assert "memsnap_drained_bytes_total 4096.0" in body
    assert "memsnap_drain_queue_depth 3.0" in body
    assert "memsnap_tier_used_bytes 1024.0" in body
    assert "memsnap_tier_capacity_bytes 8192.0" in body
    assert "memsnap_drain_queue_bytes 0.0" in body
    names = {line.split("{")[0].split(" ")[0] for line in body.splitlines() if not line.startswith("#")}
    assert all(name.startswith("memsnap_") for name in names), names


def test_shutdown_frees_the_port() -> None:
    server = serve(Metrics(), "127.0.0.1", 0)
    port = server.port
    server.shutdown()
    server.shutdown()  # idempotent
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


def test_port_zero_reports_the_bound_port() -> None:
    server = serve(Metrics(), "127.0.0.1", 0)
    try:
        assert server.port > 0
        assert "memsnap_tier_used_bytes" in scrape(server.port)
    finally:
        server.shutdown()


def test_two_metrics_instances_do_not_collide() -> None:
    first, second = Metrics(), Metrics()
    first.checkpoints.labels(result="ok").inc()
    assert b'memsnap_checkpoints_total{result="ok"} 0.0' in second.render()


def test_unknown_phase_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown phase"):
        Metrics().observe_phase("thaw", 1.0)
