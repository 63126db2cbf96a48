"""Retention and gc with a real daemon and real CRIU: the POSIX store and moto's S3 (docs/retention.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    NOBODY,
    CounterJob,
    DaemonProc,
    counter_argv,
    metrics_port,
    missing_chunks,
    sample,
    scrape_metrics,
    start_counter,
    ticks,
    wait_for,
)


def _daemon(make_daemon: Any, tmp_path: Path, name: str, retention: str, *extra: str,
            s3: Any = None, **kw: Any) -> DaemonProc:
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(f"[retention]\ngc_interval = 0\n{retention}\n")
    more = ["--config", str(cfg), *extra]
    env: dict[str, str] = dict(kw.pop("env", {}))
    if s3 is not None:
        more += ["--store-url", f"s3://{s3.bucket}/{name}-{tmp_path.name}", "--s3-endpoint", s3.endpoint_url,
                 "--s3-region", s3.region]
        env |= {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key,
               "AWS_DEFAULT_REGION": s3.region}
    d: DaemonProc = make_daemon(name, extra=more, env=env, **kw)
    return d.start()


def _ctl_json(d: DaemonProc, *args: str, user: int | None = None) -> Any:
    return json.loads(d.ctl("--json", *args, check=True, user=user).stdout)


def _durable(d: DaemonProc, target: str, *flags: str) -> str:
    ck = _ctl_json(d, "checkpoint", target, "--wait", "durable", *flags)
    assert ck["state"] == "durable"
    return str(ck["id"])


def _ids(d: DaemonProc) -> list[str]:
    return [k["id"] for k in _ctl_json(d, "list")]


def _restores_where_it_stopped(d: DaemonProc, ckpt_id: str, job: CounterJob, jobs_to_kill: list[int]) -> None:
    """Evicts the tier copy, restores from the store: the next tick follows the last one, same memory."""
    last = ticks(job.log, job.pid)[-1].n
    d.ctl("evict", ckpt_id, check=True)
    r = _ctl_json(d, "restore", ckpt_id)
    jobs_to_kill.append(r["pid"])
    assert r["from_store"] is True
    wait_for(lambda: len(ticks(job.log, r["pid"])) >= 2, 60, what="the restored job to tick")
    got = ticks(job.log, r["pid"])
    assert got[0].n == last + 1 and all(t.digest == job.digest for t in got)


def _three_checkpoints(d: DaemonProc, jobs_to_kill: list[int], name: str = "") -> tuple[CounterJob, list[str]]:
    job = start_counter(d, jobs_to_kill, 8, name)
    ids = [_durable(d, job.id), _durable(d, job.id), _durable(d, job.id, "--stop")]
    return job, ids


@pytest.mark.parametrize("backend", ["posix", "s3", "posix-whole-files"])
def test_keep_last_1_keeps_the_last_durable_checkpoint_and_frees_the_rest(make_daemon, tmp_path, jobs_to_kill,
                                                                          backend, request):
    s3 = request.getfixturevalue("s3_server") if backend == "s3" else None
    whole = ["--store-format", "whole"] if backend.endswith("whole-files") else []
    d = _daemon(make_daemon, tmp_path, "keep1", "keep_last = 1", "--metrics-listen", "127.0.0.1:0", *whole, s3=s3)
    job, ids = _three_checkpoints(d, jobs_to_kill)
    stored = {k["id"]: k["stored_bytes"] for k in _ctl_json(d, "list")}
    assert all(stored[i] > 0 for i in ids)
    r = _ctl_json(d, "gc")
    assert r["deleted"] == ids[:2] and not r["dry_run"]
    assert r["kept"] == [{"id": ids[2], "reason": "last durable checkpoint of its job"}]
    assert r["swept"]
    if whole:  # whole-file copies are freed with their checkpoint
        assert r["checkpoint_bytes"] == stored[ids[0]] + stored[ids[1]]
    else:  # chunks are freed by the sweep, and only past the grace period (24 h by default)
        assert r["checkpoint_bytes"] == 0 and r["chunks_swept"] == 0
    assert _ids(d) == ids[2:]
    assert not (d.tier / ids[0]).exists() and not (d.tier / ids[1]).exists()
    if backend == "posix":
        assert not (d.store / ids[0]).exists() and not (d.store / ids[1]).exists()
    m = scrape_metrics(metrics_port(d))
    assert sample(m, "memsnap_gc_runs_total", result="ok") == 1
    assert sample(m, "memsnap_gc_checkpoints_deleted_total") == 2
    assert sample(m, "memsnap_gc_bytes_freed_total") >= r["checkpoint_bytes"]
    assert sample(m, "memsnap_store_bytes") == stored[ids[2]] and sample(m, "memsnap_store_dedup_ratio") > 0
    _restores_where_it_stopped(d, ids[2], job, jobs_to_kill)
    assert _ctl_json(d, "gc")["deleted"] == []  # the kept one stays kept


def test_gc_dry_run_deletes_nothing(make_daemon, tmp_path, jobs_to_kill):
    d = _daemon(make_daemon, tmp_path, "dry", "keep_last = 1")
    job, ids = _three_checkpoints(d, jobs_to_kill)
    before = sorted(p.name for p in d.store.iterdir())
    r = _ctl_json(d, "gc", "--dry-run")
    assert r["dry_run"] and r["deleted"] == ids[:2]
    assert _ids(d) == ids
    assert sorted(p.name for p in d.store.iterdir()) == before and all((d.tier / i).is_dir() for i in ids)
    human = d.ctl("gc", "--dry-run", check=True).stdout
    assert f"would delete {ids[0]}" in human and "would delete 2 checkpoints" in human
    wide = d.ctl("gc", "--dry-run", "-o", "wide", check=True).stdout
    assert f"kept {ids[2]}: last durable checkpoint of its job" in wide
    assert _ids(d) == ids


def test_run_keep_last_applies_to_that_job_and_the_node_default_to_the_others(make_daemon, tmp_path, jobs_to_kill):
    d = _daemon(make_daemon, tmp_path, "perjob", "")  # the node keeps everything
    mine = _ctl_json(d, "run", "--keep-last", "0", "--name", "kept-short", "--", *counter_argv(8, 0.1))
    jobs_to_kill.append(int(mine["pid"]))
    wait_for(lambda: len(ticks(mine["log"])) >= 2, 60, what="the job to tick")
    other = start_counter(d, jobs_to_kill, 8, "kept-all")
    a = [_durable(d, mine["job"]) for _ in range(3)]
    b = [_durable(d, other.id) for _ in range(2)]
    r = _ctl_json(d, "gc")
    assert r["deleted"] == a[:2]
    assert {k["id"]: k["reason"] for k in r["kept"]} == {a[2]: "last durable checkpoint of its job",
                                                          b[0]: "no retention policy", b[1]: "no retention policy"}
    # checkpoint --keep-within sets a rule for a series from then on
    b.append(_durable(d, other.id, "--keep-within", "1h"))
    assert _ctl_json(d, "gc")["deleted"] == []


def test_gc_as_another_user_deletes_none_of_roots_checkpoints_and_sweeps_nothing(make_daemon, tmp_path,
                                                                                  jobs_to_kill):
    import os
    import shutil
    import tempfile

    sockdir = Path(tempfile.mkdtemp(prefix="memsnap-gc-"))
    os.chmod(sockdir, 0o755)
    try:
        d = _daemon(make_daemon, tmp_path, "users", 'keep_last = 0\n[daemon]\nsocket_mode = "0666"',
                    socket_path=str(sockdir / "d.sock"))
        job, ids = _three_checkpoints(d, jobs_to_kill)
        r = _ctl_json(d, "gc", user=NOBODY)
        assert r["deleted"] == [] and r["kept"] == [] and not r["swept"]
        assert "root only" in r["sweep_note"]
        assert _ids(d) == ids
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


def test_gc_while_a_drain_runs_keeps_it_and_it_becomes_durable_and_restores(make_daemon, tmp_path, jobs_to_kill):
    # A 1 MiB/s drain holds the last checkpoint mid-way while gc runs.
    d = _daemon(make_daemon, tmp_path, "busy", "keep_last = 0\nchunk_grace = 0", "--drain-bandwidth", "1M",
                "--compression-level", "0")
    job = start_counter(d, jobs_to_kill, 8)
    first = _durable(d, job.id)
    ck = _ctl_json(d, "checkpoint", job.id, "--stop")
    with d.client() as c:
        wait_for(lambda: c.show(ck["id"]).state == 3 and c.show(ck["id"]).drained_bytes > 0, 60,
                 what="the drain to be in flight")
    r = _ctl_json(d, "gc")
    assert r["deleted"] == []
    kept = {k["id"]: k["reason"] for k in r["kept"]}
    assert kept == {first: "last durable checkpoint of its job", ck["id"]: "not durable yet (draining)"}
    with d.client() as c:
        wait_for(lambda: c.show(ck["id"]).state == 4, 120, what="the drain to finish")
    assert _ctl_json(d, "gc")["deleted"] == [first]
    _referenced_chunks_present(d, ck["id"])
    _restores_where_it_stopped(d, ck["id"], job, jobs_to_kill)


def test_list_and_show_report_logical_stored_and_new_bytes(make_daemon, tmp_path, jobs_to_kill):
    d = _daemon(make_daemon, tmp_path, "sizes", "")
    job = start_counter(d, jobs_to_kill, 8)
    ck = _durable(d, job.id)
    k = _ctl_json(d, "show", ck)
    assert k["logical_bytes"] == k["size_bytes"] > 0 and k["new_bytes"] > 0 and k["stored_bytes"] > 0
    table = d.ctl("list", check=True).stdout.splitlines()
    assert table[0].split()[4:7] == ["SIZE", "STORED", "NEW"]
    shown = d.ctl("show", ck, check=True).stdout
    assert "written to the store" in shown and "were new there" in shown


def _referenced_chunks_present(d: DaemonProc, ckpt_id: str) -> int:
    """How many chunks ckpt_id's stored manifest references; asserts every one is in the (POSIX) store."""
    from memsnap.store import chunks

    m = json.loads((d.store / ckpt_id / "manifest.json").read_text())
    st = chunks.chunked_storage(m)
    assert st is not None
    refs = st.referenced_chunks()
    missing = missing_chunks(d.store, m)
    assert not missing, f"{len(missing)} of {len(refs)} chunks of {ckpt_id} are gone"
    return len(refs)


def test_kill9_in_the_chunk_sweep_loses_no_chunk_of_a_durable_checkpoint(make_daemon, tmp_path, jobs_to_kill):
    d = _daemon(make_daemon, tmp_path, "crash", "keep_last = 1\nchunk_grace = 0",
                env={"MEMSNAP_FAILPOINTS": "sweep-deleted-one"})
    for _ in range(2):  # (two garbage packs: the gc dies after deleting one)
        gone = start_counter(d, jobs_to_kill, 8)  # its only checkpoint is deleted: all its chunks are garbage
        _ctl_json(d, "delete", _durable(d, gone.id, "--stop"))
    job = start_counter(d, jobs_to_kill, 8)
    old, kept = _durable(d, job.id), _durable(d, job.id, "--stop")
    assert _referenced_chunks_present(d, kept) > 0
    r = d.ctl("gc")  # dies after the first chunk it deletes
    assert r.returncode != 0
    assert d.proc is not None and d.proc.wait(30) == 137
    _referenced_chunks_present(d, kept)
    d.env = {}
    d.start()
    assert _ids(d) == [kept]  # the retention step had deleted `old` before the sweep
    r2 = _ctl_json(d, "gc")
    assert r2["swept"] and r2["chunks_swept"] > 0 and r2["chunk_bytes_freed"] > 0 and old not in _ids(d)
    _referenced_chunks_present(d, kept)
    _restores_where_it_stopped(d, kept, job, jobs_to_kill)


def test_a_sweep_on_another_node_makes_this_nodes_next_drain_upload_the_swept_chunks_again(make_daemon, tmp_path,
                                                                                           jobs_to_kill):
    a = _daemon(make_daemon, tmp_path, "na", "chunk_grace = 0")
    b = _daemon(make_daemon, tmp_path, "nb", "chunk_grace = 0", "--store-dir", str(a.store), "--hmac-key-file",
                str(a.state / "hmac.key"))
    job = start_counter(a, jobs_to_kill, 8)
    first = _durable(a, job.id)
    swept = _referenced_chunks_present(a, first)
    _ctl_json(a, "delete", first)  # a's chunk index still lists every chunk `first` had
    r = _ctl_json(b, "gc")
    assert r["swept"] and r["chunks_swept"] >= swept
    second = _durable(a, job.id, "--stop")  # the same memory: the same chunks, gone from the store
    _referenced_chunks_present(a, second)
    _restores_where_it_stopped(a, second, job, jobs_to_kill)


def test_a_second_checkpoint_costs_a_few_store_operations_none_per_chunk(make_daemon, tmp_path, jobs_to_kill):
    d = _daemon(make_daemon, tmp_path, "ops", "")
    job = start_counter(d, jobs_to_kill, 64)
    _durable(d, job.id)
    second = _durable(d, job.id, "--stop")
    line = next(s for s in d.log.read_text().splitlines() if second in s and "round trips" in s)
    words = line.split("chunked: ")[1].replace(",", "").split()  # N chunks, N new (..) N reused, .. N round trips
    reused, trips = int(words[words.index("reused") - 1]), int(words[words.index("round") - 1])
    new = int(words[words.index("new") - 1])
    # The new chunks go into one or two packs. Besides: the bundle, the manifest, the store lock (written,
    # removed) and three lists (locks, sweep records, packs).
    assert reused >= 40 and new > 0 and trips <= 2 + 6, line


def test_the_daemon_runs_gc_every_gc_interval(make_daemon, tmp_path, jobs_to_kill):
    d = _daemon(make_daemon, tmp_path, "periodic", "keep_last = 1")
    (tmp_path / "periodic.toml").write_text("[retention]\nkeep_last = 1\ngc_interval = \"1s\"\n")
    d.stop()
    d.start()
    job, ids = _three_checkpoints(d, jobs_to_kill)
    wait_for(lambda: _ids(d) == ids[2:], 30, what="the periodic gc to delete the older checkpoints")


@pytest.mark.parametrize("backend", ["posix", "s3"])
def test_sweep_frees_the_chunks_only_deleted_checkpoints_had_and_the_kept_one_restores(make_daemon, tmp_path,
                                                                                       jobs_to_kill, backend,
                                                                                       request):
    s3 = request.getfixturevalue("s3_server") if backend == "s3" else None
    d = _daemon(make_daemon, tmp_path, "sweep", "keep_last = 1\nchunk_grace = 0", s3=s3)
    gone = start_counter(d, jobs_to_kill, 8)  # random memory of its own: its chunks are no one else's
    _ctl_json(d, "delete", _durable(d, gone.id, "--stop"))
    job, ids = _three_checkpoints(d, jobs_to_kill)
    dry = _ctl_json(d, "gc", "--dry-run")
    r = _ctl_json(d, "gc")
    assert r["deleted"] == ids[:2] and r["swept"]
    assert r["chunks_swept"] == dry["chunks_swept"] > 0 and r["chunk_bytes_freed"] >= 8 << 20
    assert _ctl_json(d, "gc")["chunks_swept"] == 0
    _restores_where_it_stopped(d, ids[2], job, jobs_to_kill)
