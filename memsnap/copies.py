"""Tier copies: the per-checkpoint locks, room in the tiers (reserved, made by evicting), and dropping a copy, for
the checkpoints in the memory tier and the guard's spill tier alike (memsnap.tiers).

A checkpoint's tier copy is fetched, published, evicted and deleted under its lock (checkpoint_lock), and never
dropped while a restore reads it (in_use: the Restorer's readers and lazy page servers). reserve() makes room for
a dump or a fetch by evicting durable copies, least recently used first; it skips, never waits for, a copy whose
lock someone holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from memsnap.catalog import DURABLE, Catalog, CheckpointRecord
from memsnap.errors import FailedPrecondition, TierExhausted
from memsnap.tier import TierFull, TierReservation
from memsnap.tiers import MEMORY, Tiers

log = logging.getLogger("memsnap.engine")


class TierCopies:
    """The tier copies of one engine's checkpoints (see the module's doc)."""

    def __init__(self, catalog: Catalog, tier: Tiers, in_use: Callable[[str], bool]) -> None:
        self.catalog, self.tier, self.in_use = catalog, tier, in_use
        self._evict_lock = threading.Lock()
        self._locks: dict[str, threading.RLock] = {}
        self._locks_lock = threading.Lock()

    def reserve(self, nbytes: int, into: str = MEMORY) -> TierReservation:
        """Reserves room in a tier; in the memory tier, evicting durable copies least-recently-used first if needed
        (the spill tier is sized by its filesystem: nothing there is evicted to make room).

        A checkpoint whose lock someone holds (a fetch, restore, delete) is skipped, never waited for: the
        caller may hold another checkpoint's lock, and waiting could deadlock.
        """
        if self.tier.named(into) is not self.tier.memory:
            try:
                return self.tier.reserve(nbytes, into)
            except TierFull as exc:
                raise TierExhausted(str(exc)) from exc
        with self._evict_lock:
            skipped: set[str] = set()
            while True:
                try:
                    return self.tier.reserve(nbytes)
                except TierFull as exc:
                    victim = self._lru_evictable(skipped)
                    if victim is None or not self._fits_after_evicting(nbytes):
                        raise TierExhausted(str(exc)) from exc
                    lock = self.lock_for(victim.id)
                    if not lock.acquire(blocking=False):
                        skipped.add(victim.id)
                        continue
                    try:
                        cur = self.catalog.get_checkpoint(victim.id)
                        if cur is not None and cur.in_tier and not self.in_use(cur.id):
                            log.info("evicting durable tier copy to make room", extra={"checkpoint_id": victim.id})
                            self.drop(cur)
                    finally:
                        lock.release()

    def _fits_after_evicting(self, nbytes: int) -> bool:
        """Whether evicting every evictable tier copy would make room for nbytes (else evict nothing)."""
        evictable = sum(r.size_bytes for r in self.catalog.checkpoints(states=(DURABLE,))
                        if r.in_tier and r.in_store and self.tier.memory.has(r.id) and not self.in_use(r.id))
        return self.tier.free_bytes() + evictable >= nbytes

    def _lru_evictable(self, skip: set[str] | None = None) -> CheckpointRecord | None:
        durable = [r for r in self.catalog.checkpoints(states=(DURABLE,))
                   if r.in_tier and r.in_store and r.id not in (skip or ()) and self.tier.memory.has(r.id)
                   and not self.in_use(r.id)]
        return min(durable, key=lambda r: (r.last_used_ms or r.created_ms)) if durable else None

    def lock_for(self, ckpt_id: str) -> threading.RLock:
        with self._locks_lock:
            return self._locks.setdefault(ckpt_id, threading.RLock())

    @contextmanager
    def checkpoint_lock(self, ckpt_id: str) -> Iterator[None]:
        """Serialises fetch, publish, evict and delete of one checkpoint's tier and store copies."""
        with self.lock_for(ckpt_id):
            yield

    def refuse_in_use(self, ckpt_id: str) -> None:
        """Refuses to drop a tier copy that a restore still reads (the caller holds checkpoint_lock)."""
        if self.in_use(ckpt_id):
            raise FailedPrecondition(f"a restore is still reading the tier copy of {ckpt_id}; try again when it "
                                     "is done")

    def drop(self, rec: CheckpointRecord) -> None:
        """Drops a tier copy; the caller holds checkpoint_lock(rec.id)."""
        # Journal first: a crash after this leaves a stray dir that recovery removes.
        self.catalog.update_checkpoint(rec.id, in_tier=False)
        self.tier.remove(rec.id)
