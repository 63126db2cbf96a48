"""Bad objects in a store are reported once each, named, counted by kind, and forgotten once swept."""

from __future__ import annotations

import json
import logging
import secrets
import struct
from pathlib import Path

import pytest

from memsnap.metrics import Metrics
from memsnap.store.bad_objects import BAD, BadObjects
from memsnap.store.chunkgc import ChunkIndex, StoreGc, sweep
from memsnap.store.chunks import chunked_storage, pack_key
from memsnap.store.posix import PosixStore


def test_a_bad_object_is_logged_and_counted_once_and_forgotten_when_deleted(caplog: pytest.LogCaptureFixture) -> None:
    bad, kinds = BadObjects(), []
    bad.subscribe(kinds.append)
    with caplog.at_level(logging.WARNING, "memsnap.store"):
        assert bad.report("pack", "packs/ab/x", "nests deeper than 32 levels", "posix:/s")
        assert not bad.report("pack", "packs/ab/x", "nests deeper than 32 levels", "posix:/s")
    assert kinds == ["pack"] and len(bad) == 1
    assert bad.listed() == ["pack packs/ab/x: nests deeper than 32 levels"]
    assert [r.getMessage() for r in caplog.records] == [
        "skipped pack packs/ab/x in posix:/s: nests deeper than 32 levels; its chunks are not reused from it; gc "
        "sweeps it once no manifest references it"]
    bad.forget("packs/ab/x")
    assert len(bad) == 0 and bad.listed() == []


def test_a_key_that_is_not_utf8_is_listed_printably() -> None:
    bad = BadObjects()
    bad.report("manifest", "ck-\udcff/manifest.json", "x" * 1000)
    (line,) = bad.listed()
    line.encode("utf-8")  # (a protobuf string field takes it)
    assert "\\udcff" in line and len(line) < 700


def test_the_metric_counts_bad_objects_by_kind() -> None:
    m = Metrics()
    m.count_bad_object("pack")
    body = m.render().decode()
    assert 'memsnap_store_bad_objects_total{kind="pack"} 1.0' in body
    assert 'memsnap_store_bad_objects_total{kind="manifest"} 0.0' in body


def test_a_drain_skips_a_planted_pack_once_and_a_sweep_deletes_it(tmp_path: Path) -> None:
    store = PosixStore(tmp_path / "store", create=True)
    pid = secrets.token_hex(32)
    index = json.dumps({"v": 1, "chunks": "x"}).encode()
    (store.root / pack_key(pid)).parent.mkdir(parents=True)
    (store.root / pack_key(pid)).write_bytes(b"\0" * 10 + index + struct.pack("<Q8s", len(index), b"MSPACK\x00\x01"))
    BAD.clear()
    gc = StoreGc(store, ChunkIndex(None), "owner")
    ops = gc.learn_packs()
    assert ops == 2 and gc.bad_packs == {pid} and BAD.listed() == [
        f"pack {pack_key(pid)}: has an index with no v1 chunk list"]
    assert gc.learn_packs() == 1  # (never read again: only the listing)
    res = sweep(store, set(), grace_s=0.0)
    assert res.deleted == 0 and res.bytes_freed > 0 and not (store.root / pack_key(pid)).exists()
    assert BAD.listed() == []


def test_a_planted_huge_loose_chunk_or_bundle_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    import os

    import blake3

    from memsnap.store.chunks import ChunkError, ChunkReader, chunk_key, get_chunk

    store = PosixStore(tmp_path / "store", create=True)
    raw = b"x" * 4096
    cid = blake3.blake3(raw).hexdigest()
    path = store.root / chunk_key(cid)
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(8 << 30)  # (sparse: 8 GiB that memory would not hold)
    with pytest.raises(ChunkError, match="larger than any encoding"):
        get_chunk(store, cid, len(raw))
    bundle = store.root / "ck-1" / "bundle"
    bundle.parent.mkdir()
    os.link(path, bundle)
    m = {"id": "ck-1", "files": {}, "storage": {"layout": "chunked", "files": {},
                                               "bundle": {"key": "ck-1/bundle", "raw_bytes": 10, "stored_bytes": 10,
                                                          "stored_blake3": "0" * 64}}}
    with pytest.raises(ChunkError, match="does not match"):
        ChunkReader(store, chunked_storage(m)).bundle()


def test_a_manifest_of_a_newer_format_stops_the_sweep_and_is_named_while_garbage_is_skipped(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from memsnap.gc import StoreSweeper, SweepRefused
    from memsnap.store import chunks

    store = PosixStore(tmp_path / "store", create=True)
    for ckpt, body in (("ck-garbage", b"[[[not json"), ("ck-new", json.dumps({"format": 3, "files": {}}).encode())):
        (store.root / ckpt).mkdir()
        (store.root / ckpt / "manifest.json").write_bytes(body)
    BAD.clear()
    sweeper = StoreSweeper(SimpleNamespace(store=store), None, 0.0, chunks)
    with pytest.raises(SweepRefused, match="format 3, newer than this memsnap knows"):
        sweeper.mark(set())
    assert [line.split(":")[0] for line in BAD.listed()] == ["manifest ck-new/manifest.json",
                                                            "manifest ck-garbage/manifest.json"]
    assert sweeper.mark({"ck-new"}) == set()  # (without it: the garbage is skipped, the mark completes)
