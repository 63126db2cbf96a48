"""The one place root walks and changes the tier, staging, state and store: dirfds, O_NOFOLLOW, lstat.

Root never follows a path that someone else could have swapped. A root directory (tier, state, store) is
checked once at start (real directory, owned by root, no group/other write, no ancestor that another user
could rename it in); everything below it is reached from a directory fd, one component at a time, with
O_NOFOLLOW, and anything that is not a real regular file or directory is refused (UnsafePath). Nothing is
chmodded, removed or renamed through a path string: fchmod on an fd, unlinkat/renameat relative to a dirfd.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_FSYNC = (errno.EINVAL, errno.ENOTSUP, errno.EROFS)


class UnsafePath(OSError):
    """A path root was about to use is a symlink, not a real file/directory, or someone else controls it.

    An OSError (errno ELOOP) so that callers mapping OSErrors still see a failure, never a success.
    """

    def __init__(self, message: str) -> None:
        super().__init__(errno.ELOOP, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


# -- roots --------------------------------------------------------------------------------------------
def ensure_root(path: str | os.PathLike[str], what: str, owner: int | None = None, mode: int = 0o700) -> Path:
    """Creates path (parents too) when missing, then checks it as check_root does; returns it absolute.

    owner defaults to our euid (root in the daemon).
    """
    owner = os.geteuid() if owner is None else owner
    p = Path(os.path.abspath(path))
    _refuse_foreign_links(p, what, owner)  # (before mkdir: that would follow such a link)
    missing = []
    cur = p
    while not os.path.lexists(cur):
        missing.append(cur)
        cur = cur.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            continue
        fd = os.open(d, _DIR_FLAGS)  # the dir we just made: fix its mode on the fd, whatever the umask did
        try:
            if os.fstat(fd).st_uid == owner:
                os.fchmod(fd, mode)
        finally:
            os.close(fd)
    check_root(p, what, owner)
    return p


def check_root(path: str | os.PathLike[str], what: str, owner: int | None = None) -> None:
    """Raises UnsafePath (one line: why, and how to fix it) unless path is a real directory owned by owner
    with no group/other write, whose ancestors only root (or a sticky bit) lets anyone rename entries in."""
    owner = os.geteuid() if owner is None else owner
    p = Path(os.path.abspath(path))
    _refuse_foreign_links(p, what, owner)
    try:
        s = os.lstat(p)
    except FileNotFoundError:
        raise UnsafePath(f"{what} {p} does not exist: create it (mkdir -m 700 {p})") from None
    if stat.S_ISLNK(s.st_mode):
        raise UnsafePath(f"{what} {p} is a symbolic link: point the config at the real directory "
                         f"({os.path.realpath(p)}) or replace the link by a directory owned by root, mode 700")
    if not stat.S_ISDIR(s.st_mode):
        raise UnsafePath(f"{what} {p} is not a directory: remove it, or configure another path")
    if s.st_uid != owner:
        raise UnsafePath(f"{what} {p} is owned by uid {s.st_uid}, not {owner}: someone else created it; "
                         f"check what is in it, then remove it (memsnapd recreates it) or chown {owner} {p}")
    if s.st_mode & 0o022:
        raise UnsafePath(f"{what} {p} is writable by group/others (mode {stat.S_IMODE(s.st_mode):o}): "
                         f"chmod 700 {p}")
    for anc in p.parents:
        a = os.stat(anc)
        if a.st_uid not in (0, owner) or (a.st_mode & 0o022 and not a.st_mode & stat.S_ISVTX):
            raise UnsafePath(f"{what} {p} lies under {anc} (uid {a.st_uid}, mode {stat.S_IMODE(a.st_mode):o}), "
                             "where another user could swap it: use a path whose parents are root-owned and "
                             "not writable by others (or sticky, like /dev/shm)")


def _refuse_foreign_links(p: Path, what: str, owner: int) -> None:
    """Raises UnsafePath if a parent of p is a symbolic link that someone but root (or owner) owns: they can point
    it anywhere at any time, so what root creates, checks or mounts there would be at a place of their choosing."""
    for anc in reversed(p.parents):  # from / down: each lstat resolves only parents already checked
        try:
            s = os.lstat(anc)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(s.st_mode) and s.st_uid not in (0, owner):
            raise UnsafePath(f"{what} {p} lies under {anc}, a symbolic link owned by uid {s.st_uid}, who can point "
                             "it anywhere: use a path without it")


def open_root(path: str | os.PathLike[str], owner: int | None = None) -> int:
    """A dirfd of an already checked root; refuses a root that became a symlink or changed hands."""
    owner = os.geteuid() if owner is None else owner
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePath(f"{path} is no longer a real directory (a symlink now?): refusing to use it") from e
        raise
    s = os.fstat(fd)
    if s.st_uid != owner or s.st_mode & 0o022:
        os.close(fd)
        raise UnsafePath(f"{path} changed owner or mode (uid {s.st_uid}, mode {stat.S_IMODE(s.st_mode):o}): "
                         "refusing to use it")
    return fd


# -- below a root: one component at a time --------------------------------------------------------------
def chmod_dir(path: str | os.PathLike[str], mode: int) -> None:
    """Sets a checked root directory's mode through an fd opened without following links."""
    fd = os.open(path, _DIR_FLAGS)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def check_name(name: str) -> str:
    """name if it is one plain path component, else ValueError."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"{name!r} is not a plain file name")
    return name


def _refuse(dirfd: int, name: str, want: str, err: OSError | None = None) -> UnsafePath:
    try:
        s = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        kind = "a symbolic link" if stat.S_ISLNK(s.st_mode) else f"not a {want} (mode {s.st_mode:o})"
    except OSError:
        kind = f"not a {want}"
    return UnsafePath(f"{name} is {kind}: refusing to follow it (has someone tampered with it?)")


def open_dir(dirfd: int, name: str, create: bool = False, mode: int = 0o700) -> int:
    """A dirfd of the real directory name in dirfd (created with mode when asked); never follows a symlink."""
    check_name(name)
    created = False
    if create:
        try:
            os.mkdir(name, mode, dir_fd=dirfd)
            created = True
        except FileExistsError:
            pass
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dirfd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse(dirfd, name, "directory", e) from e
        raise
    if created:
        os.fchmod(fd, mode)  # on the fd: the umask may have narrowed it, and a path could be swapped by now
        fsync_dir(dirfd)  # the parent gained an entry
    return fd


def open_path(dirfd: int, rel: str, create: bool = False, mode: int = 0o700) -> int:
    """A dirfd of rel ('a/b/c') below dirfd, walked one component at a time (created when asked)."""
    fd = os.dup(dirfd)
    for part in [p for p in rel.split("/") if p]:
        try:
            nxt = open_dir(fd, part, create, mode)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def open_file(dirfd: int, name: str, flags: int = os.O_RDONLY) -> int:
    """An fd of the real regular file name in dirfd; never follows a symlink, never opens a fifo or device."""
    check_name(name)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dirfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(dirfd, name, "regular file", e) from e
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refuse(dirfd, name, "regular file")
    os.set_blocking(fd, True)
    return fd


def create_file(dirfd: int, name: str, mode: int = 0o600) -> int:
    """A new file opened for writing: O_EXCL|O_NOFOLLOW, mode set on the fd before the first byte."""
    check_name(name)
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dirfd)
    os.fchmod(fd, mode)
    return fd


def temp_name(name: str, prefix: str = ".tmp-") -> str:
    """A fresh unguessable name next to name."""
    return f"{prefix}{secrets.token_hex(6)}-{name[:200]}"


def rename(dirfd: int, src: str, dst: str, dst_dirfd: int | None = None) -> None:
    """renameat: replaces dst (a file or symlink itself, never what a symlink points to)."""
    os.rename(check_name(src), check_name(dst), src_dir_fd=dirfd,
              dst_dir_fd=dirfd if dst_dirfd is None else dst_dirfd)


def write_atomic(dirfd: int, name: str, data: bytes, mode: int = 0o600) -> None:
    """Writes name in dirfd through a fresh O_EXCL temp file, fsynced, renamed into place, dir fsynced."""
    tmp = temp_name(name)
    fd = create_file(dirfd, tmp, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dirfd)
        raise
    os.close(fd)
    try:
        rename(dirfd, tmp, name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dirfd)
        raise
    fsync_dir(dirfd)


def write_new(dirfd: int, name: str, data: bytes, mode: int = 0o600) -> bool:
    """Creates name in dirfd holding data, complete and fsynced, unless name exists (then False): written to a
    fresh O_EXCL temp file, then linkat'ed, which never replaces anything."""
    tmp = temp_name(name)
    fd = create_file(dirfd, tmp, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        try:
            os.link(tmp, check_name(name), src_dir_fd=dirfd, dst_dir_fd=dirfd, follow_symlinks=False)
        except FileExistsError:
            return False
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dirfd)
    fsync_dir(dirfd)
    return True


def fsync_dir(dirfd: int) -> None:
    """fsyncs a directory fd; filesystems that cannot (EINVAL/ENOTSUP, some FUSE) are let be."""
    try:
        os.fsync(dirfd)
    except OSError as e:
        if e.errno not in _NO_FSYNC:
            raise


def lstat(dirfd: int, name: str) -> os.stat_result | None:
    """lstat of name in dirfd, None when absent."""
    try:
        return os.stat(check_name(name), dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def entries(dirfd: int) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of every entry of a dirfd, sorted; entries that vanish meanwhile are skipped."""
    out = []
    for name in sorted(os.listdir(dirfd)):
        s = lstat(dirfd, name)
        if s is not None:
            out.append((name, s))
    return out


def regular_files(dirfd: int) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of the entries of dirfd, raising UnsafePath on anything but regular files and dirs;
    directories are left out."""
    out = []
    for name, s in entries(dirfd):
        if stat.S_ISREG(s.st_mode):
            out.append((name, s))
        elif not stat.S_ISDIR(s.st_mode):
            raise _refuse(dirfd, name, "regular file")
    return out


def walk(dirfd: int, rel: str = "") -> Iterator[tuple[str, int, str, os.stat_result]]:
    """(relative dir, its dirfd, name, lstat) of every regular file below dirfd; never follows a symlink
    (raises UnsafePath at the first one); directories that vanish while walking are empty."""
    for name, s in entries(dirfd):
        if stat.S_ISDIR(s.st_mode):
            try:
                sub = open_dir(dirfd, name)
            except FileNotFoundError:
                continue
            try:
                yield from walk(sub, f"{rel}{name}/")
            finally:
                os.close(sub)
        elif stat.S_ISREG(s.st_mode):
            yield rel, dirfd, name, s
        else:
            raise _refuse(dirfd, name, "regular file or directory")


def rmtree(dirfd: int, name: str, missing_ok: bool = True) -> int:
    """Removes the entry name of dirfd and, when it is a real directory, everything below it, via dirfds.

    Never follows a symlink: a symlink (anywhere in the tree) is removed itself, never what it points to, so
    nothing outside dirfd is ever touched. Returns the bytes of the regular files removed.
    """
    check_name(name)
    s = lstat(dirfd, name)
    if s is None:
        if missing_ok:
            return 0
        raise FileNotFoundError(errno.ENOENT, f"{name} does not exist")
    if not stat.S_ISDIR(s.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dirfd)
        return s.st_size if stat.S_ISREG(s.st_mode) else 0
    try:
        fd = open_dir(dirfd, name)
    except FileNotFoundError:
        return 0
    freed = 0
    try:
        if os.fstat(fd).st_ino != s.st_ino:  # swapped between lstat and open: leave it for the next try
            raise UnsafePath(f"{name} changed while being removed: refusing to go on")
        for child in os.listdir(fd):
            freed += rmtree(fd, child)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=dirfd)
    return freed


def tree_bytes(dirfd: int) -> int:
    """Apparent size of the regular files below dirfd (symlinks are not followed, nor counted)."""
    total = 0
    for name, s in entries(dirfd):
        if stat.S_ISREG(s.st_mode):
            total += s.st_size
        elif stat.S_ISDIR(s.st_mode):
            try:
                sub = open_dir(dirfd, name)
            except OSError:
                continue
            try:
                total += tree_bytes(sub)
            finally:
                os.close(sub)
    return total


def tree_blocks_bytes(dirfd: int) -> int:
    """Bytes allocated to the regular files below dirfd (st_blocks), without following symlinks."""
    total = 0
    for name, s in entries(dirfd):
        if stat.S_ISREG(s.st_mode):
            total += s.st_blocks * 512
        elif stat.S_ISDIR(s.st_mode):
            try:
                sub = open_dir(dirfd, name)
            except OSError:
                continue
            try:
                total += tree_blocks_bytes(sub)
            finally:
                os.close(sub)
    return total


@contextlib.contextmanager
def opened(fd: int) -> Iterator[int]:
    """Closes fd when the block ends."""
    try:
        yield fd
    finally:
        os.close(fd)


def fd_path(fd: int) -> str:
    """/proc/self/fd/N: a path that names exactly the file fd refers to (for APIs that want a path)."""
    return f"/proc/self/fd/{fd}"


def read_private(path: str | os.PathLike[str], what: str, owner: int | None = None) -> bytes | None:
    """The bytes of a secret file (a key), or None when absent; refuses a symlink, a non-regular file, a file
    owned by someone else, or one that group/others may read or write."""
    owner = os.geteuid() if owner is None else owner
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(f"{what} {path} is a symbolic link: point the config at the real file") from e
        raise
    with opened(fd):
        s = os.fstat(fd)
        if not stat.S_ISREG(s.st_mode):
            raise UnsafePath(f"{what} {path} is not a regular file: remove it")
        if s.st_uid != owner:
            raise UnsafePath(f"{what} {path} is owned by uid {s.st_uid}, not {owner}: chown {owner} {path} "
                             "after checking who wrote it")
        if s.st_mode & 0o077:
            raise UnsafePath(f"{what} {path} is readable or writable by group/others (mode "
                             f"{stat.S_IMODE(s.st_mode):o}): chmod 600 {path}, and replace it if others "
                             "may have read it")
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
