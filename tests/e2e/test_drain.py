"""Asynchronous drain with real CRIU: durable, evict, restore from store, crash safety, outages, integrity."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from memsnap.client import ClientError
from tests.helpers import DaemonProc, counter_argv, restore_refused, running_job_pids, start_digest, ticks, wait_for

DURABLE, STAGED, DRAINING = 4, 2, 3


def _job(d: DaemonProc, jobs_to_kill: list[int], mib: int, *extra: str) -> tuple[str, int, str]:
    with d.client() as c:
        job = c.run(counter_argv(mib, 0.1, *extra))
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: len(ticks(job.log_path)) >= 2, 30, what="the job to tick")
    return job.id, int(job.pid), job.log_path


def _restore_and_check(d: DaemonProc, ckpt_id: str, log: str, digest: str, last: int,
                       jobs_to_kill: list[int]) -> dict:
    r = json.loads(d.ctl("--json", "restore", ckpt_id, check=True).stdout)
    jobs_to_kill.append(r["pid"])
    wait_for(lambda: len(ticks(log, r["pid"])) >= 2, 30, what="the restored job to tick")
    got = ticks(log, r["pid"])
    assert got[0].n == last + 1 and all(t.digest == digest for t in got)
    return r


def _no_temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(".tmp-")]


def test_wait_durable_then_evict_then_restore_from_store(daemon, jobs_to_kill):
    jid, pid, log = _job(daemon, jobs_to_kill, 48)
    digest = start_digest(log)
    ck = json.loads(daemon.ctl("--json", "checkpoint", jid, "--stop", "--wait", "durable", check=True).stdout)
    assert ck["state"] == "durable" and ck["in_store"] and ck["in_tier"]
    assert ck["drained_bytes"] == ck["size_bytes"] and ck["stored_bytes"] > 0
    last = ticks(log, pid)[-1].n
    ev = json.loads(daemon.ctl("--json", "evict", ck["id"], check=True).stdout)
    assert ev["in_tier"] is False and ev["state"] == "durable"
    assert not (daemon.tier / ck["id"]).exists()
    stored = list((daemon.store / ck["id"]).iterdir())
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in stored)
    r = _restore_and_check(daemon, ck["id"], log, digest, last, jobs_to_kill)
    assert r["from_store"] is True
    shown = json.loads(daemon.ctl("--json", "show", ck["id"], check=True).stdout)
    assert shown["in_tier"] is True  # fetched back into the tier


def test_evict_refuses_checkpoint_that_is_not_durable(make_daemon, jobs_to_kill):
    d = make_daemon("slow", extra=["--drain-bandwidth", "1M"]).start()
    jid, pid, log = _job(d, jobs_to_kill, 16)
    ck = json.loads(d.ctl("--json", "checkpoint", jid, check=True).stdout)
    with d.client() as c:
        with pytest.raises(ClientError) as e:
            c.evict(ck["id"])
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "not durable" in e.value.message
    assert (d.tier / ck["id"]).is_dir()


def test_kill9_during_slow_drain_then_restart_finishes_and_restores(make_daemon, jobs_to_kill):
    # (the whole-file format: its objects are big enough to be caught mid-upload; test_chunkstore has the
    # chunked format's crash tests)
    d = make_daemon("crash", extra=["--drain-bandwidth", "4M", "--compression-level", "0",
                                    "--store-format", "whole"]).start()
    jid, pid, log = _job(d, jobs_to_kill, 48)
    digest = start_digest(log)
    ck = json.loads(d.ctl("--json", "checkpoint", jid, "--stop", check=True).stdout)
    last = ticks(log, pid)[-1].n
    with d.client() as c:
        wait_for(lambda: c.show(ck["id"]).drained_bytes > 4 << 20, 30, what="the drain to be in flight")
        assert c.show(ck["id"]).state == DRAINING
    d.stop(signal.SIGKILL)
    # The interrupted upload left a temp object behind; recovery must clean it and finish the drain.
    assert not (d.store / ck["id"] / "manifest.json").exists()
    assert _no_temp_files(d.store) != []
    d.extra = ["--store-format", "whole"]  # restart without the bandwidth cap
    d.start()
    with d.client() as c:
        wait_for(lambda: c.show(ck["id"]).state == DURABLE, 60, what="the drain to finish after restart")
        listed = [k for k in c.list() if k.id == ck["id"]]
        assert len(listed) == 1 and len(c.list()) == 1
        c.evict(ck["id"])
    assert _no_temp_files(d.store) == []
    assert list((d.tier / ".staging").iterdir()) == []
    _restore_and_check(d, ck["id"], log, digest, last, jobs_to_kill)


def test_flipped_byte_in_stored_image_is_refused_and_nothing_starts(make_daemon, jobs_to_kill):
    daemon = make_daemon("flip", extra=["--store-format", "whole"]).start()  # (test_chunkstore: a flipped chunk)
    jid, pid, log = _job(daemon, jobs_to_kill, 8)
    ck = json.loads(daemon.ctl("--json", "checkpoint", jid, "--stop", "--wait", "durable", check=True).stdout)
    daemon.ctl("evict", ck["id"], check=True)
    pages = next((daemon.store / ck["id"]).glob("pages-*"))
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0x01
    pages.write_bytes(bytes(data))
    before = _job_pids(daemon)
    r = restore_refused(daemon, ck["id"], jobs_to_kill)
    assert r.returncode != 0
    assert "DATA_LOSS" in r.stderr and ("integrity" in r.stderr or "checksum" in r.stderr)
    assert _job_pids(daemon) == before
    assert not (daemon.tier / ck["id"]).exists()


def test_flipped_byte_in_tier_copy_is_refused_and_nothing_starts(daemon, jobs_to_kill):
    jid, pid, log = _job(daemon, jobs_to_kill, 8)
    ck = json.loads(daemon.ctl("--json", "checkpoint", jid, "--stop", check=True).stdout)
    pages = next((daemon.tier / ck["id"]).glob("pages-*"))
    with open(pages, "r+b") as f:
        f.seek(4096)
        b = f.read(1)
        f.seek(4096)
        f.write(bytes([b[0] ^ 0xFF]))
    before = _job_pids(daemon), {t.hostpid for t in ticks(log)}
    r = restore_refused(daemon, ck["id"], jobs_to_kill)
    assert r.returncode != 0 and "checksum" in r.stderr and "DATA_LOSS" in r.stderr
    assert (_job_pids(daemon), {t.hostpid for t in ticks(log)}) == before


def _job_pids(d: DaemonProc) -> set[int]:
    with d.client() as c:
        return {int(j.pid) for j in c.jobs() if j.running}


def test_storage_outage_mid_drain_retries_and_completes(make_daemon, jobs_to_kill, tmp_path):
    cfg = tmp_path / "retry.toml"
    cfg.write_text("[drain]\nretry_initial_s = 0.2\nretry_max_s = 1.0\n")
    d = make_daemon("outage", extra=["--config", str(cfg), "--drain-bandwidth", "8M",
                                     "--compression-level", "0"])
    d.start()
    jid, pid, log = _job(d, jobs_to_kill, 32)
    digest = start_digest(log)
    ck = json.loads(d.ctl("--json", "checkpoint", jid, "--stop", check=True).stdout)
    last = ticks(log, pid)[-1].n
    with d.client() as c:
        wait_for(lambda: c.show(ck["id"]).drained_bytes > 2 << 20, 30, what="the drain to start")
        away = d.store.with_name("store-away")
        d.store.rename(away)  # the storage "goes down"
        rec = wait_for(lambda: (k := c.show(ck["id"])).last_error and k, 30, what="a drain error")
        assert rec.state != DURABLE and rec.last_error
        time.sleep(1.0)
        assert c.show(ck["id"]).state != DURABLE
        away.rename(d.store)  # and comes back
        done = wait_for(lambda: (k := c.show(ck["id"])).state == DURABLE and k, 60, what="durable after outage")
        assert done.drain_attempts >= 2 and done.last_error == ""
        c.evict(ck["id"])
    _restore_and_check(d, ck["id"], log, digest, last, jobs_to_kill)


def test_tier_pressure_evicts_only_durable_copies(make_daemon, jobs_to_kill, tmp_path):
    mnt = tmp_path / "tier"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=112m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        d = make_daemon("pressure", tier=mnt, extra=["--compression-level", "1"]).start()
        a_id, a_pid, _ = _job(d, jobs_to_kill, 24)
        a = json.loads(d.ctl("--json", "checkpoint", a_id, "--wait", "durable", check=True).stdout)
        # B stays staged: its drain is stuck behind an unreachable store.
        away = d.store.with_name("store-away")
        d.store.rename(away)
        b_id, b_pid, _ = _job(d, jobs_to_kill, 24)
        b = json.loads(d.ctl("--json", "checkpoint", b_id, check=True).stdout)
        # C needs room: only A (durable) may be evicted to make it.
        c_id, c_pid, _ = _job(d, jobs_to_kill, 24)
        c = json.loads(d.ctl("--json", "checkpoint", c_id, check=True).stdout)
        with d.client() as cl:
            assert cl.show(a["id"]).in_tier is False and cl.show(a["id"]).state == DURABLE
            assert cl.show(b["id"]).in_tier is True and cl.show(b["id"]).state != DURABLE
            assert cl.show(c["id"]).in_tier is True
            # Nothing durable is left to evict: a fourth checkpoint is refused, B and C stay.
            with pytest.raises(ClientError) as e:
                cl.checkpoint(a_pid)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert cl.show(b["id"]).in_tier and cl.show(c["id"]).in_tier
        away.rename(d.store)
        d.cleanup()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_s3_backend_round_trip_against_local_server(make_daemon, jobs_to_kill, s3_server):
    url = f"s3://{s3_server.bucket}/ckpts"
    env = {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
           "AWS_DEFAULT_REGION": s3_server.region}
    d = make_daemon("s3", extra=["--store-url", url, "--s3-endpoint", s3_server.endpoint_url,
                                 "--s3-region", s3_server.region], env=env).start()
    jid, pid, log = _job(d, jobs_to_kill, 24)
    digest = start_digest(log)
    ck = json.loads(d.ctl("--json", "checkpoint", jid, "--stop", "--wait", "durable", check=True).stdout)
    assert ck["state"] == "durable"
    last = ticks(log, pid)[-1].n
    d.ctl("evict", ck["id"], check=True)
    assert json.loads(d.ctl("--json", "status", check=True).stdout)["store"].startswith("s3://")
    r = _restore_and_check(d, ck["id"], log, digest, last, jobs_to_kill)
    assert r["from_store"] is True


def test_watch_streams_progress_until_durable(make_daemon, jobs_to_kill):
    d = make_daemon("watch", extra=["--drain-bandwidth", "16M", "--compression-level", "0"]).start()
    jid, pid, log = _job(d, jobs_to_kill, 32)
    ck = json.loads(d.ctl("--json", "checkpoint", jid, check=True).stdout)
    r = d.ctl("--json", "watch", ck["id"], check=True, timeout=60)
    updates = [json.loads(line) for line in r.stdout.splitlines()]
    drained = [u["drained_bytes"] for u in updates]
    assert updates[-1]["state"] == "durable" and len(updates) >= 3
    assert drained == sorted(drained)
    assert any(0 < n < updates[-1]["size_bytes"] for n in drained), "no intermediate progress was shown"
    human = d.ctl("watch", ck["id"], check=True).stdout
    assert "100.0%" in human and "durable" in human


def test_another_node_restores_by_job_name_from_the_shared_store(make_daemon, jobs_to_kill, tmp_path):
    key = tmp_path / "cluster.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    shared = tmp_path / "shared-store"
    a = make_daemon("node-a", extra=["--hmac-key-file", str(key), "--store-dir", str(shared)]).start()
    b = make_daemon("node-b", extra=["--hmac-key-file", str(key), "--store-dir", str(shared)]).start()
    with a.client() as c:
        job = c.run(counter_argv(16), name="slurm-4242")
        jobs_to_kill.append(int(job.pid))
        wait_for(lambda: len(ticks(job.log_path)) >= 2, 20)
        digest = start_digest(job.log_path)
        ck = c.checkpoint(job.id, stop=True, wait_durable=True)
        assert ck.state == DURABLE
    last = ticks(job.log_path, int(job.pid))[-1].n
    # Node B has never heard of this job: it finds the newest checkpoint by name in the shared store.
    r = json.loads(b.ctl("--json", "restore", "slurm-4242", check=True).stdout)
    jobs_to_kill.append(r["pid"])
    assert r["from_store"] is True and r["checkpoint"] == ck.id and r["requested"] == "slurm-4242"
    wait_for(lambda: ticks(job.log_path, r["pid"]), 20, what="the job restored on node B to tick")
    got = ticks(job.log_path, r["pid"])
    assert got[0].n == last + 1 and got[0].digest == digest
    with b.client() as c:
        assert [k.id for k in c.list()] == [ck.id]
    # A node with a different key refuses the stored copy instead of restoring it.
    other = make_daemon("node-c", extra=["--store-dir", str(shared)]).start()
    r2 = restore_refused(other, "slurm-4242", jobs_to_kill)
    assert r2.returncode != 0 and "DATA_LOSS" in r2.stderr and "signature does not match" in r2.stderr, r2.stderr
    assert running_job_pids(other) == set()


def test_evict_and_delete_wait_for_a_restore_that_still_reads_the_tier_copy(make_daemon, jobs_to_kill):
    # slow-restore holds a restore for 3 s after it verified the tier copy and before CRIU reads it: an
    # evict or delete arriving then must be refused, and the restore must still succeed from that copy.
    d = make_daemon("reading", env={"MEMSNAP_FAILPOINTS": "slow-restore"}).start()
    jid, pid, log = _job(d, jobs_to_kill, 16)
    digest = start_digest(log)
    ck = json.loads(d.ctl("--json", "checkpoint", jid, "--stop", "--wait", "durable", check=True).stdout)
    last = ticks(log, pid)[-1].n
    env = {**os.environ, "MEMSNAP_SOCKET": d.socket}
    restore = subprocess.Popen([sys.executable, "-m", "memsnap.cli", "--json", "restore", ck["id"]], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: any(p.name.startswith(ck["id"] + ".restore-") for p in (d.state / "work").iterdir()), 10,
             what="the restore to pass verification")
    for verb in ("evict", "delete"):
        r = d.ctl(verb, ck["id"])
        assert r.returncode == 8 and "still reading" in r.stderr, (verb, r.stderr)
    out, err = restore.communicate(timeout=120)
    assert restore.returncode == 0, err
    new = int(json.loads(out)["pid"])
    jobs_to_kill.append(new)
    wait_for(lambda: len(ticks(log, new)) >= 2, 30, what="the restored job to tick")
    got = ticks(log, new)
    assert got[0].n == last + 1 and all(t.digest == digest for t in got)
    # Once the restore is done, the tier copy may go.
    assert json.loads(d.ctl("--json", "evict", ck["id"], check=True).stdout)["in_tier"] is False
