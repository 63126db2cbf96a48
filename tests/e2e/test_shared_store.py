"""Two nodes on one store, POSIX and S3 (moto): a stored checkpoint is deleted only by the node that made it (or
where its job moved, tests/unit/test_retention.py); a node that adopted it from the store (`restore NAME`) only
forgets its own catalog row, in `delete` and in gc, and says so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import DaemonProc, start_counter


def _node(make_daemon: Any, tmp_path: Path, name: str, more: str, *extra: str, s3: Any = None) -> DaemonProc:
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(f'[daemon]\nnode_name = "{name}"\n[retention]\ngc_interval = 0\n{more}\n')
    env: dict[str, str] = {}
    args = ["--config", str(cfg), *extra]
    if s3 is not None:
        args += ["--store-url", f"s3://{s3.bucket}/shared-{tmp_path.name}", "--s3-endpoint", s3.endpoint_url,
                 "--s3-region", s3.region]
        env = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key,
               "AWS_DEFAULT_REGION": s3.region}
    d: DaemonProc = make_daemon(name, extra=args, env=env)
    return d.start()


def _json(d: DaemonProc, *args: str) -> Any:
    return json.loads(d.ctl("--json", *args, check=True).stdout)


@pytest.mark.parametrize("backend", ["posix", "s3"])
def test_a_node_that_adopted_a_stored_checkpoint_only_forgets_it_and_its_maker_keeps_it(make_daemon, tmp_path,
                                                                                         jobs_to_kill, backend,
                                                                                         request):
    s3 = request.getfixturevalue("s3_server") if backend == "s3" else None
    a = _node(make_daemon, tmp_path, "na", "", s3=s3)
    b = _node(make_daemon, tmp_path, "nb", "keep_last = 1", "--store-dir", str(a.store), "--hmac-key-file",
              str(a.state / "hmac.key"), s3=s3)

    def stored(ckpt_id: str) -> bool:
        if s3 is None:
            return (a.store / ckpt_id / "manifest.json").exists()
        got = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=f"shared-{tmp_path.name}/{ckpt_id}/")
        return int(got.get("KeyCount", 0)) > 0

    job = start_counter(a, jobs_to_kill, 8, "shared")
    c1 = _json(a, "checkpoint", job.id, "--wait", "durable")["id"]
    first = _json(b, "restore", "shared")  # b adopts a's stored checkpoint
    jobs_to_kill.append(first["pid"])
    assert first["checkpoint"] == c1
    b.ctl("kill", first["job"], check=True)

    # delete on b: only b's row goes, and b says whose the stored copy is.
    r = b.ctl("delete", c1, check=True)
    assert r.stdout.strip() == f"forgot {c1} on this node; its stored copy stays: na made it and deletes it"
    assert stored(c1) and c1 not in [k["id"] for k in _json(b, "list")]

    # gc on b (keep_last 1): the adopted one goes from b's catalog only; b's own is b's to delete.
    again = _json(b, "restore", "shared")  # adopted again: b had forgotten it
    jobs_to_kill.append(again["pid"])
    assert again["checkpoint"] == c1
    c2 = _json(b, "checkpoint", again["job"], "--wait", "durable", "--stop")["id"]
    gc = _json(b, "gc")
    assert gc["deleted"] == [c1] and gc["forgotten"] == [{"id": c1, "reason": "na made it and deletes it"}]
    assert stored(c1) and stored(c2)
    human = b.ctl("gc", "--dry-run", check=True).stdout
    assert "would delete 0 checkpoints" in human
    assert b.ctl("delete", c2, check=True).stdout.strip() == f"deleted {c2}"
    assert not stored(c2) and stored(c1)

    # a made c1: a's delete takes the stored copy.
    assert a.ctl("delete", c1, check=True).stdout.strip() == f"deleted {c1}"
    assert not stored(c1)
