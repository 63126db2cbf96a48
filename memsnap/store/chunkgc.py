"""What a node knows of one chunk store's contents, and the mark and sweep that frees unreferenced chunks.

Drains and sweeps share a store (every node's), and a drain trusts this node's index of present chunks
without asking the store about each one. That is safe because of a protocol between them, through small
objects in the store itself (docs/chunkstore.md, "Garbage collection"):

- A drain writes a lock object (_locks/drain-...), then lists the locks. If a sweep holds one, it waits for
  that sweep to end (or, after SWEEP_WAIT_S, checks every reused chunk in the store, as without an index).
  Then it reads the sweep records (_gc/...) it has not seen and forgets the chunks they deleted, and trusts
  the rest of its index until its manifest is written and its lock removed. An empty index (a new node) is
  filled from one listing of the chunks: the batched existence check.
- A sweep writes a lock object (_locks/sweep-...), then lists the locks and waits for the drains it saw to
  end (or, after DRAIN_WAIT_S, deletes nothing and says so). Then it marks, writes the record of what it
  will delete, and deletes.

Each side writes its lock before it lists the other's, so of a drain and a sweep at least one sees the
other: either the sweep waits for the drain (and then marks its manifest), or the drain waits for the
sweep (and then reads its record). Locks are rewritten every LOCK_REFRESH_S; one older than LOCK_STALE_S
belongs to a daemon that died, and one of this node's earlier daemons is removed when seen.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from memsnap import failpoints
from memsnap.store.bad_objects import BAD
from memsnap.store.chunks import CHUNK_PREFIX, PACK_PREFIX, ChunkStore, chunk_id, chunk_key, is_chunk_id
from memsnap.store.errors import BadObject, StoreError, StoreNotFound
from memsnap.store.packs import Loc, pack_id_of, read_pack_index
from memsnap.store.parse import load_json

log = logging.getLogger("memsnap.chunks")

LOCKS = "_locks/"
RECORDS = "_gc/"
LOCK_REFRESH_S = 60.0
LOCK_STALE_S = 300.0  # a lock not rewritten for this long belongs to a daemon that died
SWEEP_WAIT_S = 120.0  # a drain waits this long for a running sweep, then checks each reused chunk
DRAIN_WAIT_S = 10.0  # a sweep waits this long for running drains, then deletes nothing (the next gc sweeps)
RECORD_KEEP_S = 7 * 86400.0  # sweep records older than this are deleted; an index not synced for half of it
POLL_S = 0.25  # is dropped (it may have missed a record)
RECORD_MAX = 64 << 20


class SweepDeferred(StoreError):
    """Drains into the store kept running past DRAIN_WAIT_S: the sweep deleted nothing."""


class ChunkIndex:
    """The chunks this node knows to be in one store, each with where it is (None: a loose object; else its
    pack, offset and stored length), the packs whose index it has read, and the sweep records it has applied
    (the <index>.gc file). Trusted for presence only inside StoreGc.draining(); never for contents (every
    chunk read back is verified against its id).

    The index file has a line per fact: "<id>" (a loose chunk), "<id> <pack> <offset> <length>" (a chunk in a
    pack), "+<pack>" (a pack whose chunks are all listed).
    """

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path else None
        self._ids: dict[str, Loc | None] = {}
        self._packs: set[str] = set()
        self._applied: set[str] = set()
        self._synced = 0.0
        self._lock = threading.Lock()
        side = self._side()
        if self.path is not None and self.path.is_file():
            for line in self.path.read_bytes().decode("ascii", "replace").splitlines():
                self._parse(line.split())
        try:  # (any bytes: an unreadable state is an index never synced, so its next drain trusts nothing)
            state = load_json(side.read_bytes(), "index state", str(side), RECORD_MAX) \
                if side is not None and side.is_file() else {}
            applied, synced = state.get("applied", []), state.get("synced", 0.0)
            self._applied = {n for n in applied if isinstance(n, str)} if isinstance(applied, list) else set()
            self._synced = float(synced) if type(synced) in (int, float) and 0 <= synced < 1e12 else 0.0
        except (BadObject, OSError):
            self._applied, self._synced = set(), 0.0

    def _parse(self, w: list[str]) -> None:
        if len(w) == 1 and w[0].startswith("+") and is_chunk_id(w[0][1:]):
            self._packs.add(w[0][1:])
        elif len(w) == 1 and is_chunk_id(w[0]):
            self._ids[w[0]] = None
        elif len(w) == 4 and is_chunk_id(w[0]) and is_chunk_id(w[1]) and _digits(w[2]) and _digits(w[3]):
            self._ids[w[0]] = (w[1], int(w[2]), int(w[3]))
        # (anything else: a line cut short by a crash; that chunk is simply not known)

    def _side(self) -> Path | None:
        return self.path.with_name(self.path.name + ".gc") if self.path is not None else None

    def __contains__(self, cid: object) -> bool:
        with self._lock:
            return cid in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def ids(self) -> set[str]:
        with self._lock:
            return set(self._ids)

    def where(self, cid: str) -> Loc | None:
        """Where the index says chunk cid is (None: a loose object, or not known)."""
        with self._lock:
            return self._ids.get(cid)

    def packs(self) -> set[str]:
        """The packs whose chunks this index lists."""
        with self._lock:
            return set(self._packs)

    def add(self, cids: list[str]) -> None:
        """Records loose chunks as present (appended to the index file)."""
        with self._lock:
            new = [c for c in cids if c not in self._ids]
            self._ids.update(dict.fromkeys(new))
            self._append("".join(c + "\n" for c in new))

    def add_pack(self, pid: str, entries: list[tuple[str, int, int, int]]) -> None:
        """Records a pack and the chunks in it (a chunk known elsewhere already keeps that place)."""
        with self._lock:
            if pid in self._packs:
                return
            new = [(c, off, n) for c, off, n, _raw in entries if c not in self._ids]
            self._ids.update({c: (pid, off, n) for c, off, n in new})
            self._packs.add(pid)
            self._append("".join(f"{c} {pid} {off} {n}\n" for c, off, n in new) + f"+{pid}\n")

    def _append(self, text: str) -> None:
        if text and self.path is not None:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(text)

    def discard(self, cids: list[str] | set[str], packs: set[str] | None = None) -> None:
        """Forgets chunks (missing from the store, or swept) and every chunk of the given packs; rewrites the
        index file."""
        gone, packs = set(cids), set(packs or ())
        with self._lock:
            doomed = {c for c, loc in self._ids.items() if c in gone or (loc is not None and loc[0] in packs)}
            if not doomed and not packs & self._packs:
                return
            for c in doomed:
                del self._ids[c]
            self._packs -= packs
            lines = [c if loc is None else f"{c} {loc[0]} {loc[1]} {loc[2]}" for c, loc in sorted(self._ids.items())]
            self._rewrite(self.path, "".join(x + "\n" for x in lines + [f"+{p}" for p in sorted(self._packs)]))

    def sync(self, store: ChunkStore) -> int:
        """Forgets the chunks of every sweep record it has not applied yet (all of them, when it was last
        synced longer ago than records are kept); returns the store operations it took."""
        names = [k for k in store.list(RECORDS) if _is_record(k)]
        ops, now = 1, time.time()
        with self._lock:
            new = [n for n in names if n not in self._applied]
            lost = self._synced < now - RECORD_KEEP_S / 2 and bool(self._ids)
        if lost:
            log.info("chunk index of %s not synced since %.0f: checking each chunk in the store again",
                     store.describe(), self._synced)
            self.discard(self.ids(), self.packs())
        elif new and (len(self) or self.packs()):
            gone: set[str] = set()
            gone_packs: set[str] = set()
            for name in new:
                got = read_record(store, name)
                ops += 1
                if got is None:  # what that sweep deleted is unknown: trust nothing this index lists
                    log.warning("sweep record %s in %s is unreadable: checking each chunk in the store again",
                                name, store.describe())
                    gone, gone_packs = self.ids(), self.packs()
                    break
                gone |= got[0]
                gone_packs |= got[1]
            self.discard(gone, gone_packs)
        self.mark_applied(names, now, replace=True)
        return ops

    def mark_applied(self, names: list[str], now: float, replace: bool = False) -> None:
        with self._lock:
            self._applied = set(names) if replace else self._applied | set(names)
            self._synced = max(self._synced, now)
            self._rewrite(self._side(), json.dumps({"applied": sorted(self._applied), "synced": self._synced}))

    @staticmethod
    def _rewrite(path: Path | None, text: str) -> None:
        if path is None:
            return
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{path.name}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)


def _digits(w: str) -> bool:
    return w.isascii() and w.isdigit() and len(w) < 19


# -- the store-wide protocol between drains and sweeps -----------------------------------------------------
def _is_record(key: str) -> bool:
    name = key[len(RECORDS):] if key.startswith(RECORDS) else ""
    return bool(name) and "/" not in name and name.endswith(".json")


def parse_record(data: bytes, key: str) -> tuple[set[str], set[str]]:
    """The (loose chunk ids, pack ids) a sweep record lists; BadObject (kind "sweep-record") for any bytes
    that are not a record's JSON."""
    got = load_json(data, "sweep-record", key, RECORD_MAX)
    ids, packs = got.get("chunks"), got.get("packs", [])
    if not isinstance(ids, list) or not isinstance(packs, list):
        raise BadObject(f"integrity check failed: sweep-record {key} lists no chunks and packs", "sweep-record", key)
    return {c for c in ids if is_chunk_id(c)}, {p for p in packs if is_chunk_id(p)}


def read_record(store: ChunkStore, key: str) -> tuple[set[str], set[str]] | None:
    """The (loose chunk ids, pack ids) a sweep record lists (a record gone lists none); None if it is not a
    record (then reported: memsnap.store.bad_objects)."""
    try:
        with store.open_reader(key) as f:
            data = f.read(RECORD_MAX + 1)
    except StoreNotFound:
        return set(), set()
    try:
        return parse_record(data, key)
    except BadObject as exc:
        BAD.report_error(exc, store.describe())
        return None


class StoreLock:
    """One lock object, _locks/<kind>-<owner>-<process>-<n>, rewritten every LOCK_REFRESH_S while held."""

    _seq = 0
    _seq_lock = threading.Lock()

    def __init__(self, store: ChunkStore, kind: str, owner: str, process: str) -> None:
        with StoreLock._seq_lock:
            StoreLock._seq += 1
            n = StoreLock._seq
        self.store, self.key = store, f"{LOCKS}{kind}-{owner}-{process}-{n}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self) -> None:
        with self.store.open_writer(self.key) as w:
            w.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}).encode())
            w.commit()

    def __enter__(self) -> StoreLock:
        self._write()

        def refresh() -> None:
            while not self._stop.wait(LOCK_REFRESH_S):
                try:
                    self._write()
                except (StoreError, OSError) as exc:
                    log.warning("could not refresh %s in %s: %s", self.key, self.store.describe(), exc)

        self._thread = threading.Thread(target=refresh, name="store-lock", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.store.delete_keys([self.key])
        except (StoreError, OSError) as e:  # it goes stale after LOCK_STALE_S
            log.warning("could not remove %s from %s: %s", self.key, self.store.describe(), e)


@dataclass
class DrainGrant:
    """What a drain may trust: trust_index, and the store operations the protocol took."""

    trust_index: bool
    ops: int = 0
    waited_s: float = 0.0


@dataclass
class StoreGc:
    """The protocol (module docstring) for one store, as one daemon (owner: its host and state dir)."""

    store: ChunkStore
    index: ChunkIndex
    owner: str
    process: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    sweep_wait_s: float = SWEEP_WAIT_S
    drain_wait_s: float = DRAIN_WAIT_S
    bad_packs: set[str] = field(default_factory=set)  # packs whose tail is no pack index: never read again

    @staticmethod
    def owner_of(state_dir: str) -> str:
        return chunk_id(f"{socket.gethostname()}:{os.path.realpath(state_dir or '/')}".encode())[:12]

    def fresh_locks(self, kind: str) -> set[str]:
        """The live locks of kind; stale ones of this owner's earlier daemons are removed on the way."""
        now, live, dead = time.time(), set(), []
        for key, _, mtime in self.store.list_with_mtime(LOCKS):
            name = key[len(LOCKS):]
            parts = name.split("-")
            if len(parts) != 4:
                continue
            if parts[1] == self.owner and parts[2] != self.process:
                dead.append(key)
            elif parts[0] == kind and now - mtime < LOCK_STALE_S:
                live.add(key)
        if dead:
            with contextlib.suppress(StoreError, OSError):
                self.store.delete_keys(dead)
        return live

    def _wait_gone(self, kind: str, seen: set[str], timeout_s: float) -> tuple[bool, int]:
        ops, deadline = 0, time.monotonic() + timeout_s
        while seen:
            if time.monotonic() >= deadline:
                return False, ops
            time.sleep(POLL_S)
            seen &= self.fresh_locks(kind)
            ops += 1
        return True, ops

    @contextlib.contextmanager
    def draining(self) -> Iterator[DrainGrant]:
        """Held by a drain from its first chunk to its manifest (its lock in the store)."""
        t0 = time.monotonic()
        with StoreLock(self.store, "drain", self.owner, self.process):
            sweeps = self.fresh_locks("sweep")
            ok, ops = self._wait_gone("sweep", sweeps, self.sweep_wait_s)
            grant = DrainGrant(trust_index=ok, ops=2 + ops)  # its lock, the list of locks
            if ok:
                grant.ops += self.index.sync(self.store)
                if not len(self.index):  # cold (a new node, or dropped): one listing instead of a check a chunk
                    listed = [k.rsplit("/", 1)[-1] for k in self.store.list(CHUNK_PREFIX)]
                    self.index.add([c for c in listed if is_chunk_id(c)])
                    grant.ops += 1 + len(listed) // 1000  # (S3: a request per 1000 keys)
                grant.ops += self.learn_packs()
            else:
                log.warning("a sweep of %s still runs after %.0f s: this drain checks each reused chunk in the "
                            "store", self.store.describe(), self.sweep_wait_s)
            grant.waited_s = time.monotonic() - t0
            yield grant

    def learn_packs(self) -> int:
        """Adds the chunks of the packs other drains wrote since the last call (their index, read from each
        pack's tail) to the index: deduplication across nodes. Returns the store operations it took."""
        keys = self.store.list(PACK_PREFIX)
        known = self.index.packs() | self.bad_packs
        new = [pid for k in keys if (pid := pack_id_of(k)) and pid not in known]

        def learn(pid: str) -> None:
            try:
                self.index.add_pack(pid, read_pack_index(self.store, pid))
            except StoreNotFound:
                pass  # (swept meanwhile)
            except BadObject as exc:  # not a pack's index (memsnap.store.parse): its chunks stay unknown here
                self.bad_packs.add(pid)
                BAD.report_error(exc, self.store.describe())
            except StoreError as exc:  # (unreachable now: the next drain reads it again)
                log.warning("pack %s in %s skipped: %s", pid, self.store.describe(), exc)

        if new:  # (a new node reads every pack's tail once: 8 at a time)
            with ThreadPoolExecutor(max_workers=min(8, len(new)), thread_name_prefix="learn-packs") as pool:
                list(pool.map(learn, new))
        return 1 + len(keys) // 1000 + len(new)

    @contextlib.contextmanager
    def sweeping(self) -> Iterator[None]:
        """Held by a sweep from before its mark to its last deletion; SweepDeferred if drains keep running."""
        with StoreLock(self.store, "sweep", self.owner, self.process):
            drains = self.fresh_locks("drain")
            ok, _ = self._wait_gone("drain", drains, self.drain_wait_s)
            if not ok:
                raise SweepDeferred(f"{len(drains)} drain(s) into {self.store.describe()} still ran after "
                                    f"{self.drain_wait_s:.0f} s: the sweep deleted nothing; the next gc sweeps")
            yield


# -- mark and sweep ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SweepResult:
    """What a sweep deleted (or would delete, dry run), the bytes freed, and the unreferenced chunks it kept
    because they are younger than the grace period (a drain running now may reference them next)."""

    deleted: int = 0
    bytes_freed: int = 0
    kept_in_grace: int = 0


def sweep(store: ChunkStore, keep: set[str], grace_s: float, dry_run: bool = False,
          now: float | None = None, index: ChunkIndex | None = None) -> SweepResult:
    """Deletes every loose chunk object and every pack not in keep whose upload (mtime) is older than grace_s.

    Run inside StoreGc.sweeping() (no drain runs meanwhile), with keep the union of the referenced chunks and
    packs (chunks.ChunkedStorage) of every stored manifest listed after the drains seen ended. A pack goes only when
    no manifest references any chunk in it. Before deleting anything it writes the record of what it deletes
    (_gc/<ms>-<hex>.json: loose chunk ids and pack ids), which every node's next drain reads to forget those
    chunks. On POSIX the mtime is checked again right before each unlink (an object uploaded again meanwhile
    stays). Crash-safe at any point: an object is either kept or gone, only unreferenced ones go, and the
    record was written first. index: this node's, which forgets the deleted chunks and any the store does not
    have. The chunk counts include the chunks of deleted packs (their index read from each pack's tail).
    """
    now = time.time() if now is None else now
    cutoff = now - grace_s
    in_grace, doomed = 0, []
    listed: set[str] = set()
    listed_packs: set[str] = set()
    for prefix, id_of in ((CHUNK_PREFIX, _loose_id), (PACK_PREFIX, pack_id_of)):
        for key, size, mtime in store.list_with_mtime(prefix):
            oid = id_of(key)
            if not oid:
                continue
            (listed if prefix == CHUNK_PREFIX else listed_packs).add(oid)
            if oid in keep:
                continue
            if mtime > cutoff:
                in_grace += 1
                continue
            doomed.append((oid, key, size))
    counts = {key: _chunks_in(store, oid, key) for oid, key, _ in doomed}
    if dry_run:
        return SweepResult(sum(counts.values()), sum(d[2] for d in doomed), in_grace)
    if index is not None:
        index.discard(index.ids() - listed, index.packs() - listed_packs)
    if not doomed:
        _prune_records(store, time.time())
        return SweepResult(0, 0, in_grace)
    record = f"{RECORDS}{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:16]}.json"
    loose = sorted(d[0] for d in doomed if d[1].startswith(CHUNK_PREFIX))
    packs = sorted(d[0] for d in doomed if d[1].startswith(PACK_PREFIX))
    with store.open_writer(record) as w:
        w.write(json.dumps({"at": time.time(), "chunks": loose, "packs": packs}).encode())
        w.commit()
    if index is not None:
        index.discard(set(loose), set(packs))
        index.mark_applied([record], time.time())
    deleted = freed = 0
    for _, key, size in doomed:
        if store.delete_keys([key], not_after=cutoff):
            deleted, freed = deleted + counts[key], freed + size
            BAD.forget(key)  # (a planted pack no manifest references goes like any other)
            failpoints.hit("sweep-deleted-one")
    _prune_records(store, time.time())
    return SweepResult(deleted, freed, in_grace)


def _loose_id(key: str) -> str:
    cid = key.rsplit("/", 1)[-1]
    return cid if is_chunk_id(cid) and key == chunk_key(cid) else ""


def _chunks_in(store: ChunkStore, oid: str, key: str) -> int:
    """How many chunks an object holds: 1 for a loose chunk, the entries of a pack's index (0 unreadable)."""
    if not key.startswith(PACK_PREFIX):
        return 1
    try:
        return len(read_pack_index(store, oid))
    except BadObject as exc:  # (swept all the same: no manifest references it)
        BAD.report_error(exc, store.describe())
        return 0
    except StoreError:
        return 0


def _prune_records(store: ChunkStore, now: float) -> None:
    old = [k for k, _, m in store.list_with_mtime(RECORDS) if _is_record(k) and m < now - RECORD_KEEP_S]
    if old:
        store.delete_keys(old)
