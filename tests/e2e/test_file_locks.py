"""A restored process keeps its POSIX (fcntl) locks, also on a file it has mapped: SQLite in WAL mode locks
the dead-man-switch byte (128) of its -shm file, the WAL index it maps, for as long as it is connected. CRIU
dropped that lock on restore (scripts/criu-patches/0002-...), so the next connection took the byte, believed
it was alone and rebuilt the index under the running writer (SIGBUS, or a reset index)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import sqlite3
import struct
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers import REPO, DaemonProc, job_output, wait_for

WRITER = REPO / "tests" / "workloads" / "sqlite_rows.py"


def _committed(log: str) -> int:
    found = re.findall(r"^committed (\d+)$", job_output(log), re.M)
    return int(found[-1]) if found else 0


def _dms_locked_by_someone(shm: Path) -> bool:
    """Whether another process holds a lock on byte 128 of the -shm file (F_GETLK for a write lock there)."""
    fd = os.open(shm, os.O_RDWR)
    try:
        query = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 128, 1, 0)
        got = fcntl.fcntl(fd, fcntl.F_GETLK, query)
        return struct.unpack("hhqqi", got)[0] != fcntl.F_UNLCK
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["tier", "lazy", "store"])
def test_a_restored_sqlite_wal_writer_keeps_its_locks_and_a_second_connection_leaves_it_alone(
        how, daemon: DaemonProc, jobs_to_kill, tmp_path):
    db = tmp_path / "rows.db"
    job = json.loads(daemon.ctl("--json", "run", "--", sys.executable, str(WRITER), "--db", str(db), "--journal",
                                "wal", check=True).stdout)
    jobs_to_kill.append(int(job["pid"]))
    wait_for(lambda: _committed(job["log"]) > 10, 30, what="the writer to commit")
    assert _dms_locked_by_someone(Path(f"{db}-shm"))
    ck = json.loads(daemon.ctl("--json", "checkpoint", job["job"], "--stop",
                               *(["--wait", "durable"] if how == "store" else []), check=True).stdout)
    if how == "store":
        daemon.ctl("evict", ck["id"], check=True)
    out = json.loads(daemon.ctl("--json", "restore", *(["--lazy"] if how == "lazy" else []), ck["id"],
                                check=True).stdout)
    jobs_to_kill.append(int(out["pid"]))
    n = _committed(job["log"])
    wait_for(lambda: _committed(job["log"]) > n + 3, 30, what="the restored writer to commit")
    assert _dms_locked_by_someone(Path(f"{db}-shm")), "the restored writer lost its lock on the WAL index"
    # A second connection comes and goes; the writer goes on, and every committed row is there.
    other = sqlite3.connect(db, timeout=30)
    assert other.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    other.close()
    n = _committed(job["log"])
    wait_for(lambda: _committed(job["log"]) > n + 20, 30, what="the writer to go on after a second connection")
    assert Path(f"/proc/{out['pid']}").exists() and "Bus error" not in job_output(job["log"])
    check = sqlite3.connect(db, timeout=30)
    count, top = check.execute("SELECT COUNT(*), MAX(n) FROM t").fetchone()
    check.close()
    assert count == top >= n


_LOCKER = """import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.lockf(fd, fcntl.LOCK_EX)
print('locked', flush=True)
while True:
    time.sleep(0.1)
"""


@pytest.mark.usefixtures("no_copy_outlives_the_test")
@pytest.mark.parametrize("lazy", [False, True], ids=["streamed", "lazy"])
def test_a_move_whose_copy_cannot_take_a_lock_its_stopped_original_holds_fails_at_once_and_runs_on(
        lazy, pair, jobs_to_kill, tmp_path):
    # The two daemons share this host's files: the job's stopped copy on the source holds its lock on the file
    # until the target says the moved copy runs, so the copy there cannot take it. CRIU waited for it for ever.
    locked = tmp_path / "locked"
    job = json.loads(pair.a.ctl("--json", "run", "--", sys.executable, "-c", _LOCKER, str(locked),
                                check=True).stdout)
    jobs_to_kill.append(int(job["pid"]))
    wait_for(lambda: "locked" in Path(job["log"]).read_text(), 20, what="the lock")
    r = pair.a.ctl("--json", "migrate", job["job"], "--to", pair.b.address, *(["--lazy"] if lazy else []),
                   timeout=120)
    assert r.returncode != 0 and "migration failed at restore on the target" in r.stderr, r.stderr
    assert "conflicting lock" in r.stderr and "resumed on this node" in r.stderr, r.stderr
    # The target's CRIU log the error names is still there to read (the image it received is gone).
    log = Path(re.search(r"\(log: (\S+restore\.log)\)", r.stderr).group(1))  # type: ignore[union-attr]
    assert log.is_file() and "conflicting lock" in log.read_text(), log
    fd = os.open(locked, os.O_RDWR)
    try:
        query = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        assert struct.unpack("hhqqi", fcntl.fcntl(fd, fcntl.F_GETLK, query))[0] != fcntl.F_UNLCK  # still its
    finally:
        os.close(fd)
    assert psutil.Process(int(job["pid"])).status() != psutil.STATUS_STOPPED
