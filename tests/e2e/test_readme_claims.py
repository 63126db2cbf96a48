"""README claims checked against a real daemon: JSON logs name the checkpoint, file modes of the tier, the
store and the key, and what a restart does with stray tier dirs and a tier emptied by a reboot."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

from tests.helpers import checkpoint_json, keeps_ticking_with, start_counter


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_json_log_lines_about_a_checkpoint_carry_its_id(make_daemon, jobs_to_kill):
    d = make_daemon("jsonlog", extra=["--log-format", "json"]).start()
    job = start_counter(d, jobs_to_kill, 8)
    ck = checkpoint_json(d, job.id, "--stop", "--wait", "durable")
    d.ctl("evict", str(ck["id"]), check=True)
    r = json.loads(d.ctl("--json", "restore", str(ck["id"]), check=True).stdout)
    jobs_to_kill.append(r["pid"])
    lines = [json.loads(ln) for ln in d.log.read_text().splitlines() if ln.startswith("{")]
    assert lines, "no JSON log lines"
    about = [ln for ln in lines if ln.get("checkpoint_id") == ck["id"]]
    msgs = " | ".join(ln["msg"] for ln in about)
    # The life of the checkpoint, each line tagged: staged, durable, restored.
    for words in ("checkpoint staged", "durable in", "restored as pid"):
        assert words in msgs, msgs
    # No line names the checkpoint in its text without carrying its id as a field.
    untagged = [ln["msg"] for ln in lines if ck["id"] in ln["msg"] and ln.get("checkpoint_id") != ck["id"]]
    assert untagged == []


def test_tier_store_images_and_key_are_private(make_daemon, jobs_to_kill):
    d = make_daemon("modes").start()
    job = start_counter(d, jobs_to_kill, 8)
    ck = checkpoint_json(d, job.id, "--wait", "durable")
    assert _mode(d.state / "hmac.key") == 0o600
    for root in (d.tier, d.store):
        copy = root / str(ck["id"])
        assert _mode(copy) == 0o700, (copy, oct(_mode(copy)))
        files = [p for p in copy.iterdir()]
        assert files and all(_mode(p) == 0o600 for p in files), [(p.name, oct(_mode(p))) for p in files]
    assert _mode(d.tier) & 0o022 == 0 and _mode(d.store) & 0o022 == 0  # roots: nobody else writes there


def test_restart_removes_stray_tier_dirs_and_survives_a_tier_emptied_by_a_reboot(make_daemon, jobs_to_kill):
    d = make_daemon("reboot").start()
    job = start_counter(d, jobs_to_kill, 8, "", "--digest-every", "1")
    durable = checkpoint_json(d, job.id, "--wait", "durable")
    d.stop()
    # A reboot empties the tier (it is memory); a stray dir and a half-written staging dir appear.
    shutil.rmtree(d.tier / str(durable["id"]))
    (d.tier / "ck-stray").mkdir(mode=0o700)
    (d.tier / "ck-stray" / "pages-1.img").write_bytes(b"x")
    (d.tier / ".staging" / "ck-half").mkdir(mode=0o700)
    d.start()
    assert not (d.tier / "ck-stray").exists() and not (d.tier / ".staging" / "ck-half").exists()
    assert "'stray_tier': 1" in d.log.read_text() and "'lost_tier': 1" in d.log.read_text()
    shown = json.loads(d.ctl("--json", "show", str(durable["id"]), check=True).stdout)
    assert shown["in_tier"] is False and shown["state"] == "durable" and shown["in_store"] is True
    assert (d.store / str(durable["id"])).is_dir()  # the last durable copy is never deleted
    # And it restores, from the store, with the same memory.
    d.ctl("checkpoint", job.id, "--stop", check=True)  # end the original so only the restored copy runs
    r = json.loads(d.ctl("--json", "restore", str(durable["id"]), check=True).stdout)
    jobs_to_kill.append(r["pid"])
    assert r["from_store"] is True
    keeps_ticking_with(job.log, r["pid"], job.digest, more=3)
