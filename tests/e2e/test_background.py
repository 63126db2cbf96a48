"""Drains step aside while a lazy restore serves pages (memsnap.background), with real CRIU and a real daemon:
a queued drain waits, a running drain pauses, both resume afterwards. State and counters, not times."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

from tests.helpers import (
    REPO,
    DaemonProc,
    counter_argv,
    counter_job,
    metrics_port,
    migrate,
    scrape_metrics,
    ticks,
    token_daemon,
    wait_for,
)

DURABLE, DRAINING = 4, 3


def _job(d: DaemonProc, jobs_to_kill: list[int], mib: int) -> tuple[str, str]:
    with d.client() as c:
        job = c.run(counter_argv(mib, 0.1))
    jobs_to_kill.append(int(job.pid))
    wait_for(lambda: len(ticks(job.log_path)) >= 2, 30, what="the job to tick")
    return job.id, job.log_path


def test_drains_wait_and_pause_while_a_lazy_restore_serves_pages_then_resume(make_daemon, jobs_to_kill):
    # A 4 MB/s drain cap keeps a drain in flight for seconds; slow-restore-10s holds the lazy restore 10 s
    # (foreground work) before CRIU runs, so both drains surely meet it, even on a loaded machine.
    d = make_daemon("bg", extra=["--drain-bandwidth", "4M", "--compression-level", "0",
                                 "--metrics-listen", "127.0.0.1:0"],
                    env={"MEMSNAP_FAILPOINTS": "slow-restore-10s"}).start()
    port = metrics_port(d)
    c_id, c_log = _job(d, jobs_to_kill, 8)
    ck_c = json.loads(d.ctl("--json", "checkpoint", c_id, "--stop", "--wait", "durable", check=True).stdout)
    assert ck_c["state"] == "durable"
    a_id, _ = _job(d, jobs_to_kill, 40)
    b_id, _ = _job(d, jobs_to_kill, 8)
    ck_a = json.loads(d.ctl("--json", "checkpoint", a_id, check=True).stdout)
    with d.client() as c:
        wait_for(lambda: c.show(ck_a["id"]).drained_bytes > 0, 30, what="drain A to be in flight")
        assert c.show(ck_a["id"]).state == DRAINING
        before = c.status()
    assert not before.drains_paused and before.drain_pauses == 0 and before.drain_waits == 0

    env = {**os.environ, "PYTHONPATH": str(REPO), "MEMSNAP_SOCKET": d.socket}
    restore = subprocess.Popen([sys.executable, "-m", "memsnap.cli", "--json", "restore", "--lazy", ck_c["id"]],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # B is dumped once the lazy restore is in flight (A paused): it is queued, and waits.
        with d.client() as c:
            wait_for(lambda: f"drain:{ck_a['id']} (paused)" in c.status().drains_held, 30,
                     what="drain A paused by the restore")
            ck_b = {"id": c.checkpoint(b_id).id}
            held = wait_for(lambda: (s := c.status()).drains_paused and {
                f"drain:{ck_a['id']} (paused)", f"drain:{ck_b['id']} (waiting)"} <= set(s.drains_held) and s,
                30, what="drain A paused and drain B waiting")
            assert "restore" in held.drains_paused_reason
            assert held.drains_paused_since_unix_ms > 0
            assert c.show(ck_b["id"]).drained_bytes == 0
            assert c.show(ck_a["id"]).drained_bytes < c.show(ck_a["id"]).size_bytes
        shown = d.ctl("status", check=True).stdout
        assert "drains   paused: yes" in shown
        m = scrape_metrics(port)
        assert m[("memsnap_drain_paused", ())] == 1.0
        out, err = restore.communicate(timeout=120)
        assert restore.returncode == 0, err
        jobs_to_kill.append(json.loads(out)["pid"])
    finally:
        if restore.poll() is None:
            restore.kill()

    # Once the pages are in, both drains resume and finish.
    with d.client() as c:
        wait_for(lambda: c.show(ck_a["id"]).state == DURABLE and c.show(ck_b["id"]).state == DURABLE, 120,
                 what="both drains to finish")
        after = c.status()
    assert not after.drains_paused and after.drains_held == [] and after.drains_paused_reason == ""
    assert after.drain_pauses >= 1 and after.drain_waits >= 1
    assert after.drains_paused_seconds > 0
    m = scrape_metrics(port)
    assert m[("memsnap_drain_paused", ())] == 0.0
    assert m[("memsnap_drain_holds_total", (("kind", "paused"),))] >= 1
    assert m[("memsnap_drain_holds_total", (("kind", "waiting"),))] >= 1
    assert m[("memsnap_drain_paused_seconds_total", ())] > 0
    # C was --wait durable: urgent, it never waited for anything (nothing ran in the foreground then).
    assert after.drain_pause_overrides == 0


def test_a_committed_moves_source_image_is_not_drained(tmp_path, jobs_to_kill, no_copy_outlives_the_test):
    # The target holds and drains the same image: the source drops its copy once the move is committed.
    # (The source's drain is capped so that it cannot finish before the commit.)
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    a = token_daemon(tmp_path / "a", token, extra=("--drain-bandwidth", "2M", "--compression-level", "0")).start()
    b = token_daemon(tmp_path / "b", token).start()
    try:
        _move_and_check_the_source_lets_go(a, b, jobs_to_kill)
    finally:
        a.cleanup()
        b.cleanup()


def _move_and_check_the_source_lets_go(a: DaemonProc, b: DaemonProc, jobs_to_kill: list[int]) -> None:
    job = counter_job(a, jobs_to_kill, 32, "moved-not-drained")
    r = migrate(a, job["id"], "--to", b.address)
    assert r.returncode == 0, r.stderr + a.log.read_text()[-2000:]
    out = json.loads(r.stdout)
    jobs_to_kill.append(out["target_pid"])
    ck = out["checkpoint"]
    with a.client() as c:
        assert ck not in {k.id for k in c.list()}
    assert not (a.tier / ck).exists()
    with b.client() as c:
        wait_for(lambda: c.show(ck).state == DURABLE, 120, what="the target to drain the moved image")
    assert (b.store / ck / "manifest.json").exists()
    assert not (a.store / ck / "manifest.json").exists()
    # Its drain waited while the move ran (foreground work) and was dropped at the commit, or, had it
    # started, stopped at its next block: either way the source's queue empties and nothing became durable.
    with a.client() as c:
        wait_for(lambda: c.status().drain_queue_depth == 0, 30, what="the source's drain queue to empty")
    assert f"ckpt={ck} durable in" not in a.log.read_text()
    assert not (a.store / ck / "manifest.json").exists()
