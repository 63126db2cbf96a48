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
import queue
import secrets
import struct
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from memsnap.store.base import StoreWriter
from memsnap.store.chunks import ChunkError, ChunkStore, is_chunk_id, pack_key
from memsnap.store.errors import BadObject, StoreError
from memsnap.store.parse import clip, is_count, load_json

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
    tail: the bytes to read. Total: any bytes either parse or raise ChunkError (a BadObject of kind "pack")
    naming the pack."""
    if len(tail) < FOOTER.size or size < FOOTER.size:
        raise _bad(pid, "is too short")
    n, magic = FOOTER.unpack(tail[-FOOTER.size:])
    if magic != PACK_MAGIC or n > min(INDEX_MAX, size - FOOTER.size):
        raise _bad(pid, "has no pack footer")
    if n + FOOTER.size > len(tail):
        return int(n + FOOTER.size)
    body = size - FOOTER.size - n  # where the index starts: every chunk lies before it
    try:
        data = load_json(bytes(tail[len(tail) - FOOTER.size - n: len(tail) - FOOTER.size]), "pack", pack_key(pid),
                         INDEX_MAX)
    except BadObject as exc:
        raise _bad(pid, f"has an index that {exc.reason}") from None
    items = data.get("chunks")
    if data.get("v") != 1 or not isinstance(items, list):
        raise _bad(pid, "has an index with no v1 chunk list")
    out: list[Entry] = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 4 and is_chunk_id(item[0])
                and all(is_count(v) for v in item[1:])):
            raise _bad(pid, f"has a bad index entry {clip(item, 100)}")
        cid, off, slen, rlen = item
        if not (0 < slen and off + slen <= body and rlen > 0):
            raise _bad(pid, f"has an index entry outside the pack ({cid})")
        out.append((cid, off, slen, rlen))
    return out


def _bad(pid: str, reason: str) -> ChunkError:
    return ChunkError(f"integrity check failed: pack {pid} {reason}", "pack", pack_key(pid), reason)


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

    def __init__(self, store: ChunkStore, pid: str) -> None:
        self.pid = pid
        self.writer: StoreWriter = store.open_writer(pack_key(pid))
        self.entries: list[Entry] = []
        self.pos = 0

    def add(self, cid: str, stored: bytes, raw_len: int) -> None:
        self.writer.write(stored)
        self.entries.append((cid, self.pos, len(stored), raw_len))
        self.pos += len(stored)

    def finish(self) -> int:
        tail = _footer(json.dumps({"v": 1, "chunks": self.entries}, separators=(",", ":")).encode())
        self.writer.write(tail)
        obj = self.writer.commit()
        if obj.size_bytes != self.pos + len(tail):
            raise StoreError(f"store reports {obj.size_bytes} bytes for pack {self.pid}, wrote {self.pos + len(tail)}")
        return len(tail)


_END = ("", b"", 0, "")
QUEUE_CHUNKS = 8  # chunk objects queued for the pack writer (at most 4x the average chunk size each)
COMMITS_QUEUED = 2  # written packs waiting for their commit while the writer fills the next one


class Packer:
    """Writes the chunks given to add() into packs of about `target` bytes, one after the other.

    add() places a chunk at the end of the current pack (a new one once that passed target) and queues it; one
    writer thread streams the queue into the store, so the drain's threads go on hashing and compressing while
    it uploads, and a drain writes ceil(new bytes / target) packs. A pack is committed when the next one begins
    (or at close()), by a thread of its own: the writer goes on with the next pack while the last one is synced
    and renamed (a pack's commit, fsync + rename + the directory's fsync, took ~7 ms of every 32 MiB on a local
    disk, a quarter of the writer's time; bench/results/dataplane-notes.md). Packs are committed in the order
    they were written; committed(pid, entries, trailer_bytes) runs after each commit, never before: an index must
    not list a chunk of a pack that may not exist. abort() discards every pack not yet committed; after a failed
    commit no later pack is committed.
    """

    def __init__(self, store: ChunkStore, target: int, committed: Callable[[str, list[Entry], int], None]) -> None:
        self.store, self.target, self.committed = store, max(1, target), committed
        self._q: queue.Queue[tuple[str, bytes, int, str]] = queue.Queue(maxsize=QUEUE_CHUNKS)
        self._commits: queue.Queue[_Open | None] = queue.Queue(maxsize=COMMITS_QUEUED)
        self._lock = threading.Lock()
        self._pid, self._pos = "", 0
        self._error: BaseException | None = None
        self._aborted = False
        self._committer = threading.Thread(target=self._commit_all, name="drain-pack-commit", daemon=True)
        self._committer.start()
        self._thread = threading.Thread(target=self._write_all, name="drain-pack", daemon=True)
        self._thread.start()

    def add(self, cid: str, stored: bytes, raw_len: int) -> Loc:
        """Queues a chunk object for the current pack; returns where it will be (once that pack is committed)."""
        with self._lock:
            self._raise()
            if not self._pid or self._pos >= self.target:
                self._pid, self._pos = secrets.token_hex(32), 0
            loc = (self._pid, self._pos, len(stored))
            self._pos += len(stored)
            self._q.put((cid, stored, raw_len, self._pid))  # (in order: under the lock)
        return loc

    def _raise(self) -> None:
        """Raises what the writer or the committer met (the store's own error: tampering, unavailable, full...)."""
        if isinstance(self._error, StoreError | OSError):
            raise self._error
        if self._error is not None:
            raise StoreError(f"writing a pack failed: {self._error}") from self._error

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:  # (the first one is the reason)
            self._error = exc

    def _write_all(self) -> None:
        cur: _Open | None = None
        pid = "-"
        try:
            while True:
                cid, stored, raw_len, pid = self._q.get()
                if self._error is not None:  # (a commit failed: nothing more is written)
                    raise self._error
                if cur is not None and pid != cur.pid and not self._aborted:
                    cur, done = None, cur
                    self._commits.put(done)  # (waits while COMMITS_QUEUED packs wait for theirs)
                if not pid or self._aborted:
                    break
                if cur is None:
                    cur = _Open(self.store, pid)
                cur.add(cid, stored, raw_len)
        except BaseException as exc:  # (raised in add() and close())
            self._fail(exc)
            if pid:  # (unless it was the end that failed)
                while self._q.get()[3]:  # (take what add() queued until the end, so that it never blocks)
                    pass
        finally:
            if cur is not None:
                cur.writer.abort()
            self._commits.put(None)

    def _commit_all(self) -> None:
        while (pack := self._commits.get()) is not None:
            if self._aborted or self._error is not None:
                pack.writer.abort()
                continue
            try:
                n = pack.finish()
                self.committed(pack.pid, pack.entries, n)
            except BaseException as exc:
                pack.writer.abort()  # (a no-op once committed)
                self._fail(exc)

    def close(self) -> None:
        """Commits the last pack (call once every add() returned); raises what a pack's upload raised."""
        self._q.put(_END)
        self._thread.join()
        self._committer.join()
        self._raise()

    def abort(self) -> None:
        """Discards the packs not committed yet."""
        self._aborted = True
        self._q.put(_END)
        self._thread.join()
        self._committer.join()


class PackFiles:
    """The packs one fetch reads, each opened once (store.open_ranges, where the store has it) for all of its
    chunks, at most `cap` at a time: one more closes the least recently used that no read is in (its close
    drops a local store's pack from the page cache: PosixRanges), and while all are in use a chunk is read by
    read_range as before. Told what the fetch will read (expect), a pack is closed as soon as its last expected
    chunk was read, so that the page cache gives its memory back while the fetch fills the tier. close() when the
    fetch ends."""

    def __init__(self, store: ChunkStore, cap: int = 64) -> None:
        self._open = getattr(store, "open_ranges", None)
        self._store, self._cap = store, cap
        self._files: OrderedDict[str, Any] = OrderedDict()  # least recently used first
        self._busy: Counter[str] = Counter()  # reads in each
        self._left: Counter[str] = Counter()  # reads expected of each, not started yet
        self._lock = threading.Lock()

    def expect(self, keys: Iterable[str]) -> None:
        """The packs the fetch will read, a key per chunk."""
        with self._lock:
            self._left.update(keys)

    def read(self, key: str, offset: int, length: int) -> bytes:
        f = self._take(key) if self._open is not None else None
        if f is None:
            return self._store.read_range(key, offset, length)
        done = None
        try:
            data: bytes = f.read(offset, length)
            return data
        finally:
            with self._lock:
                self._busy[key] -= 1
                if not self._busy[key] and key in self._left and self._left[key] <= 0:
                    del self._left[key], self._busy[key]  # (its last expected chunk was read)
                    done = self._files.pop(key, None)
            if done is not None:
                done.close()

    def _take(self, key: str) -> Any:
        """key's open pack, opened here if need be, counted as in use; None when at the cap and all are in use."""
        stale = None
        try:
            with self._lock:
                f = self._files.get(key)
                if f is None:
                    if len(self._files) >= self._cap:
                        idle = next((k for k in self._files if not self._busy[k]), None)
                        if idle is None:
                            return None
                        stale = self._files.pop(idle)
                        del self._busy[idle]
                    assert self._open is not None
                    f = self._files[key] = self._open(key)
                self._files.move_to_end(key)
                self._busy[key] += 1
                if key in self._left:
                    self._left[key] -= 1
            return f
        finally:
            if stale is not None:
                stale.close()  # (nobody reads it: it was idle, and left the table before)

    def close(self) -> None:
        with self._lock:
            files, self._files, self._cap = self._files, OrderedDict(), 0
        for f in files.values():
            f.close()
