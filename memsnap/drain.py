"""The drain: copies staged checkpoints from the tier to storage in the background, journaled and verified.

Life of a drain: STAGED -> (journal DRAINING) -> every file streamed through zstd into the store, its raw
blake3 checked against the signed tier manifest -> store manifest (signed, with per-object stored sizes and
hashes) written LAST -> object sizes verified -> (journal DURABLE). A failure journals the reason, goes back
to STAGED and retries with exponential backoff. After a crash, STAGED/DRAINING checkpoints are simply
drained again: objects are written atomically and the store manifest is what makes a copy count.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import queue
import re
import secrets
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from memsnap import background, backoff, failpoints, lifecycle, manifest, safefs
from memsnap.catalog import DRAINING, DURABLE, STAGED, Catalog, CheckpointRecord, now_ms
from memsnap.errors import IntegrityFailure, Unavailable
from memsnap.malloc import idle_heap, release_memory
from memsnap.store import (
    MANIFEST_NAME,
    Codec,
    EncodeResult,
    Store,
    StoreCorrupt,
    StoreError,
    StoreNotFound,
    StoreUnavailable,
    Throttle,
    chunked,
    chunks,
    copy_decode,
    copy_encode,
    open_store,
)
from memsnap.store.chunked import ChunkOpts
from memsnap.store.posix import StoreTampered
from memsnap.tier import MemoryTier

log = logging.getLogger("memsnap.drain")

INDEX = "_index"
STORE_ID = "_store/id"  # the store's identity (Drain.store_id)
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

_PROGRESS_EVERY_S = 0.25
# Files at least this big are written by a helper thread while the next chunk is read, hashed and compressed.
_PIPELINE_MIN = 8 << 20
_PIPELINE_DEPTH = 4  # chunks (~4 MiB each) in flight between the encoder and the store writer


class DrainService:
    """A pool of drain workers over a time-ordered queue, sharing one bandwidth throttle."""

    def __init__(self, store: Store, catalog: Catalog, tier: MemoryTier, key: bytes, codec: Codec,
                 throttle: Throttle | None = None, concurrency: int = 2, retry_initial_s: float = 1.0,
                 retry_max_s: float = 60.0, metrics: Any = None, chunk_opts: ChunkOpts | None = None) -> None:
        self.store = store
        self.chunk_opts = chunk_opts or ChunkOpts()
        self.node_chunks = chunked.NodeChunks(store.describe(), self.chunk_opts)
        self.catalog = catalog
        self.tier = tier
        self.key = key
        self.codec = codec
        self.throttle = throttle
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
        self._store_id = ""

    def describe(self) -> str:
        """Where checkpoints go."""
        return self.store.describe()

    def store_id(self) -> str:
        """A random id kept in the store (STORE_ID), created on first use: two daemons see the same one only
        if they share the store. A hint for preflights (a store writer can change it); integrity still rests
        on the signed manifests. "" when the store cannot be reached."""
        if self._store_id:
            return self._store_id
        try:
            if not self.store.exists(STORE_ID):
                w = self.store.open_writer(STORE_ID)
                try:
                    w.write(secrets.token_hex(16).encode())
                    w.commit()
                except BaseException:
                    w.abort()
                    raise
            with self.store.open_reader(STORE_ID) as r:
                got = r.read(64).decode("ascii", "replace").strip()
        except (StoreError, OSError, ValueError) as exc:
            log.warning("cannot read the store's id in %s: %s", self.store.describe(), exc)
            return ""
        self._store_id = got if got.isalnum() else ""
        return self._store_id

    # -- queue --------------------------------------------------------------------------------
    def start(self, pending: list[str]) -> None:
        """Cleans up interrupted uploads, requeues unfinished drains and starts the workers."""
        try:
            removed = self.store.cleanup_temps()
            if removed:
                log.info("removed %d interrupted uploads from the store", removed)
        except StoreError as exc:
            log.warning("store not reachable at start (%s); drains will retry", exc)
        try:
            self.node_chunks.prepare({r.id for r in self.catalog.checkpoints() if r.in_tier})
        except OSError as exc:
            log.warning("chunk state in %s unusable: %s", self.chunk_opts.state_dir, exc)
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
            self._storage_error("put")
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
        clog.info("durable in %s: %d bytes stored in %.2fs", self.store.describe(), stored, secs)

    def _storage_error(self, op: str) -> None:
        if self.metrics is not None:
            self.metrics.storage_errors.labels(op=op).inc()

    def _forget(self, ckpt_id: str) -> None:
        if background.moved_away(ckpt_id):
            return  # a shared store may hold the target's objects under this id
        try:
            self.store.delete_prefix(ckpt_id + "/")
        except StoreError:
            self._storage_error("delete")

    def _drain(self, rec: CheckpointRecord) -> int:
        src = self.tier.path(rec.id)
        # Bound to this record: a tier copy of another checkpoint put in its place is never made durable as it.
        tier_manifest = manifest.verify_dir_signature_only(src, self.key,
                                                           bound_to=(rec.id, rec.job, rec.owner_uid))
        with safefs.opened(os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)) as sfd:
            return self._drain_files(rec, sfd, tier_manifest)

    def _drain_files(self, rec: CheckpointRecord, sfd: int, tier_manifest: dict[str, Any]) -> int:
        files: dict[str, dict[str, Any]] = tier_manifest["files"]
        chunked_format = self.chunk_opts.format == "chunked"
        done = 0
        last_report = time.monotonic()
        stored_files: dict[str, dict[str, Any]] = {}

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

        if chunked_format:
            return self._drain_chunked(rec, sfd, tier_manifest, progress)
        # Small files first, so a late failure retries only the big page images.
        for name in sorted(files, key=lambda n: (files[n]["size"], n)):
            meta = files[name]
            key = f"{rec.id}/{name}" + (".zst" if self.codec.compressed else "")
            with os.fdopen(safefs.open_file(sfd, name), "rb") as f, self.store.open_writer(key) as w:
                # Overlap the store's I/O with hashing and compressing: done in turn, the CPU work
                # left the link idle ~20% of the time (drain of 1 GiB to a 1 Gbit/s store).
                sink: Any = _Pipelined(w) if int(meta["size"]) >= _PIPELINE_MIN else w
                try:
                    res = copy_encode(f, sink, self.codec, self.throttle, progress)
                    if isinstance(sink, _Pipelined):
                        sink.flush()
                finally:
                    if isinstance(sink, _Pipelined):
                        sink.close()
                if res.raw_blake3 != meta["blake3"] or res.raw_bytes != meta["size"]:
                    raise IntegrityFailure(f"integrity check failed: tier copy of {name} does not match its "
                                           "manifest; it will not be made durable")
                obj = w.commit()
            stored_files[name] = {"key": key, "stored_bytes": res.stored_bytes,
                                  "stored_blake3": res.stored_blake3, "codec": self.codec.name}
            if obj.size_bytes != res.stored_bytes:
                raise StoreUnavailable(f"store reports {obj.size_bytes} bytes for {key}, wrote {res.stored_bytes}")
        self.catalog.update_checkpoint(rec.id, drained_bytes=done)
        background.check_still_wanted(rec.id)  # (moved away meanwhile: no manifest, so no stored copy)
        body = dict(tier_manifest)
        body["storage"] = {"codec": self.codec.name, "files": stored_files}
        signed = manifest.sign(body, self.key)
        data = json.dumps(signed, indent=1, sort_keys=True).encode()
        with self.store.open_writer(f"{rec.id}/{MANIFEST_NAME}") as w:
            w.write(data)
            w.commit()
        # Verified: every object is there at the size we wrote (contents were checked on the way in).
        for s in stored_files.values():
            if self.store.stat(s["key"]) != s["stored_bytes"]:
                raise StoreUnavailable(f"stored {s['key']} has the wrong size after upload")
        self._index_name(rec)
        return sum(int(s["stored_bytes"]) for s in stored_files.values()) + len(data)

    # -- chunked format (memsnap.store.chunked) -----------------------------------------------------------
    def _drain_chunked(self, rec: CheckpointRecord, sfd: int, tier_manifest: dict[str, Any], progress: Any) -> int:
        cstore: chunks.ChunkStore = self.store  # type: ignore[assignment]
        trusted = (self.catalog.get_checkpoint(rec.id) or rec).meta.get("fingerprint")
        # From the first chunk to the manifest, a store lock keeps sweeps out (memsnap.store.chunkgc).
        with self.node_chunks.store_gc(cstore).draining() as grant:
            job = chunked.ChunkedDrain(cstore, self.codec.level or 0, self.node_chunks.index(),
                                       chunks.Chunking(self.chunk_opts.avg), self.throttle, self.chunk_opts.threads,
                                       trust_index=grant.trust_index, pack_size=self.chunk_opts.pack_size)
            storage = job.run(rec.id, sfd, tier_manifest["files"], trusted, progress)
            background.check_still_wanted(rec.id)  # (moved away meanwhile: no manifest, so no stored copy)
            body = {**{k: v for k, v in tier_manifest.items() if k not in ("format", "signature")}, "storage": storage}
            data = json.dumps(manifest.sign(body, self.key, manifest.FORMAT_CHUNKED), indent=1, sort_keys=True)
            with self.store.open_writer(f"{rec.id}/{MANIFEST_NAME}") as w:
                w.write(chunks.manifest_bytes(rec.id, data))  # (StoreError past what readers accept)
                failpoints.hit("chunked-manifest-written")  # (written, not yet published)
                w.commit()
        stats = job.stats.summary()
        stats["round_trips"] += 1 + grant.ops + 1  # the manifest, the protocol, the lock's removal
        stats["stored_bytes"] += len(data)
        self.node_chunks.save_map(rec.id, storage)
        if (cur := self.catalog.get_checkpoint(rec.id)) is not None:
            self.catalog.update_checkpoint(rec.id, meta={**cur.meta, "store": {"format": "chunked", **stats}})
        logging.LoggerAdapter(log, {"checkpoint_id": rec.id}).info(
            "chunked: %d chunks, %d new (%d bytes), %d reused, %d stored bytes, %d round trips", stats["chunks"],
            stats["new_chunks"], stats["new_bytes"], stats["reused_chunks"], stats["stored_bytes"],
            stats["round_trips"])
        self._index_name(rec)
        return int(stats["stored_bytes"])

    def _index_name(self, rec: CheckpointRecord) -> None:
        # A by-name index lets another node find this checkpoint (Slurm requeue elsewhere, --via-store).
        if rec.name and _SAFE_NAME.match(rec.name):
            try:
                with self.store.open_writer(f"{INDEX}/{rec.name}/{rec.id}") as w:
                    w.commit()
            except StoreTampered as exc:
                # The copy is durable; only the hint is refused (never written through a planted symlink).
                log.error("store index entry for %r refused: %s", rec.name, exc, extra={"checkpoint_id": rec.id})

    # -- fetch and delete ---------------------------------------------------------------------
    def fetch(self, rec: CheckpointRecord, dest: Path) -> None:
        """Copies a durable checkpoint into dest, verifying the signature and every hash on the way."""
        t0 = time.monotonic()
        stored = self.stored_manifest(rec)
        with safefs.opened(os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)) as dfd:
            if chunks.is_chunked(stored):
                self._fetch_chunked(rec, stored, dfd)
            else:
                self._fetch_files(rec, stored, dfd)
        tier_body = {k: v for k, v in stored.items() if k != "storage"}
        manifest.write(dest, manifest.sign(tier_body, self.key))
        if self.metrics is not None:
            self.metrics.observe_phase("fetch", time.monotonic() - t0)
        release_memory()

    def stored_manifest(self, rec: CheckpointRecord) -> dict[str, Any]:
        """The stored manifest of a durable checkpoint: signed, bound to rec, its storage listing the same files."""
        try:
            stored = chunks.load_stored_manifest(self.store, rec.id)  # type: ignore[arg-type]
        except StoreNotFound as exc:
            raise IntegrityFailure(f"integrity check failed: the store has no manifest for {rec.id}") from exc
        except StoreUnavailable as exc:
            self._storage_error("get")
            raise Unavailable(f"cannot fetch {rec.id}: {exc}") from exc
        except (ValueError, StoreError) as exc:
            raise IntegrityFailure(f"integrity check failed: stored manifest of {rec.id} is unreadable: {exc}") \
                from exc
        try:
            manifest.verify_signature(stored, self.key)
            manifest.check_binding(stored, rec.id, rec.job, rec.owner_uid)
        except manifest.IntegrityError as exc:
            raise IntegrityFailure(f"{exc} (stored copy of {rec.id})") from exc
        storage = stored.get("storage")
        if not isinstance(stored.get("files"), dict) or not isinstance(storage, dict) or \
                not isinstance(storage.get("files"), dict) or set(storage["files"]) != set(stored["files"]):
            raise IntegrityFailure(f"integrity check failed: stored manifest of {rec.id} lists other files")
        return dict(stored)

    def _fetch_chunked(self, rec: CheckpointRecord, stored: dict[str, Any], dfd: int) -> None:
        cstore: chunks.ChunkStore = self.store  # type: ignore[assignment]
        try:
            reader = chunks.ChunkReader(cstore, stored)
            tier = {r.id: self.tier.path(r.id) for r in self.catalog.checkpoints()
                    if r.in_tier and r.id != rec.id and self.tier.has(r.id)}
            got = chunked.fetch_chunked(reader, dfd, self.node_chunks.tier_chunks(tier), self.node_chunks.cache())
        except StoreUnavailable as exc:
            self._storage_error("get")
            raise Unavailable(f"cannot fetch {rec.id}: {exc}") from exc
        except (StoreError, ValueError, TypeError, KeyError) as exc:
            self._storage_error("get")
            raise IntegrityFailure(f"integrity check failed: stored copy of {rec.id}: {exc}") from exc
        log.info("fetched %s: %d chunks, %d from tier copies, %d from the chunk cache, %d from the store (%d bytes)",
                 rec.id, got["chunks"], got["from_tier"], got["from_cache"], got["from_store"], got["fetched_bytes"],
                 extra={"checkpoint_id": rec.id})

    def _fetch_files(self, rec: CheckpointRecord, stored: dict[str, Any], dfd: int) -> None:
        files = stored["files"]
        storage = stored.get("storage", {}).get("files", {})
        for name, meta in files.items():
            s = storage[name]
            if "/" in name or name.startswith(".") or not name or name == MANIFEST_NAME or \
                    s.get("key") != f"{rec.id}/{name}" + (".zst" if s.get("codec") == "zstd" else ""):
                raise IntegrityFailure(f"integrity check failed: bad entry {name!r} in stored manifest")
            fd = safefs.create_file(dfd, name, 0o600)
            try:
                with self.store.open_reader(s["key"]) as src, os.fdopen(fd, "wb") as out:
                    # Read ahead in a helper thread, so the store's I/O overlaps decompressing and hashing.
                    ahead = _ReadAhead(src) if int(meta["size"]) >= _PIPELINE_MIN else None
                    try:
                        res = copy_decode(_as_binary(ahead or src), out, s.get("codec") == "zstd")
                    finally:
                        if ahead is not None:
                            ahead.close()
            except StoreUnavailable as exc:
                self._storage_error("get")
                raise Unavailable(f"cannot fetch {rec.id}: {exc}") from exc
            except StoreError as exc:
                self._storage_error("get")
                raise IntegrityFailure(f"integrity check failed: {name}: {exc}") from exc
            if (res.raw_bytes, res.raw_blake3) != (meta["size"], meta["blake3"]) or \
                    res.stored_blake3 != s["stored_blake3"]:
                raise IntegrityFailure(f"integrity check failed: checksum mismatch in stored {name} of {rec.id}")

    def find_stored(self, name: str) -> list[dict[str, Any]]:
        """Signed store manifests of the checkpoints indexed under name, newest first (unverified ones skipped)."""
        if not _SAFE_NAME.match(name):
            return []
        try:
            keys = self.store.list(f"{INDEX}/{name}/")
        except StoreError as exc:
            self._storage_error("list")
            raise Unavailable(f"cannot search the store for {name!r}: {exc}") from exc
        found = []
        refused: list[str] = []
        for ckpt_id in chunks.indexed_ids(self.store, keys):  # type: ignore[arg-type]
            try:
                m = chunks.load_stored_manifest(self.store, ckpt_id)  # type: ignore[arg-type]
                manifest.verify_signature(m, self.key)
            except (StoreError, ValueError, manifest.IntegrityError) as exc:
                log.warning("skipping stored checkpoint %s for %r: %s", ckpt_id, name, exc)
                if isinstance(exc, manifest.IntegrityError | StoreCorrupt):  # (a BadObject: not a manifest)
                    refused.append(f"{ckpt_id}: {exc}")
                continue
            if m.get("id") == ckpt_id:
                found.append(m)
        if not found and refused:  # copies exist under this name, but none is one this node may trust
            raise IntegrityFailure(f"integrity check failed: no stored checkpoint named {name!r} verifies here "
                                   f"({refused[0]})")
        return found

    def delete(self, rec: CheckpointRecord) -> None:
        """Removes the stored copy (its chunks stay until a sweep finds them unreferenced; the node's chunk map
        of it goes at the next start)."""
        try:
            self.store.delete_prefix(rec.id + "/")
        except StoreUnavailable as exc:
            self._storage_error("delete")
            raise Unavailable(f"cannot delete {rec.id} from the store: {exc}; try again later") from exc
        except StoreTampered as exc:
            self._storage_error("delete")
            log.error("store tampering: %s", exc, extra={"checkpoint_id": rec.id})
            raise IntegrityFailure(f"the store copy of {rec.id} was tampered with, nothing was deleted through "
                                   f"it: {exc}; check the store, remove the entry by hand, then delete again") \
                from exc


def _as_binary(f: Any) -> BinaryIO:
    return f  # type: ignore[no-any-return]


class _Pipelined:
    """A store writer's write() run by a helper thread, at most _PIPELINE_DEPTH chunks behind the caller.

    flush() waits until everything was written and raises the writer's error, if any; the caller then
    commits (or aborts) the real writer itself. close() stops the thread (idempotent).
    """

    def __init__(self, w: Any) -> None:
        self._w = w
        self._q: queue.Queue[bytes | None] = queue.Queue(maxsize=_PIPELINE_DEPTH)
        self._err: BaseException | None = None
        self._t = threading.Thread(target=self._run, name="drain-write", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while (data := self._q.get()) is not None:
            if self._err is None:
                try:
                    self._w.write(data)
                except BaseException as exc:  # handed to the caller at its next write/flush
                    self._err = exc

    def write(self, data: Any) -> int:
        if self._err is not None:
            raise self._err
        self._q.put(data if isinstance(data, bytes) else bytes(data))
        return len(data)

    def flush(self) -> None:
        self.close()
        if self._err is not None:
            raise self._err

    def close(self) -> None:
        if self._t.is_alive():
            self._q.put(None)
            self._t.join()


class _ReadAhead:
    """A reader whose next chunks are read by a helper thread; read errors surface in the caller's read()."""

    def __init__(self, src: Any, chunk: int = 4 << 20) -> None:
        self._src = src
        self._chunk = chunk
        self._q: queue.Queue[bytes | BaseException] = queue.Queue(maxsize=_PIPELINE_DEPTH)
        self._buf = memoryview(b"")
        self._eof = False
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="fetch-read", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._src.read(self._chunk)
            except BaseException as exc:
                self._q.put(exc)
                return
            self._q.put(data)
            if not data:
                return

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            return b"".join(iter(lambda: self.read(self._chunk), b""))
        if not self._buf and not self._eof:
            item = self._q.get()
            if isinstance(item, BaseException):
                self._eof = True
                raise item
            self._eof = not item
            self._buf = memoryview(item)
        out, self._buf = self._buf[:n], self._buf[n:]
        return bytes(out)

    def close(self) -> None:
        self._stop.set()
        while self._t.is_alive():  # unblock a reader thread waiting on a full queue
            try:
                self._q.get(timeout=0.1)
            except queue.Empty:
                pass
        self._t.join()


def build_drain(cfg: Any, catalog: Catalog, tier: MemoryTier, key: bytes, metrics: Any) -> DrainService | None:
    """The drain for a daemon config: S3 when store.url is set, else the POSIX store dir."""
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
    opts = ChunkOpts(format=cfg.store.format, avg=cfg.store.chunk_size, state_dir=cfg.state.dir,
                     cache_dir=cfg.store.chunk_cache_dir, cache_size=cfg.store.chunk_cache_size or 0,
                     pack_size=cfg.store.pack_size or 0)
    return DrainService(store, catalog, tier, key, codec, throttle, cfg.drain.concurrency,
                        cfg.drain.retry_initial_s, cfg.drain.retry_max_s, metrics, opts)


__all__ = ["DrainService", "EncodeResult", "build_drain"]
