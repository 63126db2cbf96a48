"""Prometheus metrics for memsnapd, in a dedicated registry, and their HTTP exporter."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import start_http_server

# page_in: lazy restore from the store; restore: a whole restore; the others: memsnap.phases (a checkpoint's and a
# restore's own phases: quiesce hooks, GPU stages, CRIU, publish).
PHASES = ("freeze", "dump", "drain", "fetch", "restore", "page_in", "quiesce", "gpu_describe", "gpu_lock",
          "gpu_checkpoint", "publish", "gpu_restore", "gpu_unlock", "quiesce_resume", "verify", "placeholder",
          "criu_restore")
RESULTS = ("ok", "error")
STORAGE_OPS = ("put", "get", "delete", "list")
BAD_OBJECT_KINDS = ("pack", "manifest", "sweep-record", "name-index")  # = memsnap.store.bad_objects.KINDS
# 1 ms .. 10 min, roughly 1-2.5-5 per decade: freezes take ms, drains of big images take minutes.
PHASE_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    25.0,
    60.0,
    120.0,
    300.0,
    600.0,
)


class Metrics:
    """Every memsnap_* metric, registered in its own CollectorRegistry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        """Create the metrics in registry (a fresh one by default)."""
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.checkpoints = Counter(
            "memsnap_checkpoints_total", "Checkpoints finished, by result.", ["result"], registry=r
        )
        self.restores = Counter(
            "memsnap_restores_total", "Restores finished, by result.", ["result"], registry=r
        )
        self.migrations = Counter(
            "memsnap_migrations_total", "Migrations finished, by result.", ["result"], registry=r
        )
        self.storage_errors = Counter(
            "memsnap_storage_errors_total",
            "Storage backend errors, by operation.",
            ["op"],
            registry=r,
        )
        self.phase_seconds = Histogram(
            "memsnap_phase_seconds",
            "Duration of checkpoint/restore phases.",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.tier_used_bytes = Gauge(
            "memsnap_tier_used_bytes", "Bytes used or reserved in the memory tier.", registry=r
        )
        self.tier_capacity_bytes = Gauge(
            "memsnap_tier_capacity_bytes", "Usable bytes of the memory tier.", registry=r
        )
        self.tier_info = Gauge(
            "memsnap_tier_info", "1, labelled with what the memory tier is on: tier.kind, the filesystem, whether "
            "memsnapd mounted it (tier.mount) and its huge pages.",
            ["kind", "fstype", "mounted_by_memsnapd", "huge_pages"], registry=r,
        )
        self.drain_queue_depth = Gauge(
            "memsnap_drain_queue_depth", "Checkpoints waiting to be drained.", registry=r
        )
        self.drain_queue_bytes = Gauge(
            "memsnap_drain_queue_bytes", "Bytes waiting to be drained.", registry=r
        )
        self.moves_in_doubt = Gauge(
            "memsnap_moves_in_doubt", "Outgoing moves whose commit the target has not answered (the job "
            "waits stopped here).", registry=r
        )
        self.drained_bytes = Counter(
            "memsnap_drained_bytes_total", "Bytes written to the store by drains.", registry=r
        )
        # memsnap.guard: parks instead of OOM kills
        self.guard_events = Counter(
            "memsnap_guard_events_total", "Memory events the guard acted on (limit: a job at its cgroup "
            "limit; node: node pressure policy decisions).", ["kind"], registry=r
        )
        self.guard_parks = Counter(
            "memsnap_guard_parks_total", "Jobs parked by the guard, by result (observed: observe mode, "
            "nothing parked).", ["result"], registry=r
        )
        self.guard_resumes = Counter(
            "memsnap_guard_resumes_total", "Parked jobs resumed, by trigger.", ["trigger"], registry=r
        )
        self.guard_park_seconds = Histogram(
            "memsnap_guard_park_seconds", "Trigger to parked (image staged, job stopped).",
            buckets=PHASE_BUCKETS, registry=r
        )
        self.guard_peak_node_bytes = Gauge(
            "memsnap_guard_peak_node_bytes", "Peak node memory in use (MemTotal - MemAvailable) during the "
            "last park.", registry=r
        )
        # memsnap.gc: retention and the chunk sweep; the store's size as this node's catalog sees it
        self.gc_runs = Counter("memsnap_gc_runs_total", "gc runs (memsnapctl gc and the periodic one), by result "
                               "(deferred: drains kept running, the sweep deleted nothing).", ["result"], registry=r)
        self.gc_checkpoints_deleted = Counter(
            "memsnap_gc_checkpoints_deleted_total", "Checkpoints gc deleted under the retention policy.", registry=r)
        self.gc_chunks_swept = Counter(
            "memsnap_gc_chunks_swept_total", "Store chunks gc swept (referenced by no manifest).", registry=r)
        self.gc_bytes_freed = Counter(
            "memsnap_gc_bytes_freed_total", "Store bytes gc freed (deleted checkpoints' own bytes and swept "
            "chunks).", registry=r)
        self.store_bytes = Gauge(
            "memsnap_store_bytes", "Bytes this node's durable checkpoints wrote to the store (compressed; each "
            "chunk counted once, by the checkpoint that uploaded it).", registry=r)
        self.store_logical_bytes = Gauge(
            "memsnap_store_logical_bytes", "Image bytes of this node's durable checkpoints (before compression "
            "and deduplication).", registry=r)
        self.store_bad_objects = Counter(
            "memsnap_store_bad_objects_total", "Objects in the store that drains, gc and restores skipped because "
            "memsnap did not write them (a planted pack, a cut manifest...), each counted once, by kind; "
            "memsnapctl status names them.", ["kind"], registry=r)
        self.store_dedup_ratio = Gauge(
            "memsnap_store_dedup_ratio", "memsnap_store_logical_bytes / memsnap_store_bytes (compression and "
            "deduplication together; 0 when the store holds nothing).", registry=r)
        for result in (*RESULTS, "deferred"):
            self.gc_runs.labels(result=result)
        for kind in BAD_OBJECT_KINDS:
            self.store_bad_objects.labels(kind=kind)
        for kind in ("limit", "node"):
            self.guard_events.labels(kind=kind)
        for result in ("ok", "error", "observed"):
            self.guard_parks.labels(result=result)
        for trigger in ("auto", "manual"):
            self.guard_resumes.labels(trigger=trigger)
        for result in RESULTS:  # export zeros so rate() works before the first event
            for counter in (self.checkpoints, self.restores, self.migrations):
                counter.labels(result=result)
        for op in STORAGE_OPS:
            self.storage_errors.labels(op=op)
        for phase in PHASES:
            self.phase_seconds.labels(phase=phase)
        r.register(_BackgroundCollector())

    def count_bad_object(self, kind: str) -> None:
        """One more object of kind skipped in the store (memsnap.store.bad_objects)."""
        self.store_bad_objects.labels(kind=kind).inc()

    def observe_phase(self, phase: str, seconds: float) -> None:
        """Record one phase duration; phase is one of PHASES."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        self.phase_seconds.labels(phase=phase).observe(seconds)

    def bind_tier(self, used: Callable[[], float], capacity: Callable[[], float]) -> None:
        """Compute the tier gauges at scrape time from these callbacks."""
        self.tier_used_bytes.set_function(used)
        self.tier_capacity_bytes.set_function(capacity)

    def set_tier_info(self, kind: str, fstype: str, mounted_by_memsnapd: bool, huge_pages: str) -> None:
        """memsnap_tier_info (fixed for the daemon's life: the tier is set up once, at start)."""
        self.tier_info.labels(kind, fstype, str(mounted_by_memsnapd).lower(), huge_pages).set(1)

    def bind_drain_queue(self, depth: Callable[[], float], size: Callable[[], float]) -> None:
        """Compute the drain-queue gauges at scrape time from these callbacks."""
        self.drain_queue_depth.set_function(depth)
        self.drain_queue_bytes.set_function(size)

    def bind_store(self, totals: Callable[[], tuple[float, float]]) -> None:
        """Compute the store gauges at scrape time: totals() = (stored bytes, logical bytes)."""
        self.store_bytes.set_function(lambda: totals()[0])
        self.store_logical_bytes.set_function(lambda: totals()[1])

        def ratio() -> float:
            stored, logical = totals()
            return logical / stored if stored > 0 else 0.0

        self.store_dedup_ratio.set_function(ratio)

    def bind_quota(self, report: Callable[[], list[tuple[int, Any, dict[str, Any]]]]) -> None:
        """memsnap_quota_used / memsnap_quota_limit per uid and resource, from report() at scrape time
        (memsnap.quota.Quotas.report: (uid, usage, limits))."""
        self.registry.register(_QuotaCollector(report))

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format."""
        return generate_latest(self.registry)


class _BackgroundCollector:
    """Drains held back by foreground work (memsnap.background), read from the gate at scrape time."""

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from memsnap.background import gate

        snap = gate().snapshot()
        yield GaugeMetricFamily("memsnap_drain_paused", "1 while some drain is paused or waits for foreground "
                                "work (dump, restore, lazy paging, guard park).", value=float(snap["drains_paused"]))
        yield CounterMetricFamily("memsnap_drain_paused_seconds", "Seconds during which some drain was held "
                                  "back by foreground work.", value=float(snap["drains_paused_seconds"]))
        c = CounterMetricFamily("memsnap_drain_holds", "Drains held back by foreground work: paused while "
                                "running, waiting while queued, or overridden (urgent, or pause bound spent).",
                                labels=["kind"])
        c.add_metric(["paused"], float(snap["drain_pauses"]))
        c.add_metric(["waiting"], float(snap["drain_waits"]))
        c.add_metric(["overridden"], float(snap["drain_pause_overrides"]))
        yield c


class _QuotaCollector:
    """What each uid uses of the tier, the store, jobs and checkpoints, and its limits ([quota])."""

    RESOURCES = ("tier_bytes", "store_bytes", "jobs", "checkpoints")

    def __init__(self, report: Callable[[], list[tuple[int, Any, dict[str, Any]]]]) -> None:
        self.report = report

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        used = GaugeMetricFamily("memsnap_quota_used", "What a uid uses on this node (resource: tier_bytes, "
                                 "store_bytes, jobs, checkpoints; docs/quota.md).", labels=["uid", "resource"])
        limit = GaugeMetricFamily("memsnap_quota_limit", "A uid's limit ([quota]); absent: no limit.",
                                  labels=["uid", "resource"])
        for uid, usage, limits in self.report():
            for r in self.RESOURCES:
                used.add_metric([str(uid), r], float(getattr(usage, r)))
                if r in limits:
                    limit.add_metric([str(uid), r], float(limits[r].value))
        yield used
        yield limit


class MetricsServer:
    """A running exporter; shutdown() stops it and frees the port."""

    def __init__(self, host: str, port: int, stop: Callable[[], None]) -> None:
        """Wrap the bound address and the function that stops the server."""
        self.host = host
        self.port = port
        self._stop: Callable[[], None] | None = stop
        self._lock = threading.Lock()

    def shutdown(self) -> None:
        """Stop serving and close the listening socket (idempotent)."""
        with self._lock:
            stop, self._stop = self._stop, None
        if stop is not None:
            stop()


def serve(metrics: Metrics, host: str, port: int) -> MetricsServer:
    """Serve metrics.registry at http://host:port/metrics in a daemon thread; port 0 = any."""
    httpd, thread = start_http_server(port, addr=host, registry=metrics.registry)

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5.0)

    return MetricsServer(host, int(httpd.server_address[1]), stop)
