"""The engine's decisions about who may act on what, and which checkpoint or job a name means, and its
crash recovery of the catalog against the tier: a real Catalog and MemoryTier in temp dirs, no CRIU, no
daemon (fast; the target of scripts/mutation.sh)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from memsnap import recovery as recovery_module
from memsnap.catalog import Catalog, CheckpointRecord, JobRecord
from memsnap.engine import Caller, Engine, EngineConfig, scoped_name
from memsnap.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from memsnap.manifest import Manifest, StoredManifest
from memsnap.tier import MemoryTier

ROOT, ALICE, BOB = Caller(0), Caller(1000, 1000), Caller(1001, 1001)
STAGED, DRAINING, DURABLE, FAILED, DUMPING = "staged", "draining", "durable", "failed", "dumping"


@pytest.fixture
def eng(tmp_path: Path) -> Iterator[Engine]:
    cat = Catalog(tmp_path / "state")
    tier = MemoryTier(tmp_path / "tier")
    e = Engine(EngineConfig(state_dir=tmp_path / "state"), cat, tier, None, b"k" * 32)  # type: ignore[arg-type]
    yield e
    cat.close()


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["sleep", "300"])
    yield p
    p.kill()
    p.wait()


def _job(e: Engine, job_id: str, pid: int, owner: int, name: str = "", started: int = 1, ended: bool = False,
         pid_start: float = 0.0) -> JobRecord:
    j = JobRecord(id=job_id, pid=pid, owner_uid=owner, started_ms=started, name=name or job_id, ended=ended,
                  pid_start=pid_start)
    e.catalog.add_job(j)
    return j


def _ck(e: Engine, ck_id: str, owner: int, state: str = STAGED, job: str = "", name: str = "", created: int = 1,
        in_tier: bool = False, in_store: bool = False, pid: int = 999999, **meta: Any) -> CheckpointRecord:
    r = CheckpointRecord(id=ck_id, state=state, pid=pid, owner_uid=owner, created_ms=created, job=job, name=name,
                         in_tier=in_tier, in_store=in_store, meta=meta)
    e.catalog.add_checkpoint(r)
    return r


DEAD = 4194000  # above any pid this test machine hands out (pid_max is 4194304 at most)


# -- authorize_uid and scoped_name ------------------------------------------------------------------------
def test_root_and_the_owner_may_act_others_may_not(eng: Engine) -> None:
    eng.authorize_uid(ROOT, 1000, "x")
    eng.authorize_uid(ALICE, 1000, "x")
    with pytest.raises(PermissionDenied, match=r"^uid 1001 may not act on pid 5 owned by uid 1000; run as its"):
        eng.authorize_uid(BOB, 1000, "pid 5")
    with pytest.raises(PermissionDenied):
        eng.authorize_uid(ALICE, 0, "pid 1")


def test_scoped_name() -> None:
    assert scoped_name(ALICE, "train") == (1000, "train", False)
    assert scoped_name(ALICE, "1000:train") == (1000, "train", True)
    assert scoped_name(ROOT, "1001:train") == (1001, "train", True)
    with pytest.raises(PermissionDenied, match="uid 1000 may not name uid 1001's"):
        scoped_name(ALICE, "1001:train")
    assert scoped_name(ALICE, "x:train") == (1000, "x:train", False)
    assert scoped_name(ALICE, "12345678901:a") == (1000, "12345678901:a", False)
    assert scoped_name(ROOT, "1234567890:a") == (1234567890, "a", True)


# -- resolve_pid -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["", "   "])
def test_an_empty_target_is_refused(eng: Engine, target: str) -> None:
    with pytest.raises(InvalidArgument, match="^no target given"):
        eng.resolve_pid(target, ROOT)


@pytest.mark.parametrize("target", ["0", "4194305", "-5", "٣"])
def test_pids_out_of_range_are_invalid(eng: Engine, target: str) -> None:
    with pytest.raises(InvalidArgument, match="is not a valid PID"):
        eng.resolve_pid(target, ROOT)


def test_the_largest_pid_is_looked_up_not_refused(eng: Engine) -> None:
    with pytest.raises(NotFound, match="no process with pid 4194304"):
        eng.resolve_pid("4194304", ROOT)


@pytest.mark.parametrize("target,match", [("1", "system's init"), ("2", "kernel thread")])
def test_init_and_kernel_threads_are_refused(eng: Engine, target: str, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        eng.resolve_pid(target, ROOT)


def test_this_process_and_its_ancestors_are_refused(eng: Engine) -> None:
    import os

    for pid in (os.getpid(), os.getppid()):
        with pytest.raises(InvalidArgument):
            eng.resolve_pid(str(pid), ROOT)


def test_a_live_pid_resolves_with_its_job_if_managed(eng: Engine, sleeper: subprocess.Popen[bytes]) -> None:
    assert eng.resolve_pid(f" {sleeper.pid} ", ROOT) == (sleeper.pid, None)
    j = _job(eng, "job-1", sleeper.pid, 0, "sleepy")
    pid, job = eng.resolve_pid(str(sleeper.pid), ROOT)
    assert pid == sleeper.pid and job is not None and job.id == j.id


def test_a_job_id_resolves_only_while_it_runs(eng: Engine, sleeper: subprocess.Popen[bytes]) -> None:
    start = psutil.Process(sleeper.pid).create_time()
    _job(eng, "job-live", sleeper.pid, 1000, pid_start=start)
    assert eng.resolve_pid("job-live", ALICE)[0] == sleeper.pid
    _job(eng, "job-ended", sleeper.pid, 1000, ended=True)
    with pytest.raises(NotFound, match="job job-ended is not running"):
        eng.resolve_pid("job-ended", ALICE)
    _job(eng, "job-reused", sleeper.pid, 1000, pid_start=start - 100)  # the pid now belongs to another process
    with pytest.raises(NotFound, match="job job-reused is not running"):
        eng.resolve_pid("job-reused", ALICE)
    _job(eng, "job-gone", DEAD, 1000)
    with pytest.raises(NotFound):
        eng.resolve_pid("job-gone", ALICE)


def test_names_resolve_among_the_callers_own_jobs(eng: Engine, sleeper: subprocess.Popen[bytes]) -> None:
    _job(eng, "job-a", sleeper.pid, 1000, "train")
    assert eng.resolve_pid("train", ALICE)[1].id == "job-a"  # type: ignore[union-attr]
    with pytest.raises(InvalidArgument, match="is neither a PID nor a known job"):
        eng.resolve_pid("train", BOB)  # Bob's 'train' is not Alice's
    with pytest.raises(PermissionDenied):
        eng.resolve_pid("1000:train", BOB)
    with pytest.raises(InvalidArgument, match=r"root has no job named 'train'; uid 1000 has one: .* 1000:train"):
        eng.resolve_pid("train", ROOT)
    assert eng.resolve_pid("1000:train", ROOT)[1].id == "job-a"  # type: ignore[union-attr]
    assert eng.resolve_pid("1000:train", ALICE)[1].id == "job-a"  # type: ignore[union-attr]
    with pytest.raises(InvalidArgument, match="is neither a PID nor a known job"):
        eng.resolve_pid("1001:train", ROOT)  # explicit: no hint about other owners


def test_a_name_means_the_running_job_then_the_newest(eng: Engine, sleeper: subprocess.Popen[bytes]) -> None:
    _job(eng, "job-old", sleeper.pid, 1000, "train", started=1)
    _job(eng, "job-new-ended", DEAD, 1000, "train", started=5, ended=True)
    assert eng._job_by_name(ALICE, "train").id == "job-old"  # the running one, though older
    _job(eng, "job-newer", sleeper.pid, 1000, "train", started=3)
    assert eng._job_by_name(ALICE, "train").id == "job-newer"  # of the running ones, the newest
    _job(eng, "job-x", DEAD, 1001, "eval", started=1, ended=True)
    _job(eng, "job-y", DEAD, 1001, "eval", started=2, ended=True)
    assert eng._job_by_name(BOB, "eval").id == "job-y"  # none runs: the newest
    _job(eng, "job-b", DEAD, 1001, "same", started=2, ended=True)
    _job(eng, "job-c", DEAD, 1001, "same", started=2, ended=True)
    assert eng._job_by_name(BOB, "same").id == "job-c"  # a tie on time: the larger id


# -- latest_restorable --------------------------------------------------------------------------------------
def test_a_checkpoint_id_is_the_owners_or_roots(eng: Engine) -> None:
    _ck(eng, "ck-a", 1000)
    assert eng.latest_restorable(ALICE, "ck-a").id == "ck-a"
    assert eng.latest_restorable(ROOT, "ck-a").id == "ck-a"
    with pytest.raises(PermissionDenied, match="checkpoint ck-a"):
        eng.latest_restorable(BOB, "ck-a")


def test_a_job_id_means_its_newest_restorable_checkpoint(eng: Engine) -> None:
    _job(eng, "job-a", DEAD, 1000, "train", ended=True)
    _ck(eng, "ck-1", 1000, job="job-a", created=1)
    _ck(eng, "ck-2", 1000, job="job-a", created=3, state=DURABLE)
    _ck(eng, "ck-3", 1000, job="job-a", created=5, state=FAILED)
    _ck(eng, "ck-4", 1000, job="job-a", created=4, state=DUMPING)
    _ck(eng, "ck-5", 1001, job="job-a", created=9)  # another owner's row naming the job: never chosen
    assert eng.latest_restorable(ALICE, "job-a").id == "ck-2"
    with pytest.raises(PermissionDenied, match="job job-a"):
        eng.latest_restorable(BOB, "job-a")


def test_restorable_states_are_staged_draining_durable(eng: Engine) -> None:
    for i, state in enumerate((STAGED, DRAINING, DURABLE)):
        _ck(eng, f"ck-{state}", 1000, state=state, name=f"n{i}")
        assert eng.latest_restorable(ALICE, f"n{i}").id == f"ck-{state}"
    for i, state in enumerate((FAILED, DUMPING)):
        _ck(eng, f"ck-{state}", 1000, state=state, name=f"m{i}")
        with pytest.raises(NotFound):
            eng.latest_restorable(ALICE, f"m{i}")


def test_a_name_means_the_callers_newest_checkpoint_of_that_name(eng: Engine) -> None:
    _ck(eng, "ck-a1", 1000, name="train", created=1)
    _ck(eng, "ck-a2", 1000, name="train", created=2)
    _ck(eng, "ck-b", 1001, name="train", created=9)
    _ck(eng, "ck-a3", 1000, name="train", created=2)
    assert eng.latest_restorable(ALICE, "train").id == "ck-a3"  # a tie on time: the larger id
    assert eng.latest_restorable(BOB, "train").id == "ck-b"
    assert eng.latest_restorable(ROOT, "1001:train").id == "ck-b"
    with pytest.raises(PermissionDenied):
        eng.latest_restorable(ALICE, "1001:train")
    with pytest.raises(InvalidArgument, match=r"root has no checkpoint named 'train'; uid 1000, 1001 has"):
        eng.latest_restorable(ROOT, "train")
    with pytest.raises(NotFound, match="no checkpoint 'nothing'"):
        eng.latest_restorable(ALICE, "nothing")
    with pytest.raises(NotFound):
        eng.latest_restorable(ROOT, "0:train")  # explicit: root's own, none


def test_a_name_also_finds_checkpoints_of_jobs_of_that_name(eng: Engine) -> None:
    _job(eng, "job-a", DEAD, 1000, "train", ended=True)
    _ck(eng, "ck-1", 1000, job="job-a", name="", created=1)
    assert eng.latest_restorable(ALICE, "train").id == "ck-1"
    _job(eng, "job-b", DEAD, 1001, "train", ended=True)
    _ck(eng, "ck-2", 1001, job="job-b", created=5)
    assert eng.latest_restorable(ALICE, "train").id == "ck-1"


class _Store:
    """A repository whose find() gives these signed manifests (their storage left out: nothing is fetched)."""

    def __init__(self, manifests: list[dict[str, Any]]) -> None:
        self.manifests = [StoredManifest(Manifest.from_dict(m), {}, m) for m in manifests]
        self.asked: list[str] = []

    def find(self, name: str) -> list[StoredManifest]:
        self.asked.append(name)
        return self.manifests

    def enqueue(self, ckpt_id: str) -> None:
        pass


def test_the_store_is_searched_by_name_and_owner_only_when_the_catalog_has_none(eng: Engine) -> None:
    m = {"id": "ck-s", "name": "train", "uid": 1000, "job": "job-z", "files": {"a": {"size": 3}}, "pid": 5,
         "created_ms": 7}
    store = _Store([{**m, "id": "ck-other", "uid": 1001}, m])
    eng.repo = store  # type: ignore[assignment]
    assert eng.latest_restorable(ALICE, "train").id == "ck-s"
    rec = eng.catalog.get_checkpoint("ck-s")
    assert rec is not None and rec.owner_uid == 1000 and rec.in_store and not rec.in_tier
    assert eng.catalog.get_checkpoint("ck-other") is None  # another owner's: not adopted
    store.asked.clear()
    assert eng.latest_restorable(ALICE, "train").id == "ck-s"
    assert store.asked == []  # cataloged now: the store is not asked again
    with pytest.raises(NotFound):
        eng.latest_restorable(BOB, "eval")


def test_a_stored_manifest_naming_another_job_is_not_adopted(eng: Engine) -> None:
    eng.repo = _Store([{"id": "ck-s", "name": "other", "uid": 1000, "job": "j", "files": {}, "pid": 5}])  # type: ignore
    with pytest.raises(NotFound):
        eng.latest_restorable(ALICE, "train")
    assert eng.catalog.get_checkpoint("ck-s") is None


# -- recover -------------------------------------------------------------------------------------------------
def _publish(e: Engine, ck_id: str) -> None:
    s = e.tier.new_staging(ck_id)
    (s / "pages-1.img").write_bytes(b"x" * 10)
    (s / "manifest.json").write_text("{}")
    e.tier.publish(s, ck_id)


def test_recover_rolls_back_dumps_and_removes_strays(eng: Engine) -> None:
    _ck(eng, "ck-dumping", 1000, state=DUMPING, pid=DEAD)
    eng.tier.new_staging("ck-dumping")
    eng.tier.new_staging("ck-orphan")
    _publish(eng, "ck-unknown")  # a tier dir no row knows
    _ck(eng, "ck-evicted", 1000, state=DURABLE, in_tier=False, in_store=True)
    _publish(eng, "ck-evicted")  # a row that says it is not in the tier
    _ck(eng, "ck-kept", 1000, state=STAGED, in_tier=True)
    _publish(eng, "ck-kept")
    fixed = eng.recover()
    assert fixed == {"failed_dumps": 1, "stray_staging": 1, "stray_tier": 2, "lost_tier": 0}
    rec = eng.catalog.get_checkpoint("ck-dumping")
    assert rec is not None and rec.state == FAILED and "daemon stopped during the dump" in rec.last_error
    assert list(eng.tier.staging_ids()) == []
    assert sorted(eng.tier.published_ids()) == ["ck-kept"]
    assert eng.catalog.get_checkpoint("ck-evicted").state == DURABLE  # type: ignore[union-attr]


def test_a_tier_emptied_by_a_reboot_keeps_durable_copies_and_fails_the_rest(eng: Engine) -> None:
    _ck(eng, "ck-durable", 1000, state=DURABLE, in_tier=True, in_store=True)
    _ck(eng, "ck-staged", 1000, state=STAGED, in_tier=True)
    _ck(eng, "ck-draining", 1000, state=DRAINING, in_tier=True)
    _ck(eng, "ck-here", 1000, state=STAGED, in_tier=True)
    _publish(eng, "ck-here")
    fixed = eng.recover()
    assert fixed["lost_tier"] == 3 and fixed["stray_tier"] == 0
    durable = eng.catalog.get_checkpoint("ck-durable")
    assert durable is not None and durable.state == DURABLE and not durable.in_tier and durable.in_store
    for ck in ("ck-staged", "ck-draining"):
        r = eng.catalog.get_checkpoint(ck)
        assert r is not None and r.state == FAILED and not r.in_tier
        assert r.last_error == "tier copy lost before it became durable"
    here = eng.catalog.get_checkpoint("ck-here")
    assert here is not None and here.state == STAGED and here.in_tier
    assert eng.recover() == {"failed_dumps": 0, "stray_staging": 0, "stray_tier": 0, "lost_tier": 0}


def test_recover_ends_jobs_that_no_longer_run(eng: Engine, sleeper: subprocess.Popen[bytes]) -> None:
    _job(eng, "job-gone", DEAD, 1000)
    _job(eng, "job-live", sleeper.pid, 1000, pid_start=psutil.Process(sleeper.pid).create_time())
    eng.recover()
    assert eng.catalog.get_job("job-gone").ended  # type: ignore[union-attr]
    assert not eng.catalog.get_job("job-live").ended  # type: ignore[union-attr]


def test_recover_completes_a_published_stop_checkpoint(eng: Engine, sleeper: subprocess.Popen[bytes]) -> None:
    start = psutil.Process(sleeper.pid).create_time()
    _job(eng, "job-s", sleeper.pid, 1000, pid_start=start)
    _ck(eng, "ck-s", 1000, state=STAGED, job="job-s", in_tier=True, pid=sleeper.pid, stop=True, pid_start=start)
    _publish(eng, "ck-s")
    eng.recover()
    assert sleeper.wait(10) != 0  # killed: the image was published, so the stop is completed
    assert eng.catalog.get_job("job-s").ended  # type: ignore[union-attr]


def test_recover_resumes_a_job_a_stop_dump_left_frozen(eng: Engine, sleeper: subprocess.Popen[bytes],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    start = psutil.Process(sleeper.pid).create_time()
    _ck(eng, "ck-d", 1000, state=DUMPING, pid=sleeper.pid, stop=True, pid_start=start)
    sleeper.send_signal(signal.SIGSTOP)
    psutil.Process(sleeper.pid).status()
    monkeypatch.setattr(recovery_module, "_wait_untraced", lambda pid, timeout: None)
    eng.recover()
    assert psutil.Process(sleeper.pid).status() != psutil.STATUS_STOPPED
    assert sleeper.poll() is None  # resumed, not killed


def test_an_id_with_a_slash_is_never_looked_up(eng: Engine) -> None:
    for bad in ("", "../ck", "a/b", ".hidden"):
        with pytest.raises(InvalidArgument):
            eng.get(ROOT, bad)
    with pytest.raises(NotFound):
        eng.get(ROOT, "ck-none")
    _ck(eng, "ck-a", 1000)
    with pytest.raises(PermissionDenied):
        eng.get(BOB, "ck-a")
    assert eng.get(ALICE, "ck-a").id == "ck-a"


def test_a_second_live_job_of_the_same_name_is_refused(eng: Engine, sleeper: subprocess.Popen[bytes]) -> None:
    _job(eng, "job-a", sleeper.pid, 1000, "train")
    with pytest.raises(FailedPrecondition, match="uid 1000 already runs a job named 'train'"):
        eng.jobtable._refuse_live_duplicate(1000, "train")
    eng.jobtable._refuse_live_duplicate(1001, "train")
    _job(eng, "job-b", DEAD, 1000, "eval")
    eng.jobtable._refuse_live_duplicate(1000, "eval")


# -- eviction: least recently used durable tier copies first, never the last copy --------------------------
MiB = 1 << 20


@pytest.fixture
def small(tmp_path: Path) -> Iterator[Engine]:
    cat = Catalog(tmp_path / "state")
    tier = MemoryTier(tmp_path / "tier", capacity_bytes=4 * MiB)
    e = Engine(EngineConfig(state_dir=tmp_path / "state"), cat, tier, None, b"k" * 32)  # type: ignore[arg-type]
    yield e
    cat.close()


def _copy(e: Engine, ck_id: str, last_used: int, created: int = 1, state: str = DURABLE, in_store: bool = True) -> None:
    s = e.tier.new_staging(ck_id)
    (s / "pages-1.img").write_bytes(b"x" * MiB)
    (s / "manifest.json").write_text("{}")
    e.tier.publish(s, ck_id)
    r = CheckpointRecord(id=ck_id, state=state, pid=DEAD, owner_uid=1000, created_ms=created, in_tier=True,
                         in_store=in_store, size_bytes=MiB, last_used_ms=last_used)
    e.catalog.add_checkpoint(r)


def _in_tier(e: Engine) -> list[str]:
    return sorted(r.id for r in e.catalog.checkpoints() if r.in_tier)


def test_eviction_takes_the_least_recently_used_durable_copy_first(small: Engine) -> None:
    _copy(small, "ck-a", last_used=300)
    _copy(small, "ck-b", last_used=100)
    _copy(small, "ck-c", last_used=0, created=200)  # never used: its creation time counts
    small.reserve(2 * MiB - 64 * 1024).release()
    assert _in_tier(small) == ["ck-a", "ck-c"] and small.tier.published_ids() == ["ck-a", "ck-c"]
    small.reserve(3 * MiB - 64 * 1024).release()
    assert _in_tier(small) == ["ck-a"]
    for ck in ("ck-b", "ck-c"):
        r = small.catalog.get_checkpoint(ck)
        assert r is not None and r.state == DURABLE and r.in_store  # the stored copy stays restorable


def test_eviction_never_drops_a_copy_that_is_not_durable_in_the_store(small: Engine) -> None:
    from memsnap.errors import TierExhausted

    _copy(small, "ck-staged", last_used=1, state=STAGED, in_store=False)
    _copy(small, "ck-lost", last_used=2, state=DURABLE, in_store=False)  # durable, but its store copy is gone
    _copy(small, "ck-ok", last_used=3)
    with pytest.raises(TierExhausted):
        small.reserve(3 * MiB)  # room only by dropping a last copy: nothing is evicted
    assert _in_tier(small) == ["ck-lost", "ck-ok", "ck-staged"]
    small.reserve(2 * MiB - 64 * 1024).release()
    assert _in_tier(small) == ["ck-lost", "ck-staged"]


def test_a_copy_in_use_is_skipped_not_waited_for(small: Engine) -> None:
    import threading

    _copy(small, "ck-old", last_used=1)
    _copy(small, "ck-new", last_used=2)
    held = threading.Event()
    done = threading.Event()

    def hold() -> None:
        with small.checkpoint_lock("ck-old"):
            held.set()
            done.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        small.reserve(3 * MiB - 64 * 1024).release()
        assert _in_tier(small) == ["ck-old"]
    finally:
        done.set()
        t.join()


def test_a_job_id_is_looked_up_as_an_id_not_as_a_name(eng: Engine, sleeper: subprocess.Popen[bytes]) -> None:
    _job(eng, "job-7f3a", sleeper.pid, 1000, "trainer")
    assert eng.resolve_pid("job-7f3a", ALICE)[1].id == "job-7f3a"  # type: ignore[union-attr]


def test_a_job_whose_pid_is_init_is_refused(eng: Engine) -> None:
    _job(eng, "job-init", 1, 0, "init")
    with pytest.raises(InvalidArgument, match="system's init"):
        eng.resolve_pid("job-init", ROOT)


def test_a_name_never_means_a_dead_or_reused_pid_as_running(eng: Engine, sleeper: subprocess.Popen[bytes]) -> None:
    start = psutil.Process(sleeper.pid).create_time()
    _job(eng, "job-real", sleeper.pid, 1000, "train", started=1, pid_start=start)
    _job(eng, "job-stale", DEAD, 1000, "train", started=8)  # not marked ended, but its process is gone
    _job(eng, "job-reused", sleeper.pid, 1000, "train", started=9, pid_start=start - 100)  # pid now another's
    assert eng._job_by_name(ALICE, "train").id == "job-real"


def test_root_gets_the_uid_hint_only_for_a_name_others_have(eng: Engine) -> None:
    _ck(eng, "ck-t", 1000, name="train")
    with pytest.raises(NotFound):
        eng.latest_restorable(ROOT, "nothing")
    _job(eng, "job-r", DEAD, 0, "train", ended=True)  # root's own job of that name: asked by its id
    with pytest.raises(NotFound):
        eng.latest_restorable(ROOT, "job-r")
