"""Content-addressed chunks: page-aligned content-defined chunking, chunk objects, reader, cache.

The index of what a store holds and the sweep: memsnap.store.chunkgc. The node's chunk cache:
memsnap.store.cache.

A chunked image (stored manifest format 2, see docs/chunkstore.md) keeps each big file (pages-*.img and any
file of at least BUNDLE_MAX bytes) as a list of chunks, and the small files of a checkpoint concatenated in
one bundle object. A chunk is stored once per store under chunks/<2 hex>/<64 hex>, the hex being the blake3
of its raw bytes; its object is a zstd frame, or the raw bytes (a raw chunk that would start with the zstd
magic is compressed anyway, so the first 4 bytes always tell which). Every chunk read back is verified
against its id before it is used.

Cut points are at page (4 KiB) boundaries and depend only on the page before them (a hash of 4 of its
words): a mapping inserted into pages-*.img shifts the later pages by whole pages, and the chunks after
the next cut point are the same objects as before.
"""

from __future__ import annotations

import builtins
import logging
import mmap
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import blake3
import zstandard

from memsnap.store.bad_objects import BAD
from memsnap.store.base import Bytes, StoreWriter
from memsnap.store.errors import BadObject, StoreError, StoreNotFound
from memsnap.store.parse import MANIFEST_MAX, clip, is_count, load_json

log = logging.getLogger("memsnap.chunks")

PAGE = 4096
CHUNK_PREFIX = "chunks/"
PACK_PREFIX = "packs/"  # memsnap.store.packs
DEFAULT_AVG = 1 << 20  # chosen from the measurements in docs/chunkstore.md
BUNDLE_MAX = 1 << 20  # files smaller than this (and not pages-*.img) go into the checkpoint's bundle
BUNDLE_NAME = "bundle"
LAYOUT = "chunked"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CKPT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # = memsnap.validate.ID_RE
_K1, _K2, _K3, _K4 = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93


class ChunkError(BadObject):
    """A chunk, pack or chunked manifest is not what its id / signed manifest says (tampered or corrupt)."""


class ChunkStore(Protocol):
    """What chunks need of a store beyond memsnap.store.Store (PosixStore and S3Store have it)."""

    def open_writer(self, key: str) -> StoreWriter: ...
    def open_reader(self, key: str) -> BinaryIO: ...
    def list_with_mtime(self, prefix: str) -> list[tuple[str, int, float]]: ...
    def exists(self, key: str) -> bool: ...
    def touch(self, key: str) -> bool: ...
    def delete_keys(self, keys: list[str], not_after: float | None = None) -> int: ...
    def list(self, prefix: str) -> builtins.list[str]: ...
    def describe(self) -> str: ...
    def read_range(self, key: str, offset: int, length: int) -> bytes: ...
    def read_tail(self, key: str, length: int) -> tuple[bytes, int]: ...


class ChunkCacheLike(Protocol):
    """What a reader needs of the node's chunk cache (memsnap.store.cache.ChunkCache has it)."""

    def get(self, cid: str, raw_len: int) -> bytes | None: ...
    def put(self, cid: str, stored: bytes) -> None: ...


def chunk_key(cid: str) -> str:
    """The store key of chunk cid."""
    return f"{CHUNK_PREFIX}{cid[:2]}/{cid}"


def pack_key(pid: str) -> str:
    """The store key of pack pid (memsnap.store.packs)."""
    return f"{PACK_PREFIX}{pid[:2]}/{pid}"


def is_chunk_id(cid: object) -> bool:
    """Whether cid is a lowercase 64-hex blake3."""
    return isinstance(cid, str) and bool(_HEX64.match(cid))


def chunk_id(raw: Bytes) -> str:
    """The id of a chunk: hex blake3 of its raw bytes."""
    return blake3.blake3(raw).hexdigest()


# -- chunking ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chunking:
    """Average, minimum and maximum chunk sizes (multiples of PAGE): min = avg/4, max = 4*avg."""

    avg: int = DEFAULT_AVG

    @property
    def min(self) -> int:
        return max(PAGE, self.avg // 4)

    @property
    def max(self) -> int:
        return max(PAGE, self.avg * 4)

    def boundaries(self, buf: Bytes | mmap.mmap) -> list[tuple[int, int]]:
        """(offset, length) of the chunks of buf, in order, covering it exactly."""
        return list(self.iter_boundaries(buf))

    def iter_boundaries(self, buf: Bytes | mmap.mmap, window: int = 16 << 20) -> Iterator[tuple[int, int]]:
        """boundaries(), found window bytes at a time (a drain starts uploading before the scan ends)."""
        return self._iter(len(buf), lambda first, last, avgp: _cut_candidates(buf, first, last, avgp), window)

    def iter_file_boundaries(self, fd: int, size: int, window: int = 16 << 20) -> Iterator[tuple[int, int]]:
        """iter_boundaries() of the first size bytes of an open file, read a window at a time into one buffer
        (a mapping of the whole file would count every page of it in the reader's RSS). A file that is shorter
        than size is cut as if it ended in zero pages: whoever reads the chunks finds it short."""
        buf = bytearray(max(PAGE, window - window % PAGE))

        def candidates(first: int, last: int, avgp: int) -> list[int]:
            n = (last - first) * PAGE
            with memoryview(buf) as mv, mv[:n] as dst:
                got = os.preadv(fd, [dst], first * PAGE)
                dst[max(0, got):] = bytes(n - max(0, got))
            return [first + i for i in _cut_candidates(buf, 0, last - first, avgp)]

        return self._iter(size, candidates, len(buf))

    def _iter(self, size: int, candidates: Callable[[int, int, int], list[int]],
              window: int) -> Iterator[tuple[int, int]]:
        avgp = max(1, self.avg // PAGE)
        npages = size // PAGE
        start = 0
        lo, hi = self.min, self.max
        step = max(1, window // PAGE)
        for first in range(0, npages, step):
            for i in candidates(first, min(npages, first + step), avgp):
                end = (i + 1) * PAGE
                if end - start < lo:
                    continue
                while end - start > hi:
                    yield start, hi
                    start += hi
                yield start, end - start
                start = end
        while size - start > hi:
            yield start, hi
            start += hi
        if size > start:
            yield start, size - start


def _cut_candidates(buf: Bytes | mmap.mmap, first: int, last: int, avgp: int) -> list[int]:
    """Pages i in [first, last) after which a chunk may end: a mix of 4 of the page's 64-bit words is 0 modulo
    avgp. Vectorized (numpy wraps uint64 arithmetic modulo 2**64, as the definition's & (2**64 - 1) does, and
    releases the GIL): a drain's cut runs beside its hashing and compression threads."""
    if last <= first:
        return []
    import numpy as np  # (here, not at the top: it is a tenth of memsnapd's start, and only a drain cuts)

    _U1, _U2, _U3, _U4 = (np.uint64(k) for k in (_K1, _K2, _K3, _K4))
    pages = np.frombuffer(buf, dtype="<u8", count=(last - first) * (PAGE // 8),
                          offset=first * PAGE).reshape(last - first, PAGE // 8)
    h = pages[:, 0] * _U1
    h ^= pages[:, 129] * _U2
    h ^= pages[:, 258] * _U3
    h ^= pages[:, 511] * _U4
    h += _U1
    h ^= h >> np.uint64(29)
    h *= _U2
    h >>= np.uint64(32)
    return (np.flatnonzero(h % np.uint64(avgp) == 0) + first).tolist()


def is_bundled(name: str, size: int) -> bool:
    """Whether a file goes into the checkpoint's bundle rather than into chunks."""
    return not name.startswith("pages-") and size < BUNDLE_MAX


# -- chunk objects -----------------------------------------------------------------------------------------
def encode_chunk(raw: Bytes, level: int) -> bytes:
    """The stored object of a chunk: a zstd frame (level > 0), else the raw bytes (see the module doc). A chunk
    whose sampled pages do not compress (random or already compressed memory) is stored raw: its frame would
    be no smaller, and compressing it costs more CPU than hashing and writing it together."""
    if (level > 0 and compressible(raw)) or bytes(raw[:4]) == ZSTD_MAGIC:
        return _compressor(max(1, level)).compress(raw)
    return bytes(raw)


SAMPLES, SAMPLE = 8, 8 << 10  # compressible(): 8 samples of 8 KiB spread over the chunk
INCOMPRESSIBLE = 0.95  # ...none of which shrinks below this fraction in all: store the chunk raw
_tls = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for level (a ZstdCompressor is not thread-safe; one per chunk costs its setup)."""
    cs: dict[int, zstandard.ZstdCompressor] | None = getattr(_tls, "zstd", None)
    if cs is None:
        cs = _tls.zstd = {}
    c = cs.get(level)
    if c is None:
        c = cs[level] = zstandard.ZstdCompressor(level=level, write_checksum=False)
    return c


def compressible(raw: Bytes) -> bool:
    """Whether zstd (level 1) shrinks samples of raw to under INCOMPRESSIBLE of their size; small chunks are
    assumed compressible (the test would cost as much as compressing them)."""
    n = len(raw)
    if n < 8 * SAMPLES * SAMPLE:
        return True
    step = n // SAMPLES
    with memoryview(raw) as mv:
        sample = b"".join(mv[i * step : i * step + SAMPLE] for i in range(SAMPLES))
    return len(_compressor(1).compress(sample)) < INCOMPRESSIBLE * len(sample)


def decode_chunk(stored: bytes, cid: str, raw_len: int) -> bytes:
    """The raw bytes of a stored chunk object, verified against its id and length (else ChunkError)."""
    raw = stored
    if stored[:4] == ZSTD_MAGIC:
        try:
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=max(raw_len, 1))
        except zstandard.ZstdError as exc:
            raise ChunkError(f"integrity check failed: chunk {cid} does not decompress: {exc}") from exc
    if len(raw) != raw_len or chunk_id(raw) != cid:
        raise ChunkError(f"integrity check failed: chunk {cid} does not match its id (tampered or corrupt)")
    return raw


def put_chunk(store: ChunkStore, cid: str, stored: bytes) -> int:
    """Uploads a chunk object (atomically, under its key); returns its stored size."""
    with store.open_writer(chunk_key(cid)) as w:
        w.write(stored)
        obj = w.commit()
    if obj.size_bytes != len(stored):
        raise StoreError(f"store reports {obj.size_bytes} bytes for chunk {cid}, wrote {len(stored)}")
    return len(stored)


class RangeReads(Protocol):
    """Ranged reads of pack objects for one fetch (memsnap.store.packs.PackFiles)."""

    def read(self, key: str, offset: int, length: int) -> bytes: ...


def get_chunk(store: ChunkStore, cid: str, raw_len: int, loc: tuple[str, int, int] | None = None,
              packs: RangeReads | None = None) -> tuple[bytes, bytes]:
    """(raw, stored) of a chunk fetched from the store (its loose object, or its slice of pack loc) and verified."""
    if loc is not None:
        key = pack_key(loc[0])
        stored = packs.read(key, loc[1], loc[2]) if packs is not None else store.read_range(key, loc[1], loc[2])
    else:
        most = raw_len + (raw_len >> 7) + 4096  # (zstd's worst case; a planted 100 GB file is never read whole)
        with store.open_reader(chunk_key(cid)) as f:
            stored = f.read(most + 1)
        if len(stored) > most:
            raise ChunkError(f"integrity check failed: chunk {cid} is larger than any encoding of it", "chunk",
                             chunk_key(cid))
    return decode_chunk(stored, cid, raw_len), stored


# -- the storage section of a format-2 manifest ------------------------------------------------------------
@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a file: its id, offset in the file and raw length; loc: where it is stored in a pack (pack
    id, offset, stored length), None for a loose chunk object."""

    id: str
    offset: int
    length: int
    loc: tuple[str, int, int] | None = None


@dataclass(frozen=True)
class Layout:
    """Where a stored file's bytes are: its chunks, or a slice of the bundle (bundle = (offset, size)); blake3:
    the hash of the whole file (its manifest's)."""

    size: int
    chunks: tuple[ChunkRef, ...] = ()
    bundle: tuple[int, int] | None = None
    blake3: str = ""


@dataclass(frozen=True)
class OwnBundle:
    """A bundle stored as an object of its own, <checkpoint>/bundle (the format before packs): zstd or raw."""

    key: str
    raw_bytes: int
    stored_bytes: int
    stored_blake3: str


@dataclass(frozen=True)
class ChunkedStorage:
    """The "storage" section of a chunked (format 2) stored manifest, parsed and checked (chunked_storage): each
    file's layout, the bundle of the small files, and the upload's sizes."""

    ckpt_id: str
    files: Mapping[str, Layout]  # the same names as the manifest's "files"
    bundle: ChunkRef | OwnBundle | None = None
    logical_bytes: int = 0
    stored_bytes: int = 0
    new_bytes: int = 0

    def refs(self) -> list[ChunkRef]:
        """Every chunk it references: the files' and the bundle's."""
        own = [self.bundle] if isinstance(self.bundle, ChunkRef) else []
        return [ref for lay in self.files.values() for ref in lay.chunks] + own

    def referenced_chunks(self) -> set[str]:
        """Ids of the chunks it references."""
        return {ref.id for ref in self.refs()}

    def referenced_packs(self) -> set[str]:
        """Ids of the packs whose chunks it references."""
        return {ref.loc[0] for ref in self.refs() if ref.loc}

    def sizes(self) -> dict[str, int]:
        """logical_bytes, stored_bytes and new_bytes of the upload (0 where the manifest has none)."""
        return {"logical_bytes": self.logical_bytes, "stored_bytes": self.stored_bytes, "new_bytes": self.new_bytes}


def is_image_file_name(name: object) -> bool:
    """Whether a manifest may list name as a file of an image: a plain name, never manifest.json itself."""
    return isinstance(name, str) and bool(name) and "/" not in name and not name.startswith(".") and \
        name != "manifest.json"


def chunked_storage(stored: dict[str, Any]) -> ChunkedStorage | None:
    """The parsed storage section of a stored manifest's JSON, None for a whole-file (format 1) one; checked
    for consistency (else ChunkError): safe names, the same file set as "files", valid ids, chunks that tile
    each file exactly, a bundle that holds every bundled file. Total: any JSON object gives a result or
    ChunkError (gc marks with manifests no key verified)."""
    storage = stored.get("storage")
    if not isinstance(storage, dict) or storage.get("layout") != LAYOUT:
        return None
    files, sfiles, ckpt_id = stored.get("files"), storage.get("files"), stored.get("id")
    if not isinstance(files, dict) or not isinstance(sfiles, dict):
        raise ChunkError("integrity check failed: chunked manifest has no file list")
    if not isinstance(ckpt_id, str):
        raise ChunkError("integrity check failed: chunked manifest names no checkpoint")
    packs = storage.get("packs", [])
    if not isinstance(packs, list) or not all(is_chunk_id(p) for p in packs):
        raise ChunkError("integrity check failed: bad pack list in stored manifest")
    if set(sfiles) != set(files):
        raise ChunkError("integrity check failed: stored manifest lists other files")
    bundle = _bundle(ckpt_id, storage.get("bundle"), packs)
    out = {name: _layout(name, meta, sfiles[name], packs) for name, meta in files.items()}
    room = -1 if bundle is None else bundle.length if isinstance(bundle, ChunkRef) else bundle.raw_bytes
    for name, lay in out.items():
        if lay.bundle is not None and lay.bundle[0] + lay.size > room:
            raise ChunkError(f"integrity check failed: the bundle of the stored manifest does not hold "
                             f"{clip(name, 100)!r}")
    return ChunkedStorage(ckpt_id, out, bundle,
                          *(v if is_count(v := storage.get(k)) else 0
                            for k in ("logical_bytes", "stored_bytes", "new_bytes")))


def _layout(name: str, meta: Any, s: Any, packs: list[str]) -> Layout:
    size = meta.get("size") if isinstance(meta, dict) else None
    digest = meta.get("blake3") if isinstance(meta, dict) else None
    if not is_image_file_name(name) or not is_count(size) or not isinstance(digest, str) or not isinstance(s, dict):
        raise ChunkError(f"integrity check failed: bad entry {clip(name, 100)!r} in stored manifest")
    if "bundle" in s:
        b = s["bundle"]
        if not (isinstance(b, list) and len(b) == 2 and is_count(b[0]) and b[1] == size):
            raise ChunkError(f"integrity check failed: bad bundle slice of {clip(name, 100)!r} in stored manifest")
        return Layout(size, bundle=(b[0], size), blake3=digest)
    items = s.get("chunks", [])
    if not isinstance(items, list):
        raise ChunkError(f"integrity check failed: bad chunk list of {clip(name, 100)!r} in stored manifest")
    refs, pos = [], 0
    for item in items:
        cid, off, n, loc = _ref_item(item, packs)
        if not is_chunk_id(cid) or off != pos or not is_count(n) or n <= 0:
            raise ChunkError(f"integrity check failed: bad chunk list of {clip(name, 100)!r} in stored manifest")
        refs.append(ChunkRef(cid, off, n, loc))
        pos += n
    if pos != size:
        raise ChunkError(f"integrity check failed: the chunks of {clip(name, 100)!r} do not add up to its size")
    return Layout(size, chunks=tuple(refs), blake3=digest)


def _ref_item(item: Any, packs: list[str]) -> tuple[Any, Any, Any, tuple[str, int, int] | None]:
    """(id, offset, length, loc) of a chunk list item: [id, offset, length] (a loose chunk) or
    [id, offset, length, pack number, offset in the pack, stored length]."""
    if isinstance(item, list) and len(item) == 3:
        return item[0], item[1], item[2], None
    if isinstance(item, list) and len(item) == 6:
        p, poff, plen = item[3:]
        if all(is_count(v) for v in (p, poff, plen)) and p < len(packs) and plen > 0:
            return item[0], item[1], item[2], (packs[p], poff, plen)
    raise ChunkError("integrity check failed: bad chunk entry in stored manifest")


def _bundle(ckpt_id: str, b: Any, packs: list[str]) -> ChunkRef | OwnBundle | None:
    """The bundle of the small files: one chunk (in a pack, or loose), an object of its own, or none."""
    if not b:
        return None
    if isinstance(b, dict) and "chunk" in b:
        cid, off, n, loc = _ref_item(b["chunk"], packs)
        if is_chunk_id(cid) and off == 0 and n == b.get("raw_bytes") and is_count(n) and n > 0:
            return ChunkRef(cid, 0, n, loc)
    elif isinstance(b, dict) and b.get("key") == f"{ckpt_id}/{BUNDLE_NAME}":
        raw_n, stored_n, digest = b.get("raw_bytes"), b.get("stored_bytes"), b.get("stored_blake3")
        if is_count(raw_n) and is_count(stored_n) and isinstance(digest, str):
            return OwnBundle(b["key"], raw_n, stored_n, digest)
    raise ChunkError("integrity check failed: bad bundle entry in stored manifest")


# -- random access to a stored chunked image ---------------------------------------------------------------
class ChunkReader:
    """Random access to the files of a stored chunked image, each chunk fetched on demand and verified.

    Built from a store and the parsed storage of a stored manifest whose signature and binding the caller
    verified (memsnap.manifest.StoredManifest.chunked). Thread-safe:
    concurrent reads of one chunk fetch it once. Chunks go through the optional ChunkCache; the last few
    decoded chunks stay in memory (mem_chunks) for neighbouring reads. With fill_cache=False the cache is only
    read (a restore fills it once every chunk was verified: fetch_chunked).
    """

    def __init__(self, store: ChunkStore, storage: ChunkedStorage, cache: ChunkCacheLike | None = None,
                 mem_chunks: int = 8, fill_cache: bool = True) -> None:
        self.store, self.storage, self.cache, self.fill_cache = store, storage, cache, fill_cache
        self.layouts = storage.files
        self._mem: OrderedDict[str, bytes] = OrderedDict()
        self._mem_max = max(1, mem_chunks)
        self._lock = threading.Lock()
        self._inflight: dict[str, threading.Event] = {}
        self._bundle: bytes | None = None
        self.fetched_chunks = 0
        self.fetched_bytes = 0  # stored bytes read from the store
        self.packs: RangeReads | None = None  # while a fetch reads every chunk (memsnap.store.chunked.fetch_chunked)

    def files(self) -> dict[str, int]:
        """name -> size of every file of the image."""
        return {n: lay.size for n, lay in self.layouts.items()}

    def chunks(self, file_name: str) -> list[ChunkRef]:
        """The chunks of a file in order (empty for a bundled file): a prefetcher streams them in turn."""
        return list(self._layout(file_name).chunks)

    def _layout(self, file_name: str) -> Layout:
        try:
            return self.layouts[file_name]
        except KeyError:
            raise StoreNotFound(f"{file_name!r} is not a file of this image") from None

    def read_at(self, file_name: str, offset: int, length: int) -> bytes:
        """Raw bytes [offset, offset+length) of a file (shorter at its end)."""
        lay = self._layout(file_name)
        end = min(lay.size, offset + max(0, length))
        if offset < 0 or offset >= end:
            return b""
        if lay.bundle is not None:
            base = lay.bundle[0]
            return self.bundle()[base + offset : base + end]
        parts = []
        for ref in _overlapping(lay.chunks, offset, end):
            raw = self.chunk(ref)
            parts.append(raw[max(0, offset - ref.offset) : end - ref.offset])
        return b"".join(parts)

    def chunk(self, ref: ChunkRef) -> bytes:
        """The raw bytes of one chunk, verified (memory, then cache, then store)."""
        while True:
            with self._lock:
                if ref.id in self._mem:
                    self._mem.move_to_end(ref.id)
                    return self._mem[ref.id]
                ev = self._inflight.get(ref.id)
                if ev is None:
                    ev = self._inflight[ref.id] = threading.Event()
                    break
            ev.wait()
            with self._lock:
                if ref.id in self._mem or ref.id in self._inflight:
                    continue
            # The fetch that we waited for failed: try ourselves.
        try:
            raw = self._load(ref)
            with self._lock:
                self._mem[ref.id] = raw
                while len(self._mem) > self._mem_max:
                    self._mem.popitem(last=False)
            return raw
        finally:
            with self._lock:
                self._inflight.pop(ref.id, None)
            ev.set()

    def _load(self, ref: ChunkRef) -> bytes:
        if self.cache is not None:
            got = self.cache.get(ref.id, ref.length)
            if got is not None:
                return got
        raw, stored = get_chunk(self.store, ref.id, ref.length, ref.loc, self.packs)
        with self._lock:
            self.fetched_chunks += 1
            self.fetched_bytes += len(stored)
        if self.cache is not None and self.fill_cache:
            self.cache.put(ref.id, stored)
        return raw

    def bundle(self) -> bytes:
        """The raw bundle of the image's small files, verified against the manifest."""
        with self._lock:
            if self._bundle is not None:
                return self._bundle
        b = self.storage.bundle
        if b is None:
            raise ChunkError("integrity check failed: the stored manifest has no bundle")
        if isinstance(b, ChunkRef):
            raw = self.chunk(b)
            with self._lock:
                self._bundle = raw
            return raw
        with self.store.open_reader(b.key) as f:
            stored = f.read(b.stored_bytes + 1)
        if len(stored) != b.stored_bytes or blake3.blake3(stored).hexdigest() != b.stored_blake3:
            raise ChunkError(f"integrity check failed: the bundle of {self.storage.ckpt_id} does not match "
                             "its manifest")
        try:
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=max(1, b.raw_bytes)) \
                if stored[:4] == ZSTD_MAGIC else stored
        except zstandard.ZstdError as exc:
            raise ChunkError(f"integrity check failed: the bundle of {self.storage.ckpt_id} does not "
                             f"decompress: {exc}") from exc
        with self._lock:
            self.fetched_bytes += len(stored)
            self._bundle = raw
        return raw


def _overlapping(refs: tuple[ChunkRef, ...], start: int, end: int) -> Iterator[ChunkRef]:
    lo, hi = 0, len(refs)
    while lo < hi:  # first chunk ending after start
        mid = (lo + hi) // 2
        if refs[mid].offset + refs[mid].length <= start:
            lo = mid + 1
        else:
            hi = mid
    for ref in refs[lo:]:
        if ref.offset >= end:
            return
        yield ref


def load_stored_manifest(store: ChunkStore, ckpt_id: str) -> dict[str, Any]:
    """The JSON object of a checkpoint's stored manifest, NOT verified: what its signature is checked over,
    then parsed once (memsnap.manifest.StoredManifest.parse; gc's mark: chunked_storage). BadObject (kind
    "manifest", reported: memsnap.store.bad_objects) for any bytes that are not a JSON object
    (memsnap.store.parse)."""
    key = f"{ckpt_id}/manifest.json"
    with store.open_reader(key) as f:
        data = f.read(MANIFEST_MAX + 1)
    try:
        return load_json(data, "manifest", key, MANIFEST_MAX, clip(key, 150))
    except BadObject as exc:
        BAD.report_error(exc, store.describe())
        raise


def manifest_bytes(ckpt_id: str, text: str) -> bytes:
    """A stored manifest to write, refused (StoreError) past MANIFEST_MAX: no reader would accept it, so it
    never becomes durable."""
    data = text.encode()
    if len(data) > MANIFEST_MAX:
        raise StoreError(f"the manifest of {ckpt_id} would have {len(data)} bytes, more than a reader accepts "
                         f"({MANIFEST_MAX}); drain it with a larger [store] chunk_size")
    return data


def indexed_ids(store: ChunkStore, keys: list[str]) -> list[str]:
    """The checkpoint ids that name-index entries (_index/<name>/<id>) list, newest first; an entry that names
    no id (anyone who writes the store may plant one) is reported and skipped."""
    ids = []
    for key in keys:
        cid = key.rsplit("/", 1)[-1]
        if _CKPT_ID.match(cid):
            ids.append(cid)
        else:
            BAD.report("name-index", key, "names no checkpoint id", store.describe())
    return sorted(ids, reverse=True)
