"""Lazy restore with real CRIU over userfaultfd: resumes at once, same digest, ends up with every page."""

from __future__ import annotations

import json
import time

import psutil
import pytest

from memsnap.proc import tree_rss
from tests.helpers import counter_argv, restore_refused, start_digest, ticks, wait_for


def _lazy_servers(tier: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "lazy-pages" in cmd and any(tier in a for a in cmd):
            out.append(p)
    return out


def test_lazy_restore_resumes_with_same_digest_and_gets_all_pages(daemon, jobs_to_kill):
    mib = 128
    with daemon.client() as c:
        job = c.run(counter_argv(mib, 0.1, "--digest-every", "5"))
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: len(ticks(job.log_path)) >= 2, 30, what="the job to tick")
    digest = start_digest(job.log_path)
    ck = json.loads(daemon.ctl("--json", "checkpoint", job.id, "--stop", check=True).stdout)
    last = ticks(job.log_path, int(job.pid))[-1].n

    r = json.loads(daemon.ctl("--json", "restore", "--lazy", ck["id"], check=True).stdout)
    pid = r["pid"]
    jobs_to_kill.append(pid)
    wait_for(lambda: len(ticks(job.log_path, pid)) >= 6, 30, what="the lazily restored job to tick")
    got = ticks(job.log_path, pid)
    assert got[0].n == last + 1
    assert all(t.digest == digest for t in got), "memory differs after a lazy restore"
    assert any(t.fresh for t in got)  # computed from the restored memory, not only carried over
    # The lazy-pages server pushes the remaining pages in the background, then exits.
    wait_for(lambda: not _lazy_servers(str(daemon.tier)), 60, what="the lazy-pages server to finish")
    rss = tree_rss(pid)  # the job runs under its init (memsnap.jobinit)
    assert rss >= mib << 20, f"restored job has only {rss >> 20} MiB resident"
    n = len(ticks(job.log_path, pid))
    wait_for(lambda: len(ticks(job.log_path, pid)) > n + 5, 20, what="ticks after all pages arrived")
    assert all(t.digest == digest for t in ticks(job.log_path, pid))
    assert any(t.fresh for t in ticks(job.log_path, pid)[n:])


def test_a_small_lazy_restore_whose_pages_all_arrived_before_criu_returned(make_daemon, jobs_to_kill):
    # A small job's lazy-pages can push every page and exit before CRIU's restore call returns; the
    # daemon's reaper (every second) then used to remove the restore's work dir under it, and the restore
    # failed after the job already ran, unrecorded (seen in CI as a move that failed and left a copy).
    # slow-restore-bookkeeping holds the restore 2.5 s right there, so the reaper surely ticks.
    d = make_daemon(env={"MEMSNAP_FAILPOINTS": "slow-restore-bookkeeping"}).start()
    with d.client() as c:
        job = c.run(counter_argv(8, 0.1, "--digest-every", "5"))
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: len(ticks(job.log_path)) >= 2, 30, what="the job to tick")
    digest = start_digest(job.log_path)
    ck = json.loads(d.ctl("--json", "checkpoint", job.id, "--stop", check=True).stdout)

    r = d.ctl("--json", "restore", "--lazy", ck["id"])
    assert r.returncode == 0, r.stderr + d.log.read_text()[-3000:]
    pid = json.loads(r.stdout)["pid"]
    jobs_to_kill.append(pid)
    wait_for(lambda: len(ticks(job.log_path, pid)) >= 6, 30, what="the lazily restored job to tick")
    assert all(t.digest == digest for t in ticks(job.log_path, pid))
    assert any(t.fresh for t in ticks(job.log_path, pid))
    with d.client() as c:
        assert [j for j in c.jobs() if j.running and int(j.pid) == pid], "the restored job is not recorded"


@pytest.mark.parametrize("lazy", [False, True], ids=["plain", "lazy"])
def test_a_restore_that_fails_after_criu_returned_leaves_no_copy_running(lazy, make_daemon, jobs_to_kill):
    # Anything that fails once CRIU has put the tree back (GPU state, the catalog write: here a failpoint)
    # fails the restore, and the restored tree is killed: it must not run on, unrecorded.
    d = make_daemon(env={"MEMSNAP_FAILPOINTS": "record-restored-fails"}).start()
    with d.client() as c:
        job = c.run(counter_argv(8, 0.1, "--digest-every", "5"))
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: len(ticks(job.log_path)) >= 2, 30, what="the job to tick")
    ck = json.loads(d.ctl("--json", "checkpoint", job.id, "--stop", check=True).stdout)

    r = restore_refused(d, ck["id"], jobs_to_kill, *(["--lazy"] if lazy else []))
    assert r.returncode != 0 and "catalog could not be written" in r.stderr, r.stderr
    time.sleep(1.0)
    n = len(ticks(job.log_path))
    time.sleep(1.0)
    assert len(ticks(job.log_path)) == n, "a restored copy runs on after the restore failed"
    with d.client() as c:
        assert not [j for j in c.jobs() if j.running]
