"""The store repository: the only door to the store (restic's repository is the model).

Everything that reads or writes a checkpoint's stored copy goes through Repository: the upload of a tier copy
(put: every file or chunk, then the signed manifest LAST, then the by-name index entry), its stored manifest
(verified and bound to its record), the fetch back into a tier directory, the chunk reader of a lazy restore from
the store, the search by job name, and the deletion. The drain (memsnap.drain) only decides when to put; the
sweep (memsnap.gc) reaches the chunks through .store and .node_chunks.

Retries: a whole upload is retried by the drain on its backoff schedule; a single store call is retried by the
S3 client itself (botocore's standard mode, memsnap.store.s3). A second retrying layer here would multiply
the two, so there is none.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from memsnap import background, failpoints, manifest, safefs
from memsnap.catalog import DURABLE, CheckpointRecord, now_ms
from memsnap.errors import IntegrityFailure, Unavailable
from memsnap.malloc import bulk_transfer
from memsnap.store import (
    MANIFEST_NAME,
    Codec,
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
)
from memsnap.store.chunked import ChunkOpts
from memsnap.store.posix import StoreTampered

if TYPE_CHECKING:
    from memsnap.metrics import Metrics

log = logging.getLogger("memsnap.repository")

INDEX = "_index"
STORE_ID = "_store/id"  # the store's identity (Repository.id)
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# Files at least this big are written by a helper thread while the next chunk is read, hashed and compressed.
_PIPELINE_MIN = 8 << 20
_PIPELINE_DEPTH = 4  # chunks (~4 MiB each) in flight between the encoder and the store writer

LocalCopies = Callable[[str], dict[str, Path]]  # ckpt id -> the other checkpoints' tier dirs (chunks to reuse)


@dataclass
class Put:
    """What an upload stored: its bytes in the store (manifest included), and the chunked format's counts."""

    stored_bytes: int
    chunk_stats: dict[str, Any] = field(default_factory=dict)  # {} for the whole-file format


class Repository:
    """A store, the node key that signs what goes into it, and the codec and chunking it is written with."""

    def __init__(self, store: Store, key: bytes, codec: Codec, throttle: Throttle | None = None,
                 metrics: Metrics | None = None, chunk_opts: ChunkOpts | None = None,
                 local_copies: LocalCopies | None = None) -> None:
        self.store = store
        self.key = key
        self.codec = codec
        self.throttle = throttle
        self.metrics = metrics
        self.chunk_opts = chunk_opts or ChunkOpts()
        self.node_chunks = chunked.NodeChunks(store.describe(), self.chunk_opts)
        self._local_copies = local_copies or (lambda _exclude: {})
        self._id = ""
        self._opened = False
        self._open_lock = threading.Lock()

    def describe(self) -> str:
        """Where checkpoints go."""
        return self.store.describe()

    def id(self) -> str:
        """A random id kept in the store (STORE_ID), created on first use: two daemons see the same one only
        if they share the store. A hint for preflights (a store writer can change it); integrity still rests
        on the signed manifests. "" when the store cannot be reached."""
        if self._id:
            return self._id
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
        self._id = got if got.isalnum() else ""
        return self._id

    def open(self, live_ids: set[str]) -> None:
        """Once, before the first upload: removes interrupted uploads and loads the node's chunk state (live_ids:
        the checkpoints with a tier copy here, whose chunk maps are kept)."""
        with self._open_lock:
            if self._opened:
                return
            self._opened = True
        try:
            removed = self.store.cleanup_temps()
            if removed:
                log.info("removed %d interrupted uploads from the store", removed)
        except StoreError as exc:
            log.warning("store not reachable at start (%s); drains will retry", exc)
        try:
            self.node_chunks.prepare(live_ids)
        except OSError as exc:
            log.warning("chunk state in %s unusable: %s", self.chunk_opts.state_dir, exc)

    def storage_error(self, op: str) -> None:
        """Counts a failed store call (op: put, get, list, delete)."""
        if self.metrics is not None:
            self.metrics.storage_errors.labels(op=op).inc()

    # -- put ----------------------------------------------------------------------------------------------------
    def put(self, rec: CheckpointRecord, sfd: int, tier_manifest: dict[str, Any], progress: Callable[[int], None],
            fingerprint: dict[str, list[int]] | None, before_publish: Callable[[], None]) -> Put:
        """Uploads the verified tier copy open at sfd: every file (or chunk), checked against tier_manifest on
        the way, then the signed store manifest, which is what makes the copy count, then the index entry.
        progress(n) after each n raw bytes (it may raise to stop the upload); before_publish() just before
        the manifest is written (it may raise: nothing is published then). fingerprint: the tier files' (inode,
        size, mtime, ctime) recorded when the checkpoint hashed them (a file that still has them is not hashed
        again)."""
        with bulk_transfer():  # (chunk buffers reused, not a fresh mmap each: memsnap.malloc)
            if self.chunk_opts.format == "chunked":
                done = self._put_chunked(rec, sfd, tier_manifest, progress, fingerprint, before_publish)
            else:
                done = self._put_files(rec, sfd, tier_manifest, progress, before_publish)
        self._index_name(rec)
        return done

    def _put_files(self, rec: CheckpointRecord, sfd: int, tier_manifest: dict[str, Any],
                   progress: Callable[[int], None], before_publish: Callable[[], None]) -> Put:
        files: dict[str, dict[str, Any]] = tier_manifest["files"]
        stored_files: dict[str, dict[str, Any]] = {}
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
        before_publish()
        body = dict(tier_manifest)
        body["storage"] = {"codec": self.codec.name, "files": stored_files}
        data = json.dumps(manifest.sign(body, self.key), indent=1, sort_keys=True).encode()
        with self.store.open_writer(f"{rec.id}/{MANIFEST_NAME}") as w:
            w.write(data)
            w.commit()
        # Verified: every object is there at the size we wrote (contents were checked on the way in).
        for s in stored_files.values():
            if self.store.stat(s["key"]) != s["stored_bytes"]:
                raise StoreUnavailable(f"stored {s['key']} has the wrong size after upload")
        return Put(sum(int(s["stored_bytes"]) for s in stored_files.values()) + len(data))

    def _put_chunked(self, rec: CheckpointRecord, sfd: int, tier_manifest: dict[str, Any],
                     progress: Callable[[int], None], fingerprint: dict[str, list[int]] | None,
                     before_publish: Callable[[], None]) -> Put:
        cstore: chunks.ChunkStore = self.store  # type: ignore[assignment]
        # From the first chunk to the manifest, a store lock keeps sweeps out (memsnap.store.chunkgc).
        with self.node_chunks.store_gc(cstore).draining() as grant:
            job = chunked.ChunkedDrain(cstore, self.codec.level or 0, self.node_chunks.index(),
                                       chunks.Chunking(self.chunk_opts.avg), self.throttle, self.chunk_opts.threads,
                                       trust_index=grant.trust_index, pack_size=self.chunk_opts.pack_size)
            storage = job.run(rec.id, sfd, tier_manifest["files"], fingerprint, progress)
            before_publish()
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
        logging.LoggerAdapter(log, {"checkpoint_id": rec.id}).info(
            "chunked: %d chunks, %d new (%d bytes), %d reused, %d stored bytes, %d round trips", stats["chunks"],
            stats["new_chunks"], stats["new_bytes"], stats["reused_chunks"], stats["stored_bytes"],
            stats["round_trips"])
        return Put(int(stats["stored_bytes"]), {"format": "chunked", **stats})

    def _index_name(self, rec: CheckpointRecord) -> None:
        # A by-name index lets another node find this checkpoint (Slurm requeue elsewhere, --via-store).
        if rec.name and SAFE_NAME.match(rec.name):
            try:
                with self.store.open_writer(f"{INDEX}/{rec.name}/{rec.id}") as w:
                    w.commit()
            except StoreTampered as exc:
                # The copy is durable; only the hint is refused (never written through a planted symlink).
                log.error("store index entry for %r refused: %s", rec.name, exc, extra={"checkpoint_id": rec.id})

    # -- get ----------------------------------------------------------------------------------------------------
    def stored_manifest(self, rec: CheckpointRecord) -> manifest.StoredManifest:
        """The stored manifest of a durable checkpoint: signed, parsed (signed_manifest) and bound to rec."""
        stored = self.signed_manifest(rec.id)
        try:
            stored.check_binding(rec.id, rec.job, rec.owner_uid)
        except manifest.IntegrityError as exc:
            raise IntegrityFailure(f"{exc} (stored copy of {rec.id})") from exc
        return stored

    def chunk_reader(self, storage: chunks.ChunkedStorage) -> chunks.ChunkReader:
        """Reads the chunks of a verified chunked manifest (stored_manifest), through the node's chunk cache."""
        return chunks.ChunkReader(self.store, storage, self.node_chunks.cache())  # type: ignore[arg-type]

    def fetch(self, rec: CheckpointRecord, dest: Path) -> None:
        """Copies a durable checkpoint into dest, verifying the signature and every hash on the way."""
        t0 = time.monotonic()
        stored = self.stored_manifest(rec)
        with safefs.opened(os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)) as dfd, \
                bulk_transfer():
            if isinstance(stored.storage, chunks.ChunkedStorage):
                self._fetch_chunked(rec, stored.storage, dfd)
            else:
                self._fetch_files(rec, stored.storage, dfd)
        manifest.write(dest, manifest.sign(stored.tier_body(), self.key))
        if self.metrics is not None:
            self.metrics.observe_phase("fetch", time.monotonic() - t0)

    def _fetch_chunked(self, rec: CheckpointRecord, storage: chunks.ChunkedStorage, dfd: int) -> None:
        try:
            reader = chunks.ChunkReader(self.store, storage)  # type: ignore[arg-type]
            local = self.node_chunks.tier_chunks(self._local_copies(rec.id))
            got = chunked.fetch_chunked(reader, dfd, local, self.node_chunks.cache(), fill_later=_fill_cache_later)
        except StoreUnavailable as exc:
            self.storage_error("get")
            raise Unavailable(f"cannot fetch {rec.id}: {exc}") from exc
        except (StoreError, ValueError) as exc:
            self.storage_error("get")
            raise IntegrityFailure(f"integrity check failed: stored copy of {rec.id}: {exc}") from exc
        log.info("fetched %s: %d chunks, %d from tier copies, %d from the chunk cache, %d from the store (%d bytes)",
                 rec.id, got["chunks"], got["from_tier"], got["from_cache"], got["from_store"], got["fetched_bytes"],
                 extra={"checkpoint_id": rec.id})

    def _fetch_files(self, rec: CheckpointRecord, files: Mapping[str, manifest.StoredFile], dfd: int) -> None:
        for name, s in files.items():
            fd = safefs.create_file(dfd, name, 0o600)
            try:
                with self.store.open_reader(s.key) as src, os.fdopen(fd, "wb") as out:
                    # Read ahead in a helper thread, so the store's I/O overlaps decompressing and hashing.
                    ahead = _ReadAhead(src) if s.size >= _PIPELINE_MIN else None
                    try:
                        res = copy_decode(_as_binary(ahead or src), out, s.zstd)
                    finally:
                        if ahead is not None:
                            ahead.close()
            except StoreUnavailable as exc:
                self.storage_error("get")
                raise Unavailable(f"cannot fetch {rec.id}: {exc}") from exc
            except StoreError as exc:
                self.storage_error("get")
                raise IntegrityFailure(f"integrity check failed: {name}: {exc}") from exc
            if (res.raw_bytes, res.raw_blake3, res.stored_blake3) != (s.size, s.blake3, s.stored_blake3):
                raise IntegrityFailure(f"integrity check failed: checksum mismatch in stored {name} of {rec.id}")

    def signed_manifest(self, ckpt_id: str) -> manifest.StoredManifest:
        """The stored manifest of ckpt_id, its signature verified (this node's key, or its cluster's), parsed, and
        its id ckpt_id: what a node that did not make the checkpoint adopts it from (adopted_record)."""
        try:
            m = chunks.load_stored_manifest(self.store, ckpt_id)  # type: ignore[arg-type]
        except StoreNotFound as exc:
            raise IntegrityFailure(f"integrity check failed: the store has no manifest for {ckpt_id}") from exc
        except StoreUnavailable as exc:
            self.storage_error("get")
            raise Unavailable(f"cannot fetch {ckpt_id}: {exc}") from exc
        except (ValueError, StoreError) as exc:
            raise IntegrityFailure(f"integrity check failed: stored manifest of {ckpt_id} is unreadable: {exc}") \
                from exc
        try:
            manifest.verify_signature(m, self.key)
            stored = manifest.StoredManifest.parse(m)
        except manifest.IntegrityError as exc:
            raise IntegrityFailure(f"{exc} (stored copy of {ckpt_id})") from exc
        if stored.man.id != ckpt_id:
            raise IntegrityFailure(f"integrity check failed: the stored manifest under {ckpt_id} is the one of "
                                   f"{stored.man.id!r}")
        return stored

    def find(self, name: str) -> list[manifest.StoredManifest]:
        """Signed store manifests of the checkpoints indexed under name (unverified ones skipped)."""
        if not SAFE_NAME.match(name):
            return []
        try:
            keys = self.store.list(f"{INDEX}/{name}/")
        except StoreError as exc:
            self.storage_error("list")
            raise Unavailable(f"cannot search the store for {name!r}: {exc}") from exc
        found = []
        refused: list[str] = []
        for ckpt_id in chunks.indexed_ids(self.store, keys):  # type: ignore[arg-type]
            try:
                m = self.signed_manifest(ckpt_id)
            except Unavailable as exc:
                log.warning("skipping stored checkpoint %s for %r: %s", ckpt_id, name, exc)
                continue
            except IntegrityFailure as exc:
                log.warning("skipping stored checkpoint %s for %r: %s", ckpt_id, name, exc)
                if isinstance(exc.__cause__, manifest.IntegrityError | StoreCorrupt):  # (signed elsewhere, or cut)
                    refused.append(f"{ckpt_id}: {exc}")
                continue
            found.append(m)
        if not found and refused:  # copies exist under this name, but none is one this node may trust
            raise IntegrityFailure(f"integrity check failed: no stored checkpoint named {name!r} verifies here "
                                   f"({refused[0]})")
        return found

    # -- delete -------------------------------------------------------------------------------------------------
    def delete(self, rec: CheckpointRecord) -> None:
        """Removes the stored copy (its chunks stay until a sweep finds them unreferenced; the node's chunk map
        of it goes at the next start)."""
        try:
            self.store.delete_prefix(rec.id + "/")
        except StoreUnavailable as exc:
            self.storage_error("delete")
            raise Unavailable(f"cannot delete {rec.id} from the store: {exc}; try again later") from exc
        except StoreTampered as exc:
            self.storage_error("delete")
            log.error("store tampering: %s", exc, extra={"checkpoint_id": rec.id})
            raise IntegrityFailure(f"the store copy of {rec.id} was tampered with, nothing was deleted through "
                                   f"it: {exc}; check the store, remove the entry by hand, then delete again") \
                from exc

    def forget(self, ckpt_id: str) -> None:
        """Removes whatever an upload of ckpt_id left (a checkpoint deleted while it drained); failures are only
        counted (the next sweep finds what is left)."""
        try:
            self.store.delete_prefix(ckpt_id + "/")
        except StoreError:
            self.storage_error("delete")


def adopted_record(m: manifest.StoredManifest, home: str = "") -> CheckpointRecord:
    """The catalog record of a durable checkpoint from its signed stored manifest (Repository.signed_manifest),
    for a node that did not make it. home: the node that made it, which deletes the stored copy ("" when this
    node owns it from now on: a move's target)."""
    man = m.man
    return CheckpointRecord(
        id=man.id, state=DURABLE, pid=man.pid, owner_uid=man.uid, created_ms=man.created_ms, job=man.job,
        name=man.name or "", size_bytes=man.size_bytes, frozen_ms=int(man.frozen_ms), dump_ms=int(man.dump_ms),
        in_tier=False, in_store=True, durable_ms=now_ms(),
        meta={**m.catalog_meta(), **({"home": home} if home else {})})


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


CACHE_FILL_WAIT_S = 120.0  # a cache fill held back by foreground work longer than this is dropped


def _fill_cache_later(fill: chunked.CacheFill) -> None:
    """Adds a fetch's chunks to the node's chunk cache in a thread of its own, once no foreground work runs (the
    restore that fetched them first): background work, like a drain. One held back for CACHE_FILL_WAIT_S is
    dropped (its descriptors keep the fetched files' memory)."""

    def run() -> None:
        deadline = time.monotonic() + CACHE_FILL_WAIT_S
        try:
            background.gate().wait_idle("cache-fill", stop=lambda: time.monotonic() > deadline)
            if time.monotonic() > deadline:
                log.info("chunk cache not filled: foreground work ran for %.0f s", CACHE_FILL_WAIT_S)
                return
            n = fill.run()
            log.info("chunk cache: %d chunks added after a fetch", n)
        except Exception as exc:  # (best effort: the cache is a hint, every read of it is verified)
            log.warning("chunk cache not filled: %s", exc)
        finally:
            fill.close()

    threading.Thread(target=run, name="cache-fill", daemon=True).start()


__all__ = ["INDEX", "STORE_ID", "Put", "Repository", "adopted_record"]

