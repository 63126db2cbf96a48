"""PosixStore: a directory tree (local disk, NFS, Lustre) with atomic, fsynced renames."""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import fcntl
import io
import mmap
import os
import stat as st
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from memsnap import safefs
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


class StoreTampered(StoreError):
    """A store entry is a symlink or not a real file/directory: someone changed the store behind our back."""


class PosixStore:
    """Objects are files under root; writes go to '.tmp-<rand>-<name>' and are renamed into place.

    The root is a real directory owned by the daemon's uid with no group/other write (checked at creation and
    on every open); below it every directory is opened from its parent's fd with O_NOFOLLOW (memsnap.safefs),
    so a store writer who swaps a directory for a symlink gets a refusal (StoreTampered), never a write,
    read or delete outside the store.
    """

    def __init__(self, root: str | os.PathLike[str], *, create: bool = False, check_timeout_s: float = 10.0):
        self.root = Path(root).absolute()
        self.check_timeout_s = check_timeout_s
        if create:
            try:
                safefs.ensure_root(self.root, "store root")
            except safefs.UnsafePath as e:
                raise StoreUnavailable(str(e)) from e
            except OSError as e:
                raise StoreUnavailable(f"cannot create store root {self.root}: {e.strerror or e}") from e
        try:
            self._dev: int | None = os.stat(self.root).st_dev
        except OSError:
            self._dev = None
        self.local = on_local_fs(self.root)  # (read_range: the page cache where it is local, O_DIRECT elsewhere)

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
        except safefs.UnsafePath as e:
            raise StoreTampered(f"{what} in {self.root}: {e}") from e
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

    def _root_fd(self) -> int:
        """A dirfd of the root: a missing root is StoreUnavailable, a swapped or loosened one StoreTampered."""
        try:
            return safefs.open_root(self.root)
        except FileNotFoundError:
            raise self._root_missing() from None
        except safefs.UnsafePath as e:
            raise StoreTampered(f"store root {self.root}: {e}") from e

    def _dir_fd(self, rel: str, create: bool = False) -> int:
        """A dirfd of rel below the root, walked with O_NOFOLLOW (created 0700 via fds when asked)."""
        root = self._root_fd()
        with safefs.opened(root):
            return safefs.open_path(root, rel, create=create)

    def open_writer(self, key: str) -> StoreWriter:
        """A writer into a temp file (in the key's directory, by dirfd) that commit() renames to key."""
        parent, _, name = validate_key(key).rpartition("/")
        with self._translate(f"open {key} for writing"):
            dfd = self._dir_fd(parent, create=True)
            try:
                return _PosixWriter(self, key, dfd, name)
            except BaseException:
                os.close(dfd)
                raise

    def _open_object(self, key: str) -> int:
        parent, _, name = validate_key(key).rpartition("/")
        with safefs.opened(self._dir_fd(parent)) as dfd:
            s = safefs.lstat(dfd, name)
            if s is None:
                raise StoreNotFound(f"{key} is not in {self.root}")
            if st.S_ISDIR(s.st_mode):
                raise StoreNotFound(f"{key} is not an object in {self.root}")
            return safefs.open_file(dfd, name)

    def open_reader(self, key: str) -> BinaryIO:
        """A buffered reader whose I/O errors are mapped to Store errors."""
        with self._translate(f"open {key}"):
            fd = self._open_object(key)
        return io.BufferedReader(_MappedFile(self, key, fd), buffer_size=1 << 20)

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of key (shorter at its end), in one read.

        On a network or FUSE filesystem a chunk in a pack is read with O_DIRECT (the page-aligned range around
        it), else with readahead off: the kernel's readahead past the chunk would fetch the next chunks for
        nothing, and without readahead a network filesystem gets one small request at a time (sshfs at 1
        Gbit/s, 8 readers of 1 MiB: 74 MB/s with readahead, ~100 without, 119 with O_DIRECT, the same as whole
        files; bench/results/chunks.md). On a local filesystem a plain read: the packs a drain just wrote are
        still in the page cache (a 2 GiB fetch: 1.1-1.2 s against 1.6-1.9 s with O_DIRECT), and a cold one
        reads as fast either way."""
        with self._translate(f"read {key}"):
            fd = self._open_object(key)
            with safefs.opened(fd):
                return os.pread(fd, length, offset) if self.local else _pread_uncached(fd, offset, length)

    def open_ranges(self, key: str) -> PosixRanges:
        """key opened once for many read_range()s (a fetch reads every chunk of a pack): each open walks the
        store's directories by dirfd, which cost a fetch a fifth of its time when done for every chunk."""
        with self._translate(f"open {key}"):
            return PosixRanges(self, key, self._open_object(key))

    def read_tail(self, key: str, length: int) -> tuple[bytes, int]:
        """(the last `length` bytes of key or all of it, its size)."""
        with self._translate(f"read {key}"):
            fd = self._open_object(key)
            with safefs.opened(fd):
                size = os.fstat(fd).st_size
                return os.pread(fd, min(length, size), max(0, size - length)), size

    def exists(self, key: str) -> bool:
        """Whether key is a published file."""
        try:
            return self.stat(key) >= 0
        except StoreNotFound:
            return False

    def stat(self, key: str) -> int:
        """Size of key in bytes."""
        parent, _, name = validate_key(key).rpartition("/")
        with self._translate(f"stat {key}"), safefs.opened(self._dir_fd(parent)) as dfd:
            s = safefs.lstat(dfd, name)
        if s is None or st.S_ISDIR(s.st_mode):
            raise StoreNotFound(f"{key} is not an object in {self.root}")
        if not st.S_ISREG(s.st_mode):
            raise StoreTampered(f"{key} in {self.root} is not a regular file (a symlink?): refusing it")
        return s.st_size

    def _walk(self, prefix: str, temps: bool) -> list[str]:
        return sorted(key for key, _st in self._walk_stat(prefix, temps))

    def _walk_stat(self, prefix: str, temps: bool) -> builtins.list[tuple[str, os.stat_result]]:
        base = prefix.rpartition("/")[0]
        out: builtins.list[tuple[str, os.stat_result]] = []
        with self._translate(f"list {prefix!r}"):
            try:
                dfd = self._dir_fd(base)
            except (FileNotFoundError, NotADirectoryError):
                if not self.root.is_dir():
                    raise self._root_missing() from None
                return []
            with safefs.opened(dfd):
                for rel, _fd, name, s in safefs.walk(dfd, f"{base}/" if base else ""):
                    key = rel + name
                    if name.startswith(TEMP_PREFIX) == temps and key.startswith(prefix):
                        out.append((key, s))
        return out

    def list(self, prefix: str) -> list[str]:
        """Sorted keys starting with prefix; temp files are skipped. A symlink met on the way is refused
        (StoreTampered), never followed."""
        return self._walk(validate_prefix(prefix), temps=False)

    def list_with_mtime(self, prefix: str) -> builtins.list[tuple[str, int, float]]:
        """(key, size, mtime) of every key starting with prefix, sorted; temp files skipped, symlinks refused."""
        return sorted((k, s.st_size, s.st_mtime) for k, s in self._walk_stat(validate_prefix(prefix), temps=False))

    def touch(self, key: str) -> bool:
        """Sets key's mtime to now (a chunk reused by a drain starts a new grace period); False if absent."""
        parent, _, name = validate_key(key).rpartition("/")
        with self._translate(f"touch {key}"):
            try:
                dfd = self._dir_fd(parent)
            except (FileNotFoundError, NotADirectoryError):
                return False
            with safefs.opened(dfd):
                s = safefs.lstat(dfd, name)
                if s is None or st.S_ISDIR(s.st_mode):
                    return False
                if not st.S_ISREG(s.st_mode):
                    raise StoreTampered(f"{key} in {self.root} is not a regular file (a symlink?): refusing it")
                try:
                    os.utime(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    return False
        return True

    def delete_keys(self, keys: builtins.list[str], not_after: float | None = None) -> int:
        """Deletes these objects (absent ones are skipped); with not_after, only those whose mtime is still
        at or before it (one touched meanwhile is kept). Returns how many were deleted."""
        deleted = 0
        for key in keys:
            parent, _, name = validate_key(key).rpartition("/")
            with self._translate(f"delete {key}"):
                try:
                    dfd = self._dir_fd(parent)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                with safefs.opened(dfd):
                    s = safefs.lstat(dfd, name)
                    if s is None or not st.S_ISREG(s.st_mode):
                        continue
                    if not_after is not None and s.st_mtime > not_after:
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dfd)
                        deleted += 1
        return deleted

    def delete_prefix(self, prefix: str) -> None:
        """Deletes manifests first (fsynced), then the rest; a prefix ending in '/' removes the dir.

        Everything is removed through dirfds: a checkpoint dir swapped for a symlink raises StoreTampered
        and nothing is removed, inside the store or out of it.
        """
        if not validate_prefix(prefix):
            raise ValueError("refusing to delete the whole store: give a non-empty prefix")
        keys = self.list(prefix)
        with self._translate(f"delete {prefix!r}"):
            for key in sorted(keys, key=lambda k: not is_manifest(k)):
                parent, _, name = key.rpartition("/")
                try:
                    dfd = self._dir_fd(parent)
                except FileNotFoundError:
                    continue
                with safefs.opened(dfd):
                    s = safefs.lstat(dfd, name)
                    if s is not None and not st.S_ISDIR(s.st_mode):
                        os.unlink(name, dir_fd=dfd)
                    if is_manifest(key):
                        safefs.fsync_dir(dfd)
            if prefix.endswith("/"):
                parent, _, name = prefix.removesuffix("/").rpartition("/")
                try:
                    dfd = self._dir_fd(parent)
                except FileNotFoundError:
                    return
                with safefs.opened(dfd):
                    s = safefs.lstat(dfd, name)
                    if s is not None and st.S_ISDIR(s.st_mode):
                        safefs.rmtree(dfd, name)
                        safefs.fsync_dir(dfd)

    def cleanup_temps(self, older_than_s: float = 0.0) -> int:
        """Removes temp files not modified for older_than_s seconds (0: all, i.e. after a crash)."""
        cutoff = time.time() - older_than_s
        removed = 0
        with self._translate("clean up temp files"), safefs.opened(self._root_fd()) as root:
            for _rel, dfd, name, s in safefs.walk(root):
                if name.startswith(TEMP_PREFIX) and (older_than_s <= 0 or s.st_mtime < cutoff):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dfd)
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
                s = os.lstat(self.root)
                if st.S_ISLNK(s.st_mode):
                    raise StoreTampered(f"store root {self.root} is now a symbolic link: refusing to follow it")
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


_bufs = threading.local()


def _aligned_buffer(n: int) -> mmap.mmap:
    """This thread's page-aligned read buffer of at least n bytes (kept: a new mapping per read costs a page
    fault and a zeroed page for every 4 KiB read)."""
    buf: mmap.mmap | None = getattr(_bufs, "buf", None)
    if buf is None or len(buf) < n:
        if buf is not None:
            buf.close()
        buf = _bufs.buf = mmap.mmap(-1, max(n, 4 << 20))
    return buf


# Filesystems on this machine's own block devices or memory: their page cache is worth reading through.
LOCAL_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "jfs", "reiserfs",
                      "tmpfs", "ramfs"})


def on_local_fs(path: Path, mountinfo: str | None = None) -> bool:
    """Whether path is on a local filesystem (LOCAL_FS), by the longest mount point above it in
    /proc/self/mountinfo; False when unknown (network and FUSE filesystems are read with O_DIRECT)."""
    from memsnap import mounts

    try:
        table = mounts.parse(mountinfo) if mountinfo is not None else mounts.mountinfo("self")
    except OSError:
        return False
    p = str(path)
    best = max((m for m in table if m.point == "/" or p == m.point or p.startswith(m.point.rstrip("/") + "/")),
               key=lambda m: len(m.point), default=None)
    return best is not None and best.fstype in LOCAL_FS


def _pread_uncached(fd: int, offset: int, length: int) -> bytes:
    """pread through O_DIRECT where the filesystem takes it (aligned to pages), else with readahead off."""
    if length <= 0:
        return b""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if not flags & os.O_DIRECT:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
        start, end = offset & ~(PAGE - 1), (offset + length + PAGE - 1) & ~(PAGE - 1)
        buf = _aligned_buffer(end - start)  # (page-aligned memory, as O_DIRECT wants)
        with memoryview(buf) as mv, mv[: end - start] as dst:
            got = os.preadv(fd, [dst], start)
            return bytes(mv[offset - start : max(offset - start, min(got, offset - start + length))])
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return os.pread(fd, length, offset)


class PosixRanges:
    """An open object read by ranges, as read_range() reads it (O_DIRECT where the filesystem takes it).

    close() drops the object from the page cache: a fetch writes what it read into the tier, and a second copy
    of the packs in the page cache doubled what a restore from the store held (2 GiB image: 4 GiB, until the
    cache was reclaimed), on nodes where memory pressure is what makes restores come from the store. Dropped
    whole, at close: a range of a read is mostly inside larger folios, which a ranged POSIX_FADV_DONTNEED
    leaves in place."""

    def __init__(self, store: PosixStore, key: str, fd: int) -> None:
        self._store, self._key, self.fd = store, key, fd

    def read(self, offset: int, length: int) -> bytes:
        with self._store._translate(f"read {self._key}"):
            if self._store.local:
                return os.pread(self.fd, length, offset)
            return _pread_uncached(self.fd, offset, length)

    def close(self) -> None:
        if self.fd >= 0:
            if self._store.local:
                with contextlib.suppress(OSError):
                    os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(self.fd)
            self.fd = -1


class _MappedFile(io.FileIO):
    """A read-only file (opened by fd) whose read errors are mapped to Store errors."""

    def __init__(self, store: PosixStore, key: str, fd: int) -> None:
        super().__init__(fd, "rb", closefd=True)
        self._store, self._key = store, key

    def readinto(self, buffer: WriteableBuffer) -> int | None:
        with self._store._translate(f"read {self._key}"):
            return super().readinto(buffer)


# Writeback of an object is started every SYNC_RANGE bytes and waited for one range later, so the disk
# sees a steady trickle instead of one fsync of the whole image at commit: that fsync stalled the job's own
# small writes (and their fsyncs) behind gigabytes of dirty pages for seconds (issue 21, docs/background.md).
SYNC_RANGE = 8 << 20
PAGE = 4096
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4


def _load_sync_file_range() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()


def sync_range(fd: int, offset: int, nbytes: int, flags: int) -> bool:
    """sync_file_range(2); False where the call is missing or refused (the caller then uses fdatasync)."""
    if _SYNC_FILE_RANGE is None:
        return False
    if _SYNC_FILE_RANGE(fd, offset, nbytes, flags) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP):
            return False
        raise OSError(err, os.strerror(err))
    return True


class _PosixWriter(StoreWriter):
    """Writes to a 0600 temp file (O_EXCL|O_NOFOLLOW) in the key's directory fd, renamed there on commit.

    Written in ranges synced as they go (SYNC_RANGE): writeback of each range starts once it is written,
    and is waited for (then dropped from the page cache) when the next one starts; where sync_file_range
    is missing, an fdatasync per range. The fsync at commit finds little left to do.
    """

    def __init__(self, store: PosixStore, key: str, dirfd: int, name: str) -> None:
        self.key, self._store, self._dirfd, self._name = key, store, dirfd, name
        self._tmp = safefs.temp_name(name, TEMP_PREFIX)
        fd = safefs.create_file(dirfd, self._tmp, 0o600)
        self._file: BinaryIO | None = os.fdopen(fd, "wb")
        self._size = 0
        self._done = False
        self._started = 0  # writeback started up to here
        self._synced = 0  # on disk (waited for) up to here
        self.range_syncs = 0  # ranges synced before commit (tests)

    def write(self, data: Bytes) -> int:
        """Appends data to the temp file."""
        if self._file is None:
            raise StoreError(f"write to {self.key} after commit/abort")
        with self._store._translate(f"write {self.key}"):
            self._file.write(data)
            self._size += len(data)
            if self._size - self._started >= SYNC_RANGE:
                self._sync_as_we_go(self._file)
        return len(data)

    def _sync_as_we_go(self, f: BinaryIO) -> None:
        f.flush()
        fd = f.fileno()
        if self._started > self._synced:  # the previous range: wait until it is on disk, then drop it
            waited = sync_range(fd, self._synced, self._started - self._synced,
                                _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER)
            if not waited:
                os.fdatasync(fd)
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, self._synced, self._started - self._synced, os.POSIX_FADV_DONTNEED)
            self._synced = self._started
            self.range_syncs += 1
        if not sync_range(fd, self._started, self._size - self._started, _SFR_WRITE):  # start this one
            os.fdatasync(fd)
            self._synced = self._size
            self.range_syncs += 1
        self._started = self._size

    def commit(self) -> StoredObject:
        """fsync, rename into place (renameat in the same dirfd), fsync the directory."""
        if self._file is None:
            raise StoreError(f"commit of {self.key} after commit/abort")
        try:
            with self._store._translate(f"commit {self.key}"):
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None
                safefs.rename(self._dirfd, self._tmp, self._name)
                self._done = True
                safefs.fsync_dir(self._dirfd)
        except BaseException:
            self.abort()
            raise
        self._close_dir()
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
                os.unlink(self._tmp, dir_fd=self._dirfd)
        self._close_dir()

    def _close_dir(self) -> None:
        if self._dirfd >= 0:
            os.close(self._dirfd)
            self._dirfd = -1
