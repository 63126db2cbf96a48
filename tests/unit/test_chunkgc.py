"""The protocol between drains and sweeps sharing one chunk store (memsnap.store.chunkgc), on a real POSIX
store, with two "nodes" (two StoreGc owners, each with its own index) in one process. Each test runs with
loose chunks (an object per chunk) and with packs (memsnap.store.packs)."""

from __future__ import annotations

import collections
import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import blake3
import pytest

from memsnap import safefs
from memsnap.store import chunkgc
from memsnap.store.chunked import ChunkedDrain
from memsnap.store.chunkgc import ChunkIndex, StoreGc, SweepDeferred, sweep
from memsnap.store.chunks import PAGE, ChunkedStorage, Chunking, ChunkReader, chunk_key, chunked_storage, pack_key
from memsnap.store.posix import PosixStore

AVG = 64 << 10


class Counting:
    """A real store whose method calls are counted."""

    def __init__(self, store: PosixStore, pack_size: int) -> None:
        self.store, self.calls, self.pack_size = store, collections.Counter[str](), pack_size

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def call(*a: Any, **kw: Any) -> Any:
            self.calls[name] += 1
            return attr(*a, **kw)

        return call


@pytest.fixture(params=[0, 256 << 10], ids=["loose", "packs"])
def store(tmp_path: Path, request: pytest.FixtureRequest) -> Counting:
    return Counting(PosixStore(tmp_path / "store", create=True), request.param)


def _st(m: dict[str, Any]) -> ChunkedStorage:
    """The parsed storage of a chunked stored manifest's JSON."""
    st = chunked_storage(m)
    assert st is not None
    return st


def _tier(tmp: Path, seed: int, pages: int = 300) -> tuple[Path, dict[str, Any]]:
    d = tmp / f"tier-{seed}"
    d.mkdir()
    (d / "pages-1.img").write_bytes(random.Random(seed).randbytes(pages * PAGE))
    (d / "core-1.img").write_bytes(b"core" * 100)
    return d, {n: {"size": (d / n).stat().st_size, "blake3": blake3.blake3((d / n).read_bytes()).hexdigest()}
               for n in ("pages-1.img", "core-1.img")}


def _drain(gc: StoreGc, d: Path, files: dict[str, Any], ckpt: str) -> tuple[dict[str, Any], ChunkedDrain]:
    with gc.draining() as grant:
        job = ChunkedDrain(gc.store, 0, gc.index, Chunking(AVG), threads=2, trust_index=grant.trust_index,
                           pack_size=getattr(gc.store, "pack_size", 0))
        with safefs.opened(os.open(d, os.O_RDONLY | os.O_DIRECTORY)) as sfd:
            storage = job.run(ckpt, sfd, files, None, lambda n: None)
    return {"id": ckpt, "files": files, "storage": storage}, job


def _node(store: Any, tmp: Path, name: str, **kw: float) -> StoreGc:
    return StoreGc(store, ChunkIndex(tmp / f"index-{name}"), StoreGc.owner_of(str(tmp / name)), **kw)


def _objects(m: dict[str, Any]) -> set[str]:
    """The store keys of the chunk objects and packs m references."""
    refs = [r for lay in _st(m).files.values() for r in lay.chunks]
    return {chunk_key(r.id) if r.loc is None else pack_key(r.loc[0]) for r in refs}


def _present(store: Counting, m: dict[str, Any]) -> bool:
    return all((store.store.root / k).is_file() for k in _objects(m))


def _drained_again(store: Counting, tmp: Path, first: StoreGc, second: StoreGc, seed: int) -> dict[str, Any]:
    """Drains the same pages with first, then (store calls counted from here) with second: nothing new, no
    existence check, no touch. Returns the second manifest."""
    d, files = _tier(tmp, seed)
    _drain(first, d, files, "ck-1")
    store.calls.clear()
    m, job = _drain(second, d, files, "ck-2")
    assert job.stats.new_chunks == 0 and job.stats.reused_chunks == job.stats.chunks > 10
    assert store.calls["touch"] == store.calls["exists"] == 0
    return m


def test_a_drain_of_unchanged_pages_asks_the_store_about_no_chunk(tmp_path: Path, store: Counting) -> None:
    a = _node(store, tmp_path, "a")
    _drained_again(store, tmp_path, a, a, 1)
    # Writes: the lock, the bundle; lists: the locks, the sweep records, the packs; then the lock's removal.
    assert sum(store.calls.values()) <= 7, store.calls


def test_a_chunk_another_node_swept_is_uploaded_again_by_a_node_whose_index_lists_it(tmp_path: Path,
                                                                                    store: Counting) -> None:
    a, b = _node(store, tmp_path, "a"), _node(store, tmp_path, "b")
    d, files = _tier(tmp_path, 2)
    m1, _ = _drain(a, d, files, "ck-1")
    assert _st(m1).referenced_chunks() <= a.index.ids()
    with b.sweeping():  # ck-1 was deleted: nothing references its chunks
        res = sweep(b.store, set(), grace_s=0, now=time.time() + 1, index=b.index)
    assert res.deleted == len(_st(m1).referenced_chunks()) and not _present(store, m1)
    m2, job = _drain(a, d, files, "ck-2")
    assert job.stats.new_chunks == job.stats.chunks and _present(store, m2)
    assert ChunkReader(store.store, _st(m2)).read_at("pages-1.img", 0, 300 * PAGE) == (d / "pages-1.img").read_bytes()


def test_a_sweep_deletes_nothing_while_another_nodes_drain_holds_its_lock(tmp_path: Path, store: Counting) -> None:
    a, b = _node(store, tmp_path, "a"), _node(store, tmp_path, "b", drain_wait_s=0.3)
    d, files = _tier(tmp_path, 3)
    m1, _ = _drain(a, d, files, "ck-1")
    with a.draining(), pytest.raises(SweepDeferred, match="deleted nothing"), b.sweeping():
        sweep(b.store, set(), grace_s=0, now=time.time() + 1)
    assert _present(store, m1)
    with b.sweeping():  # the drain ended: the sweep runs
        assert sweep(b.store, set(), grace_s=0, now=time.time() + 1).deleted == len(_st(m1).referenced_chunks())


def test_a_drain_that_meets_a_sweep_starts_after_it_ends_and_trusts_its_index(tmp_path: Path,
                                                                              store: Counting) -> None:
    a, b = _node(store, tmp_path, "a"), _node(store, tmp_path, "b")
    inside, ended = threading.Event(), threading.Event()

    def sweeper() -> None:
        with b.sweeping():
            inside.set()
            time.sleep(0.5)
            ended.set()

    t = threading.Thread(target=sweeper)
    t.start()
    inside.wait(10)
    with a.draining() as grant:
        assert ended.is_set() and grant.trust_index
    t.join()


def test_a_drain_that_outwaits_a_sweep_checks_each_chunk_its_index_lists(tmp_path: Path, store: Counting) -> None:
    a = _node(store, tmp_path, "a", sweep_wait_s=0.2)
    d, files = _tier(tmp_path, 4)
    _drain(a, d, files, "ck-1")
    other = _node(store, tmp_path, "b")
    with other.sweeping():
        store.calls.clear()
        m, job = _drain(a, d, files, "ck-2")
    assert store.calls["touch"] == len(_objects(m)) and job.stats.reused_chunks == job.stats.chunks


def test_a_lock_of_this_nodes_dead_daemon_is_removed_and_another_nodes_stale_one_ignored(tmp_path: Path,
                                                                                        store: Counting) -> None:
    a = _node(store, tmp_path, "a")
    root = store.store.root
    (root / "_locks").mkdir()
    dead = root / "_locks" / f"sweep-{a.owner}-0123456789ab-1"
    stale = root / "_locks" / "sweep-ffffffffffff-0123456789ab-1"
    live = root / "_locks" / "sweep-eeeeeeeeeeee-0123456789ab-1"
    for p in (dead, stale, live):
        p.write_text("{}")
    old = time.time() - chunkgc.LOCK_STALE_S - 10
    os.utime(stale, (old, old))
    assert a.fresh_locks("sweep") == {"_locks/" + live.name}
    assert not dead.exists() and stale.exists()


def test_an_index_not_synced_for_longer_than_sweep_records_are_kept_is_dropped(tmp_path: Path,
                                                                               store: Counting) -> None:
    index = ChunkIndex(tmp_path / "index")
    index.add(["a" * 64, "b" * 64])
    index.mark_applied([], time.time() - chunkgc.RECORD_KEEP_S)
    ChunkIndex(tmp_path / "index").sync(store)  # (a fresh object: what a restarted daemon reads)
    assert len(ChunkIndex(tmp_path / "index")) == 0
    index2 = ChunkIndex(tmp_path / "index")
    index2.add(["c" * 64])
    index2.sync(store)  # synced just now: kept
    assert "c" * 64 in ChunkIndex(tmp_path / "index")
    assert json.loads((tmp_path / "index.gc").read_text())["synced"] > time.time() - 60


def test_after_an_unreadable_sweep_record_a_drain_uploads_the_chunks_that_sweep_deleted(tmp_path: Path,
                                                                                       store: Counting) -> None:
    a, b = _node(store, tmp_path, "a"), _node(store, tmp_path, "b")
    d, files = _tier(tmp_path, 5)
    _drain(a, d, files, "ck-1")
    with b.sweeping():
        assert sweep(b.store, set(), grace_s=0, now=time.time() + 1).deleted > 0
    (record,) = (store.store.root / "_gc").iterdir()
    record.write_text("{not json")
    m, job = _drain(a, d, files, "ck-2")
    assert job.stats.new_chunks == job.stats.chunks and _present(store, m)


def test_a_new_node_learns_the_stores_chunks_from_one_listing_not_a_check_per_chunk(tmp_path: Path,
                                                                                   store: Counting) -> None:
    m = _drained_again(store, tmp_path, _node(store, tmp_path, "a"), _node(store, tmp_path, "b"), 6)
    assert store.calls["list"] == 3  # sweep records, chunks, packs
    assert store.calls["read_tail"] == len(_objects(m) - {chunk_key(c) for c in _st(m).referenced_chunks()})
    assert _present(store, m)


def test_gcs_sweep_never_deletes_the_chunks_of_a_drain_in_flight(tmp_path: Path, store: Counting) -> None:
    # What keeps gc (memsnap.gc.StoreSweeper) off the chunks a drain is writing, before its manifest exists:
    # the drain's store lock, which a sweep waits out (then marks the manifest) or defers on, deleting
    # nothing; and, for a dry run (no lock), the grace counted back from when the checkpoint being drained
    # here was taken. No list of in-flight chunks is needed.
    from types import SimpleNamespace

    from memsnap.catalog import DRAINING
    from memsnap.gc import StoreSweeper
    from memsnap.store import chunks

    node = _node(store, tmp_path, "a", drain_wait_s=0.3)  # (the drain and the sweep share it, as in memsnapd)
    pending = [SimpleNamespace(state=DRAINING, created_ms=int(time.time() * 1000) - 1000)]
    catalog = SimpleNamespace(checkpoints=lambda states: [r for r in pending if r.state in states])
    repo = SimpleNamespace(store=store, node_chunks=SimpleNamespace(store_gc=lambda s: node, index=lambda: node.index))
    sweeper = StoreSweeper(repo, catalog, 0.0, chunks)
    d, files = _tier(tmp_path, 7)
    with node.draining() as grant:
        job = ChunkedDrain(store, 0, node.index, Chunking(AVG), threads=2, trust_index=grant.trust_index,
                           pack_size=store.pack_size)
        with safefs.opened(os.open(d, os.O_RDONLY | os.O_DIRECTORY)) as sfd:
            m = {"id": "ck-1", "files": files, "storage": job.run("ck-1", sfd, files, None, lambda n: None)}
        assert _present(store, m) and not (store.store.root / "ck-1/manifest.json").exists()  # no manifest yet
        dry = sweeper.sweep(True, time.time() + 60, set())
        assert dry.deleted == 0 and dry.kept_in_grace == len(_objects(m))
        with pytest.raises(SweepDeferred, match="deleted nothing"):
            sweeper.sweep(False, time.time() + 60, set())
        assert _present(store, m)
        with store.open_writer("ck-1/manifest.json") as w:
            w.write(json.dumps(m).encode())
            w.commit()
    pending.clear()  # durable: nothing dumping or draining here now, the grace counts from now
    assert sweeper.sweep(False, time.time() + 60, set()).deleted == 0 and _present(store, m)
    store.delete_keys(["ck-1/manifest.json"])  # the checkpoint deleted: its chunks go
    assert sweeper.sweep(False, time.time() + 60, set()).deleted == len(_st(m).referenced_chunks())
    assert not _present(store, m)
