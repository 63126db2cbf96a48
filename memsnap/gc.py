"""Garbage collection: `memsnapctl gc` and memsnapd's periodic run (docs/retention.md).

One run: (1) the retention policy (memsnap.retention) picks checkpoints of this node's catalog to delete;
each goes through the engine's delete path (store copy, tier copy, catalog) under its checkpoint lock, and
only if, at that moment, nothing uses it (a restore, a move, a park, a drain). A stored copy another node owns
(retention.not_ours: the node its job moved to, else the one that made it) stays: only the row here goes,
reported as forgotten. (2) For root only, the
chunk sweep of the whole store: mark = the chunks every stored manifest references (every node's, since
nodes share a store); sweep = unreferenced chunks older than the grace period, with no drain of any node
running (the store locks of memsnap.store.chunkgc: a drain holds its lock from its first chunk to its
manifest, so the mark reads the manifest of every drain that could have written a chunk). A crash
anywhere leaves every chunk a durable checkpoint references: a manifest is deleted before any chunk it
alone referenced, and a chunk is deleted only once no manifest references it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from memsnap import background
from memsnap.catalog import DURABLE, CheckpointRecord
from memsnap.engine import ROOT, Caller, Engine
from memsnap.errors import FailedPrecondition, MemsnapError
from memsnap.metrics import Metrics
from memsnap.retention import Ckpt, Plan, Policy, chunked, not_ours, plan, sizes
from memsnap.store import chunkgc
from memsnap.store.chunkgc import SweepResult

log = logging.getLogger("memsnap.gc")


class ChunkSweeper(Protocol):
    """The store's chunk sweep (memsnap.store.chunks), behind the drain that owns the store."""

    def sweep(self, dry_run: bool, now: float, gone: set[str]) -> SweepResult:
        """Sweeps unreferenced chunks older than the grace period; gone: checkpoint ids whose manifests
        count as deleted already (a dry run's deletions)."""
        ...


@dataclass
class GcReport:
    """The outcome of one gc run."""

    dry_run: bool
    deleted: list[CheckpointRecord] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    checkpoint_bytes: int = 0
    swept: bool = False
    sweep_note: str = ""
    sweep: SweepResult = field(default_factory=SweepResult)
    sweep_failed: bool = False
    sweep_deferred: bool = False  # drains into the store kept running: the next run sweeps
    duration_ms: int = 0
    forgotten: dict[str, str] = field(default_factory=dict)  # deleted here only: id -> whose stored copy it is


# Why a checkpoint stays whatever the policy says (also re-checked under its lock, just before deletion).
IN_RESTORE = "a restore reads its tier copy"
IN_MOVE = "a move holds it"
PARKED = "its job is parked on it"


class Collector:
    """Runs gc for the API (memsnapctl gc) and periodically for the daemon; one run at a time."""

    def __init__(self, engine: Engine, default: Policy, grace_s: float, sweeper: ChunkSweeper | None = None,
                 metrics: Metrics | None = None, clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.default = default
        self.grace_s = grace_s
        self.sweeper = sweeper
        self.metrics = metrics
        self.clock = clock
        self._run_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- policy -------------------------------------------------------------------------------
    def policy_for(self, series: str, own: dict[str, dict[str, Any]] | None = None) -> Policy:
        """A series' effective policy: its own rules (run/checkpoint --keep-*) over the node's default."""
        mine = (own if own is not None else self.engine.catalog.policies()).get(series)
        return Policy.from_dict(mine).over(self.default) if mine else self.default

    def set_policy(self, series: str, keep_last: int | None, keep_within_s: float | None) -> Policy:
        """Sets the given rules of a series' own policy (the others stay as they were)."""
        old = Policy.from_dict(self.engine.catalog.policies().get(series, {}))
        new = Policy(keep_last if keep_last is not None else old.keep_last,
                     keep_within_s if keep_within_s is not None else old.keep_within_s)
        self.engine.catalog.set_policy(series, new.to_dict())
        log.info("retention of %s: %s", series, new.describe())
        return new

    def in_use(self, rec: Ckpt) -> str:
        """Why rec (a CheckpointRecord) must stay now whatever the policy says, or ""."""
        assert isinstance(rec, CheckpointRecord)
        if rec.state != DURABLE:
            return f"not durable ({rec.state})"
        if self.engine.tier_copy_in_use(rec.id):
            return IN_RESTORE
        m = rec.marks
        if m.hold or m.lazy_move or m.committing_to or m.move_pending or m.pages_remote:
            return IN_MOVE
        guard = self.engine.guard
        g = guard.get(rec.job) if guard is not None and rec.job else None
        if g is not None and g.state == "parked" and g.checkpoint == rec.id:
            return PARKED
        return ""

    def plan(self, caller: Caller) -> tuple[Plan, list[CheckpointRecord]]:
        """What the policy deletes among the checkpoints caller may see."""
        recs = [r for r in self.engine.catalog.checkpoints() if caller.is_root or r.owner_uid == caller.uid]
        own = self.engine.catalog.policies()
        p = plan(recs, lambda s: self.policy_for(s, own), int(self.clock() * 1000), self.in_use)
        return p, recs

    def totals(self) -> tuple[float, float]:
        """(stored, logical) bytes of this node's durable checkpoints (the store gauges, memsnap.metrics)."""
        stored = logical = 0
        for r in self.engine.catalog.checkpoints(states=(DURABLE,)):
            if r.in_store:
                lg, st, _ = sizes(r)
                stored, logical = stored + st, logical + lg
        return float(stored), float(logical)

    # -- a run --------------------------------------------------------------------------------
    def run(self, caller: Caller, dry_run: bool = False) -> GcReport:
        """One gc run as caller (root: every checkpoint and the chunk sweep; else only the caller's own)."""
        t0 = time.monotonic()
        with self._run_lock:
            try:
                rep = self._run(caller, dry_run)
            except Exception:
                self._count("error")
                raise
        rep.duration_ms = int((time.monotonic() - t0) * 1000)
        self._count("error" if rep.sweep_failed else "deferred" if rep.sweep_deferred else "ok", rep)
        log.info("gc%s: %d checkpoints %sdeleted (%d bytes), %s", " (dry run)" if dry_run else "",
                 len(rep.deleted), "would be " if dry_run else "", rep.checkpoint_bytes,
                 f"{rep.sweep.deleted} chunks swept ({rep.sweep.bytes_freed} bytes), "
                 f"{rep.sweep.kept_in_grace} in grace" if rep.swept else f"no sweep: {rep.sweep_note}",
                 extra={"uid": caller.uid})
        return rep

    def _run(self, caller: Caller, dry_run: bool) -> GcReport:
        rep = GcReport(dry_run=dry_run)
        p, recs = self.plan(caller)
        by_id = {r.id: r for r in recs}
        rep.kept = dict(p.keep)
        for ckpt_id in p.delete:
            rec = by_id[ckpt_id]
            try:
                why = "" if dry_run else self.engine.try_delete(ckpt_id, self.in_use)
            except MemsnapError as exc:  # the store refused or is out of reach: kept, retried next run
                why = f"not deleted: {exc}"
            if why:
                rep.kept[ckpt_id] = why
                continue
            rep.deleted.append(rec)
            theirs = not_ours(rec, self.engine.node) if rec.in_store else ""  # (the engine kept its stored copy)
            if theirs:
                rep.forgotten[ckpt_id] = theirs
            elif not chunked(rec):  # a chunked one's chunks are freed by the sweep, if no one else has them
                rep.checkpoint_bytes += sizes(rec)[1]
        if not caller.is_root:
            rep.sweep_note = "the chunk sweep covers the whole store: root only"
        elif self.sweeper is None:
            rep.sweep_note = ("no store" if self.engine.repo is None else
                              "the store holds no chunks (whole-file checkpoints only)")
        else:
            from memsnap.store import StoreError

            try:
                rep.sweep = self.sweeper.sweep(dry_run, self.clock(),
                                               {r.id for r in rep.deleted} if dry_run else set())
                rep.swept = True
            except chunkgc.SweepDeferred as exc:  # drains kept running: nothing deleted, not a failure
                rep.sweep_note = str(exc)
                rep.sweep_deferred = True
            except (MemsnapError, StoreError) as exc:  # the deletions above stand; the next run sweeps
                rep.sweep_note = f"the sweep failed: {exc}"
                rep.sweep_failed = True
        return rep

    def _count(self, result: str, rep: GcReport | None = None) -> None:
        if self.metrics is None:
            return
        self.metrics.gc_runs.labels(result=result).inc()
        if rep is not None and not rep.dry_run:
            self.metrics.gc_checkpoints_deleted.inc(len(rep.deleted))
            self.metrics.gc_chunks_swept.inc(rep.sweep.deleted)
            self.metrics.gc_bytes_freed.inc(rep.checkpoint_bytes + rep.sweep.bytes_freed)

    # -- periodic -----------------------------------------------------------------------------
    def start(self, interval_s: float) -> None:
        """Runs gc as root every interval_s (0: never), the first time one interval after start."""
        if interval_s <= 0:
            return

        def loop() -> None:
            while not self._stop.wait(interval_s):
                background.gate().wait_idle("gc", self._stop.is_set)  # background work: after foreground work
                try:
                    self.run(ROOT)
                except Exception:  # logged; the next interval tries again
                    log.exception("periodic gc failed")

        self._thread = threading.Thread(target=loop, name="gc", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the periodic run (a run in progress finishes: every step of it is crash-safe anyway)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class SweepRefused(FailedPrecondition):
    """The mark could not be completed (a manifest unreadable): nothing was swept."""


class StoreSweeper:
    """Mark and sweep over the chunked store behind a drain (memsnap.store.chunks).

    Mark: the chunks and packs every stored manifest in the store references (every node's), minus those of `gone`
    (a dry run's deletions). A drain in flight has no manifest yet; its chunks are safe all the same: the
    sweep waits for its store lock to go (the manifest is written by then) or deletes nothing, and they are
    younger than its checkpoint, from which this node's grace is counted. Sweep: chunks outside the mark
    uploaded longer ago than the grace period (counted from the moment the oldest checkpoint still dumping or
    draining here was taken), inside the store-wide sweep lock: no drain of any node runs from the mark to
    the last deletion, and each drain forgets what the sweep's record lists (memsnap.store.chunkgc). A
    manifest that cannot be read stops the run before anything is swept (its chunks are unknown).
    """

    def __init__(self, repo: Any, catalog: Any, grace_s: float, chunks: Any) -> None:
        self.repo = repo
        self.catalog = catalog
        self.grace_s = grace_s
        self.chunks = chunks

    def mark(self, gone: set[str]) -> set[str]:
        """The ids of the chunks and packs to keep. A manifest that is no manifest memsnap writes (any bytes:
        memsnap.store.parse) is skipped and reported: it can reference nothing a restore could use. One that
        declares a newer format, or that cannot be read right now, stops the sweep (its chunks are unknown)."""
        from memsnap.manifest import KNOWN_FORMATS
        from memsnap.store import MANIFEST_NAME, StoreError, StoreNotFound
        from memsnap.store.bad_objects import BAD
        from memsnap.store.errors import BadObject

        store = self.repo.store
        keep: set[str] = set()
        for key in store.list(""):
            ckpt_id, _, rest = key.partition("/")
            if rest != MANIFEST_NAME or ckpt_id in gone:
                continue
            try:
                stored = self.chunks.load_stored_manifest(store, ckpt_id)
                fmt = stored.get("format")
                if type(fmt) is int and fmt > max(KNOWN_FORMATS):  # (named in status too: it stops every sweep)
                    BAD.report("manifest", key, f"declares format {fmt}, newer than this memsnap knows: no sweep "
                               "until memsnap is upgraded here or it is deleted", store.describe())
                    raise SweepRefused(f"the stored manifest of {ckpt_id} has format {fmt}, newer than this memsnap "
                                       "knows: the sweep stopped before deleting anything; upgrade memsnap on this "
                                       "node (or delete that checkpoint from the store)")
                storage = self.chunks.chunked_storage(stored)  # (None: a whole-file copy references no chunk)
                if storage is not None:
                    keep |= storage.referenced_chunks() | storage.referenced_packs()
            except StoreNotFound:
                continue  # deleted meanwhile: its chunks may go
            except (BadObject, ValueError) as exc:  # planted or cut: never a reason to stop every node's gc
                BAD.report("manifest", key, str(exc), store.describe())
                continue
            except StoreError as exc:
                raise SweepRefused(f"the stored manifest of {ckpt_id} cannot be read ({exc}): the sweep stopped "
                                   "before deleting anything; try again when the store answers") from exc
        return keep

    def sweep(self, dry_run: bool, now: float, gone: set[str]) -> SweepResult:
        """Marks, then sweeps (failpoint sweep-deleted-one: die after the first chunk deleted)."""
        from memsnap.catalog import DRAINING, DUMPING, STAGED

        pending = [r.created_ms / 1000 for r in self.catalog.checkpoints(states=(DUMPING, STAGED, DRAINING))]
        since = min([now, *pending])
        if dry_run:
            r = chunkgc.sweep(self.repo.store, self.mark(gone), self.grace_s, dry_run=True, now=since)
        else:  # no drain (any node's) runs from the mark to the last deletion (memsnap.store.chunkgc)
            with self.repo.node_chunks.store_gc(self.repo.store).sweeping():
                r = chunkgc.sweep(self.repo.store, self.mark(gone), self.grace_s, now=since,
                                  index=self.repo.node_chunks.index())
        return r


def chunk_sweeper(repo: Any, catalog: Any, grace_s: float) -> ChunkSweeper | None:
    """The chunk sweep of the store behind the repository (memsnap.repository), or None without a store."""
    from memsnap.store import chunks

    if repo is None:
        return None
    return StoreSweeper(repo, catalog, grace_s, chunks)


__all__ = ["ChunkSweeper", "Collector", "GcReport", "SweepResult", "chunk_sweeper"]
