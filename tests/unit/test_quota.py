"""memsnap.quota over a real catalog and a fake engine: the limits a uid gets, usage from the catalog, and
admissions that refuse before any work starts.

The checkpoint quotas of a user other than root are tested here, with a fake engine: CRIU on the test VM cannot
dump another uid's processes (root lacks CAP_SYS_RESOURCE there), so tests/e2e/test_quota.py limits root's
checkpoints and a user's jobs for real instead.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from memsnap.catalog import Catalog, CheckpointRecord, JobRecord, now_ms
from memsnap.config import ConfigError, QuotaConfig, UidQuota, load_config
from memsnap.engine import ROOT, Caller
from memsnap.errors import QuotaExceeded
from memsnap.quota import Quotas, Usage

M = 1 << 20


class FakeEngine:
    """What Quotas asks of the engine: every pid is the root of a job of its uid, pid // 1000."""

    def __init__(self, tmp: Path) -> None:
        self.catalog = Catalog(tmp)
        self.estimate = 10 * M
        self.evicted: list[str] = []
        self.resolved: list[str] = []

    def resolve_pid(self, target: str, caller: Caller = ROOT) -> tuple[int, JobRecord | None]:
        self.resolved.append(target)
        pid = int(target)
        return pid, JobRecord(id=f"job-{pid}", pid=pid, owner_uid=pid // 1000, started_ms=0)

    def dump_estimate(self, pid: int) -> int:
        return self.estimate

    def latest_restorable(self, caller: Caller, key: str) -> CheckpointRecord:
        rec = self.catalog.get_checkpoint(key)
        assert rec is not None
        return rec

    def evict(self, caller: Caller, ckpt_id: str) -> CheckpointRecord:
        self.catalog.update_checkpoint(ckpt_id, in_tier=False)
        self.evicted.append(ckpt_id)
        rec = self.catalog.get_checkpoint(ckpt_id)
        assert rec is not None
        return rec

    def tier_copy_in_use(self, ckpt_id: str) -> bool:
        return False


def ckpt(e: FakeEngine, ckpt_id: str, uid: int, state: str = "durable", size: int = 10 * M, in_tier: bool = True,
         stored: int = 0, age_ms: int = 0) -> None:
    e.catalog.add_checkpoint(CheckpointRecord(id=ckpt_id, state=state, pid=1, owner_uid=uid,
                                              created_ms=now_ms() - age_ms, size_bytes=size, in_tier=in_tier,
                                              in_store=state == "durable", stored_bytes=stored))


def quotas(tmp: Path, default: QuotaConfig | None = None, **uids: dict[str, int | None]) -> Quotas:
    own = tuple(UidQuota(int(u.removeprefix("u")), tuple(v.items())) for u, v in uids.items())
    return Quotas(default or QuotaConfig(), own, FakeEngine(tmp), running=lambda j: True)


def test_the_default_applies_to_every_uid_but_root_and_a_uid_table_wins_key_by_key(tmp_path):
    q = quotas(tmp_path, QuotaConfig(jobs=2, checkpoints=5), u1000={"jobs": 8}, u1001={"jobs": None},
               u0={"checkpoints": 1})
    assert {r: (lim.value, lim.key) for r, lim in q.limits(1000).items()} == \
        {"jobs": (8, "quota.uid.1000.jobs"), "checkpoints": (5, "quota.checkpoints")}
    assert set(q.limits(1001)) == {"checkpoints"}  # "" in its table: no jobs limit for it
    assert {r: lim.value for r, lim in q.limits(4242).items()} == {"jobs": 2, "checkpoints": 5}
    assert {r: lim.key for r, lim in q.limits(0).items()} == {"checkpoints": "quota.uid.0.checkpoints"}
    assert quotas(tmp_path / "x", QuotaConfig(jobs=2)).limits(0) == {}


def test_quota_tables_load_and_bad_ones_are_refused_with_the_key(tmp_path):
    cfg = tmp_path / "q.toml"
    cfg.write_text('[quota]\njobs = 2\ntier_bytes = "1G"\n[quota.uid.1000]\njobs = ""\ncheckpoints = 3\n')
    c = load_config(str(cfg))
    assert c.quota == QuotaConfig(tier_bytes=1 << 30, jobs=2)
    assert c.quota_uids == (UidQuota(1000, (("jobs", None), ("checkpoints", 3))),)
    for bad, says in (('[quota.uid.alice]\njobs = 1\n', "quota.uid.alice: expected a numeric uid"),
                      ('[quota.uid.1000]\nmemory = 1\n', "quota.uid.1000.memory: unknown key"),
                      ('[quota.uid.1000]\njobs = -1\n', "quota.uid.1000.jobs: expected"),
                      ('[quota]\nstore_bytes = "lots"\n', "quota.store_bytes: expected")):
        cfg.write_text(bad)
        with pytest.raises(ConfigError, match=says):
            load_config(str(cfg))


def test_a_users_checkpoints_stop_at_its_quota_before_anything_runs_and_others_go_through(tmp_path):
    q = quotas(tmp_path, QuotaConfig(checkpoints=2))
    e = q.host
    ckpt(e, "a", 1000)  # type: ignore[arg-type]
    ckpt(e, "b", 1000, state="staged")  # type: ignore[arg-type]
    ckpt(e, "c", 1000, state="failed")  # type: ignore[arg-type]  (not restorable: not counted)
    ran = []
    with pytest.raises(QuotaExceeded) as refused:
        with q.admit_checkpoint(Caller(1000), "1000123"):
            ran.append("dump")
    assert ran == [] and refused.value.code == "RESOURCE_EXHAUSTED"
    assert str(refused.value) == ("uid 1000 has 2 of 2 checkpoints (quota.checkpoints): delete one "
                                  "('memsnapctl delete ID' or 'memsnapctl gc') or ask the administrator for more")
    with q.admit_checkpoint(Caller(1001), "1001123"):  # another user
        ran.append("theirs")
    with q.admit_checkpoint(ROOT, "77"):  # root's own (no limit of its own)
        ran.append("root's")
    with q.admit_checkpoint(ROOT, "1000123"):  # root on the user's job: not the user's request
        ran.append("root on the user's job")
    assert ran == ["theirs", "root's", "root on the user's job"]


def test_requests_in_flight_count_so_two_at_once_cannot_both_pass(tmp_path):
    q = quotas(tmp_path, QuotaConfig(jobs=1))
    inside, release = threading.Event(), threading.Event()

    def first() -> None:
        with q.admit_job(Caller(1000)):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(10)
    try:
        with pytest.raises(QuotaExceeded, match=r"uid 1000 runs 1 of 1 jobs \(quota.jobs\): stop one"):
            with q.admit_job(Caller(1000)):
                pass
    finally:
        release.set()
        t.join()
    with q.admit_job(Caller(1000)):  # the first one is gone (and left no job behind)
        pass
    e = q.host
    e.catalog.add_job(JobRecord(id="j", pid=5, owner_uid=1000, started_ms=0))  # type: ignore[attr-defined]
    with pytest.raises(QuotaExceeded):
        with q.admit_job(Caller(1000)):
            pass


def test_the_tier_quota_evicts_the_users_own_durable_copies_first_and_refuses_when_that_cannot_help(tmp_path):
    q = quotas(tmp_path, u1000={"tier_bytes": 35 * M})
    e = q.host
    ckpt(e, "old", 1000, age_ms=3000)  # type: ignore[arg-type]
    ckpt(e, "new", 1000, age_ms=1000)  # type: ignore[arg-type]
    ckpt(e, "drains", 1000, state="draining")  # type: ignore[arg-type]  (not evictable)
    ckpt(e, "theirs", 1001, age_ms=5000)  # type: ignore[arg-type]  (another uid's: never evicted for 1000)
    with q.admit_checkpoint(Caller(1000), "1000123"):  # 30 MiB + 10 MiB > 35: the oldest durable copy goes
        pass
    assert e.evicted == ["old"]  # type: ignore[attr-defined]
    e.estimate = 30 * M  # type: ignore[attr-defined]
    with pytest.raises(QuotaExceeded) as refused:  # 20 + 30 > 35 even after evicting "new": nothing goes
        with q.admit_checkpoint(Caller(1000), "1000123"):
            pass
    assert e.evicted == ["old"]  # type: ignore[attr-defined]
    assert str(refused.value).startswith("uid 1000 has 20.0 MiB of 35.0 MiB in the memory tier "
                                         "(quota.uid.1000.tier_bytes) and this needs about 30.0 MiB more: delete")
    e.estimate = 40 * M  # type: ignore[attr-defined]
    with pytest.raises(QuotaExceeded, match="more than the whole quota: ask the administrator"):
        with q.admit_checkpoint(Caller(1000), "1000123"):
            pass


def test_a_user_at_its_store_quota_may_not_start_a_checkpoint(tmp_path):
    q = quotas(tmp_path, QuotaConfig(store_bytes=8 * M))
    ckpt(q.host, "a", 1000, stored=5 * M)  # type: ignore[arg-type]
    with q.admit_checkpoint(Caller(1000), "1000123"):
        pass
    ckpt(q.host, "b", 1000, stored=3 * M)  # type: ignore[arg-type]
    with pytest.raises(QuotaExceeded, match=r"uid 1000 has 8.0 MiB of 8.0 MiB in the store \(quota.store_bytes\)"):
        with q.admit_checkpoint(Caller(1000), "1000123"):
            pass


def test_a_restore_counts_a_job_and_a_fetch_into_the_tier(tmp_path):
    q = quotas(tmp_path, QuotaConfig(tier_bytes=15 * M, jobs=1))
    e = q.host
    ckpt(e, "tiered", 1000, state="staged")  # type: ignore[arg-type]  (not evictable: not in the store yet)
    ckpt(e, "stored", 1000, in_tier=False)  # type: ignore[arg-type]
    with q.admit_restore(Caller(1000), "tiered"):  # a tier copy: nothing more in the tier
        pass
    with pytest.raises(QuotaExceeded, match="needs about 10.0 MiB more"):  # the fetch: 10 + 10 > 15
        with q.admit_restore(Caller(1000), "stored"):
            pass
    with q.admit_restore(Caller(1000), "stored", lazy=True):  # pages in from the store
        pass
    e.catalog.add_job(JobRecord(id="j", pid=5, owner_uid=1000, started_ms=0))
    with pytest.raises(QuotaExceeded, match="runs 1 of 1 jobs"):
        with q.admit_restore(Caller(1000), "tiered"):
            pass


def test_no_limit_for_the_caller_means_no_lookup_at_all(tmp_path):
    q = quotas(tmp_path, u1000={"jobs": 1})
    with q.admit_checkpoint(Caller(1001), "1001123"):
        pass
    assert q.host.resolved == []  # type: ignore[attr-defined]


def test_root_sees_every_uids_usage_and_a_user_its_own(tmp_path):
    q = quotas(tmp_path, QuotaConfig(jobs=3), u1002={"checkpoints": 1})
    ckpt(q.host, "a", 1000, stored=M)  # type: ignore[arg-type]
    q.host.catalog.add_job(JobRecord(id="j", pid=5, owner_uid=1001, started_ms=0))  # type: ignore[attr-defined]
    rows = {u: (used, set(lim)) for u, used, lim in q.report(ROOT)}
    assert set(rows) == {0, 1000, 1001, 1002}
    assert rows[1000][0] == Usage(tier_bytes=10 * M, store_bytes=M, checkpoints=1) and rows[1000][1] == {"jobs"}
    assert rows[1001][0].jobs == 1 and rows[0] == (Usage(), set())
    assert [(u, used) for u, used, _ in q.report(Caller(1001))] == [(1001, Usage(jobs=1))]
