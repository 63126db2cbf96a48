"""Fakes for fast engine and move tests: no root, no CRIU (the httpx way: a mock beside the interface)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from memsnap import jobs
from memsnap.catalog import Catalog, CheckpointRecord, JobRecord, now_ms
from memsnap.client import ClientError
from memsnap.criu import CriuError, DumpOptions, DumpStats, NotifyCallback, RestoreOptions
from memsnap.engine import Engine, EngineConfig
from memsnap.tier import MemoryTier
from memsnap.tiers import MEMORY, Tiers

KEY = b"k" * 32
# A pid no process can have (above the kernel's highest pid_max, 2**22), for rows whose process does not
# matter. Never pid 1: a mutant that signals a row's tree would then signal every process of the machine.
NO_PID = 4_194_305


class FakeCriu:
    """A CriuApi: a dump writes a small image (and stops the tree when asked), a restore starts `sleep`."""

    def __init__(self) -> None:
        self.dumps: list[tuple[int, DumpOptions]] = []
        self.restores: list[int] = []
        self.fail_dump = ""
        self.lazy = True

    def version(self) -> str:
        return "4.1.1"

    def lazy_pages_supported(self) -> bool:
        return self.lazy

    def dump(self, pid: int, images_dir: Path, work_dir: Path, opts: DumpOptions,
             notify: NotifyCallback | None = None) -> DumpStats:
        if notify is not None and not notify("pre-dump", pid):
            raise CriuError("dump", "pre-dump hook refused")
        (images_dir / "inventory.img").write_bytes(b"inventory")
        (images_dir / "pages-1.img").write_bytes(os.urandom(8192))
        if self.fail_dump:
            raise CriuError("dump", self.fail_dump, str(work_dir / "dump.log"))
        if opts.leave_stopped:
            os.kill(pid, signal.SIGSTOP)
        if notify is not None and not notify("post-dump", pid):
            os.kill(pid, signal.SIGCONT)
            raise CriuError("dump", "post-dump hook refused")
        self.dumps.append((pid, opts))
        return DumpStats(wall_ms=3.0, freezing_ms=1.0, frozen_ms=2.0)

    def restore(self, images_dir: Path, work_dir: Path, opts: RestoreOptions,
                notify: NotifyCallback | None = None) -> int:
        proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
        if notify is not None:
            notify("post-restore", proc.pid)
        self.restores.append(proc.pid)
        return proc.pid

    def start_lazy_pages(self, images_dir: Path, work_dir: Path, ps_socket: int = -1) -> subprocess.Popen[bytes]:
        raise NotImplementedError("FakeCriu does no lazy pages")


@dataclass
class Procs:
    """`sleep` processes a test starts; all killed at the end."""

    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, stopped: bool = False) -> tuple[int, float]:
        """(pid, start time) of a new process, SIGSTOPped when asked."""
        p = subprocess.Popen(["sleep", "300"])
        self.started.append(p)
        if stopped:
            os.kill(p.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 10  # (the stop lands asynchronously: a test reading 'R' raced it)
            while state_of(p.pid) != "T" and time.monotonic() < deadline:
                time.sleep(0.001)
        return p.pid, jobs.start_time(p.pid)


def state_of(pid: int) -> str:
    """'T' stopped, 'S' sleeping, 'Z'/'' gone (from /proc/PID/stat)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


@pytest.fixture(name="procs")
def procs_fixture() -> Iterator[Procs]:
    """Procs, killed after the test (import procs_fixture to use it as `procs`)."""
    ps = Procs()
    yield ps
    for p in ps.started:
        try:
            p.kill()
        except OSError:
            pass
        p.wait()


def make_engine(tmp: Path, capacity: int = 0, criu: FakeCriu | None = None, spill: bool = False,
                **kw: Any) -> Engine:
    """An Engine over temp dirs and a FakeCriu; spill: with a spill tier (tmp/spill) beside the memory tier."""
    state = tmp / "state"
    state.mkdir(exist_ok=True)
    tiers = Tiers(MemoryTier(tmp / "tier", capacity_bytes=capacity),
                  MemoryTier(tmp / "spill", label="spill tier") if spill else None)
    return Engine(EngineConfig(state_dir=state, reserve_margin=0.0), Catalog(state), tiers, criu or FakeCriu(),
                  KEY, **kw)


def add_ckpt(engine: Engine, ckpt_id: str, state: str, pid: int = 0, **kw: Any) -> CheckpointRecord:
    """A catalog row (and nothing else)."""
    rec = CheckpointRecord(id=ckpt_id, state=state, pid=pid, owner_uid=os.getuid(), created_ms=now_ms(), **kw)
    engine.catalog.add_checkpoint(rec)
    return rec


def add_job(engine: Engine, job_id: str, pid: int, pid_start: float, restored_from: str = "") -> JobRecord:
    """A job row for a running process."""
    job = JobRecord(id=job_id, pid=pid, pid_start=pid_start, owner_uid=os.getuid(), started_ms=now_ms(),
                    name=job_id, restored_from=restored_from)
    engine.catalog.add_job(job)
    return job


def put_in_tier(engine: Engine, ckpt_id: str, nbytes: int, into: str = MEMORY) -> None:
    """A published tier copy of about nbytes (in the spill tier with into=SPILL)."""
    d = engine.tier.new_staging(ckpt_id, into=into)
    (d / "pages-1.img").write_bytes(b"\0" * nbytes)
    (d / "manifest.json").write_text("{}")
    engine.tier.publish(d, ckpt_id)


class FakePeer:
    """A MemsnapClient stand-in for the commit protocol: answers from a script of outcomes."""

    def __init__(self, answers: list[grpc.StatusCode | None]) -> None:
        self.answers = list(answers)  # None: the commit is applied; a code: that error
        self.asked = 0

    def commit_move(self, ckpt_id: str, timeout: float = 0) -> Any:
        self.asked += 1
        code = self.answers.pop(0) if self.answers else None
        if code is not None:
            raise ClientError(code, "scripted")
        return None

    def __enter__(self) -> FakePeer:
        return self

    def __exit__(self, *exc: object) -> None:
        pass
