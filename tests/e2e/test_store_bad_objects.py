"""Objects planted in a shared store (issue #28 item 1) stop nothing: a real daemon, real CRIU, a POSIX store.

Anyone who writes the store (another node, a holder of its credentials) can leave a pack whose index nests
200,000 deep, a manifest and a sweep record that are no JSON memsnap writes, a name-index entry that names
no checkpoint. Before, the pack alone made every drain fail with RecursionError and retry forever, and root's
gc answer INTERNAL. Now each is skipped, named in the log, in root's `memsnapctl status` and in
memsnap_store_bad_objects_total{kind}; drains become durable, gc answers, restores of other checkpoints work.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
import tempfile
from pathlib import Path
from typing import Any

from tests.helpers import (
    NOBODY,
    DaemonProc,
    metrics_port,
    run_as,
    sample,
    scrape_metrics,
    start_counter,
    ticks,
    wait_for,
)


def _deep(n: int = 200_000) -> bytes:
    return b"[" * n + b"]" * n


def _plant(store: Path, key: str, data: bytes) -> Path:
    p = store / key
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def _ctl_json(d: DaemonProc, *args: str, user: int | None = None, timeout: float = 120) -> Any:
    r = d.ctl("--json", *args, user=user, timeout=timeout)
    assert r.returncode == 0, f"memsnapctl {' '.join(args)} exited {r.returncode}: {r.stderr}"
    return json.loads(r.stdout)


def test_a_planted_pack_manifest_sweep_record_and_index_entry_stop_no_drain_gc_or_restore(make_daemon, tmp_path,
                                                                                          jobs_to_kill):
    sockdir = Path(tempfile.mkdtemp(prefix="memsnap-bad-"))
    os.chmod(sockdir, 0o755)  # (uid 65534 reaches the socket: status must not show it the store's objects)
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[daemon]\nsocket_mode = "0666"\n[retention]\ngc_interval = 0\nchunk_grace = "0s"\n'
                   '[drain]\nretry_initial_s = 0.2\nretry_max_s = 1.0\n')
    try:
        d: DaemonProc = make_daemon("bad", extra=["--config", str(cfg), "--metrics-listen", "127.0.0.1:0"],
                                    socket_path=str(sockdir / "d.sock")).start()
        a = start_counter(d, jobs_to_kill, 8, "first")
        ck_a = _ctl_json(d, "checkpoint", a.id, "--wait", "durable", "--stop")["id"]

        # What another node (or anyone with the store's credentials) leaves in the store:
        pid = secrets.token_hex(32)
        index = b'{"v": 1, "chunks": ' + _deep() + b"}"
        pack = _plant(d.store, f"packs/{pid[:2]}/{pid}", b"\0" * 64 + index + struct.pack("<Q8s", len(index),
                                                                                               b"MSPACK\x00\x01"))
        assert 390_000 < pack.stat().st_size < 410_000
        _plant(d.store, "ck-planted/manifest.json", b'{"files": ' + _deep() + b"}")
        record = f"_gc/{9_999_999_999_999:013d}-{secrets.token_hex(8)}.json"
        _plant(d.store, record, b"\xff\xfe" + _deep(1000))
        _plant(d.store, "_index/ghost/-planted", b"")

        # A drain after the planting becomes durable (before: RecursionError at every attempt, for ever).
        b = start_counter(d, jobs_to_kill, 8, "second")
        ck_b = _ctl_json(d, "checkpoint", b.id, "--wait", "durable", timeout=90)
        assert ck_b["state"] == "durable", ck_b

        # A restore of another checkpoint, from the store, works; a restore by a name only the planted index
        # entry lists is NOT_FOUND (the entry is skipped).
        d.ctl("evict", ck_a, check=True)
        last = ticks(a.log, a.pid)[-1].n
        r = _ctl_json(d, "restore", ck_a)
        jobs_to_kill.append(r["pid"])
        assert r["from_store"] is True
        wait_for(lambda: len(ticks(a.log, r["pid"])) >= 2, 60, what="the restored job to tick")
        assert ticks(a.log, r["pid"])[0].n == last + 1
        ghost = d.ctl("restore", "ghost")
        assert ghost.returncode == 3 and "NOT_FOUND" in ghost.stderr, ghost.stderr

        # root's status names each bad object; the human line too; uid 65534's status shows none of them.
        st = _ctl_json(d, "status")
        listed = "\n".join(st["store_bad_objects"])
        assert st["store_bad_object_count"] >= 3, st["store_bad_objects"]
        assert f"pack packs/{pid[:2]}/{pid}: has an index that nests deeper than 32 levels" in listed
        assert f"sweep-record {record}" in listed and "name-index _index/ghost/-planted" in listed
        human = d.ctl("status", check=True).stdout
        assert "objects in the store skipped" in human
        nobody = run_as(NOBODY, "import sys\nfrom memsnap.client import MemsnapClient\n"
                                "s = MemsnapClient(socket=sys.argv[1]).status()\n"
                                "print(len(s.store_bad_objects), s.store_bad_object_count, s.store)", d.socket)
        assert nobody.returncode == 0, nobody.stderr
        assert nobody.stdout.split()[:2] == ["0", "0"] and "posix:" in nobody.stdout, nobody.stdout
        scraped = scrape_metrics(metrics_port(d))
        for kind in ("pack", "sweep-record", "name-index"):
            assert sample(scraped, "memsnap_store_bad_objects_total", kind=kind) == 1, kind
        assert f"skipped pack packs/{pid[:2]}/{pid}" in d.log.read_text(errors="replace")

        # root's gc answers (before: INTERNAL), skips the planted manifest, and sweeps the planted pack, which
        # no manifest references; both real checkpoints stay whole.
        g = d.ctl("--json", "gc")
        assert g.returncode == 0 and "INTERNAL" not in g.stderr, g.stderr
        out = json.loads(g.stdout)
        assert out["swept"] is True, out
        assert not pack.exists()
        listed = "\n".join(_ctl_json(d, "status")["store_bad_objects"])
        assert "manifest ck-planted/manifest.json: nests deeper" in listed and pid not in listed
        assert sample(scrape_metrics(metrics_port(d)), "memsnap_store_bad_objects_total", kind="manifest") == 1
        assert "skipped manifest ck-planted/manifest.json" in d.log.read_text(errors="replace")
        ids = {k["id"]: k["state"] for k in _ctl_json(d, "list")}
        assert ids[ck_a] == "durable" and ids[ck_b["id"]] == "durable", ids
        d.ctl("evict", ck_b["id"], check=True)
        r2 = _ctl_json(d, "restore", ck_b["id"])
        jobs_to_kill.append(r2["pid"])
        wait_for(lambda: len(ticks(b.log, r2["pid"])) >= 2, 60, what="the second restored job to tick")
    finally:
        import shutil

        shutil.rmtree(sockdir, ignore_errors=True)
