"""Lazy restore from the store (memsnap.pageserver): the tier copy is gone, the job resumes while its pages
are still in the store, and a store that fails mid-way gets the job killed, with the reason in `show`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psutil
import pytest

from memsnap.proc import tree_rss
from tests.helpers import (
    DaemonProc,
    counter_argv,
    flip_stored_chunk_byte,
    job_output,
    metrics_port,
    resident_pages,
    restore_refused,
    sample,
    scrape_metrics,
    start_digest,
    ticks,
    wait_for,
)


def _durable_then_evicted(d: DaemonProc, jobs_to_kill: list[int], mib: int) -> tuple[dict, str, str, int]:
    with d.client() as c:
        job = c.run(counter_argv(mib, 0.1, "--digest-every", "5"))
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: len(ticks(job.log_path)) >= 2, 30, what="the job to tick")
    digest = start_digest(job.log_path)
    ck = json.loads(d.ctl("--json", "checkpoint", job.id, "--stop", "--wait", "durable", check=True).stdout)
    assert ck["state"] == "durable"
    last = ticks(job.log_path, int(job.pid))[-1].n
    d.ctl("evict", ck["id"], check=True)
    return ck, job.log_path, digest, last


def _lazy_pages_running(d: DaemonProc) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "lazy-pages" in cmd and any(str(d.state) in a for a in cmd):
            out.append(p)
    return out


def _s3_daemon(make_daemon, s3_server, name: str, env: dict[str, str] | None = None) -> DaemonProc:
    url = f"s3://{s3_server.bucket}/{name}"
    env = {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
           "AWS_DEFAULT_REGION": s3_server.region, **(env or {})}
    return make_daemon(name, extra=["--store-url", url, "--s3-endpoint", s3_server.endpoint_url,
                                    "--s3-region", s3_server.region], env=env).start()


@pytest.mark.parametrize("backend", ["posix", "s3", "posix-whole-files"])
def test_lazy_restore_from_the_store_after_evict_has_the_same_digest(backend, make_daemon, jobs_to_kill,
                                                                   request):
    # posix-whole-files: the old store format (one object per file), whose hash is known only at its end: it is
    # fetched whole and verified into the tier first, then restored lazily from there (never served unverified).
    if backend == "s3":
        d = _s3_daemon(make_daemon, request.getfixturevalue("s3_server"), "lazystore")
    else:
        d = make_daemon(backend, extra=["--store-format", "whole"] if backend.endswith("whole-files") else []).start()
    mib = 64
    ck, log, digest, last = _durable_then_evicted(d, jobs_to_kill, mib)
    packs = _cached_packs(d) if backend == "posix" else []

    r = d.ctl("--json", "restore", "--lazy", ck["id"])
    assert r.returncode == 0, r.stderr + d.log.read_text()[-3000:]
    res = json.loads(r.stdout)
    pid = res["pid"]
    jobs_to_kill.append(pid)
    assert res["from_store"] is True
    wait_for(lambda: len(ticks(log, pid)) >= 6, 60, what="the lazily restored job to tick")
    got = ticks(log, pid)
    assert got[0].n == last + 1
    assert all(t.digest == digest for t in got), "memory differs after a lazy restore from the store"
    assert any(t.fresh for t in got)  # computed from the restored memory
    # The pages follow from the store; lazy-pages exits once all of them are in place.
    wait_for(lambda: not _lazy_pages_running(d), 120, what="every page to arrive")
    assert tree_rss(pid) >= mib << 20
    n = len(ticks(log, pid))
    wait_for(lambda: len(ticks(log, pid)) > n + 5, 30, what="ticks after all pages arrived")
    assert all(t.digest == digest for t in ticks(log, pid))
    assert any(t.fresh for t in ticks(log, pid)[n:])
    shown = json.loads(d.ctl("--json", "show", ck["id"], check=True).stdout)
    if backend.endswith("whole-files"):
        assert shown["in_tier"] is True and "every page resident" not in d.log.read_text()
    else:  # paged in from the store, never fetched whole into the tier
        assert shown["in_tier"] is False and "every page resident" in d.log.read_text()
    # The job holds its pages now: the packs they came from are not held in the page cache beside them.
    wait_for(lambda: sum(resident_pages(p) for p in packs) == 0, 30, what="the packs to leave the page cache")


def _cached_packs(d: DaemonProc) -> list[Path]:
    """The store's packs, on disk and in the page cache (as just written or read)."""
    packs = [p for p in (d.store / "packs").rglob("*") if p.is_file()]
    assert packs
    for p in packs:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        p.read_bytes()
    assert sum(resident_pages(p) for p in packs) > 0
    return packs


def test_lazy_restore_with_the_store_cut_off_mid_way_kills_the_job_and_says_why(make_daemon, jobs_to_kill):
    # Failpoint lazy-store-cut: every stored page image breaks after its first MiB, as a store that goes
    # away would, after the job already resumed.
    d = make_daemon("cut", env={"MEMSNAP_FAILPOINTS": "lazy-store-cut"},
                    extra=["--metrics-listen", "127.0.0.1:0"]).start()
    ck, log, digest, last = _durable_then_evicted(d, jobs_to_kill, 64)
    r = d.ctl("--json", "restore", "--lazy", ck["id"])
    if r.returncode == 0:
        pid = json.loads(r.stdout)["pid"]
        jobs_to_kill.append(pid)
        wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
                 60, what="the job to be killed")
        assert "lazy restore into job" in d.log.read_text()
    else:  # (the cut came while CRIU restored: its tasks were killed before they ran)
        assert "store" in r.stderr, r.stderr
    shown = _wound_up(d, ck["id"])
    assert "lazy restore" in shown["last_error"] and "store" in shown["last_error"] and \
        "killed" in shown["last_error"], shown["last_error"]
    port = metrics_port(d)
    assert sample(scrape_metrics(port), "memsnap_restores_total", result="store_failed") == 1
    with d.client() as c:
        assert not [j for j in c.jobs() if j.running and j.name == ck["name"] and j.id != ck["job"]]


@pytest.mark.parametrize("where", ["lazy", "eager"])
def test_lazy_restore_of_a_tampered_chunk_kills_or_refuses_the_job_and_says_why(where, make_daemon, jobs_to_kill):
    # lazy: a chunk of the job's buffer (the largest pages image), served after the job resumed: killed.
    # eager: the last chunk of the smallest pages image (the job's init; its stack, which criu restore
    # reads itself): refused before anything runs.
    d = make_daemon("tamper").start()
    ck, log, digest, last = _durable_then_evicted(d, jobs_to_kill, 32)
    stored = json.loads((d.store / ck["id"] / "manifest.json").read_text())
    pages = sorted((n for n in stored["files"] if n.startswith("pages-")), key=lambda n: stored["files"][n]["size"])
    refs = stored["storage"]["files"][pages[-1] if where == "lazy" else pages[0]]["chunks"]
    cid = refs[len(refs) // 2][0] if where == "lazy" else refs[-1][0]
    flip_stored_chunk_byte(d.store, stored, cid)
    before = _running(d)
    r = restore_refused(d, ck["id"], jobs_to_kill, "--lazy")
    if r.returncode == 0:  # refused only once the job ran (the tampered bytes were lazy): killed
        # (eager: the init's last chunk is usually read by criu restore itself, but where its stack pages lie
        # in a lazy range, the page server meets it first; either way nothing runs on the tampered bytes)
        pid = json.loads(r.stdout)["pid"]
        wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
                 60, what="the job to be killed")
        shown = _wound_up(d, ck["id"])
        assert "killed" in shown["last_error"], shown["last_error"]
    else:  # refused: nothing runs (refused before CRIU returned, or its restored copy killed before it ran)
        assert "DATA_LOSS" in r.stderr and ("integrity" in r.stderr or "checksum" in r.stderr), r.stderr
        shown = _wound_up(d, ck["id"])
        assert "refused" in shown["last_error"] or "killed" in shown["last_error"], shown["last_error"]
    assert "integrity check failed" in shown["last_error"] and cid in shown["last_error"], shown["last_error"]
    assert _running(d) == before


def _wound_up(d: DaemonProc, ckpt_id: str) -> dict[str, Any]:
    """The checkpoint's record once a failed lazy restore from the store is wound up: lazy-pages gone and its work
    dir removed, within 30 s (the reason and the metric are recorded before that)."""
    wait_for(lambda: not _lazy_pages_running(d) and not list(d.state.glob(f"work/{ckpt_id}.lazystore-*")), 30,
             what="the failed lazy restore to be wound up (lazy-pages gone, its work dir removed)")
    shown: dict[str, Any] = json.loads(d.ctl("--json", "show", ckpt_id, check=True).stdout)
    return shown


def _running(d: DaemonProc) -> set[int]:
    with d.client() as c:
        return {int(j.pid) for j in c.jobs() if j.running}


def test_migrate_via_store_pages_the_job_in_from_the_store_on_the_target(pair, jobs_to_kill, tmp_path):
    # The target catalogs the stored copy and restores it with early resume: a lazy restore whose tier copy
    # was never there, i.e. this path (its page server logs the line below); same digest on the target.
    from tests.helpers import counter_job, keeps_ticking_with, migrate, token_daemon

    a = pair.a
    c = token_daemon(tmp_path / "c", pair.token_file)
    c.extra += ["--store-dir", str(a.store), "--hmac-key-file", str(a.state / "hmac.key")]
    c.start()
    try:
        job = counter_job(a, jobs_to_kill, 32, "lazystore-via")
        r = migrate(a, job["id"], "--to", c.address, "--via-store")
        assert r.returncode == 0, r.stderr + c.log.read_text()[-3000:]
        out = json.loads(r.stdout)
        jobs_to_kill.append(out["target_pid"])
        ck = out["checkpoint"]
        assert f"lazy restore of {ck} from the store: every page resident" in c.log.read_text()
        keeps_ticking_with(job["log"], out["target_pid"], job["digest"], more=5)
        with c.client() as cl:
            assert not cl.show(ck).in_tier
    finally:
        c.cleanup()


def test_a_daemon_killed_while_a_lazy_restore_pages_in_from_the_store_leaves_no_job_running(make_daemon,
                                                                                           jobs_to_kill):
    # slow-lazy-store: each store read takes 0.2 s once the job resumed, so its pages are still coming when
    # the daemon dies; lazy-pages loses its page server, fails, and its supervisor kills the job (whose
    # missing pages would read as zeros). The restarted daemon records it as ended and removes the dir.
    import signal

    d = make_daemon("crash", env={"MEMSNAP_FAILPOINTS": "slow-lazy-store"}).start()
    ck, log, digest, last = _durable_then_evicted(d, jobs_to_kill, 64)
    r = d.ctl("--json", "restore", "--lazy", ck["id"])
    assert r.returncode == 0, r.stderr
    pid = json.loads(r.stdout)["pid"]
    jobs_to_kill.append(pid)
    assert _lazy_pages_running(d), "every page arrived before the daemon could be killed"
    d.stop(signal.SIGKILL)
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
             30, what="the half-paged job to be killed")
    wait_for(lambda: not _lazy_pages_running(d), 30, what="lazy-pages to end")
    d.start()
    with d.client() as c:
        assert not [j for j in c.jobs() if j.running and int(j.pid) == pid]
    assert not list(d.state.glob(f"work/{ck['id']}.lazystore-*"))


ZEROCHECK = Path(__file__).resolve().parents[1] / "workloads" / "zerocheck.py"


@pytest.mark.parametrize("cut", ["lazy-store-cut", "lazy-store-cut-late"], ids=["while-criu-restores",
                                                                               "after-resume"])
def test_a_store_that_fails_mid_lazy_restore_never_lets_the_job_read_a_zero_page(cut, make_daemon, jobs_to_kill):
    # The job checks every page of its memory (a non-zero pattern) over and over and says ZERO PAGE the moment
    # one reads as zeros. The store fails while CRIU restores (the first lazy page), or once the job runs
    # and 8 MiB more came: either way the tasks die before lazy-pages lets go of their memory.
    import sys

    d = make_daemon("zero", env={"MEMSNAP_FAILPOINTS": cut}).start()
    with d.client() as c:
        job = c.run([sys.executable, str(ZEROCHECK), "--mib", "64"])
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: "tick 10 " in Path(job.log_path).read_text(), 60, what="the job to check its memory")
    ck = json.loads(d.ctl("--json", "checkpoint", job.id, "--stop", "--wait", "durable", check=True).stdout)
    d.ctl("evict", ck["id"], check=True)
    r = d.ctl("--json", "restore", "--lazy", ck["id"])
    out = job_output(job.log_path)
    if r.returncode == 0:
        pid = json.loads(r.stdout)["pid"]
        jobs_to_kill.append(pid)
        wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
                 60, what="the job to be killed")
        out = job_output(job.log_path)
        assert cut == "lazy-store-cut-late", r.stdout  # (the early cut fails the restore itself)
    else:
        assert "store" in r.stderr and "nothing was left running" in r.stderr, r.stderr
    assert "ZERO PAGE" not in out, [ln for ln in out.splitlines() if "ZERO PAGE" in ln][:3]
    shown = _wound_up(d, ck["id"])
    assert "killed" in shown["last_error"], shown["last_error"]


def test_a_job_lazily_restored_from_a_slow_store_answers_long_before_every_page_is_resident(make_daemon,
                                                                                          jobs_to_kill):
    # slow-lazy-store: every store read takes 0.2 s once the job asked for its first lazy page, so its 96 MiB
    # page in for seconds. A tick needs a few pages only (no digest): its faults must be answered on their own,
    # not behind the background push (issue 27: redis answered no PING until every page was resident).
    d = make_daemon("faults", env={"MEMSNAP_FAILPOINTS": "slow-lazy-store"}).start()
    with d.client() as c:
        job = c.run(counter_argv(96, 0.05, "--digest-every", "1000000"))
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: len(ticks(job.log_path)) >= 3, 30, what="the job to tick")
    ck = json.loads(d.ctl("--json", "checkpoint", job.id, "--stop", "--wait", "durable", check=True).stdout)
    d.ctl("evict", ck["id"], check=True)
    pid = json.loads(d.ctl("--json", "restore", "--lazy", ck["id"], check=True).stdout)["pid"]
    jobs_to_kill.append(pid)
    wait_for(lambda: ticks(job.log_path, pid), 60, 0.01, "the first tick after the restore")
    assert "every page resident" not in d.log.read_text(), "the job answered only once every page was resident"
    wait_for(lambda: "every page resident" in d.log.read_text(), 120, what="every page to arrive")
    line = next(ln for ln in d.log.read_text().splitlines() if "every page resident" in ln)
    assert "faults answered in p50" in line, line
