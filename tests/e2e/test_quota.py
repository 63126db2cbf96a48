"""Quotas for real ([quota], docs/quota.md): a user over its limit is refused before any work starts, as uid 65534
over the real socket, while other users and root go on; `status` and the metrics show usage per uid.

Where the VM stops us: CRIU here cannot dump another uid's processes (root lacks CAP_SYS_RESOURCE), so no user
other than root can take a checkpoint. A user's limit is shown with jobs (`run`), and the checkpoint and tier
limits with root's own ([quota.uid.0]: root may be limited too); tests/unit/test_quota.py covers a user's
checkpoint, tier and store limits with a fake engine.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    NOBODY,
    DaemonProc,
    metrics_port,
    sample,
    scrape_metrics,
    start_counter,
    ticks,
    wait_for,
)

OTHER = 65533  # a second unprivileged user

CONFIG = """
[daemon]
socket_mode = "0666"

[quota]
jobs = 2

[quota.uid.0]
checkpoints = 1
tier_bytes = "48M"
"""


@pytest.fixture
def limited(make_daemon: Any, tmp_path: Path) -> Iterator[DaemonProc]:
    """A daemon with [quota] whose socket any local user reaches (0666 in a 0755 dir)."""
    cfg = tmp_path / "quota.toml"
    cfg.write_text(CONFIG)
    sockdir = Path(tempfile.mkdtemp(prefix="memsnap-q-"))
    os.chmod(sockdir, 0o755)
    d: DaemonProc = make_daemon("q", extra=["--config", str(cfg), "--metrics-listen", "127.0.0.1:0"],
                                socket_path=str(sockdir / "d.sock"))
    d.start()
    yield d
    d.cleanup()
    shutil.rmtree(sockdir, ignore_errors=True)


def _run(d: DaemonProc, jobs_to_kill: list[int], user: int | None) -> Any:
    r = d.ctl("--json", "run", "--", "/bin/sleep", "120", user=user)
    if r.returncode == 0:
        out = json.loads(r.stdout)
        jobs_to_kill.append(int(out["pid"]))
        return out
    return json.loads(r.stderr)["error"]


def _usage(d: DaemonProc, user: int | None = None) -> dict[int, dict[str, int]]:
    s = json.loads(d.ctl("--json", "status", user=user, check=True).stdout)
    return {u.get("uid", 0): u for u in s["usage"]}


def test_a_users_jobs_stop_at_its_quota_while_other_users_and_root_go_on(limited, jobs_to_kill):
    d = limited
    mine = [_run(d, jobs_to_kill, NOBODY) for _ in range(2)]
    assert all("job" in j for j in mine), mine
    refused = _run(d, jobs_to_kill, NOBODY)
    assert refused == {"code": "RESOURCE_EXHAUSTED", "exit_code": 7, "message":
                       "uid 65534 runs 2 of 2 jobs (quota.jobs): stop one ('memsnapctl stop JOB') or ask the "
                       "administrator for more"}
    assert "job" in _run(d, jobs_to_kill, OTHER)  # another user's job starts
    assert all("job" in _run(d, jobs_to_kill, None) for _ in range(3))  # root has no jobs limit
    counter = start_counter(d, jobs_to_kill, 4)  # root's checkpoint still goes through
    assert json.loads(d.ctl("--json", "checkpoint", counter.id, check=True).stdout)["state"] == "staged"

    # status: a user sees its own usage, root everyone's; the metrics too.
    human = d.ctl("status", user=NOBODY, check=True).stdout
    assert "usage    uid 65534: tier 0 B, store 0 B, jobs 2 of 2, checkpoints 0" in human, human
    assert "uid 0" not in human and f"uid {OTHER}" not in human
    theirs = _usage(d, NOBODY)
    assert list(theirs) == [NOBODY] and theirs[NOBODY]["jobs"] == 2 and theirs[NOBODY]["jobs_limit"] == 2
    everyone = _usage(d)
    assert {0, OTHER, NOBODY} <= set(everyone)
    assert everyone[0]["jobs"] == 4 and everyone[0]["checkpoints"] == 1 and everyone[0]["checkpoints_limit"] == 1
    assert "jobs_limit" not in everyone[0] and everyone[OTHER]["jobs"] == 1
    m = scrape_metrics(metrics_port(d))
    assert sample(m, "memsnap_quota_used", uid=str(NOBODY), resource="jobs") == 2
    assert sample(m, "memsnap_quota_limit", uid=str(NOBODY), resource="jobs") == 2
    assert sample(m, "memsnap_quota_used", uid="0", resource="checkpoints") == 1

    # Stopping one frees its place.
    d.ctl("stop", mine[0]["job"], user=NOBODY, check=True)
    assert "job" in _run(d, jobs_to_kill, NOBODY)


def test_roots_own_checkpoints_stop_at_its_quota_before_the_dump_freezes_anything(limited, jobs_to_kill):
    d = limited
    big = start_counter(d, jobs_to_kill, 48, "big")
    r = d.ctl("--json", "checkpoint", big.id)
    err = json.loads(r.stderr)["error"]
    assert err["code"] == "RESOURCE_EXHAUSTED" and r.returncode == 7, err
    assert err["message"].startswith("uid 0 has 0 B of 48.0 MiB in the memory tier (quota.uid.0.tier_bytes) and "
                                     "this needs about "), err
    assert err["message"].endswith("more than the whole quota: ask the administrator for more"), err
    n = len(ticks(big.log, big.pid))
    wait_for(lambda: len(ticks(big.log, big.pid)) >= n + 2, 20, what="the big job to tick on")
    assert json.loads(d.ctl("--json", "list", check=True).stdout) == []  # nothing dumped, nothing failed
    assert not (d.state / "work").exists() or not any((d.state / "work").iterdir())

    small = start_counter(d, jobs_to_kill, 4, "small")
    first = json.loads(d.ctl("--json", "checkpoint", small.id, check=True).stdout)
    r = d.ctl("--json", "checkpoint", small.id)
    assert json.loads(r.stderr)["error"]["message"] == (
        "uid 0 has 1 of 1 checkpoints (quota.uid.0.checkpoints): delete one ('memsnapctl delete ID' or "
        "'memsnapctl gc') or ask the administrator for more")
    assert [k["id"] for k in json.loads(d.ctl("--json", "list", check=True).stdout)] == [first["id"]]
    d.ctl("delete", first["id"], check=True)
    assert json.loads(d.ctl("--json", "checkpoint", small.id, check=True).stdout)["id"] != first["id"]
