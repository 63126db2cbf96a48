"""Chunked store with real daemons and real CRIU (POSIX store and moto's S3): dedup across checkpoints and jobs,
restore from the store, the old whole-file format, a tampered chunk, kill -9 at the chunk failpoints."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from memsnap.store.chunks import chunked_storage
from tests.helpers import (
    REPO,
    DaemonProc,
    flip_stored_chunk_byte,
    missing_chunks,
    resident_pages,
    restore_refused,
    running_job_pids,
    start_digest,
    ticks,
    wait_for,
)

INFER = REPO / "tests" / "workloads" / "infer.py"


def _infer(d: DaemonProc, jobs_to_kill: list[int], seed: str = "w-1", mib: int = 32) -> tuple[str, int, str]:
    with d.client() as c:
        job = c.run([sys.executable, str(INFER), "--weights-mib", str(mib), "--state-mib", "2", "--seed", seed,
                     "--interval", "0.1"])
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: len(ticks(job.log_path)) >= 2, 60, what="the job to tick")
    return job.id, int(job.pid), job.log_path


def _ckpt(d: DaemonProc, jid: str, *flags: str) -> dict[str, Any]:
    return dict(json.loads(d.ctl("--json", "checkpoint", jid, *flags, check=True).stdout))


def _stored(d: DaemonProc, ckpt_id: str) -> dict[str, Any]:
    return dict(json.loads((d.store / ckpt_id / "manifest.json").read_text()))


def referenced_chunks(stored: dict[str, Any]) -> set[str]:
    """The chunks a chunked stored manifest's JSON references."""
    st = chunked_storage(stored)
    assert st is not None
    return st.referenced_chunks()


def _reused(old: dict[str, Any], new: dict[str, Any]) -> int:
    """Raw bytes of new's chunks that old's manifest references too."""
    have = referenced_chunks(old)
    return sum(n for f in new["storage"]["files"].values() for cid, _, n, *_ in f.get("chunks", []) if cid in have)


def _restore_and_check(d: DaemonProc, ckpt_id: str, log: str, digest: str, last: int,
                       jobs_to_kill: list[int]) -> dict[str, Any]:
    r = json.loads(d.ctl("--json", "restore", ckpt_id, check=True).stdout)
    jobs_to_kill.append(r["pid"])
    wait_for(lambda: len(ticks(log, r["pid"])) >= 2, 60, what="the restored job to tick")
    got = ticks(log, r["pid"])
    assert got[0].n == last + 1 and all(t.digest == digest for t in got)
    return dict(r)


def test_second_checkpoint_uploads_only_changed_chunks_and_restores_from_store(make_daemon, jobs_to_kill):
    d = make_daemon("dedup").start()
    jid, pid, log = _infer(d, jobs_to_kill)
    digest = start_digest(log)
    ck1 = _ckpt(d, jid, "--wait", "durable")
    wait_for(lambda: ticks(log, pid)[-1].n >= ticks(log, pid)[0].n + 5, 30, what="more ticks")
    ck2 = _ckpt(d, jid, "--stop", "--wait", "durable")
    last = ticks(log, pid)[-1].n
    s1, s2 = _stored(d, ck1["id"])["storage"], _stored(d, ck2["id"])["storage"]
    assert _stored(d, ck2["id"])["format"] == 2 and s2["layout"] == "chunked"
    assert s1["logical_bytes"] >= 32 << 20 and s2["logical_bytes"] >= 32 << 20
    assert s1["new_bytes"] >= 32 << 20
    # The 32 MiB of weights were stored once: ck2 reuses them (all but the chunks where they meet other memory).
    assert _reused(_stored(d, ck1["id"]), _stored(d, ck2["id"])) >= 28 << 20
    assert s2["new_bytes"] <= s2["logical_bytes"] - (28 << 20)
    assert s2["stored_bytes"] * 3 <= s1["stored_bytes"] and ck2["stored_bytes"] * 3 <= ck1["stored_bytes"]
    assert len(referenced_chunks(_stored(d, ck1["id"])) & referenced_chunks(_stored(d, ck2["id"]))) >= 16
    # Restore from the store after evict: the chunks come from ck1's tier copy, the rest from the store.
    d.ctl("evict", ck2["id"], check=True)
    r = _restore_and_check(d, ck2["id"], log, digest, last, jobs_to_kill)
    assert r["from_store"] is True
    fetched = [line for line in d.log.read_text().splitlines() if f"fetched {ck2['id']}" in line]
    assert fetched and " 0 from tier copies" not in fetched[-1]


def _log_lines(d: DaemonProc, text: str) -> list[str]:
    return [line for line in d.log.read_text().splitlines() if text in line]


def test_a_dump_hashed_while_criu_wrote_it_restores_from_the_store_then_from_the_cache_filled_after(
        make_daemon, jobs_to_kill, tmp_path):
    # (the cache on a filesystem of its own: on the store's, memsnapd keeps none)
    cache = Path(f"/dev/shm/memsnap-test-cache-{tmp_path.name}")
    d = make_daemon("hash-fill", extra=["--chunk-cache-dir", str(cache)]).start()
    jid, pid, log = _infer(d, jobs_to_kill, seed="w-hash", mib=64)
    digest = start_digest(log)
    ck = _ckpt(d, jid, "--stop", "--wait", "durable")
    last = ticks(log, pid)[-1].n
    staged = _log_lines(d, "checkpoint staged")
    hashed = int(staged[-1].rsplit(" bytes hashed while CRIU dumped", 1)[0].rsplit(" ", 1)[1])
    assert hashed > 0  # (the pages file followed as it grew: the rest was hashed after CRIU returned)
    # The tier copy goes; the restore fetches every chunk from the store, verified against the hashes.
    d.ctl("evict", ck["id"], check=True)
    r = _restore_and_check(d, ck["id"], log, digest, last, jobs_to_kill)
    assert r["from_store"] is True and " 0 from the store" not in _log_lines(d, f"fetched {ck['id']}")[-1]
    # After the restore, in the background: the fetched chunks join the node's chunk cache.
    wait_for(lambda: _log_lines(d, "chunks added after a fetch"), 60, what="the chunk cache to be filled")
    os.kill(r["pid"], signal.SIGKILL)
    wait_for(lambda: r["pid"] not in running_job_pids(d), 30, what="the restored job to end")
    d.ctl("evict", ck["id"], check=True)
    _restore_and_check(d, ck["id"], log, digest, last, jobs_to_kill)
    fetched = _log_lines(d, f"fetched {ck['id']}")[-1]
    n, tier, cached = (int(x) for x in re.findall(
        r"(\d+) chunks, (\d+) from tier copies, (\d+) from the chunk cache", fetched)[0])
    assert n > 0 and tier == 0 and cached == n  # (only the small files' bundle comes from the store again)
    shutil.rmtree(cache, ignore_errors=True)


def test_a_node_keeps_no_chunk_cache_on_its_stores_own_filesystem(make_daemon, jobs_to_kill):
    d = make_daemon("no-cache").start()  # (state dir and store dir side by side: one filesystem)
    assert _log_lines(d, "chunk cache off:") and "same filesystem as the store" in _log_lines(d, "chunk cache off:")[0]
    jid, pid, log = _infer(d, jobs_to_kill, seed="w-nocache", mib=32)
    digest = start_digest(log)
    ck = _ckpt(d, jid, "--stop", "--wait", "durable")
    last = ticks(log, pid)[-1].n
    d.ctl("evict", ck["id"], check=True)
    r = _restore_and_check(d, ck["id"], log, digest, last, jobs_to_kill)
    assert r["from_store"] is True
    time.sleep(1)
    assert not _log_lines(d, "chunks added after a fetch")  # (nothing written a second time)
    assert not (d.state / "chunk-cache").exists() or not any((d.state / "chunk-cache").iterdir())


def test_a_restore_from_the_store_leaves_no_pack_in_the_page_cache_and_a_second_restores_too(make_daemon,
                                                                                           jobs_to_kill):
    # The fetched copy is in the tier: the packs it came from need not stay in memory beside it.
    d = make_daemon("pack-cache").start()
    jid, pid, log = _infer(d, jobs_to_kill, seed="w-pagecache", mib=48)
    digest = start_digest(log)
    ck = _ckpt(d, jid, "--stop", "--wait", "durable")
    last = ticks(log, pid)[-1].n
    packs = [p for p in (d.store / "packs").rglob("*") if p.is_file()]
    assert packs
    for p in packs:  # (on disk, and cached as if just written or read)
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        p.read_bytes()
    assert sum(resident_pages(p) for p in packs) > 0
    d.ctl("evict", ck["id"], check=True)
    r = _restore_and_check(d, ck["id"], log, digest, last, jobs_to_kill)
    assert r["from_store"] is True
    assert sum(resident_pages(p) for p in packs) == 0
    # A second fetch of the same checkpoint reads them from the disk again, and restores the same state.
    os.kill(r["pid"], signal.SIGKILL)
    d.ctl("evict", ck["id"], check=True)
    r2 = _restore_and_check(d, ck["id"], log, digest, last, jobs_to_kill)
    assert r2["from_store"] is True


def test_a_second_job_with_the_same_weights_stores_few_new_bytes_on_s3(make_daemon, jobs_to_kill, s3_server):
    url = f"s3://{s3_server.bucket}/dedup-jobs"
    env = {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
           "AWS_DEFAULT_REGION": s3_server.region}
    d = make_daemon("s3", extra=["--store-url", url, "--s3-endpoint", s3_server.endpoint_url,
                                 "--s3-region", s3_server.region], env=env).start()
    j1, _, _ = _infer(d, jobs_to_kill, seed="shared")
    j2, pid2, log2 = _infer(d, jobs_to_kill, seed="shared")
    digest = start_digest(log2)
    ck1 = _ckpt(d, j1, "--stop", "--wait", "durable")
    ck2 = _ckpt(d, j2, "--stop", "--wait", "durable")
    last = ticks(log2, pid2)[-1].n
    with d.client() as c:
        assert c.show(ck1["id"]).state == c.show(ck2["id"]).state == 4
    # The second job's weights were not stored again (only its interpreter, its state and the chunks where
    # the weights meet them were).
    assert ck1["stored_bytes"] >= 32 << 20 and ck2["stored_bytes"] * 3 <= ck1["stored_bytes"]
    d.ctl("evict", ck2["id"], check=True)
    d.ctl("evict", ck1["id"], check=True)  # (no tier copy to take chunks from: all from S3)
    r = _restore_and_check(d, ck2["id"], log2, digest, last, jobs_to_kill)
    assert r["from_store"] is True


def test_a_job_on_another_node_sharing_the_store_uploads_only_what_the_store_lacks(make_daemon, jobs_to_kill):
    a = make_daemon("node-a").start()
    b = make_daemon("node-b", extra=["--store-dir", str(a.store), "--hmac-key-file",
                                     str(a.state / "hmac.key")]).start()
    ja, _, _ = _infer(a, jobs_to_kill, seed="cluster-weights")
    ck_a = _ckpt(a, ja, "--stop", "--wait", "durable")
    jb, pid_b, log_b = _infer(b, jobs_to_kill, seed="cluster-weights")
    digest = start_digest(log_b)
    ck_b = _ckpt(b, jb, "--stop", "--wait", "durable")
    last = ticks(log_b, pid_b)[-1].n
    sa, sb = _stored(a, ck_a["id"])["storage"], _stored(a, ck_b["id"])["storage"]
    # Node b's index knew none of node a's chunks: it found them in the store and uploaded only its own.
    assert _reused(_stored(a, ck_a["id"]), _stored(a, ck_b["id"])) >= 24 << 20
    assert sb["new_bytes"] <= sb["logical_bytes"] - (24 << 20) and sa["new_bytes"] >= 32 << 20
    b.ctl("evict", ck_b["id"], check=True)
    _restore_and_check(b, ck_b["id"], log_b, digest, last, jobs_to_kill)


def test_whole_file_checkpoint_still_restores_after_switching_to_chunked(make_daemon, jobs_to_kill):
    d = make_daemon("old", extra=["--store-format", "whole"]).start()
    jid, pid, log = _infer(d, jobs_to_kill, mib=16)
    digest = start_digest(log)
    ck = _ckpt(d, jid, "--stop", "--wait", "durable")
    last = ticks(log, pid)[-1].n
    assert _stored(d, ck["id"])["format"] == 1 and (d.store / ck["id"] / "pages-1.img.zst").is_file()
    d.ctl("evict", ck["id"], check=True)
    d.stop()
    d.extra = []  # now chunked (the default)
    d.start()
    r = _restore_and_check(d, ck["id"], log, digest, last, jobs_to_kill)
    assert r["from_store"] is True


def test_a_checkpoint_of_loose_chunks_restores_after_packs_are_on_and_the_next_one_reuses_its_chunks(
        make_daemon, jobs_to_kill):
    d = make_daemon("loose", extra=["--pack-size", ""]).start()  # (an object per chunk: the format before packs)
    jid, pid, log = _infer(d, jobs_to_kill, mib=16)
    digest = start_digest(log)
    ck1 = _ckpt(d, jid, "--wait", "durable")
    assert "packs" not in _stored(d, ck1["id"])["storage"] and len(list((d.store / "chunks").rglob("*"))) > 16
    d.stop()
    d.extra = []  # packs (the default)
    d.start()
    ck2 = _ckpt(d, jid, "--stop", "--wait", "durable")
    last = ticks(log, pid)[-1].n
    s2 = _stored(d, ck2["id"])
    assert s2["storage"]["packs"] and _reused(_stored(d, ck1["id"]), s2) >= 12 << 20
    for ck in (ck1, ck2):
        d.ctl("evict", ck["id"], check=True)
    r = _restore_and_check(d, ck2["id"], log, digest, last, jobs_to_kill)  # (loose and packed chunks)
    assert r["from_store"] is True


def test_tampered_chunk_is_refused_with_data_loss_and_no_process(make_daemon, jobs_to_kill):
    d = make_daemon("tamper", extra=["--compression-level", "0"]).start()
    jid, _, log = _infer(d, jobs_to_kill, mib=8)
    ck = _ckpt(d, jid, "--stop", "--wait", "durable")
    d.ctl("evict", ck["id"], check=True)
    m = _stored(d, ck["id"])
    cid = m["storage"]["files"]["pages-1.img"]["chunks"][0][0]
    flip_stored_chunk_byte(d.store, m, cid)
    before = running_job_pids(d)
    r = restore_refused(d, ck["id"], jobs_to_kill)
    assert r.returncode != 0 and "DATA_LOSS" in r.stderr and "integrity check failed" in r.stderr
    assert running_job_pids(d) == before
    assert not (d.tier / ck["id"]).exists() and list((d.tier / ".staging").iterdir()) == []


@pytest.mark.parametrize("point", ["chunk-uploaded", "chunked-manifest-written"])
def test_kill9_at_a_chunk_failpoint_then_restart_drains_and_both_checkpoints_restore(make_daemon, jobs_to_kill,
                                                                                    point):
    d = make_daemon("crash").start()  # (a short name: the socket path must fit in sun_path under any basetemp)
    jid, pid, log = _infer(d, jobs_to_kill, mib=16)
    digest = start_digest(log)
    ck1 = _ckpt(d, jid, "--wait", "durable")
    d.stop()
    d.env = {"MEMSNAP_FAILPOINTS": point}
    d.start()
    ck2 = _ckpt(d, jid, "--stop")
    last = ticks(log, pid)[-1].n
    assert d.proc is not None
    d.proc.wait(60)  # the drain died at the failpoint, like kill -9
    assert d.proc.returncode == 137
    assert not (d.store / ck2["id"] / "manifest.json").exists()
    d.env = {}
    d.start()
    with d.client() as c:
        wait_for(lambda: c.show(ck2["id"]).state == 4, 60, what="the drain to finish after restart")
    # Every chunk both durable manifests reference is in the store, and both restore from it.
    for ck in (ck1, ck2):
        assert not missing_chunks(d.store, _stored(d, ck["id"]))
        d.ctl("evict", ck["id"], check=True)
    _restore_and_check(d, ck2["id"], log, digest, last, jobs_to_kill)
    d.stop(signal.SIGKILL)


def test_a_tier_on_a_huge_page_tmpfs_dumps_fetches_from_the_store_and_restores(make_daemon, jobs_to_kill, tmp_path):
    import subprocess

    mnt = tmp_path / "hugetier"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1G,huge=within_size,mode=0755", "tmpfs", str(mnt)],
                   check=True)
    try:
        d = make_daemon("huge", tier=mnt / "tier").start()
        jid, pid, log = _infer(d, jobs_to_kill, mib=16)
        digest = start_digest(log)
        ck = _ckpt(d, jid, "--stop", "--wait", "durable")
        last = ticks(log, pid)[-1].n
        d.ctl("evict", ck["id"], check=True)
        r = _restore_and_check(d, ck["id"], log, digest, last, jobs_to_kill)
        assert r["from_store"] is True
        d.stop()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
