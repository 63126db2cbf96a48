"""Packs: the new chunks of a drain written as a few large objects, not one object each.

A pack (packs/<2 hex>/<64 hex>, a random id) is the concatenation of chunk objects (each what
memsnap.store.chunks.encode_chunk makes: a zstd frame or the raw bytes), followed by its own index and a
footer:

    chunk objects ... | index (JSON: {"v": 1, "chunks": [[id, offset, stored_len, raw_len], ...]}) |
    index length (8 bytes, little endian) | PACK_MAGIC (8 bytes)

A stored manifest says where each of its chunks is (pack, offset, stored length): a restore reads a chunk with
one ranged read, and verifies it against its id as it does a loose chunk. The index at the end lets other
nodes learn which chunks a pack holds from one read of its tail (memsnap.store.chunkgc: a drain lists the packs
it has not seen and reads their tails), so that deduplication still works across nodes. Packs are written whole
or not at all (a store writer publishes on commit); a sweep deletes a pack when no manifest references it.

As restic does (its packs and index files), this trades a little space for round trips: a pack that holds one
chunk still referenced stays whole (docs/chunkstore.md, "Packs").
"""

from __future__ import annotations

import json
import secrets
import struct
import threading
from collections.abc import Callable

from memsnap.store.base import StoreWriter
from memsnap.store.chunks import ChunkError, ChunkStore, is_chunk_id, pack_key
from memsnap.store.errors import StoreError

PACK_MAGIC = b"MSPACK\x00\x01"
FOOTER = struct.Struct("<Q8s")
TAIL_READ = 64 << 10  # the first read of a pack's tail (an index of ~500 chunks fits)
INDEX_MAX = 16 << 20
DEFAULT_PACK = 32 << 20  # pack size target; 0 = a loose object per chunk (the format before packs)

Loc = tuple[str, int, int]  # (pack id, offset, stored length)
Entry = tuple[str, int, int, int]  # (chunk id, offset, stored length, raw length)


def pack_id_of(key: str) -> str:
    """The pack id of a store key under packs/ ("" if it is not one)."""
    pid = key.rsplit("/", 1)[-1]
    return pid if is_chunk_id(pid) and key == pack_key(pid) else ""


def _footer(index: bytes) -> bytes:
    return index + FOOTER.pack(len(index), PACK_MAGIC)


def parse_tail(tail: bytes, size: int, pid: str) -> list[Entry] | int:
    """The entries of a pack from its last bytes (tail) and its size; an int when the index is longer than
    tail: the bytes to read. ChunkError for a pack whose footer or index is not one."""
    if len(tail) < FOOTER.size or size < FOOTER.size:
        raise ChunkError(f"integrity check failed: pack {pid} is too short")
    n, magic = FOOTER.unpack(tail[-FOOTER.size:])
    if magic != PACK_MAGIC or n > min(INDEX_MAX, size - FOOTER.size):
        raise ChunkError(f"integrity check failed: pack {pid} has no pack footer")
    if n + FOOTER.size > len(tail):
        return int(n + FOOTER.size)
    body = size - FOOTER.size - n  # where the index starts: every chunk lies before it
    try:
        data = json.loads(tail[len(tail) - FOOTER.size - n: len(tail) - FOOTER.size])
        items = data["chunks"] if isinstance(data, dict) and data.get("v") == 1 else None
        out: list[Entry] = []
        for cid, off, slen, rlen in items if isinstance(items, list) else ():
            if not (is_chunk_id(cid) and all(isinstance(v, int) for v in (off, slen, rlen))
                    and 0 <= off and 0 < slen and off + slen <= body and rlen > 0):
                raise ValueError(f"bad entry {cid!r}")
            out.append((cid, off, slen, rlen))
    except (ValueError, TypeError, KeyError) as exc:
        raise ChunkError(f"integrity check failed: the index of pack {pid} is not valid ({exc})") from exc
    if items is None:
        raise ChunkError(f"integrity check failed: the index of pack {pid} is not valid")
    return out


def read_pack_index(store: ChunkStore, pid: str) -> list[Entry]:
    """The chunks a pack holds, from its tail (one read, two for a big index). A hint: each chunk read later
    is verified against its id."""
    tail, size = store.read_tail(pack_key(pid), TAIL_READ)
    got = parse_tail(tail, size, pid)
    if isinstance(got, int):
        tail, size = store.read_tail(pack_key(pid), got)
        got = parse_tail(tail, size, pid)
        if isinstance(got, int):
            raise ChunkError(f"integrity check failed: pack {pid} changed while it was read")
    return got


class _Open:
    """One pack being written: its store writer, id and entries."""

    def __init__(self, store: ChunkStore) -> None:
        self.pid = secrets.token_hex(32)
        self.writer: StoreWriter = store.open_writer(pack_key(self.pid))
        self.entries: list[Entry] = []
        self.pos = 0

    def add(self, cid: str, stored: bytes, raw_len: int) -> Loc:
        self.writer.write(stored)
        self.entries.append((cid, self.pos, len(stored), raw_len))
        loc = (self.pid, self.pos, len(stored))
        self.pos += len(stored)
        return loc

    def finish(self) -> int:
        tail = _footer(json.dumps({"v": 1, "chunks": self.entries}, separators=(",", ":")).encode())
        self.writer.write(tail)
        obj = self.writer.commit()
        if obj.size_bytes != self.pos + len(tail):
            raise StoreError(f"store reports {obj.size_bytes} bytes for pack {self.pid}, wrote {self.pos + len(tail)}")
        return len(tail)


class Packer:
    """Writes the chunks given to add() into packs of about `target` bytes, at most `max_open` at once.

    A thread takes the pack written last if it is free, and opens another only while all are busy (a slow
    store gets parallel uploads; a fast one, few packs). A pack full past target is committed by the thread
    that filled it; close() commits the rest. committed(pid, entries, trailer_bytes) runs after each commit
    (never before: an index must not list a chunk of a pack that may not exist). abort() discards every pack
    not yet committed.
    """

    def __init__(self, store: ChunkStore, target: int, committed: Callable[[str, list[Entry], int], None],
                 max_open: int = 4) -> None:
        self.store, self.target, self.committed = store, max(1, target), committed
        self.max_open = max(1, max_open)
        self._free: list[_Open] = []
        self._open = 0
        self._cond = threading.Condition()
        self._closed = False

    def add(self, cid: str, stored: bytes, raw_len: int) -> Loc:
        """Appends a chunk object to a pack; returns where it is (valid once the pack is committed)."""
        p = self._take()
        try:
            loc = p.add(cid, stored, raw_len)
            if p.pos >= self.target:
                self._commit(p)
                return loc
        except BaseException:
            self._drop(p)
            raise
        with self._cond:
            self._free.append(p)
            self._cond.notify()
        return loc

    def _drop(self, p: _Open) -> None:
        p.writer.abort()
        with self._cond:
            self._open -= 1
            self._cond.notify()

    def _take(self) -> _Open:
        with self._cond:
            while True:
                if self._closed:
                    raise StoreError("the drain's packs were closed")
                if self._free:
                    return self._free.pop()
                if self._open < self.max_open:
                    self._open += 1
                    break
                self._cond.wait()
        try:
            return _Open(self.store)
        except BaseException:
            with self._cond:
                self._open -= 1
                self._cond.notify()
            raise

    def _commit(self, p: _Open) -> None:
        """Commits p (on failure the caller drops it)."""
        n = p.finish()
        with self._cond:
            self._open -= 1
            self._cond.notify()
        self.committed(p.pid, p.entries, n)

    def close(self) -> None:
        """Commits every pack still open (call once every add() returned)."""
        with self._cond:
            packs, self._free = self._free, []
        for i, p in enumerate(packs):
            try:
                self._commit(p) if p.entries else self._drop(p)
            except BaseException:
                for q in packs[i:]:
                    self._drop(q)
                raise

    def abort(self) -> None:
        """Discards the packs not committed yet."""
        with self._cond:
            self._closed = True
            packs, self._free = self._free, []
        for p in packs:
            self._drop(p)
