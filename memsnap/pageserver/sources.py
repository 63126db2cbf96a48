"""Where a lazy restore's pages come from: PageSource and its implementations.

A PageSource answers read_at(file, offset, length) with verified bytes of a checkpoint file, or raises
SourceFailed. blocks(file) names the units it fetches in (chunk boundaries), which the prefetcher
streams in order.

- DirPageSource: files in a local directory (tests, and a source for the tier).
- StreamedSource: today's whole-file store format (one zstd object per file). The object streams in
  order into a local spill file; read_at waits until the stream passed the range. Whole-file objects can
  only be verified at their end: the last hash check fails the source, and the restored job is killed.
- memsnap.pageserver.chunked (with the chunked store format): chunks fetched on demand, each verified
  before a byte of it is served.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Protocol, cast

from memsnap.store import StoreError, StoreUnavailable, copy_decode

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


class _Spill:
    """One stored object streaming into a local file; readers wait for the bytes they need."""

    def __init__(self, name: str, path: Path, size: int) -> None:
        self.name = name
        self.size = size
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        path.unlink()  # (gone with the fd)
        self.avail = 0
        self.error: SourceFailed | None = None
        self.verified = False
        self.cv = threading.Condition()

    def write(self, data: Any) -> int:
        n = os.pwrite(self.fd, data, self.avail)
        with self.cv:
            self.avail += n
            self.cv.notify_all()
        return n

    def fail(self, err: SourceFailed) -> None:
        with self.cv:
            if self.error is None:
                self.error = err
            self.cv.notify_all()


class StreamedSource:
    """Whole-file stored objects (store format 1), streamed in order into spill files under spill_dir.

    files: {name: (open_stream, compressed, raw size, raw blake3, stored blake3)}. The streams start at once,
    one thread per file: that is the prefetch.
    """

    def __init__(self, files: dict[str, tuple[Callable[[], BinaryIO], bool, int, str, str]], spill_dir: Path,
                 on_storage_error: Callable[[], None] | None = None) -> None:
        self._spills: dict[str, _Spill] = {}
        self._closed = threading.Event()
        self._on_error = on_storage_error or (lambda: None)
        for i, (name, spec) in enumerate(sorted(files.items())):
            spill = _Spill(name, spill_dir / f"spill-{i}", spec[2])
            self._spills[name] = spill
            threading.Thread(target=self._stream, args=(spill, *spec), name=f"lazystore-stream-{name}",
                             daemon=True).start()

    def _stream(self, spill: _Spill, open_stream: Callable[[], BinaryIO], compressed: bool, size: int,
                raw_blake3: str, stored_blake3: str) -> None:
        try:
            with open_stream() as src:
                res = copy_decode(src, cast(BinaryIO, _Sink(spill, self._closed)), compressed)
            if (res.raw_bytes, res.raw_blake3, res.stored_blake3) != (size, raw_blake3, stored_blake3):
                raise SourceFailed(f"integrity check failed: checksum mismatch in stored {spill.name}",
                                   integrity=True)
            with spill.cv:
                spill.verified = True
                spill.cv.notify_all()
            log.debug("%s streamed and verified (%d bytes)", spill.name, size)
        except SourceFailed as exc:
            spill.fail(exc)
        except StoreUnavailable as exc:
            self._on_error()
            spill.fail(SourceFailed(f"the store failed while streaming {spill.name}: {exc}"))
        except StoreError as exc:
            self._on_error()
            spill.fail(SourceFailed(f"integrity check failed: stored {spill.name}: {exc}", integrity=True))
        except _Closed:
            spill.fail(SourceFailed("the page source was closed"))
        except Exception as exc:  # a broken stream of any kind: the pages cannot be had
            self._on_error()
            spill.fail(SourceFailed(f"the store failed while streaming {spill.name}: {exc}"))

    def read_at(self, name: str, offset: int, length: int) -> bytes:
        spill = self._spills.get(name)
        if spill is None:
            raise SourceFailed(f"no stored file {name!r}")
        if offset + length > spill.size:
            raise SourceFailed(f"{name} ends before {offset + length}")
        with spill.cv:
            while spill.avail < offset + length and spill.error is None:
                spill.cv.wait(1.0)
            if spill.avail < offset + length:
                assert spill.error is not None
                raise spill.error
        return os.pread(spill.fd, length, offset)

    def blocks(self, name: str) -> list[tuple[int, int]]:
        spill = self._spills.get(name)
        return fixed_blocks(spill.size) if spill is not None else []

    def finish(self) -> None:
        """Waits until every file streamed in full and verified (a whole-file hash is known only at its end)."""
        for s in self._spills.values():
            with s.cv:
                while not s.verified and s.error is None:
                    s.cv.wait(1.0)
                if s.error is not None:
                    raise s.error

    def close(self) -> None:
        self._closed.set()
        for s in self._spills.values():
            s.fail(SourceFailed("the page source was closed"))
            try:
                os.close(s.fd)
            except OSError:
                pass


class _Closed(Exception):
    pass


class _Sink:
    def __init__(self, spill: _Spill, closed: threading.Event) -> None:
        self.spill = spill
        self.closed = closed

    def write(self, data: Any) -> int:
        if self.closed.is_set():
            raise _Closed()
        return self.spill.write(data)


class ChunkSource:
    """A chunked stored image (store format 2) through memsnap.store.chunks.ChunkReader: each chunk is
    fetched when first needed and verified (blake3 of its raw bytes) before a byte of it is served."""

    def __init__(self, reader: Any, on_storage_error: Callable[[], None] | None = None) -> None:
        self.reader = reader
        self._on_error = on_storage_error or (lambda: None)

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
        pass
