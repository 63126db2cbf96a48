"""The memory tier: where CRIU dumps images (tmpfs, NUMA-bound tmpfs or DAX), with reservations."""

from __future__ import annotations

import logging
import os
import secrets
import stat
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memsnap import failpoints, manifest, safefs
from memsnap.catalog import STAGED, Catalog, now_ms

log = logging.getLogger("memsnap.tier")

STAGING = ".staging"
INCOMING = ".incoming"


class TierFull(Exception):
    """The tier cannot hold an image of the requested size."""


@dataclass
class TierReservation:
    """Room held for one image until it is published or released."""

    tier: MemoryTier
    key: str
    nbytes: int
    released: bool = False

    def release(self) -> None:
        """Gives the room back (idempotent)."""
        if not self.released:
            self.tier._release(self)
            self.released = True

    def __enter__(self) -> TierReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class MemoryTier:
    """A directory on a memory-backed filesystem; each published checkpoint is one subdirectory.

    The tier root is a real directory owned by root with mode 0700 (checked at start: safefs.check_root),
    and so are .staging and .incoming: only root can put anything where CRIU writes or what gets signed.
    Everything below the root is reached through the root's dirfd (memsnap.safefs), never a path string.
    """

    def __init__(self, root: str | Path, capacity_bytes: int = 0, kind: str = "tmpfs") -> None:
        self.root = safefs.ensure_root(root, "memory tier")
        self.kind = kind
        self._fd = safefs.open_root(self.root)
        for sub in (STAGING, INCOMING):
            s = safefs.lstat(self._fd, sub)
            if s is not None and not stat.S_ISDIR(s.st_mode):
                # Only root can write here, but a link left from before must never lead recovery outside.
                log.warning("removing %s/%s: a %s, not a directory", self.root, sub,
                            "symbolic link" if stat.S_ISLNK(s.st_mode) else "file")
                os.unlink(sub, dir_fd=self._fd)
            os.close(self._subdir(sub))
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._reserved: dict[str, int] = {}

    def _subdir(self, sub: str) -> int:
        """A dirfd of .staging or .incoming, created root-only 0700; refused if someone else's or a link."""
        fd = safefs.open_dir(self._fd, sub, create=True)
        s = os.fstat(fd)
        if s.st_uid != os.geteuid():
            os.close(fd)
            raise safefs.UnsafePath(f"{self.root / sub} is owned by uid {s.st_uid}, not the daemon's: remove it")
        if s.st_mode & 0o077:
            os.fchmod(fd, 0o700)
        return fd

    # -- capacity ---------------------------------------------------------------
    def capacity_bytes(self) -> int:
        """Configured capacity, else the filesystem's size."""
        if self._capacity:
            return self._capacity
        st = os.fstatvfs(self._fd)
        return st.f_blocks * st.f_frsize

    def used_bytes(self) -> int:
        """Bytes held by files in the tier (published, staging and incoming)."""
        return safefs.tree_blocks_bytes(self._fd)

    def free_bytes(self) -> int:
        """Room left for new images, net of outstanding reservations."""
        st = os.fstatvfs(self._fd)
        fs_free = st.f_bavail * st.f_frsize
        if self._capacity:
            fs_free = min(fs_free, max(0, self._capacity - self.used_bytes()))
        with self._lock:
            return max(0, fs_free - sum(self._reserved.values()))

    def reserve(self, nbytes: int) -> TierReservation:
        """Holds nbytes for a dump or raises TierFull; the caller may evict and retry."""
        st = os.fstatvfs(self._fd)
        fs_free = st.f_bavail * st.f_frsize
        if self._capacity:
            fs_free = min(fs_free, max(0, self._capacity - self.used_bytes()))
        with self._lock:
            free = fs_free - sum(self._reserved.values())
            if nbytes > free:
                raise TierFull(
                    f"memory tier {self.root} has {free >> 20} MiB free but the image needs about "
                    f"{nbytes >> 20} MiB; free space (memsnapctl evict/delete) or enlarge the tier"
                )
            key = uuid.uuid4().hex
            self._reserved[key] = nbytes
        return TierReservation(self, key, nbytes)

    def _release(self, res: TierReservation) -> None:
        with self._lock:
            self._reserved.pop(res.key, None)

    # -- layout ---------------------------------------------------------------
    def path(self, ckpt_id: str) -> Path:
        """Where a published checkpoint lives."""
        return self.root / safefs.check_name(ckpt_id)

    def has(self, ckpt_id: str) -> bool:
        """Whether a published copy exists (a real directory holding a real manifest.json)."""
        try:
            with safefs.opened(safefs.open_dir(self._fd, ckpt_id)) as d:
                s = safefs.lstat(d, "manifest.json")
        except OSError:
            return False
        return s is not None and stat.S_ISREG(s.st_mode)

    def new_staging(self, ckpt_id: str, area: str = STAGING, unique: bool = False) -> Path:
        """A fresh private directory to dump or receive into; never restorable as is.

        unique: a name of its own (<id>.<random>), for work that may run twice at once (fetches).
        """
        name = f"{ckpt_id}.{secrets.token_hex(4)}" if unique else ckpt_id
        with safefs.opened(self._subdir(area)) as a:
            safefs.rmtree(a, name)
            os.mkdir(safefs.check_name(name), 0o700, dir_fd=a)
            with safefs.opened(safefs.open_dir(a, name)) as d:
                os.fchmod(d, 0o700)
        return self.root / area / name

    def publish(self, staging: Path, ckpt_id: str) -> Path:
        """Atomically makes a complete staging directory visible under its id."""
        area = staging.parent.name
        if staging.parent.parent != self.root or area not in (STAGING, INCOMING):
            raise ValueError(f"{staging} is not a staging dir of {self.root}")
        with safefs.opened(safefs.open_dir(self._fd, area)) as a:
            safefs.rename(a, staging.name, safefs.check_name(ckpt_id), dst_dirfd=self._fd)
        safefs.fsync_dir(self._fd)
        return self.root / ckpt_id

    def remove(self, ckpt_id: str) -> int:
        """Drops a published copy and returns the bytes freed (never follows a symlink out of the tier)."""
        return safefs.rmtree(self._fd, safefs.check_name(ckpt_id))

    def discard_staging(self, ckpt_id: str) -> None:
        """Removes a half-written image (by id, or a unique staging dir by its name)."""
        for area in (STAGING, INCOMING):
            with safefs.opened(self._subdir(area)) as a:
                safefs.rmtree(a, safefs.check_name(ckpt_id))

    def discard(self, staging: Path) -> None:
        """Removes one staging dir that new_staging returned."""
        if staging.parent.parent == self.root and staging.parent.name in (STAGING, INCOMING):
            with safefs.opened(self._subdir(staging.parent.name)) as a:
                safefs.rmtree(a, safefs.check_name(staging.name))

    def staging_ids(self) -> Iterator[str]:
        """Names in .staging/.incoming (half-written images after a crash); discard_staging takes them."""
        for area in (STAGING, INCOMING):
            with safefs.opened(self._subdir(area)) as a:
                names = os.listdir(a)
            yield from names

    def published_ids(self) -> list[str]:
        """Ids of checkpoints with a published tier copy; anything else at the top (a symlink, a file) is
        listed too, so that recovery removes it."""
        return [n for n in sorted(os.listdir(self._fd)) if not n.startswith(".")]


def dir_bytes(d: Path) -> int:
    """Apparent size of the files in a directory tree."""
    with safefs.opened(os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)) as fd:
        return safefs.tree_bytes(fd)


def publish_image(tier: MemoryTier, catalog: Catalog, key: bytes, staging: Path, man: manifest.Manifest,
                  keep_meta: dict[str, Any] | None = None, failpoint: str = "", **record: Any) -> int:
    """The one way an image enters the tier: signs man with this node's key into staging, moves staging
    into place, and records the checkpoint (cataloged before, as DUMPING) as STAGED and in the tier, with
    man.catalog_meta() over keep_meta and the fingerprint that spares restore a second hash. record: more
    CheckpointRecord fields. Returns the image's size in bytes."""
    manifest.write(staging, man.sign(key))
    if failpoint:
        failpoints.hit(failpoint)
    tier.publish(staging, man.id)
    meta = {**(keep_meta or {}), **man.catalog_meta(), "fingerprint": manifest.fingerprint(tier.path(man.id))}
    catalog.update_checkpoint(man.id, state=STAGED, in_tier=True, size_bytes=man.size_bytes,
                              last_used_ms=now_ms(), meta=meta, **record)
    return man.size_bytes
