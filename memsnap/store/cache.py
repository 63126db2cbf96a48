"""The node-local chunk cache: stored chunk objects kept on this node, verified on every read (LRU, capped)."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from collections import OrderedDict
from pathlib import Path

from memsnap.store.chunks import ZSTD_MAGIC, ChunkError, chunk_id, decode_chunk, is_chunk_id

log = logging.getLogger("memsnap.chunks")


class ChunkCache:
    """Stored chunk objects kept on this node, least recently used evicted past cap bytes (0 = off).

    Entries are verified on every get (a bad one is dropped), so the cache never has to be trusted.
    """

    def __init__(self, root: str | os.PathLike[str], cap: int) -> None:
        self.root, self.cap = Path(root), cap
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0
        if cap <= 0:
            return
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        found = []
        with os.scandir(self.root) as entries:  # (one lstat a file)
            for e in entries:
                if is_chunk_id(e.name) and e.is_file(follow_symlinks=False):
                    s = e.stat(follow_symlinks=False)
                    found.append((s.st_mtime, e.name, s.st_size))
                elif e.name.startswith(".tmp-"):
                    (self.root / e.name).unlink(missing_ok=True)
        for _m, cid, n in sorted(found):
            self._lru[cid] = n
            self._bytes += n
        self._trim()

    def __contains__(self, cid: str) -> bool:
        with self._lock:
            return cid in self._lru

    def get(self, cid: str, raw_len: int) -> bytes | None:
        """The raw bytes of a cached chunk, verified; None when absent (or bad: then dropped)."""
        buf = bytearray(raw_len)
        return bytes(buf) if self.read_into(cid, memoryview(buf)) else None

    def read_into(self, cid: str, buf: memoryview) -> bool:
        """Reads a cached chunk's raw bytes (len(buf) of them) into buf, verified against its id; False when
        absent (or bad: then dropped). A raw entry is read straight into buf: no allocation, one copy."""
        if self.cap <= 0:
            return False
        with self._lock:
            known = cid in self._lru
            if known:
                self._lru.move_to_end(cid)
        if not known:
            self.misses += 1
            return False
        try:
            fd = os.open(self.root / cid, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                if size != len(buf) or os.preadv(fd, [buf], 0) != size or buf[:4] == ZSTD_MAGIC:
                    buf[:] = decode_chunk(os.pread(fd, size + 1, 0), cid, len(buf))  # (a zstd entry: see encode)
                elif chunk_id(buf) != cid:
                    raise ChunkError(f"integrity check failed: chunk {cid} does not match its id")
            finally:
                os.close(fd)
        except (OSError, ValueError, ChunkError) as exc:
            log.warning("chunk cache entry %s dropped: %s", cid, exc)
            self._drop(cid)
            self.misses += 1
            return False
        self.hits += 1
        return True

    def put(self, cid: str, stored: bytes) -> None:
        """Adds a (verified) stored chunk object."""
        staged = self.stage(cid, stored)
        if staged is not None:
            self.commit([staged])

    def stage(self, cid: str, stored: bytes) -> tuple[str, Path, int] | None:
        """Writes a chunk object under a temp name; it joins the cache at commit() (or goes at discard())."""
        if self.cap <= 0 or len(stored) > self.cap:
            return None
        with self._lock:
            if cid in self._lru:
                return None
        # A name of its own each time: one fetch stages a chunk its image holds twice twice, before the commit.
        tmp = self.root / f".tmp-{secrets.token_hex(8)}-{cid}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.warning("cannot cache chunk %s: %s", cid, exc)
            return None
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(stored)
        except OSError as exc:
            log.warning("cannot cache chunk %s: %s", cid, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()
            return None
        return cid, tmp, len(stored)

    def commit(self, staged: list[tuple[str, Path, int]]) -> None:
        """Moves staged chunks into the cache."""
        for cid, tmp, n in staged:
            try:
                os.rename(tmp, self.root / cid)
            except OSError as exc:
                log.warning("cannot cache chunk %s: %s", cid, exc)
                continue
            with self._lock:
                if cid not in self._lru:
                    self._lru[cid] = n
                    self._bytes += n
        self._trim()

    @staticmethod
    def discard(staged: list[tuple[str, Path, int]]) -> None:
        """Removes staged chunks (the restore that fetched them failed)."""
        for _cid, tmp, _n in staged:
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _drop(self, cid: str) -> None:
        with self._lock:
            self._bytes -= self._lru.pop(cid, 0)
        with contextlib.suppress(OSError):
            (self.root / cid).unlink()

    def _trim(self) -> None:
        while True:
            with self._lock:
                if self._bytes <= self.cap or not self._lru:
                    return
                cid, n = self._lru.popitem(last=False)
                self._bytes -= n
            with contextlib.suppress(OSError):
                (self.root / cid).unlink()

    @property
    def size_bytes(self) -> int:
        """Bytes cached now."""
        return self._bytes
