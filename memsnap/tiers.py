"""A node's tiers: the memory tier, and the guard's spill tier (guard.spill_dir) when there is one.

One engine owns the checkpoints in both (memsnap.copies holds their locks, readers and room). A checkpoint's tier
copy lies in one of them: what acts on one checkpoint (path, has, publish, remove, discard) finds it where it is,
and a dump names where it goes (into=SPILL: the guard's park images). Room, capacity and what the status line
shows are the memory tier's; the spill tier (a disk directory, DAX or a NUMA tmpfs) is sized by its filesystem
and never evicted to make room in the memory tier.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memsnap import failpoints, lifecycle, manifest
from memsnap.catalog import STAGED, Catalog, now_ms
from memsnap.tier import STAGING, MemoryTier, MountEntry, TierReservation

MEMORY, SPILL = "memory", "spill"


class Tiers:
    """The memory tier and the optional spill tier, behind the one interface the engine uses (see the module)."""

    def __init__(self, memory: MemoryTier, spill: MemoryTier | None = None) -> None:
        self.memory = memory
        self.spill = spill

    def _all(self) -> list[MemoryTier]:
        return [self.memory] if self.spill is None else [self.memory, self.spill]

    def named(self, into: str) -> MemoryTier:
        """The tier a new copy goes into: MEMORY, or SPILL (the memory tier when no spill tier is set)."""
        if into == SPILL and self.spill is not None:
            return self.spill
        if into not in (MEMORY, SPILL):
            raise ValueError(f"no tier {into!r}")
        return self.memory

    def where(self, ckpt_id: str) -> str:
        """SPILL when the spill tier holds a published copy of ckpt_id, else MEMORY."""
        return SPILL if self.spill is not None and self.spill.has(ckpt_id) else MEMORY

    def tier_of(self, ckpt_id: str) -> MemoryTier:
        """The tier holding ckpt_id's published copy (the memory tier when neither does)."""
        return self.named(self.where(ckpt_id))

    # -- the memory tier's: the status line, metrics and room ------------------------------------------------
    @property
    def root(self) -> Path:
        return self.memory.root

    @property
    def kind(self) -> str:
        return self.memory.kind

    @property
    def fs(self) -> MountEntry | None:
        return self.memory.fs

    def describe(self) -> str:
        return self.memory.describe()

    def in_ram(self) -> bool:
        return self.memory.in_ram()

    def info(self) -> dict[str, Any]:
        return self.memory.info()

    def capacity_bytes(self) -> int:
        return self.memory.capacity_bytes()

    def used_bytes(self) -> int:
        return self.memory.used_bytes()

    def free_bytes(self) -> int:
        return self.memory.free_bytes()

    def reserved_bytes(self) -> int:
        return self.memory.reserved_bytes()

    def reserve(self, nbytes: int, into: str = MEMORY) -> TierReservation:
        """Holds nbytes in the named tier or raises TierFull (memsnap.copies evicts from the memory tier)."""
        return self.named(into).reserve(nbytes)

    # -- one checkpoint's copy, wherever it lies ------------------------------------------------------------
    def path(self, ckpt_id: str) -> Path:
        return self.tier_of(ckpt_id).path(ckpt_id)

    def has(self, ckpt_id: str) -> bool:
        return any(t.has(ckpt_id) for t in self._all())

    def new_staging(self, ckpt_id: str, area: str = STAGING, unique: bool = False, into: str = MEMORY) -> Path:
        """A fresh private directory in the named tier to dump or receive into (MemoryTier.new_staging)."""
        return self.named(into).new_staging(ckpt_id, area, unique)

    def _owner(self, staging: Path) -> MemoryTier:
        for t in self._all():
            if staging.parent.parent == t.root:
                return t
        raise ValueError(f"{staging} is not a staging dir of a tier")

    def publish(self, staging: Path, ckpt_id: str) -> Path:
        """Publishes a staging dir in the tier it lies in (a copy never crosses tiers by rename)."""
        return self._owner(staging).publish(staging, ckpt_id)

    def remove(self, ckpt_id: str) -> int:
        """Drops ckpt_id's published copies in every tier; the bytes freed."""
        return sum(t.remove(ckpt_id) for t in self._all())

    def discard_staging(self, ckpt_id: str) -> None:
        for t in self._all():
            t.discard_staging(ckpt_id)

    def discard(self, staging: Path) -> None:
        self._owner(staging).discard(staging)

    def staging_ids(self) -> Iterator[str]:
        for t in self._all():
            yield from t.staging_ids()

    def published_ids(self) -> list[str]:
        return sorted({n for t in self._all() for n in t.published_ids()})


def publish_image(tier: Tiers | MemoryTier, catalog: Catalog, key: bytes, staging: Path, man: manifest.Manifest,
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
    lifecycle.advance(catalog, man.id, STAGED, in_tier=True, size_bytes=man.size_bytes,
                      last_used_ms=now_ms(), meta=meta, **record)
    return man.size_bytes
