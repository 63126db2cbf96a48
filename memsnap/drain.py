"""The drain: the upload scheduler. It copies staged checkpoints from the tier into the store repository
(memsnap.repository) in the background, journaled, retried, and out of foreground work's way.

Life of a drain: STAGED -> (journal DRAINING) -> Repository.put: every file streamed through zstd into the
store, its raw blake3 checked against the signed tier manifest -> store manifest (signed) written LAST ->
(journal DURABLE). A failure journals the reason, goes back to STAGED and retries with exponential backoff.
After a crash, STAGED/DRAINING checkpoints are simply drained again: objects are written atomically and the
store manifest is what makes a copy count.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from memsnap import background, backoff, lifecycle, manifest, safefs
from memsnap.catalog import DRAINING, DURABLE, STAGED, Catalog, CheckpointRecord, now_ms
from memsnap.malloc import idle_heap, release_memory
from memsnap.repository import Repository
from memsnap.store import Codec, StoreError, Throttle, open_store
from memsnap.store.chunked import ChunkOpts
from memsnap.store.posix import StoreTampered
from memsnap.tier import MemoryTier
from memsnap.tiers import Tiers

log = logging.getLogger("memsnap.drain")

_PROGRESS_EVERY_S = 0.25


class DrainService:
    """A pool of drain workers over a time-ordered queue, sharing one bandwidth throttle."""

    def __init__(self, repo: Repository, catalog: Catalog, tier: Tiers | MemoryTier, concurrency: int = 2,
                 retry_initial_s: float = 1.0, retry_max_s: float = 60.0, metrics: Any = None) -> None:
        self.repo = repo
        self.catalog = catalog
        self.tier = tier
        self.key = repo.key
        self.concurrency = max(1, concurrency)
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.metrics = metrics
        self._heap: list[tuple[float, str]] = []
        self._queued: set[str] = set()
        self._active: set[str] = set()
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- queue --------------------------------------------------------------------------------
    def start(self, pending: list[str]) -> None:
        """Opens the repository (interrupted uploads removed), requeues unfinished drains and starts the
        workers."""
        self.repo.open({r.id for r in self.catalog.checkpoints() if r.in_tier})
        for ckpt_id in pending:
            self.enqueue(ckpt_id)
        for i in [*map(str, range(self.concurrency)), "urgent"]:  # (+ a spare one for urgent drains: see Gate)
            t = threading.Thread(target=self._worker, args=(i == "urgent",), name=f"drain-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def enqueue(self, ckpt_id: str, delay_s: float = 0.0) -> None:
        """Queues a checkpoint for draining (now, or after delay_s)."""
        with self._cv:
            if ckpt_id in self._queued:
                return
            self._queued.add(ckpt_id)
            heapq.heappush(self._heap, (time.monotonic() + delay_s, ckpt_id))
            self._cv.notify()

    def stop(self) -> None:
        """Stops the workers; an interrupted drain resumes at the next start."""
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=5)

    def queue_stats(self) -> tuple[int, int]:
        """(checkpoints waiting or draining, bytes still to drain)."""
        with self._cv:
            ids = set(self._queued) | set(self._active)
        left = 0
        for ckpt_id in ids:
            rec = self.catalog.get_checkpoint(ckpt_id)
            if rec is not None:
                left += max(0, rec.size_bytes - rec.drained_bytes)
        return len(ids), left

    def _next(self, urgent_only: bool = False) -> str | None:
        with self._cv:
            while not self._stop.is_set():
                if self._heap:
                    wait = self._heap[0][0] - time.monotonic()
                    if wait <= 0:
                        taken = background.take_due(self._heap, urgent_only=urgent_only)  # (see Gate)
                        if taken is None:
                            self._cv.wait(background.POLL_S)
                            continue
                        ckpt_id = taken
                        self._queued.discard(ckpt_id)
                        self._active.add(ckpt_id)
                        return ckpt_id
                    self._cv.wait(min(wait, 1.0))
                else:
                    self._cv.wait(1.0)
        return None

    def _worker(self, urgent_only: bool = False) -> None:
        while (ckpt_id := self._next(urgent_only)) is not None:
            try:
                self._drain_with_retry(ckpt_id)
            finally:
                with self._cv:
                    self._active.discard(ckpt_id)
                background.gate().forget(ckpt_id)
                release_memory()

    # -- one drain ----------------------------------------------------------------------------
    def _drain_with_retry(self, ckpt_id: str) -> None:
        rec = self.catalog.get_checkpoint(ckpt_id)
        if rec is None or rec.state not in (STAGED, DRAINING) or not rec.in_tier or rec.meta.get("moved_to") \
                or rec.meta.get("move_incoming"):
            return  # (a committed move's source image: the target drains it; a received one: once committed)
        clog = logging.LoggerAdapter(log, {"checkpoint_id": ckpt_id})
        attempts = rec.drain_attempts + 1
        if not lifecycle.advance(self.catalog, ckpt_id, DRAINING, drain_attempts=attempts, drained_bytes=0):
            self._forget(ckpt_id)  # (deleted meanwhile: what an earlier attempt left in the store goes too)
            return
        t0 = time.monotonic()
        try:
            stored = self._drain(rec)
        except background.MovedAway as exc:  # the target drains it; its objects may share our keys
            clog.info("drain stopped: %s", exc)
            return
        except Exception as exc:  # any failure: keep the reason, back off, try again
            if self.catalog.get_checkpoint(ckpt_id) is None:
                self._forget(ckpt_id)  # deleted while draining
                return
            delay = backoff.Backoff(self.retry_initial_s, 2.0, self.retry_max_s).delay(attempts - 1)
            reason = f"{type(exc).__name__}: {exc}" if not isinstance(exc, StoreError) else str(exc)
            lifecycle.advance(self.catalog, ckpt_id, STAGED, last_error=reason,
                                           next_attempt_ms=now_ms() + int(delay * 1000))
            self.repo.storage_error("put")
            # Tampering (a symlink where the store or tier had a directory) is an error, not a hiccup.
            level = logging.ERROR if isinstance(exc, (StoreTampered, safefs.UnsafePath)) else logging.WARNING
            clog.log(level, "drain attempt %d failed, retrying in %.1fs: %s", attempts, delay, reason)
            self.enqueue(ckpt_id, delay)
            return
        if self.catalog.get_checkpoint(ckpt_id) is None:
            self._forget(ckpt_id)
            return
        lifecycle.advance(self.catalog, ckpt_id, DURABLE, in_store=True, durable_ms=now_ms(),
                                       drained_bytes=rec.size_bytes, stored_bytes=stored, last_error="",
                                       next_attempt_ms=0)
        secs = time.monotonic() - t0
        if self.metrics is not None:
            self.metrics.observe_phase("drain", secs)
        clog.info("durable in %s: %d bytes stored in %.2fs", self.repo.describe(), stored, secs)

    def _forget(self, ckpt_id: str) -> None:
        if background.moved_away(ckpt_id):
            return  # a shared store may hold the target's objects under this id
        self.repo.forget(ckpt_id)

    def _drain(self, rec: CheckpointRecord) -> int:
        src = self.tier.path(rec.id)
        # Bound to this record: a tier copy of another checkpoint put in its place is never made durable as it.
        tier_manifest = manifest.verify_dir_signature_only(src, self.key,
                                                           bound_to=(rec.id, rec.job, rec.owner_uid))
        done = 0
        last_report = time.monotonic()

        def progress(n: int) -> None:
            nonlocal done, last_report
            done += n
            if self.metrics is not None:
                self.metrics.drained_bytes.inc(n)
            if time.monotonic() - last_report >= _PROGRESS_EVERY_S:
                last_report = time.monotonic()
                self.catalog.update_checkpoint(rec.id, drained_bytes=done)
            background.check_still_wanted(rec.id)  # (a committed move's source image: the target drains it)
            background.gate().pause_point(rec.id, self._stop.is_set)  # foreground work first

        def before_publish() -> None:
            self.catalog.update_checkpoint(rec.id, drained_bytes=done)
            background.check_still_wanted(rec.id)  # (moved away meanwhile: no manifest, so no stored copy)

        trusted = (self.catalog.get_checkpoint(rec.id) or rec).meta.get("fingerprint")
        with safefs.opened(os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)) as sfd:
            put = self.repo.put(rec, sfd, tier_manifest, progress, trusted, before_publish)
        if put.chunk_stats:
            lifecycle.mark(self.catalog, rec.id, store=put.chunk_stats)
        return put.stored_bytes


def same_filesystem(a: str, b: str) -> bool:
    """Whether paths a and b (or, where one does not exist yet, its nearest existing parent) are on one
    filesystem."""
    def dev(path: str) -> int:
        p = Path(path).absolute()
        while not p.exists() and p != p.parent:
            p = p.parent
        return os.stat(p).st_dev

    try:
        return dev(a) == dev(b)
    except OSError:
        return False


def build_repository(cfg: Any, catalog: Catalog, tier: Tiers | MemoryTier, key: bytes,
                     metrics: Any) -> Repository | None:
    """The store repository for a daemon config: S3 when store.url is set, else the POSIX store dir; None
    without a store."""
    idle_heap()  # the drain's and fetch's 4 MiB chunks go back to the OS when freed (memsnap.malloc)
    if cfg.store.url:
        store = open_store(store_url=cfg.store.url, endpoint_url=cfg.store.s3_endpoint or None,
                           region=cfg.store.s3_region or None)
    elif cfg.store.dir:
        store = open_store(store_dir=cfg.store.dir, create=True)
    else:
        return None
    # 0 = auto. Under a bandwidth cap, one synchronous compressor: zstd's worker threads hand their output
    # back in bursts of tens of MB, which the token bucket cannot bank, and drains reached only 0.84-0.87 of
    # the cap (0.95-0.97 synchronous). Without a cap, every core (the same speed at 1 Gbit/s).
    threads = cfg.drain.compression_threads or (0 if cfg.drain.bandwidth else -1)
    codec = Codec(level=cfg.drain.compression_level or None, threads=threads)
    background.configure(cfg.drain.max_pause_s)
    throttle = Throttle(cfg.drain.bandwidth) if cfg.drain.bandwidth else None
    cache_size = cfg.store.chunk_cache_size or 0
    cache_dir = cfg.store.chunk_cache_dir or str(Path(cfg.state.dir) / "chunk-cache")
    if cache_size and not cfg.store.url and same_filesystem(cfg.store.dir, cache_dir):
        # A copy of the store's chunks on the store's own filesystem saves no trip: its many small files read
        # slower than the store's packs, and filling it after each restore writes the image a second time.
        log.info("chunk cache off: %s is on the same filesystem as the store %s (set store.chunk_cache_dir "
                 "to a faster disk to have one)", cache_dir, cfg.store.dir)
        cache_size = 0
    opts = ChunkOpts(format=cfg.store.format, avg=cfg.store.chunk_size, state_dir=cfg.state.dir,
                     cache_dir=cfg.store.chunk_cache_dir, cache_size=cache_size,
                     pack_size=cfg.store.pack_size or 0)

    def local_copies(exclude: str) -> dict[str, Path]:  # (chunks a fetch finds here instead of in the store)
        return {r.id: tier.path(r.id) for r in catalog.checkpoints()
                if r.in_tier and r.id != exclude and tier.has(r.id)}

    return Repository(store, key, codec, throttle, metrics, opts, local_copies)


def build_drain(cfg: Any, catalog: Catalog, tier: Tiers | MemoryTier, repo: Repository | None,
                metrics: Any) -> DrainService | None:
    """The drain of tier into repo (None without a store)."""
    if repo is None:
        return None
    return DrainService(repo, catalog, tier, cfg.drain.concurrency, cfg.drain.retry_initial_s,
                        cfg.drain.retry_max_s, metrics)


__all__ = ["DrainService", "build_drain", "build_repository"]
