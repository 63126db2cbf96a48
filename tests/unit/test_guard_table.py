"""The memory guard's job table lives in the catalog (journaled, on disk before the write returns), not in a
JSON file replaced without fsync."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from memsnap.catalog import Catalog
from memsnap.config import GuardConfig
from memsnap.guard.service import PARKED, Guard


def guard(state: Path, catalog: Catalog) -> Guard:
    cfg = GuardConfig(cgroup_root=str(state / "no-cgroupfs"))  # (no controller: the table is what is tested)
    return Guard(SimpleNamespace(catalog=catalog, tier=SimpleNamespace(spill=None)), cfg, state)


def test_a_parked_job_in_the_guards_table_is_still_parked_after_a_restart(tmp_path: Path) -> None:
    cat = Catalog(tmp_path)
    g = guard(tmp_path, cat)
    g.adopt("job-1", 1000, limit=64 << 20, priority=0, on_limit="park", cgroup="")
    g.table.update("job-1", state=PARKED, checkpoint="ck-1")
    cat.close()
    again = guard(tmp_path, Catalog(tmp_path))  # (a new daemon over the same state dir)
    got = again.get("job-1")
    assert got is not None and got.state == PARKED and got.checkpoint == "ck-1" and got.limit == 64 << 20
    assert not (tmp_path / "guard" / "jobs.json").exists()


def test_an_older_daemons_jobs_json_moves_into_the_catalog_once(tmp_path: Path) -> None:
    (tmp_path / "guard").mkdir(mode=0o700)
    (tmp_path / "guard" / "jobs.json").write_text(json.dumps({
        "job-7": {"job_id": "job-7", "owner_uid": 0, "state": PARKED, "checkpoint": "ck-7"},
        "job-8": {"job_id": "job-8", "owner_uid": 0, "no_such_field": 1}}))  # (a row that does not parse)
    cat = Catalog(tmp_path)
    g = guard(tmp_path, cat)
    got = g.get("job-7")
    assert got is not None and got.state == PARKED and got.checkpoint == "ck-7"
    assert g.get("job-8") is None
    assert not (tmp_path / "guard" / "jobs.json").exists()
    assert set(cat.guard_jobs()) == {"job-7", "job-8"}  # (kept as it was: only this daemon's view skips it)


class _ParkEndsMeanwhile:
    """The catalog, but a park of the job finishes while the loop looks its job row up (its process is gone)."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.guard: Guard | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.catalog, name)

    def get_job(self, job_id: str) -> None:
        assert self.guard is not None
        self.guard.table.update(job_id, state=PARKED, checkpoint="ck-1")  # (the park thread, done now)
        return None


def test_a_park_that_ends_while_the_loop_reads_the_table_stays_parked(tmp_path: Path) -> None:
    cat = _ParkEndsMeanwhile(Catalog(tmp_path))
    g = Guard(SimpleNamespace(catalog=cat, tier=SimpleNamespace(spill=None)),
              GuardConfig(cgroup_root=str(tmp_path / "no-cgroupfs")), tmp_path)
    cat.guard = g
    g.adopt("job-1", 1000, limit=0, priority=0, on_limit="park", cgroup="")
    assert g.loop.running() == []
    got = g.get("job-1")
    assert got is not None and got.state == PARKED and got.checkpoint == "ck-1"  # (not "ended")
    assert cat.catalog.guard_jobs()["job-1"]["state"] == PARKED


def test_a_job_that_is_no_longer_running_is_not_parked_again(tmp_path: Path) -> None:
    g = guard(tmp_path, Catalog(tmp_path))
    g.adopt("job-1", 1000, limit=0, priority=0, on_limit="park", cgroup="")
    g.table.update("job-1", state=PARKED, checkpoint="ck-1")
    g.parker.park_async("job-1", "node memory pressure", 0.0)  # (a decision from a table read before the park)
    assert not g.table.busy("job-1")
    assert not [t for t in threading.enumerate() if t.name == "park-job-1"]
