"""PosixStore: a directory tree (local disk, NFS, Lustre) with atomic, fsynced renames."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import secrets
import shutil
import stat as st
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from memsnap.store.base import (
    TEMP_PREFIX,
    Bytes,
    StoredObject,
    StoreWriter,
    is_manifest,
    validate_key,
    validate_prefix,
)
from memsnap.store.errors import StoreError, StoreFull, StoreNotFound, StoreUnavailable

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

_UNAVAILABLE = {
    errno.ESTALE, errno.ENOTCONN, errno.EIO, errno.EROFS, errno.ETIMEDOUT, errno.EHOSTDOWN,
    errno.EHOSTUNREACH, errno.ENODEV, errno.ENXIO, errno.EACCES, errno.EPERM,
}  # fmt: skip


def _fsync_dir(path: Path) -> None:
    """fsyncs a directory; filesystems that cannot (EINVAL/ENOTSUP, some FUSE) are let be."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


class PosixStore:
    """Objects are files under root; writes go to '.tmp-<rand>-<name>' and are renamed into place."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = False, check_timeout_s: float = 10.0):
        self.root = Path(root).absolute()
        self.check_timeout_s = check_timeout_s
        if create:
            with self._translate("create store root"):
                self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            self._dev: int | None = os.stat(self.root).st_dev
        except OSError:
            self._dev = None

    def describe(self) -> str:
        """'posix:<root>'."""
        return f"posix:{self.root}"

    def _root_missing(self) -> StoreUnavailable:
        return StoreUnavailable(
            f"store root {self.root} is missing: mount the filesystem or create it (mkdir -m 700 {self.root})"
        )

    @contextlib.contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        """Maps OSError to the Store error types."""
        try:
            yield
        except OSError as e:
            msg = f"{what} in {self.root}: {e.strerror or e}"
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"{msg}: free space or raise the quota") from e
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                if not self.root.is_dir():
                    raise self._root_missing() from e
                raise StoreNotFound(msg) from e
            if e.errno in _UNAVAILABLE:
                raise StoreUnavailable(f"{msg}: check the mount and permissions of {self.root}") from e
            raise StoreError(msg) from e

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def _ensure_dir(self, path: Path) -> None:
        """Creates path (0700) below root, fsyncing each parent that gained an entry."""
        if not self.root.is_dir():
            raise self._root_missing()
        cur = self.root
        for part in path.relative_to(self.root).parts:
            parent, cur = cur, cur / part
            try:
                os.mkdir(cur, 0o700)
            except FileExistsError:
                continue
            os.chmod(cur, 0o700)
            _fsync_dir(parent)

    def open_writer(self, key: str) -> StoreWriter:
        """A writer into a temp file that commit() renames to key."""
        final = self._path(key)
        with self._translate(f"open {key} for writing"):
            self._ensure_dir(final.parent)
            return _PosixWriter(self, key, final)

    def open_reader(self, key: str) -> BinaryIO:
        """A buffered reader whose I/O errors are mapped to Store errors."""
        path = self._path(key)
        with self._translate(f"open {key}"):
            if path.is_dir():
                raise StoreNotFound(f"{key} is not an object in {self.root}")
            return io.BufferedReader(_MappedFile(self, key, path), buffer_size=1 << 20)

    def exists(self, key: str) -> bool:
        """Whether key is a published file."""
        try:
            return self.stat(key) >= 0
        except StoreNotFound:
            return False

    def stat(self, key: str) -> int:
        """Size of key in bytes."""
        path = self._path(key)
        with self._translate(f"stat {key}"):
            s = os.stat(path)
        if not st.S_ISREG(s.st_mode):
            raise StoreNotFound(f"{key} is not an object in {self.root}")
        return s.st_size

    def _walk(self, prefix: str, temps: bool) -> list[str]:
        base = self.root / prefix.rpartition("/")[0]
        if not self.root.is_dir():
            raise self._root_missing()
        out: list[str] = []

        def fail(e: OSError) -> None:
            if e.errno != errno.ENOENT:  # a directory deleted while walking is just empty
                raise e

        with self._translate(f"list {prefix!r}"):
            for dirpath, _dirs, files in os.walk(base, onerror=fail):
                rel = Path(dirpath).relative_to(self.root).as_posix()
                for name in files:
                    key = name if rel == "." else f"{rel}/{name}"
                    if name.startswith(TEMP_PREFIX) == temps and key.startswith(prefix):
                        out.append(key)
        return sorted(out)

    def list(self, prefix: str) -> list[str]:
        """Sorted keys starting with prefix; temp files are skipped."""
        return self._walk(validate_prefix(prefix), temps=False)

    def delete_prefix(self, prefix: str) -> None:
        """Deletes manifests first (fsynced), then the rest; a prefix ending in '/' removes the dir."""
        if not validate_prefix(prefix):
            raise ValueError("refusing to delete the whole store: give a non-empty prefix")
        keys = self.list(prefix)
        with self._translate(f"delete {prefix!r}"):
            for key in sorted(keys, key=lambda k: not is_manifest(k)):
                path = self.root / key
                path.unlink(missing_ok=True)
                if is_manifest(key):
                    _fsync_dir(path.parent)
            tree = self.root / prefix
            if prefix.endswith("/") and tree.is_dir():
                shutil.rmtree(tree)
                _fsync_dir(tree.parent)

    def cleanup_temps(self, older_than_s: float = 0.0) -> int:
        """Removes temp files not modified for older_than_s seconds (0: all, i.e. after a crash)."""
        cutoff = time.time() - older_than_s
        removed = 0
        with self._translate("clean up temp files"):
            for key in self._walk("", temps=True):
                path = self.root / key
                with contextlib.suppress(FileNotFoundError):
                    if older_than_s <= 0 or path.stat().st_mtime < cutoff:
                        path.unlink()
                        removed += 1
        return removed

    def check(self) -> None:
        """Stats the root in a thread (a hung NFS mount times out) and checks it is writable."""
        result: list[BaseException | None] = []
        t = threading.Thread(target=lambda: result.append(self._probe()), daemon=True)
        t.start()
        t.join(self.check_timeout_s)
        if not result:
            raise StoreUnavailable(
                f"store root {self.root} did not answer within {self.check_timeout_s:g}s: check its mount/server"
            )
        if result[0] is not None:
            raise result[0]

    def _probe(self) -> BaseException | None:
        try:
            with self._translate("health check"):
                s = os.stat(self.root)
                if not st.S_ISDIR(s.st_mode):
                    raise self._root_missing()
                if self._dev is not None and s.st_dev != self._dev:
                    raise StoreUnavailable(
                        f"store root {self.root} moved to another filesystem (unmounted?): remount it"
                    )
                if not os.access(self.root, os.W_OK | os.X_OK):
                    raise StoreUnavailable(
                        f"store root {self.root} is not writable: fix its owner/permissions"
                    )
                vfs = os.statvfs(self.root)
                if vfs.f_bavail == 0:
                    raise StoreFull(
                        f"store root {self.root} has no free space: free space or raise the quota"
                    )
        except StoreError as e:
            return e
        return None


class _MappedFile(io.FileIO):
    """A read-only file whose read errors are mapped to Store errors."""

    def __init__(self, store: PosixStore, key: str, path: Path) -> None:
        super().__init__(path, "rb")
        self._store, self._key = store, key

    def readinto(self, buffer: WriteableBuffer) -> int | None:
        with self._store._translate(f"read {self._key}"):
            return super().readinto(buffer)


class _PosixWriter(StoreWriter):
    """Writes to a 0600 temp file next to the final path."""

    def __init__(self, store: PosixStore, key: str, final: Path) -> None:
        self.key, self._store, self._final = key, store, final
        self._tmp = final.parent / f"{TEMP_PREFIX}{secrets.token_hex(6)}-{final.name[:200]}"
        fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)
        self._file: BinaryIO | None = os.fdopen(fd, "wb")
        self._size = 0
        self._done = False

    def write(self, data: Bytes) -> int:
        """Appends data to the temp file."""
        if self._file is None:
            raise StoreError(f"write to {self.key} after commit/abort")
        with self._store._translate(f"write {self.key}"):
            self._file.write(data)
        self._size += len(data)
        return len(data)

    def commit(self) -> StoredObject:
        """fsync, rename into place, fsync the directory."""
        if self._file is None:
            raise StoreError(f"commit of {self.key} after commit/abort")
        try:
            with self._store._translate(f"commit {self.key}"):
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None
                os.replace(self._tmp, self._final)
                self._done = True
                _fsync_dir(self._final.parent)
        except BaseException:
            self.abort()
            raise
        return StoredObject(self.key, self._size)

    def abort(self) -> None:
        """Closes and unlinks the temp file."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        if not self._done:
            self._done = True
            with contextlib.suppress(OSError):
                self._tmp.unlink()
