"""Where a lazy restore's pages come from: PageSource and its implementations.

A PageSource answers read_at(file, offset, length) with verified bytes of a checkpoint file, or raises
SourceFailed. blocks(file) names the units it fetches in (chunk boundaries), which the prefetcher
streams in order.

- DirPageSource: files in a local directory (tests).
- ChunkSource: a chunked stored image (store format 2): chunks fetched on demand, each verified before a
  byte of it is served.

Whole-file stored images (format 1: one zstd object per file) have no source: their hash is known only at
the end of a file, so bytes served before it would be unverified. Those are fetched whole and verified
first, as before (memsnap.pageserver.restore returns None for them).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from memsnap.store import StoreError, StoreUnavailable

log = logging.getLogger("memsnap.pageserver")

BLOCK = 4 << 20  # fetch unit of sources without chunks of their own


class SourceFailed(Exception):
    """The pages cannot be had: the store failed (integrity=False) or a chunk did not verify (True)."""

    def __init__(self, why: str, integrity: bool = False) -> None:
        super().__init__(why)
        self.integrity = integrity


class PageSource(Protocol):
    """Verified bytes of a checkpoint's files, fetched on demand."""

    def read_at(self, name: str, offset: int, length: int) -> bytes:
        """length bytes of file name at offset (SourceFailed if they cannot be had or do not verify)."""
        ...

    def blocks(self, name: str) -> list[tuple[int, int]]:
        """The (offset, length) units name is fetched in, in file order."""
        ...

    def finish(self) -> None:
        """Returns once every byte served so far is known good (SourceFailed if not)."""
        ...

    def close(self) -> None:
        """Stops background work and frees what the source holds."""
        ...


def fixed_blocks(size: int, block: int = BLOCK) -> list[tuple[int, int]]:
    return [(o, min(block, size - o)) for o in range(0, size, block)]


class DirPageSource:
    """The files of a local directory (no verification of its own: the directory is trusted)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                if "/" in name or name.startswith("."):
                    raise SourceFailed(f"bad file name {name!r}")
                try:
                    fd = os.open(self.root / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError as exc:
                    raise SourceFailed(f"cannot open {name}: {exc.strerror}") from exc
                self._fds[name] = fd
            return fd

    def read_at(self, name: str, offset: int, length: int) -> bytes:
        data = os.pread(self._fd(name), length, offset)
        if len(data) != length:
            raise SourceFailed(f"{name} ends before {offset + length}")
        return data

    def blocks(self, name: str) -> list[tuple[int, int]]:
        return fixed_blocks(os.fstat(self._fd(name)).st_size)

    def finish(self) -> None:
        pass

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class ChunkSource:
    """A chunked stored image (store format 2) through memsnap.store.chunks.ChunkReader: each chunk is
    fetched when first needed and verified (blake3 of its raw bytes) before a byte of it is served.

    Its packs are opened once each (PackFiles), and each is closed, and so dropped from a local store's page
    cache, once its last chunk was read: the job holds the pages then, the page cache need not as well."""

    def __init__(self, reader: Any, on_storage_error: Callable[[], None] | None = None) -> None:
        self.reader = reader
        self._on_error = on_storage_error or (lambda: None)
        self._packs: Any = None
        if getattr(reader, "packs", False) is None:  # (a ChunkReader that no fetch reads with already)
            from memsnap.store.chunks import pack_key
            from memsnap.store.packs import PackFiles

            self._packs = reader.packs = PackFiles(reader.store)
            self._packs.expect(pack_key(ref.loc[0]) for lay in reader.layouts.values() for ref in lay.chunks
                               if ref.loc is not None)

    def read_at(self, name: str, offset: int, length: int) -> bytes:
        from memsnap.store.chunks import ChunkError

        try:
            data: bytes = self.reader.read_at(name, offset, length)
        except ChunkError as exc:  # ("integrity check failed: chunk ... does not match its id")
            self._on_error()
            raise SourceFailed(str(exc), integrity=True) from exc
        except StoreUnavailable as exc:
            self._on_error()
            raise SourceFailed(f"the store failed: {exc}") from exc
        except StoreError as exc:  # (a chunk the store no longer has, a corrupt object)
            self._on_error()
            raise SourceFailed(f"integrity check failed: {exc}", integrity=True) from exc
        except Exception as exc:  # (a connection that broke mid-read, ...)
            self._on_error()
            raise SourceFailed(f"the store failed: {exc}") from exc
        if len(data) != length:
            raise SourceFailed(f"{name} ends before {offset + length}", integrity=True)
        return data

    def blocks(self, name: str) -> list[tuple[int, int]]:
        return [(ref.offset, ref.length) for ref in self.reader.chunks(name)]

    def finish(self) -> None:
        pass

    def close(self) -> None:
        packs, self._packs = self._packs, None
        if packs is not None:
            self.reader.packs = None
            packs.close()
