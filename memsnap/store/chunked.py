"""Draining a tier copy into chunks, and fetching a chunked image back (the format-2 half of memsnap.drain).

Drain: each big file is cut into chunks (memsnap.store.chunks.Chunking); worker threads hash each chunk,
and upload (compressed) only the ones the store lacks. A chunk the local index lists is assumed present
and then checked in one parallel pass per file (touch: also restarts its GC grace period); one that is
gone is uploaded again, never silently left out. The small files go, concatenated, into one bundle object.
The caller signs and writes the manifest last.

Fetch: every chunk comes from, in this order, a tier copy of another checkpoint that has it, the node's
chunk cache, or the store (in parallel); each is verified against its id before it is written.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import blake3
import zstandard

from memsnap import failpoints, manifest, safefs
from memsnap.errors import IntegrityFailure
from memsnap.store.cache import ChunkCache
from memsnap.store.chunkgc import ChunkIndex, StoreGc
from memsnap.store.chunks import (
    BUNDLE_NAME,
    DEFAULT_AVG,
    LAYOUT,
    ChunkError,
    Chunking,
    ChunkReader,
    ChunkRef,
    ChunkStore,
    chunk_id,
    chunk_key,
    encode_chunk,
    is_bundled,
    is_chunk_id,
    pack_key,
    put_chunk,
)
from memsnap.store.errors import BadObject, StoreError
from memsnap.store.packs import DEFAULT_PACK, Entry, Loc, Packer, PackFiles, pack_id_of
from memsnap.store.parse import MANIFEST_MAX, is_count, load_json
from memsnap.store.throttle import Throttle

log = logging.getLogger("memsnap.drain")
Progress = Callable[[int], None]


@dataclass(frozen=True)
class ChunkOpts:
    """[store] format and the chunk store's node-local state (memsnap.store.chunks)."""

    format: str = "whole"  # "chunked": content-addressed chunks (manifest format 2); "whole": one object a file
    avg: int = DEFAULT_AVG
    state_dir: str = ""  # index of present chunks and chunk maps of tier copies; "" = none
    cache_dir: str = ""  # "" = <state_dir>/chunk-cache
    cache_size: int = 0  # bytes; 0 = no chunk cache
    threads: int = 8  # chunks hashed, compressed and uploaded at once (uploads wait on fsyncs, not CPU)
    pack_size: int = DEFAULT_PACK  # new chunks go into packs of about this size; 0 = an object per chunk


class NodeChunks:
    """This node's chunk state for one store: the index of present chunks, the chunk cache, the chunk maps
    (<state>/chunks/maps: one JSON line per drained checkpoint, its files' chunks). prepare() creates all of
    them at start, so that later drains and restores only write into files that exist (no new names)."""

    def __init__(self, store_desc: str, opts: ChunkOpts) -> None:
        self.opts = opts
        base = Path(opts.state_dir) / "chunks" if opts.state_dir else None
        self.maps_path = base / "maps" if base else None
        self._index_path = base / f"index-{chunk_id(store_desc.encode())[:16]}" if base else None
        self._index: ChunkIndex | None = None
        self._cache: ChunkCache | None = None
        self._gcs: dict[str, StoreGc] = {}
        self._lock = threading.Lock()

    def prepare(self, keep_ids: set[str]) -> None:
        """Creates the index, the maps file (keeping the maps of keep_ids only) and the cache dir."""
        if self.maps_path is not None:
            self.maps_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            kept = [line for line in _map_lines(self.maps_path) if _id_of(line) in keep_ids]
            tmp = self.maps_path.with_name(".tmp-maps")
            tmp.write_text("".join(json.dumps(m) + "\n" for m in kept))
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.maps_path)
        if self._index_path is not None and not self._index_path.exists():
            self._index_path.touch(mode=0o600)
        self.index()
        self.cache()

    def index(self) -> ChunkIndex:
        with self._lock:
            return self._index_unlocked()

    def _index_unlocked(self) -> ChunkIndex:
        if self._index is None:
            self._index = ChunkIndex(self._index_path)
        return self._index

    def cache(self) -> ChunkCache | None:
        with self._lock:
            if self._cache is None and self.opts.cache_size > 0:
                root = self.opts.cache_dir or str(Path(self.opts.state_dir or "/tmp") / "chunk-cache")
                self._cache = open_cache(root, self.opts.cache_size)
            return self._cache

    def save_map(self, ckpt_id: str, storage: dict[str, Any]) -> None:
        """Remembers which chunks a drained tier copy holds (a hint: every use is verified)."""
        if self.maps_path is None:
            return
        body = {n: s["chunks"] for n, s in storage["files"].items() if "chunks" in s}
        line = json.dumps({"id": ckpt_id, "files": body}) + "\n"
        with self._lock:
            fd = os.open(self.maps_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(line)

    def store_gc(self, store: ChunkStore) -> StoreGc:
        """The drain/sweep protocol for store (memsnap.store.chunkgc), one per store for this daemon."""
        with self._lock:
            gc = self._gcs.get(store.describe())
            if gc is None or gc.store is not store:
                gc = self._gcs[store.describe()] = StoreGc(store, self._index_unlocked(),
                                                           StoreGc.owner_of(self.opts.state_dir))
            return gc

    def tier_chunks(self, tier_paths: dict[str, Path]) -> TierChunks:
        """Where the tier copies in tier_paths (id -> dir) hold which chunks."""
        maps = {m["id"]: m["files"] for m in _map_lines(self.maps_path) if _id_of(m) in tier_paths} \
            if self.maps_path is not None else {}
        return TierChunks({tier_paths[i]: files for i, files in maps.items()})


def _id_of(m: dict[str, Any]) -> str:
    return m["id"] if isinstance(m.get("id"), str) else ""


def _map_lines(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_bytes().decode("utf-8", "replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            m = load_json(line.encode(), "chunk map", str(path), MANIFEST_MAX)
        except BadObject:
            continue  # (a line cut short by a crash)
        if isinstance(m.get("files"), dict):
            out.append(m)
    return out


@dataclass
class DrainStats:
    """What one chunked drain did: bytes (logical = raw image, stored = compressed bytes uploaded, new = raw
    bytes of the chunks it uploaded), chunk counts and store round trips."""

    logical_bytes: int = 0
    stored_bytes: int = 0
    new_bytes: int = 0
    chunks: int = 0
    new_chunks: int = 0
    reused_chunks: int = 0
    reuploaded_chunks: int = 0  # the index said present, the store did not have them
    round_trips: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def summary(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


class ChunkedDrain:
    """Uploads one tier copy as chunks + bundle; run() returns the manifest's "storage" section."""

    def __init__(self, store: ChunkStore, level: int, index: ChunkIndex, chunking: Chunking,
                 throttle: Throttle | None = None, threads: int = 4, trust_index: bool = False,
                 pack_size: int = 0) -> None:
        """trust_index: the index is right about presence (inside StoreGc.draining(), when no sweep ran
        meanwhile); else each chunk it lists is checked (and touched) in the store. pack_size: new chunks go
        into packs of about this size (memsnap.store.packs); 0 = each into its own object."""
        self.store, self.level, self.index, self.chunking = store, level, index, chunking
        self.trust_index = trust_index
        self.throttle, self.threads = throttle, max(1, threads)
        self.stats = DrainStats()
        self._claimed: set[str] = set()
        self._lock = threading.Lock()
        self._loc: dict[str, Loc] = {}  # where this drain put the chunks it packed
        self.pack_size = pack_size
        self._packer: Packer | None = None

    def run(self, ckpt_id: str, sfd: int, files: dict[str, dict[str, Any]], trusted: dict[str, list[int]] | None,
            progress: Progress) -> dict[str, Any]:
        stored_files: dict[str, Any] = {}
        small = sorted(n for n, m in files.items() if is_bundled(n, int(m["size"])))
        self._packer = Packer(self.store, self.pack_size, self._pack_committed) if self.pack_size > 0 else None
        try:
            bundle = self._bundle(ckpt_id, sfd, small, files, stored_files, progress)
            with ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="drain-chunk") as pool:
                for name in sorted((n for n in files if n not in small), key=lambda n: (files[n]["size"], n)):
                    refs = self._file(pool, sfd, name, files[name], (trusted or {}).get(name), progress)
                    stored_files[name] = {"chunks": refs}
            if self._packer is not None:
                self._packer.close()
        except BaseException:
            if self._packer is not None:
                self._packer.abort()
            raise
        packed_bundle = [bundle["chunk"]] if bundle and "chunk" in bundle else []
        packs = self._locate([*stored_files.values(), {"chunks": packed_bundle}])
        return {"layout": LAYOUT, "codec": "zstd" if self.level else "raw", "chunk_avg": self.chunking.avg,
                "bundle": bundle, "files": stored_files, **({"packs": packs} if packs else {}),
                **{k: v for k, v in self.stats.summary().items() if k in ("logical_bytes", "stored_bytes",
                                                                          "new_bytes")}}

    def _locate(self, entries: list[dict[str, Any]]) -> list[str]:
        """Adds where each chunk is stored to its item ([id, offset, length] -> [..., pack number, offset in
        the pack, stored length]; loose chunks keep 3 items); returns the pack list the numbers index."""
        packs: dict[str, int] = {}
        for s in entries:
            for item in s.get("chunks", ()):
                loc = self._loc.get(item[0]) or self.index.where(item[0])
                if loc is not None:
                    item += [packs.setdefault(loc[0], len(packs)), loc[1], loc[2]]
        return list(packs)

    # -- the bundle of small files ------------------------------------------------------------------------
    def _bundle(self, ckpt_id: str, sfd: int, names: list[str], files: dict[str, dict[str, Any]],
                stored_files: dict[str, Any], progress: Progress) -> dict[str, Any] | None:
        if not names:
            return None
        parts, pos = [], 0
        for name in names:
            with os.fdopen(safefs.open_file(sfd, name), "rb") as f:
                data = f.read()
            if len(data) != files[name]["size"] or blake3.blake3(data).hexdigest() != files[name]["blake3"]:
                raise IntegrityFailure(f"integrity check failed: tier copy of {name} does not match its manifest; "
                                       "it will not be made durable")
            stored_files[name] = {"bundle": [pos, len(data)]}
            parts.append(data)
            pos += len(data)
        raw = b"".join(parts)
        if self._packer is not None:  # one chunk in this drain's pack (no object of its own)
            cid = chunk_id(raw)
            self.stats.add(logical_bytes=len(raw))
            if not (self.trust_index and cid in self.index):
                self._upload(cid, raw, counts_as_chunk=False)
            progress(len(raw))
            return {"chunk": [cid, 0, len(raw)], "raw_bytes": len(raw)}
        stored = zstandard.ZstdCompressor(level=self.level).compress(raw) if self.level else raw
        if self.throttle is not None:
            self.throttle.consume(len(stored))
        key = f"{ckpt_id}/{BUNDLE_NAME}"
        with self.store.open_writer(key) as w:
            w.write(stored)
            obj = w.commit()
        if obj.size_bytes != len(stored):
            raise StoreError(f"store reports {obj.size_bytes} bytes for {key}, wrote {len(stored)}")
        self.stats.add(logical_bytes=len(raw), stored_bytes=len(stored), new_bytes=len(raw), round_trips=1)
        progress(len(raw))
        return {"key": key, "raw_bytes": len(raw), "stored_bytes": len(stored),
                "stored_blake3": blake3.blake3(stored).hexdigest()}

    # -- one chunked file -------------------------------------------------------------------------------------
    def _file(self, pool: ThreadPoolExecutor, sfd: int, name: str, meta: dict[str, Any],
              trusted_fp: list[int] | None, progress: Progress) -> list[list[Any]]:
        fd = safefs.open_file(sfd, name)
        with safefs.opened(fd):
            st = os.fstat(fd)
            if st.st_size != meta["size"]:
                raise IntegrityFailure(f"integrity check failed: tier copy of {name} has {st.st_size} bytes, its "
                                       f"manifest says {meta['size']}; it will not be made durable")
            # Hash once: a file whose fingerprint is the one recorded when the checkpoint hashed it is those bytes.
            fp = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
            if fp != trusted_fp and manifest.fd_blake3(fd) != meta["blake3"]:
                raise IntegrityFailure(f"integrity check failed: tier copy of {name} does not match its manifest; "
                                       "it will not be made durable")
            refs: list[list[Any]] = []
            trusted: dict[str, tuple[int, int]] = {}
            pending: deque[tuple[int, int, Future[tuple[str, str]]]] = deque()
            depth = 2 * self.threads

            def collect() -> None:
                off, n, fut = pending.popleft()
                cid, how = fut.result()
                refs.append([cid, off, n])
                if how == "trusted":
                    trusted[cid] = (off, n)
                progress(n)  # (called between chunks: where drains are throttled and paused)

            try:
                for off, n in self.chunking.iter_file_boundaries(fd, st.st_size):
                    pending.append((off, n, pool.submit(self._chunk, fd, off, n)))
                    while len(pending) >= depth:
                        collect()
                while pending:
                    collect()
            except BaseException:
                # The pool's tasks pread fd by number: none may outlive it, or a task still queued reads whatever
                # file reuses the number (another checkpoint's image) into the store.
                for *_, fut in pending:
                    fut.cancel()
                wait([fut for *_, fut in pending])
                raise
            self._verify_trusted(fd, trusted)
            st2 = os.fstat(fd)
            if [st2.st_ino, st2.st_size, st2.st_mtime_ns, st2.st_ctime_ns] != fp:
                raise IntegrityFailure(f"integrity check failed: tier copy of {name} changed while it drained")
        self.stats.add(logical_bytes=int(meta["size"]))
        return refs

    def _chunk(self, fd: int, off: int, n: int) -> tuple[str, str]:
        raw = os.pread(fd, n, off)
        if len(raw) != n:
            raise IntegrityFailure("integrity check failed: tier copy shrank while it drained")
        cid = chunk_id(raw)
        with self._lock:
            dup = cid in self._claimed
            self._claimed.add(cid)
        self.stats.add(chunks=1)
        if dup:
            return cid, "dup"
        if cid in self.index:
            if self.trust_index:
                self.stats.add(reused_chunks=1)
                return cid, "indexed"
            return cid, "trusted"
        if self._packer is not None:  # (the index lists every pack's chunks: memsnap.store.chunkgc.learn_packs)
            self._upload(cid, raw)
            return cid, "new"
        self.stats.add(round_trips=1)
        if self.store.exists(chunk_key(cid)) if self.trust_index else self.store.touch(chunk_key(cid)):
            self.stats.add(reused_chunks=1)
            self.index.add([cid])
            return cid, "present"
        self._upload(cid, raw)
        return cid, "new"

    def _upload(self, cid: str, raw: bytes, counts_as_chunk: bool = True) -> None:
        """Writes a new chunk (into the drain's pack, or as its own object), under the bandwidth cap.
        counts_as_chunk=False: the packed bundle of small files (bytes, not a chunk of an image file)."""
        stored = encode_chunk(raw, self.level)
        if self.throttle is not None:
            self.throttle.consume(len(stored))
        self.stats.add(stored_bytes=len(stored), new_bytes=len(raw), new_chunks=int(counts_as_chunk))
        if self._packer is not None:
            loc = self._packer.add(cid, stored, len(raw))
            with self._lock:
                self._loc[cid] = loc
            return
        put_chunk(self.store, cid, stored)
        self.stats.add(round_trips=1)
        self.index.add([cid])
        failpoints.hit("chunk-uploaded")

    def _pack_committed(self, pid: str, entries: list[Entry], trailer: int) -> None:
        self.stats.add(stored_bytes=trailer, round_trips=1)
        self.index.add_pack(pid, entries)
        failpoints.hit("chunk-uploaded")

    def _verify_trusted(self, fd: int, trusted: dict[str, tuple[int, int]]) -> None:
        """The index is a hint: every chunk it vouched for must be in the store now (touched, so a sweep
        running meanwhile keeps it); one that is gone is uploaded again."""
        keys = {c: chunk_key(c) if (loc := self.index.where(c)) is None else pack_key(loc[0]) for c in trusted}
        objs = sorted(set(keys.values()))  # (a pack is touched once for all of its chunks)
        there = dict(zip(objs, parallel_map(self.store.touch, objs, max(self.threads, 8)), strict=True))
        self.stats.add(round_trips=len(objs), reused_chunks=sum(1 for c in trusted if there[keys[c]]))
        missing = [c for c in trusted if not there[keys[c]]]
        if not missing:
            return
        log.warning("%d chunks the local index listed are missing from %s: uploading them again",
                    len(missing), self.store.describe())
        self.index.discard(missing, {pid for k, ok in there.items() if not ok and (pid := pack_id_of(k))})
        for cid in missing:
            off, n = trusted[cid]
            raw = os.pread(fd, n, off)
            if chunk_id(raw) != cid:
                raise IntegrityFailure("integrity check failed: tier copy changed while it drained")
            self._upload(cid, raw)
            self.stats.add(reuploaded_chunks=1)


# -- chunks of other checkpoints' tier copies count as local ----------------------------------------------------
class TierChunks:
    """chunk id -> where a tier copy of another checkpoint has it, from the chunk maps (tier dir -> files)."""

    def __init__(self, maps: dict[Path, dict[str, Any]] | None = None) -> None:
        self._where: dict[str, tuple[Path, int, int]] = {}
        self.hits = 0
        for path, body in (maps or {}).items():
            for name, refs in body.items():
                if "/" in name or name.startswith(".") or not isinstance(refs, list):
                    continue
                for item in refs:  # (a hint from this node's own file: every use is verified)
                    if isinstance(item, list) and len(item) >= 3 and is_chunk_id(item[0]) and is_count(item[1]) \
                            and is_count(item[2]):
                        self._where.setdefault(item[0], (path / name, item[1], item[2]))

    def has(self, ref: ChunkRef) -> bool:
        hit = self._where.get(ref.id)
        return hit is not None and hit[2] == ref.length

    def read_into(self, ref: ChunkRef, buf: memoryview) -> bool:
        """Reads the chunk from a tier copy into buf (len: ref.length), verified against its id; False if none."""
        if not self.has(ref):
            return False
        path, off, n = self._where[ref.id]
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with safefs.opened(fd):
                got = os.preadv(fd, [buf], off)
        except OSError:
            return False
        if got != n or chunk_id(buf) != ref.id:
            return False
        self.hits += 1
        return True


def fetch_chunked(reader: ChunkReader, dfd: int, local: TierChunks, cache: ChunkCache | None = None,
                  threads: int = 8, fill_later: Callable[[CacheFill], None] | None = None) -> dict[str, int]:
    """Writes every file of a chunked image into dfd, each chunk verified, taking chunks from tier copies (local),
    then the cache, then the store (reader). The chunks that came from the store join the cache only once every
    file was written and verified, read back from the files written: a refused restore adds nothing. That fill
    runs here, or, given fill_later, is handed to it (a restore waits for its image, not for the node's cache:
    writing each chunk into the cache as it came cost a third of the fetch's time). Returns counts.

    Chunks in a tier copy are copied by as many threads as there are CPUs (bounded by memory bandwidth: each reads
    into a reused buffer, hashes it, and writes it; more threads only contend for the destination file's lock).
    Chunks in the cache, which is on disk, and chunks from the store are read by `threads` threads each (bounded
    by the disk's queue or by round trips): with 2 threads, a warm cache read 2x slower than the store it saves
    a trip to when both were on one local disk."""
    near: list[tuple[int, ChunkRef]] = []  # in a tier copy (per the maps)
    cached: list[tuple[int, ChunkRef]] = []  # in the cache (per its index)
    far: list[tuple[int, ChunkRef]] = []
    fds: list[int] = []
    fetched: list[tuple[int, ChunkRef]] = []  # (list.append is atomic: the pool's threads share it)
    bufs = threading.local()

    def from_store(fd: int, ref: ChunkRef) -> str:
        raw = reader.chunk(ref)
        _pwrite_all(fd, raw, ref.offset)
        fetched.append((fd, ref))
        return "store"

    def from_near(fd: int, ref: ChunkRef) -> str:
        buf = getattr(bufs, "buf", None)
        if buf is None or len(buf) < ref.length:
            buf = bufs.buf = bytearray(ref.length)
        mv = memoryview(buf)[: ref.length]
        where = "tier" if local.read_into(ref, mv) else \
            "cache" if cache is not None and cache.read_into(ref.id, mv) else ""
        if not where:  # (a bad or vanished local copy: dropped, fetched from the store instead)
            return from_store(fd, ref)
        _pwrite_all(fd, mv, ref.offset)
        return where

    packs = reader.packs = PackFiles(reader.store)  # (each pack opened once, not once per chunk)
    try:
        for name, lay in reader.layouts.items():
            fd = safefs.create_file(dfd, name, 0o600)
            fds.append(fd)
            if lay.bundle is not None:
                data = reader.read_at(name, 0, lay.size)
                if len(data) != lay.size or blake3.blake3(data).hexdigest() != lay.blake3:
                    raise ChunkError(f"integrity check failed: checksum mismatch in stored {name}")
                os.write(fd, data)
                continue
            os.ftruncate(fd, lay.size)
            for ref in lay.chunks:
                (near if local.has(ref) else cached if cache is not None and ref.id in cache else far).append(
                    (fd, ref))
        packs.expect(pack_key(ref.loc[0]) for _fd, ref in far if ref.loc is not None)
        got = _run_both([(from_store, far, threads), (from_near, near, max(1, min(threads, os.cpu_count() or 1))),
                         (from_near, cached, threads)])
        if cache is not None and fetched:
            fill = CacheFill(cache, fetched)  # (it holds fds of its own)
            (fill_later or CacheFill.run)(fill)
    finally:
        packs.close()
        reader.packs = None
        for fd in fds:
            os.close(fd)
    return {"chunks": len(near) + len(cached) + len(far), "from_tier": got.count("tier"),
            "from_cache": got.count("cache"), "from_store": reader.fetched_chunks,
            "fetched_bytes": reader.fetched_bytes}


class CacheFill:
    """Chunks a fetch took from the store, to be added to the node's chunk cache: read back from the files the
    fetch wrote (descriptors of its own, so that a later rename or unlink of the image changes nothing) and
    verified against their ids again before each joins the cache (the files live in a tier that other work
    may touch meanwhile). Runs once; close() gives up what is left."""

    def __init__(self, cache: ChunkCache, fetched: list[tuple[int, ChunkRef]]) -> None:
        self.cache = cache
        self._fds: dict[int, int] = {}
        try:
            for fd, _ref in fetched:
                if fd not in self._fds:  # (reopened for reading: the fetch wrote through write-only fds)
                    self._fds[fd] = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.close()
            raise
        self._todo = [(self._fds[fd], ref) for fd, ref in fetched]
        self.added = 0

    def run(self, stop: Callable[[], bool] | None = None) -> int:
        """Adds the chunks (stops early when stop() turns true); returns how many joined the cache."""
        try:
            for fd, ref in self._todo:
                if stop is not None and stop():
                    break
                raw = os.pread(fd, ref.length, ref.offset)
                if len(raw) != ref.length or chunk_id(raw) != ref.id:
                    log.warning("chunk %s changed in the fetched image before it was cached; not cached", ref.id)
                    continue
                self.cache.put(ref.id, encode_chunk(raw, 0))
                self.added += 1
        finally:
            self.close()
        return self.added

    def close(self) -> None:
        fds, self._fds, self._todo = self._fds, {}, []
        for fd in fds.values():
            os.close(fd)


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _run_both(groups: list[tuple[Callable[[int, ChunkRef], str], list[tuple[int, ChunkRef]], int]]) -> list[str]:
    """Each group's jobs on its own thread pool, all at once; results in order. The first exception is raised
    once every job that started has finished (the callers' file descriptors stay open until then)."""
    live = [(fn, jobs, ThreadPoolExecutor(max_workers=n, thread_name_prefix="chunks")) for fn, jobs, n in groups
            if jobs]
    try:
        futs = [pool.submit(fn, *job) for fn, jobs, pool in live for job in jobs]
        try:
            return [f.result() for f in futs]
        except BaseException:
            for f in futs:
                f.cancel()
            raise
    finally:
        for _fn, _jobs, pool in live:
            pool.shutdown(wait=True)


def parallel_map(fn: Any, items: list[Any], threads: int = 8) -> list[Any]:
    """fn over items with a thread pool, results in order (the first exception is raised)."""
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="chunks") as pool:
        return list(pool.map(fn, items))


def open_cache(cache_dir: str, cap: int) -> ChunkCache | None:
    """The node's chunk cache, or None when off (cap 0) or unusable."""
    if cap <= 0:
        return None
    try:
        return ChunkCache(cache_dir, cap)
    except OSError as exc:
        log.warning("chunk cache %s unusable, restoring without it: %s", cache_dir, exc)
        return None
