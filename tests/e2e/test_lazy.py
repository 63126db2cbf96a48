"""Lazy restore with real CRIU over userfaultfd: resumes at once, same digest, ends up with every page."""

from __future__ import annotations

import json

import psutil

from tests.helpers import counter_argv, start_digest, ticks, wait_for


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
    # The lazy-pages server pushes the remaining pages in the background, then exits.
    wait_for(lambda: not _lazy_servers(str(daemon.tier)), 60, what="the lazy-pages server to finish")
    rss = psutil.Process(pid).memory_info().rss
    assert rss >= mib << 20, f"restored job has only {rss >> 20} MiB resident"
    n = len(ticks(job.log_path, pid))
    wait_for(lambda: len(ticks(job.log_path, pid)) > n + 5, 20, what="ticks after all pages arrived")
    assert all(t.digest == digest for t in ticks(job.log_path, pid))
