"""The guard's orchestration without root: its Loop, Parker and Resumer (memsnap.guard) over a fake cgroupfs
(fake_cgroupfs: CgroupV1/CgroupV2 pointed at a temp dir, with the kernel's side as methods), a real Engine over
FakeCriu, and `sleep` processes as the guarded jobs. Each test is a sequence of steps; after each it checks the
guard's table (and the catalog's copy of it), the catalog's checkpoints and jobs, the job's processes (none left
stopped) and the cgroup files. tests/e2e/test_guard.py runs the same paths as root on real cgroup v1 and CRIU."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fake_cgroupfs import FakeCgroupFs
from fakes import FakeCriu, Procs, add_job, make_engine, procs_fixture, state_of  # noqa: F401 (procs_fixture)

from memsnap.catalog import DUMPING, FAILED, STAGED
from memsnap.config import GuardConfig
from memsnap.engine import Engine
from memsnap.errors import InvalidArgument
from memsnap.guard.service import ENDED, KILLED, PARKED, RESUMED, RUNNING, Guard, GuardedJob

M = 1 << 20
LIMIT = 64 * M


@pytest.fixture
def criu() -> Iterator[FakeCriu]:
    c = FakeCriu()
    yield c
    for pid in c.restores:  # (the restored `sleep`s)
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


@dataclass
class Rig:
    """An engine, its guard over a fake cgroupfs, and the test's processes."""

    engine: Engine
    criu: FakeCriu
    guard: Guard
    fs: FakeCgroupFs
    procs: Procs

    def guarded(self, job_id: str = "job-a", on_limit: str = "park") -> tuple[int, Path]:
        """A running `sleep` recorded as job_id, in a job cgroup of its own with LIMIT, guarded and watched, as a
        launch with --memory-limit leaves it: (its pid, its cgroup)."""
        pid, start = self.procs.start()
        add_job(self.engine, job_id, pid, start)
        assert self.guard.cg is not None
        self.fs.job("j-" + job_id)  # (the kernel's mkdir: the control files appear)
        cg = self.guard.cg.create("j-" + job_id, LIMIT)
        self.guard.cg.enter(cg, [pid])
        self.guard.adopt(job_id, os.getuid(), LIMIT, 0, on_limit, str(cg))
        return pid, cg

    def row(self, job_id: str) -> GuardedJob:
        """The guard's row of the job, checked against the catalog's copy (every change is saved before it
        returns)."""
        g = self.guard.get(job_id)
        assert g is not None
        saved = self.engine.catalog.guard_jobs()[job_id]
        assert (saved["state"], saved["checkpoint"], saved["limit"]) == (g.state, g.checkpoint, g.limit)
        return g

    def state(self, job_id: str) -> str:
        """The guard's state of the job now, for a poll (row() compares it with the saved copy, which a park
        thread may be writing at that moment)."""
        g = self.guard.get(job_id)
        return g.state if g is not None else ""

    def settle(self, job_id: str) -> None:
        """Waits until no park (a thread of its own) works on the job."""
        until(lambda: not self.guard.table.busy(job_id), f"the park of {job_id} ended")

    def watched(self) -> set[str]:
        """The jobs with an open watcher (Watchers has no public query)."""
        return set(self.guard.watchers._fds.values())

    def reap(self, pid: int) -> None:
        """The test is the job's parent: it reaps a job the park ended (init does for the daemon's jobs), so that
        a restore may take its pid again."""
        next(p for p in self.procs.started if p.pid == pid).wait(10)

    def checkpoints_settled(self) -> None:
        """No checkpoint is left in a transient state (DUMPING: a dump that neither published nor failed)."""
        stuck = [(r.id, r.state) for r in self.engine.catalog.checkpoints() if r.state == DUMPING]
        assert not stuck, stuck


def rig(tmp_path: Path, criu: FakeCriu, procs: Procs, version: int = 1, metrics: Any = None, **cfg: Any) -> Rig:
    fs = FakeCgroupFs(tmp_path, version)
    engine = make_engine(tmp_path, criu=criu)
    guard = Guard(engine, GuardConfig(cgroup_root=str(fs.root), **cfg), engine.cfg.state_dir, metrics=metrics)
    assert guard.cg is not None and guard.cg.version == version, guard.cg_error
    engine.guard = guard  # (as the daemon does: a checkpoint carries the guard settings, a restore tells the guard)
    return Rig(engine, criu, guard, fs, procs)


def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.01)


def runs(pid: int) -> None:
    """The process runs, not stopped (a SIGCONT lands at once; give it a moment to show in /proc)."""
    until(lambda: state_of(pid) in ("S", "R"), f"pid {pid} runs (state {state_of(pid)!r})", timeout=2.0)


def gone(pid: int) -> bool:
    return state_of(pid) in ("", "Z", "X")


def eventfd_closed(fd: int, ino: int) -> bool:
    """Whether the eventfd that had fd number fd (and inode ino) is closed (its number may be reused since)."""
    try:
        return os.fstat(fd).st_ino != ino
    except OSError:
        return True


# -- park, then resume ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", [1, 2])
def test_a_job_at_its_limit_is_parked_then_resumed_with_a_new_limit(tmp_path: Path, criu: FakeCriu, procs: Procs,
                                                                    version: int) -> None:
    r = rig(tmp_path, criu, procs, version)
    pid, cg = r.guarded()
    assert r.row("job-a").state == RUNNING and r.watched() == {"job-a"} and r.fs.limit(cg) == LIMIT
    if version == 1:
        efd, _, _ = r.fs.registration(cg)  # (the limit watcher: an eventfd on memory.oom_control)
        efd_ino = os.fstat(efd).st_ino
        assert r.fs.oom_kill_disable(cg) == 1  # (tasks wait at the limit instead of dying)

    # 1. the kernel: the job's tasks wait at the limit (v1 under_oom 1; v2 memory.high reached)
    r.fs.reach_limit(cg)
    r.guard.loop.check_limits(set(), time.monotonic())
    r.settle("job-a")
    g = r.row("job-a")
    assert g.state == PARKED and g.reason.startswith("reached its memory limit (64 MiB"), g
    ckpt = r.engine.catalog.get_checkpoint(g.checkpoint)
    assert ckpt is not None and ckpt.state == STAGED and ckpt.job == "job-a" and ckpt.in_tier
    assert ckpt.meta["parked"]["reason"] == g.reason and ckpt.meta["stop"] is True
    assert [(p, o.leave_stopped) for p, o in criu.dumps] == [(pid, True)]  # (dumped stopped: --stop)
    assert g.stats["at_limit_at_trigger"] is True and g.stats["image_bytes"] == ckpt.size_bytes
    assert g.stats["headroom_limit"] > LIMIT  # (headroom to leave the kernel, while it was dumped)
    assert gone(pid), state_of(pid)  # (the park ends the job once its image is staged)
    job = r.engine.catalog.get_job("job-a")
    assert job is not None and job.ended
    assert r.fs.limit(cg) == LIMIT  # (the headroom is taken back: the cgroup holds the job's own limit again)
    if version == 1:
        assert r.fs.oom_kill_disable(cg) == 1
        assert eventfd_closed(efd, efd_ino), "the parked job's watcher stays open"
    else:
        assert r.fs.hard_max(cg) == LIMIT + 16 * M
    assert r.watched() == set()
    r.checkpoints_settled()

    # 2. a resume with a larger limit: the limit is in the cgroup before CRIU restores into it
    r.reap(pid)
    res = r.guard.resume("job-a", new_limit=96 * M)
    assert r.fs.limit(cg) == 96 * M
    if version == 1:
        assert r.fs.oom_kill_disable(cg) == 1
        new_efd, _, _ = r.fs.registration(cg)  # (the resumed job is watched: a fresh eventfd)
        assert os.readlink(f"/proc/self/fd/{new_efd}") == "anon_inode:[eventfd]"
    else:
        assert r.fs.hard_max(cg) == 96 * M + 16 * M
    old, new = r.row("job-a"), r.row(res.job.id)
    assert old.state == RESUMED and old.resumed_as == res.job.id
    assert (new.state, new.limit, new.cgroup, new.on_limit) == (RUNNING, 96 * M, str(cg), "park")
    assert new.stats["resumed_from"] == "job-a"
    assert criu.restores == [res.pid]
    job = r.engine.catalog.get_job(res.job.id)
    assert job is not None and job.restored_from == ckpt.id and not job.ended and job.pid == res.pid
    runs(res.pid)  # (never left stopped: the manifest says parked, so the restore sends SIGCONT)
    assert r.watched() == {res.job.id}
    assert not r.guard.table.busy("job-a") and not r.guard.table.busy(res.job.id)
    r.checkpoints_settled()


def test_a_resume_below_the_image_size_is_refused_and_the_job_stays_parked(tmp_path: Path, criu: FakeCriu,
                                                                           procs: Procs) -> None:
    r = rig(tmp_path, criu, procs)
    pid, cg = r.guarded()
    r.fs.reach_limit(cg)
    r.guard.loop.check_limits(set(), time.monotonic())
    r.settle("job-a")
    r.reap(pid)
    with pytest.raises(InvalidArgument, match="cannot hold it; give --memory-limit of at least 17M"):
        r.guard.resume("job-a", new_limit=8 * M)
    assert r.row("job-a").state == PARKED and r.fs.limit(cg) == LIMIT and criu.restores == []
    assert not r.guard.table.busy("job-a")


# -- a park that fails -------------------------------------------------------------------------------------------
def failed_park(r: Rig, criu: FakeCriu, error: str) -> tuple[int, Path]:
    """job-a reaches its limit and the guard's park of it fails with CRIU's error: (its pid, its cgroup)."""
    pid, cg = r.guarded()
    criu.fail_dump = error
    r.fs.reach_limit(cg)
    r.guard.loop.check_limits(set(), time.monotonic())
    r.settle("job-a")
    return pid, cg


def test_a_park_whose_dump_fails_leaves_the_job_running_at_its_own_limit_and_backs_off(
        tmp_path: Path, criu: FakeCriu, procs: Procs) -> None:
    r = rig(tmp_path, criu, procs)
    # 1. the park stops the job, CRIU fails: the job runs on, and its row says so
    pid, cg = failed_park(r, criu, "Error (criu/cr-dump.c:1): fake dump failure")
    runs(pid)  # (SIGCONT after the SIGSTOP the park sent: never left stopped)
    g = r.row("job-a")
    assert g.state == RUNNING and g.checkpoint == "" and r.watched() == {"job-a"}
    job = r.engine.catalog.get_job("job-a")
    assert job is not None and not job.ended
    (failed,) = r.engine.catalog.checkpoints()
    assert failed.state == FAILED and "fake dump failure" in failed.last_error
    assert r.fs.limit(cg) == LIMIT  # (the dump's headroom is taken back: failed parks never ratchet it up)
    assert not r.engine.tier.has(failed.id)
    r.checkpoints_settled()
    assert r.guard.parker.backing_off("job-a")

    # 2. still at its limit, but the guard backs off: no second park right away
    r.guard.loop.check_limits(set(), time.monotonic())
    assert not r.guard.table.busy("job-a")  # (no park was started)
    assert len(r.engine.catalog.checkpoints()) == 1 and criu.dumps == []
    runs(pid)
    assert r.row("job-a").state == RUNNING


def test_a_failed_park_is_retried_after_its_backoff_without_a_new_event(tmp_path: Path, criu: FakeCriu,
                                                                          procs: Procs) -> None:
    """The watcher fired once; the job then hovers just under its limit (the kernel reclaims), so neither the
    limit nor an event would ever ask again: the retry the log promised ("retrying in 30 s") must come anyway.
    (Seen in the soak: a PyTorch job's park met an exiting DataLoader worker, "Zombies with threads are not
    supported", and the job was never parked.)"""
    r = rig(tmp_path, criu, procs)
    _, cg = failed_park(r, criu, "Error (criu/seize.c:882): Zombies with threads are not supported")
    assert r.row("job-a").state == RUNNING and r.guard.parker.backing_off("job-a")
    r.fs.use(cg, LIMIT - (4 << 20))  # (just under the limit: no longer at it, and no event)
    if r.fs.version == 1:
        (cg / "memory.oom_control").write_text("oom_kill_disable 1\nunder_oom 0\noom_kill 0\n")
    criu.fail_dump = ""
    r.guard.loop.check_limits(set(), time.monotonic())  # (still backing off: nothing)
    assert len(r.engine.catalog.checkpoints()) == 1
    r.guard.parker._backoff["job-a"] = time.monotonic() - 1  # (the 30 s are over)
    r.guard.loop.check_limits(set(), time.monotonic())
    r.settle("job-a")
    g = r.row("job-a")
    assert g.state == PARKED and "retried" in g.reason, g.reason
    assert not r.guard.parker.retry_due("job-a")  # (parked: nothing left to retry)


# -- observe mode, on-limit kill, a job that ended ------------------------------------------------------------------
def test_observe_mode_only_records_would_park(tmp_path: Path, criu: FakeCriu, procs: Procs) -> None:
    r = rig(tmp_path, criu, procs, mode="observe")
    pid, cg = r.guarded()
    r.fs.reach_limit(cg)
    for _ in range(2):
        r.guard.loop.check_limits(set(), time.monotonic())
        assert r.guard.would_park == ["job-a"]  # (once, however often it is seen)
        assert not r.guard.table.busy("job-a")
        assert r.row("job-a").state == RUNNING and r.watched() == {"job-a"}
        assert r.engine.catalog.checkpoints() == [] and criu.dumps == []
        assert r.fs.limit(cg) == LIMIT  # (no headroom given: nothing was stopped)
        runs(pid)


def test_on_limit_kill_kills_the_job(tmp_path: Path, criu: FakeCriu, procs: Procs) -> None:
    r = rig(tmp_path, criu, procs)
    pid, cg = r.guarded(on_limit="kill")
    efd, _, _ = r.fs.registration(cg)
    efd_ino = os.fstat(efd).st_ino
    r.fs.reach_limit(cg)
    r.guard.loop.check_limits(set(), time.monotonic())
    g = r.row("job-a")
    assert g.state == KILLED and "on-limit kill" in g.reason
    assert gone(pid), state_of(pid)
    job = r.engine.catalog.get_job("job-a")
    assert job is not None and job.ended
    assert r.engine.catalog.checkpoints() == [] and criu.dumps == []
    assert r.watched() == set() and eventfd_closed(efd, efd_ino)
    assert not r.guard.table.busy("job-a")


def test_a_job_that_ended_is_recorded_ended_and_unwatched(tmp_path: Path, criu: FakeCriu, procs: Procs,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    r = rig(tmp_path, criu, procs)
    pid, cg = r.guarded()
    efd, _, _ = r.fs.registration(cg)
    efd_ino = os.fstat(efd).st_ino
    assert r.guard.cg is not None
    removed: list[Path] = []
    real_remove = r.guard.cg.remove

    def remove(path: Path) -> None:
        removed.append(path)
        real_remove(path)
    monkeypatch.setattr(r.guard.cg, "remove", remove)
    r.fs.reach_limit(cg)  # (its cgroup still says under_oom: the job ended first, nothing is left to park)
    r.procs.started[0].kill()
    r.reap(pid)
    r.guard.loop.check_limits(set(), time.monotonic())
    assert r.row("job-a").state == ENDED
    assert r.watched() == set() and eventfd_closed(efd, efd_ino)
    assert removed == [cg]  # (its cgroup is let go; a real rmdir of the empty cgroup removes it)
    assert not r.guard.table.busy("job-a")
    assert r.engine.catalog.checkpoints() == [] and criu.dumps == []
    r.guard.loop.check_limits(set(), time.monotonic())  # (and it stays so)
    assert r.row("job-a").state == ENDED and criu.dumps == []


# -- the loop's thread, woken by the kernel's eventfd ----------------------------------------------------------------
def test_the_loop_thread_parks_a_job_that_reaches_its_limit(tmp_path: Path, criu: FakeCriu, procs: Procs) -> None:
    """Through Guard.start: the watcher thread's own steps (its sample alone would find the job at its limit: the
    next test is the one where only the watcher's event moves it)."""
    r = rig(tmp_path, criu, procs, poll_interval_s=0.05)
    r.guard.start()
    try:
        pid, cg = r.guarded()
        r.fs.reach_limit(cg)
        r.fs.notify(cg)  # (memory.oom_control's eventfd, as the kernel signals a task waiting at the limit)
        until(lambda: r.state("job-a") == PARKED, "the loop parked job-a")
        r.settle("job-a")
    finally:
        r.guard.stop()
    assert gone(pid) and r.fs.limit(cg) == LIMIT and r.watched() == set()
    job = r.engine.catalog.get_job("job-a")
    assert job is not None and job.ended
    r.checkpoints_settled()


def test_a_memory_pressure_level_event_below_the_limit_parks_the_job(tmp_path: Path, criu: FakeCriu,
                                                                     procs: Procs) -> None:
    """Below its limit (under_oom 0) only the watcher's event moves the loop: the eventfd is polled, acknowledged
    and names its job."""
    r = rig(tmp_path, criu, procs, poll_interval_s=0.05, pressure_level="critical")
    r.guard.start()
    try:
        pid, cg = r.guarded()
        assert r.fs.registration(cg)[2] == "critical"  # (the last registration: memory.pressure_level's)
        r.fs.use(cg, 40 * M)
        time.sleep(0.2)  # (the loop samples it a few times: below the limit, it is left alone)
        assert r.row("job-a").state == RUNNING and criu.dumps == []
        r.fs.notify(cg)
        until(lambda: r.state("job-a") == PARKED, "the loop parked job-a")
        r.settle("job-a")
    finally:
        r.guard.stop()
    g = r.row("job-a")
    assert g.reason.startswith("memory pressure in its cgroup (memory.pressure_level critical; usage 40 of 64"), g
    assert g.stats["at_limit_at_trigger"] is False
    assert gone(pid) and r.fs.limit(cg) == LIMIT and r.watched() == set()
    r.checkpoints_settled()


@dataclass
class _Labelled:
    counts: Counter[str]
    key: str

    def inc(self) -> None:
        self.counts[self.key] += 1


class Tally:
    """A labelled prometheus counter's stand-in: inc() counts by the label values."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def labels(self, **kw: str) -> _Labelled:
        return _Labelled(self.counts, ",".join(kw.values()))


class ObserveMetrics:
    """The metrics an observe-mode guard's loop touches (memsnap.metrics: guard_events, guard_parks)."""

    def __init__(self) -> None:
        self.guard_events = Tally()
        self.guard_parks = Tally()


def test_a_watcher_event_is_acknowledged_one_event_one_decision(tmp_path: Path, criu: FakeCriu,
                                                                 procs: Procs) -> None:
    """Observe mode through the loop thread: one memory.pressure_level event is one decision (its eventfd read
    back to zero), not one at every poll after it."""
    metrics = ObserveMetrics()
    r = rig(tmp_path, criu, procs, poll_interval_s=0.05, pressure_level="critical", mode="observe", metrics=metrics)
    r.guard.start()
    try:
        pid, cg = r.guarded()
        r.fs.use(cg, 40 * M)
        r.fs.notify(cg)
        until(lambda: r.guard.would_park == ["job-a"], "the loop saw the event")
        time.sleep(0.4)  # (some 8 polls more)
        assert metrics.guard_events.counts == {"limit": 1} and metrics.guard_parks.counts == {"observed": 1}
    finally:
        r.guard.stop()
    assert r.row("job-a").state == RUNNING and r.watched() == {"job-a"}
    assert r.engine.catalog.checkpoints() == [] and criu.dumps == [] and r.fs.limit(cg) == LIMIT
    runs(pid)
