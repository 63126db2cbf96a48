"""The guard's job table: what it knows of each guarded job (the catalog's guard_jobs table, journaled beside the
checkpoints), and which jobs a park, a resume or an eviction holds right now."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("memsnap.guard")

RUNNING, PARKED, RESUMED, ENDED, KILLED = "running", "parked", "resumed", "ended", "killed"


@dataclass
class GuardedJob:
    """What the guard knows of a job (kept in the catalog's guard_jobs table, beside the checkpoints)."""

    job_id: str
    owner_uid: int
    priority: int = 0
    limit: int = 0  # bytes; 0 = no cgroup limit (the node policy may still park it)
    on_limit: str = "park"
    cgroup: str = ""  # absolute path of its memory cgroup, "" = none
    state: str = RUNNING
    reason: str = ""
    parked_ms: int = 0
    checkpoint: str = ""
    resumed_as: str = ""
    oom_kills_at_start: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


class JobTable:
    """The guarded jobs by id; every change is saved to the catalog before it returns.

    A job is busy while a park, a resume or the eviction of its parked image works on it (claim/release): each
    of them leaves a busy job alone."""

    def __init__(self, catalog: Any, legacy: Path) -> None:
        self.catalog = catalog
        self._lock = threading.RLock()
        self._jobs: dict[str, GuardedJob] = self._load(legacy)
        self._busy: set[str] = set()

    def _load(self, legacy: Path) -> dict[str, GuardedJob]:
        """The table from the catalog. A table an older memsnapd kept in <state>/guard/jobs.json (replaced
        without fsync, outside the journal) moves into the catalog once."""
        raw = self.catalog.guard_jobs()
        if not raw and legacy.exists():
            try:
                raw = json.loads(legacy.read_text())
                if not isinstance(raw, dict):
                    raise ValueError("not a table")
                self.catalog.save_guard_jobs(raw)
            except (OSError, ValueError) as exc:
                log.warning("guard: ignoring %s (%s)", legacy, exc)
                raw = {}
            legacy.unlink(missing_ok=True)
        jobs: dict[str, GuardedJob] = {}
        for k, v in raw.items():
            try:
                jobs[k] = GuardedJob(**v)
            except TypeError as exc:
                log.warning("guard: forgetting job %s, whose row does not parse: %s", k, exc)
        return jobs

    def _save(self) -> None:
        """(the caller holds _lock)"""
        self.catalog.save_guard_jobs({k: asdict(v) for k, v in self._jobs.items()})

    def get(self, job_id: str) -> GuardedJob | None:
        with self._lock:
            return self._jobs.get(job_id)

    def jobs(self, *states: str) -> list[GuardedJob]:
        """The jobs in any of these states (all of them when none is named)."""
        with self._lock:
            return [g for g in self._jobs.values() if not states or g.state in states]

    def put(self, g: GuardedJob) -> None:
        """Records a job (replacing a row of the same id)."""
        with self._lock:
            self._jobs[g.job_id] = g
            self._save()

    def update(self, job_id: str, **changes: Any) -> None:
        """Sets fields of a job's row; a job not in the table is left alone."""
        with self._lock:
            g = self._jobs.get(job_id)
            if g is None:
                return
            for k, v in changes.items():
                setattr(g, k, v)
            self._save()

    def update_if_running(self, job_id: str, **changes: Any) -> bool:
        """update(), only while the job is running and nothing works on it, checked with the change (a park that
        ends meanwhile is not overwritten). Whether it changed."""
        with self._lock:
            g = self._jobs.get(job_id)
            if g is None or g.state != RUNNING or job_id in self._busy:
                return False
            for k, v in changes.items():
                setattr(g, k, v)
            self._save()
            return True

    def add_stats(self, job_id: str, **stats: Any) -> None:
        """Adds to (or overwrites entries of) a job's stats."""
        with self._lock:
            g = self._jobs.get(job_id)
            if g is None:
                return
            g.stats.update(stats)
            self._save()

    # -- busy: a park, resume or eviction at work ---------------------------------------
    def claim(self, job_id: str) -> bool:
        """Marks the job busy; False when it was already."""
        with self._lock:
            if job_id in self._busy:
                return False
            self._busy.add(job_id)
            return True

    def release(self, job_id: str) -> None:
        with self._lock:
            self._busy.discard(job_id)

    def busy(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._busy
