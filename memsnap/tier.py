"""The memory tier: where CRIU dumps images (tmpfs, NUMA-bound tmpfs or DAX), with reservations."""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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
    """A directory on a memory-backed filesystem; each published checkpoint is one subdirectory."""

    def __init__(self, root: str | Path, capacity_bytes: int = 0, kind: str = "tmpfs") -> None:
        self.root = Path(root)
        self.kind = kind
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        for sub in (STAGING, INCOMING):
            (self.root / sub).mkdir(exist_ok=True, mode=0o700)
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._reserved: dict[str, int] = {}

    # -- capacity ---------------------------------------------------------------
    def capacity_bytes(self) -> int:
        """Configured capacity, else the filesystem's size."""
        if self._capacity:
            return self._capacity
        st = os.statvfs(self.root)
        return st.f_blocks * st.f_frsize

    def used_bytes(self) -> int:
        """Bytes held by files in the tier (published, staging and incoming)."""
        total = 0
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except OSError:
                    pass
        return total

    def free_bytes(self) -> int:
        """Room left for new images, net of outstanding reservations."""
        st = os.statvfs(self.root)
        fs_free = st.f_bavail * st.f_frsize
        if self._capacity:
            fs_free = min(fs_free, max(0, self._capacity - self.used_bytes()))
        with self._lock:
            return max(0, fs_free - sum(self._reserved.values()))

    def reserve(self, nbytes: int) -> TierReservation:
        """Holds nbytes for a dump or raises TierFull; the caller may evict and retry."""
        st = os.statvfs(self.root)
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
        return self.root / ckpt_id

    def has(self, ckpt_id: str) -> bool:
        """Whether a published copy exists."""
        return (self.root / ckpt_id / "manifest.json").is_file()

    def new_staging(self, ckpt_id: str, area: str = STAGING) -> Path:
        """A fresh private directory to dump or receive into; never restorable as is."""
        d = self.root / area / ckpt_id
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(mode=0o700)
        return d

    def publish(self, staging: Path, ckpt_id: str) -> Path:
        """Atomically makes a complete staging directory visible under its id."""
        dst = self.root / ckpt_id
        os.rename(staging, dst)
        fd = os.open(self.root, os.O_DIRECTORY | os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return dst

    def remove(self, ckpt_id: str) -> int:
        """Drops a published copy and returns the bytes freed."""
        d = self.root / ckpt_id
        if not d.exists():
            return 0
        freed = dir_bytes(d)
        shutil.rmtree(d, ignore_errors=True)
        return freed

    def discard_staging(self, ckpt_id: str) -> None:
        """Removes a half-written image."""
        for area in (STAGING, INCOMING):
            shutil.rmtree(self.root / area / ckpt_id, ignore_errors=True)

    def staging_ids(self) -> Iterator[str]:
        """Ids with a half-written image (after a crash)."""
        for area in (STAGING, INCOMING):
            base = self.root / area
            if base.is_dir():
                yield from (p.name for p in base.iterdir())

    def published_ids(self) -> list[str]:
        """Ids of checkpoints with a published tier copy."""
        return [p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")]


def dir_bytes(d: Path) -> int:
    """Apparent size of the files in a directory tree."""
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
