"""The catalog: jobs and checkpoints in SQLite (WAL) in the state dir; the truth after a crash."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from memsnap.errors import InvalidArgument

DUMPING, STAGED, DRAINING, DURABLE, FAILED = "dumping", "staged", "draining", "durable", "failed"
STATES = (DUMPING, STAGED, DRAINING, DURABLE, FAILED)
RESTORABLE = (STAGED, DRAINING, DURABLE)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
  id TEXT PRIMARY KEY,
  state TEXT NOT NULL,
  pid INTEGER NOT NULL,
  job TEXT NOT NULL DEFAULT '',
  name TEXT NOT NULL DEFAULT '',
  owner_uid INTEGER NOT NULL,
  created_ms INTEGER NOT NULL,
  size_bytes INTEGER NOT NULL DEFAULT 0,
  frozen_ms INTEGER NOT NULL DEFAULT 0,
  dump_ms INTEGER NOT NULL DEFAULT 0,
  in_tier INTEGER NOT NULL DEFAULT 0,
  in_store INTEGER NOT NULL DEFAULT 0,
  drained_bytes INTEGER NOT NULL DEFAULT 0,
  stored_bytes INTEGER NOT NULL DEFAULT 0,
  last_error TEXT NOT NULL DEFAULT '',
  drain_attempts INTEGER NOT NULL DEFAULT 0,
  next_attempt_ms INTEGER NOT NULL DEFAULT 0,
  last_used_ms INTEGER NOT NULL DEFAULT 0,
  durable_ms INTEGER NOT NULL DEFAULT 0,
  meta TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY,
  name TEXT NOT NULL DEFAULT '',
  pid INTEGER NOT NULL,
  pid_start REAL NOT NULL DEFAULT 0,
  owner_uid INTEGER NOT NULL,
  argv TEXT NOT NULL DEFAULT '[]',
  log_path TEXT NOT NULL DEFAULT '',
  started_ms INTEGER NOT NULL,
  restored_from TEXT NOT NULL DEFAULT '',
  ended INTEGER NOT NULL DEFAULT 0,
  moved_from TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS ckpt_job ON checkpoints(job);
CREATE TABLE IF NOT EXISTS guard_jobs (
  job_id TEXT PRIMARY KEY,
  data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS retention (
  series TEXT PRIMARY KEY,
  policy TEXT NOT NULL DEFAULT '{}'
);
"""


def now_ms() -> int:
    """Wall clock in milliseconds."""
    return int(time.time() * 1000)


@dataclass
class CheckpointRecord:
    """One checkpoint's row."""

    id: str
    state: str
    pid: int
    owner_uid: int
    created_ms: int
    job: str = ""
    name: str = ""
    size_bytes: int = 0
    frozen_ms: int = 0
    dump_ms: int = 0
    in_tier: bool = False
    in_store: bool = False
    drained_bytes: int = 0
    stored_bytes: int = 0
    last_error: str = ""
    drain_attempts: int = 0
    next_attempt_ms: int = 0
    last_used_ms: int = 0
    durable_ms: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def marks(self) -> MoveMarks:
        """The move marks journaled in meta (memsnap.move)."""
        return MoveMarks.of(self.meta)


@dataclass(frozen=True)
class MoveMarks:
    """What the journal says about a move of this checkpoint; recovery reads these after a crash.

    Source side: hold (the tree stays stopped while it moves), lazy_move (a lazy dump towards that
    target), committing_to (the commit was asked of that target: in doubt after a crash), moved_to and
    moved_job (the target keeps the job: the held copy here ends). Target side: move_pending (the job
    restored for a move that the source has not committed yet), pages_remote (the small first half of a
    lazy move: its memory stayed on the source), move_incoming (an image that came for a move not committed
    yet: it goes unless the commit comes; "store" when it is the source's stored copy, cataloged only).
    """

    hold: bool = False
    lazy_move: str = ""
    committing_to: str = ""
    moved_to: str = ""
    moved_job: str = ""
    move_pending: str = ""
    pages_remote: bool = False
    move_incoming: str = ""

    @classmethod
    def of(cls, meta: dict[str, Any]) -> MoveMarks:
        """The marks in a checkpoint's meta (absent ones are empty)."""
        return cls(hold=bool(meta.get("hold")), lazy_move=str(meta.get("lazy_move") or ""),
                   committing_to=str(meta.get("committing_to") or ""), moved_to=str(meta.get("moved_to") or ""),
                   moved_job=str(meta.get("moved_job") or ""), move_pending=str(meta.get("move_pending") or ""),
                   pages_remote=bool(meta.get("pages_remote")),
                   move_incoming=str(meta.get("move_incoming") or ""))


@dataclass
class JobRecord:
    """One managed job (launched or restored by memsnap)."""

    id: str
    pid: int
    owner_uid: int
    started_ms: int
    name: str = ""
    pid_start: float = 0.0
    argv: list[str] = field(default_factory=list)
    log_path: str = ""
    restored_from: str = ""
    ended: bool = False
    moved_from: str = ""  # SOURCE_HOST/SOURCE_JOB of a job that moved here


_CK_FIELDS = [f.name for f in fields(CheckpointRecord)]
_JOB_FIELDS = [f.name for f in fields(JobRecord)]


class Catalog:
    """Thread-safe access to the state database; every write is committed before it returns."""

    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / "catalog.db"
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # 0600 before SQLite opens it (its -wal and -shm files take the database's mode): the state dir
        # is traversable (0711) so that job owners reach their logs.
        for suffix in ("", "-wal", "-shm"):
            try:
                fd = os.open(f"{self.path}{suffix}", os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if not suffix else 0),
                             0o600)
            except FileNotFoundError:
                continue
            try:
                os.fchmod(fd, 0o600)
            finally:
                os.close(fd)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a state change is on disk before the action it records starts.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        cols = {r[1] for r in self._db.execute("PRAGMA table_info(jobs)")}
        if "moved_from" not in cols:  # a catalog written before moved_from existed
            self._db.execute("ALTER TABLE jobs ADD COLUMN moved_from TEXT NOT NULL DEFAULT ''")
        self._lock = threading.RLock()
        self._changes = threading.Condition(threading.Lock())
        self._generation = 0  # one more for every checkpoint write: what waiters wake on

    def close(self) -> None:
        """Closes the database."""
        with self._lock:
            self._db.close()

    # -- checkpoints ------------------------------------------------------------
    def add_checkpoint(self, rec: CheckpointRecord) -> None:
        """Journals a new checkpoint (normally in state dumping)."""
        _check_ids(rec.owner_uid, rec.pid)
        _check_ints(rec.size_bytes, rec.frozen_ms, rec.dump_ms, rec.created_ms, rec.drained_bytes,
                    rec.stored_bytes)
        row = asdict(rec)
        row["meta"] = json.dumps(rec.meta)
        cols = ",".join(_CK_FIELDS)
        marks = ",".join("?" for _ in _CK_FIELDS)
        with self._lock:
            self._db.execute(f"INSERT INTO checkpoints ({cols}) VALUES ({marks})", [row[c] for c in _CK_FIELDS])
        self._changed()

    def update_checkpoint(self, ckpt_id: str, **changes: Any) -> None:
        """Journals a change of some fields, never of the state (memsnap.lifecycle.advance changes that) nor of
        the meta marks (memsnap.lifecycle.mark)."""
        if "state" in changes:
            raise TypeError("a checkpoint's state changes through memsnap.lifecycle.advance")
        if "meta" in changes:
            raise TypeError("a checkpoint's marks change through memsnap.lifecycle.mark")
        self._update(ckpt_id, None, changes)

    def merge_meta(self, ckpt_id: str, changes: dict[str, Any]) -> bool:
        """Sets (a value) or removes (None) keys of a checkpoint's meta in one step under the catalog's lock, so
        two writers of different keys never lose each other's (memsnap.lifecycle.mark's primitive). False when
        the checkpoint is gone."""
        with self._lock:
            row = self._db.execute("SELECT meta FROM checkpoints WHERE id=?", (ckpt_id,)).fetchone()
            if row is None:
                return False
            meta = json.loads(row[0] or "{}")
            for k, v in changes.items():
                if v is None:
                    meta.pop(k, None)
                else:
                    meta[k] = v
            self._db.execute("UPDATE checkpoints SET meta=? WHERE id=?", (json.dumps(meta), ckpt_id))
        self._changed()
        return True

    def update_if_state(self, ckpt_id: str, states: tuple[str, ...], **changes: Any) -> bool:
        """Journals a change of some fields if the checkpoint is in one of states, in one statement; whether it
        was. (memsnap.lifecycle's primitive: the check and the change cannot be split by another writer.)"""
        return self._update(ckpt_id, states, changes) > 0

    def _update(self, ckpt_id: str, states: tuple[str, ...] | None, changes: dict[str, Any]) -> int:
        if "meta" in changes:
            changes["meta"] = json.dumps(changes["meta"])
        bad = set(changes) - set(_CK_FIELDS)
        if bad:
            raise KeyError(f"unknown checkpoint fields {bad}")
        _check_ints(*(v for v in changes.values() if isinstance(v, int) and not isinstance(v, bool)))
        sets = ",".join(f"{k}=?" for k in changes)
        where = "" if states is None else f" AND state IN ({','.join('?' for _ in states)})"  # (IN (): none)
        with self._lock:
            n = self._db.execute(f"UPDATE checkpoints SET {sets} WHERE id=?{where}",
                                 [*changes.values(), ckpt_id, *(states or ())]).rowcount
        self._changed()
        return int(n)

    def generation(self) -> int:
        """A number that grows with every checkpoint write (see wait_changed)."""
        with self._changes:
            return self._generation

    def wait_changed(self, seen: int, timeout: float) -> int:
        """Blocks until a checkpoint write after generation `seen`, or timeout; the generation now."""
        with self._changes:
            self._changes.wait_for(lambda: self._generation != seen, timeout)
            return self._generation

    def _changed(self) -> None:
        with self._changes:
            self._generation += 1
            self._changes.notify_all()

    def get_checkpoint(self, ckpt_id: str) -> CheckpointRecord | None:
        """A checkpoint by id."""
        with self._lock:
            cur = self._db.execute(f"SELECT {','.join(_CK_FIELDS)} FROM checkpoints WHERE id=?", (ckpt_id,))
            row = cur.fetchone()
        return _ck(row) if row else None

    def checkpoints(self, job: str = "", states: tuple[str, ...] = ()) -> list[CheckpointRecord]:
        """Checkpoints, oldest first, optionally of one job and in some states."""
        q = f"SELECT {','.join(_CK_FIELDS)} FROM checkpoints"
        cond, args = [], []
        if job:
            cond.append("job=?")
            args.append(job)
        if states:
            cond.append(f"state IN ({','.join('?' for _ in states)})")
            args.extend(states)
        if cond:
            q += " WHERE " + " AND ".join(cond)
        with self._lock:
            rows = self._db.execute(q + " ORDER BY created_ms, id", args).fetchall()
        return [_ck(r) for r in rows]

    def delete_checkpoint(self, ckpt_id: str) -> None:
        """Forgets a checkpoint."""
        with self._lock:
            self._db.execute("DELETE FROM checkpoints WHERE id=?", (ckpt_id,))
        self._changed()

    def counts_by_state(self) -> dict[str, int]:
        """How many checkpoints are in each state."""
        with self._lock:
            rows = self._db.execute("SELECT state, COUNT(*) FROM checkpoints GROUP BY state").fetchall()
        return {s: int(n) for s, n in rows}

    # -- jobs ---------------------------------------------------------------------
    def add_job(self, job: JobRecord) -> None:
        """Records a launched or restored job."""
        _check_ids(job.owner_uid, job.pid)
        _check_ints(job.started_ms)
        row = asdict(job)
        row["argv"] = json.dumps(job.argv)
        cols = ",".join(_JOB_FIELDS)
        with self._lock:
            self._db.execute(
                f"INSERT OR REPLACE INTO jobs ({cols}) VALUES ({','.join('?' for _ in _JOB_FIELDS)})",
                [row[c] for c in _JOB_FIELDS],
            )

    def update_job(self, job_id: str, **changes: Any) -> None:
        """Changes some fields of a job."""
        if "argv" in changes:
            changes["argv"] = json.dumps(changes["argv"])
        sets = ",".join(f"{k}=?" for k in changes)
        with self._lock:
            self._db.execute(f"UPDATE jobs SET {sets} WHERE id=?", [*changes.values(), job_id])

    def get_job(self, job_id: str) -> JobRecord | None:
        """A job by id (names are per owner: see jobs_named)."""
        q = f"SELECT {','.join(_JOB_FIELDS)} FROM jobs WHERE id=?"
        with self._lock:
            row = self._db.execute(q, (job_id,)).fetchone()
        return _job(row) if row else None

    def jobs_named(self, name: str, owner_uid: int | None = None) -> list[JobRecord]:
        """The jobs called name (of one owner, when given), oldest first."""
        q = f"SELECT {','.join(_JOB_FIELDS)} FROM jobs WHERE name=?"
        args: list[Any] = [name]
        if owner_uid is not None:
            q += " AND owner_uid=?"
            args.append(owner_uid)
        with self._lock:
            rows = self._db.execute(q + " ORDER BY started_ms, id", args).fetchall()
        return [_job(r) for r in rows]

    def jobs(self) -> list[JobRecord]:
        """All jobs, oldest first."""
        with self._lock:
            rows = self._db.execute(f"SELECT {','.join(_JOB_FIELDS)} FROM jobs ORDER BY started_ms").fetchall()
        return [_job(r) for r in rows]

    def job_by_pid(self, pid: int) -> JobRecord | None:
        """The live job whose root has this pid."""
        q = f"SELECT {','.join(_JOB_FIELDS)} FROM jobs WHERE pid=? AND ended=0 ORDER BY started_ms DESC"
        with self._lock:
            row = self._db.execute(q, (pid,)).fetchone()
        return _job(row) if row else None

    def iter_ids(self) -> Iterator[str]:
        """All checkpoint ids."""
        with self._lock:
            rows = self._db.execute("SELECT id FROM checkpoints").fetchall()
        return (r[0] for r in rows)

    # -- retention policies (memsnap.retention): one per series, set by run/checkpoint --keep-* -------
    # -- the memory guard's job table (memsnap.guard) ----------------------------------
    def guard_jobs(self) -> dict[str, dict[str, Any]]:
        """The guard's table: job id -> what it knows of the job."""
        with self._lock:
            rows = self._db.execute("SELECT job_id, data FROM guard_jobs").fetchall()
        return {str(k): json.loads(v) for k, v in rows}

    def save_guard_jobs(self, table: dict[str, dict[str, Any]]) -> None:
        """Replaces the guard's table, in one transaction (on disk before it returns, like every write here)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM guard_jobs")
                self._db.executemany("INSERT INTO guard_jobs (job_id, data) VALUES (?, ?)",
                                     [(k, json.dumps(v)) for k, v in table.items()])
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def set_policy(self, series: str, policy: dict[str, Any]) -> None:
        """Records a series' own retention rules (memsnap.retention.Policy.to_dict())."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO retention (series, policy) VALUES (?, ?)",
                             (series, json.dumps(policy)))

    def policies(self) -> dict[str, dict[str, Any]]:
        """Every series' own retention rules."""
        with self._lock:
            rows = self._db.execute("SELECT series, policy FROM retention").fetchall()
        return {s: json.loads(p or "{}") for s, p in rows}

    def delete_job(self, job_id: str) -> None:
        """Forgets a job (memsnapctl rm / prune)."""
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE id=?", (job_id,))


_UID_MAX = (1 << 32) - 2  # (uid_t)-1 means "no uid"
_INT_MAX = (1 << 63) - 1  # SQLite INTEGER


def _check_ids(uid: int, pid: int) -> None:
    """Owner uids and pids are what the kernel allows, so that every row can be listed."""
    if not 0 <= uid <= _UID_MAX:
        raise InvalidArgument(f"uid {uid} is out of range 0..{_UID_MAX}")
    if not 0 <= pid <= _INT_MAX:
        raise InvalidArgument(f"pid {pid} is out of range")


def _check_ints(*values: int) -> None:
    for v in values:
        if not 0 <= v <= _INT_MAX:
            raise InvalidArgument(f"{v} is out of range 0..2^63-1")


def _ck(row: tuple[Any, ...]) -> CheckpointRecord:
    d = dict(zip(_CK_FIELDS, row, strict=True))
    d["meta"] = json.loads(d["meta"] or "{}")
    d["in_tier"], d["in_store"] = bool(d["in_tier"]), bool(d["in_store"])
    return CheckpointRecord(**d)


def _job(row: tuple[Any, ...]) -> JobRecord:
    d = dict(zip(_JOB_FIELDS, row, strict=True))
    d["argv"] = json.loads(d["argv"] or "[]")
    d["ended"] = bool(d["ended"])
    return JobRecord(**d)
