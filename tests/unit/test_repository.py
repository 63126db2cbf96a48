"""The store repository (memsnap.repository) and the drain (memsnap.drain, the upload scheduler) on a temp POSIX
store and a temp tier, without root: a checkpoint's stored life as a sequence (staged -> durable -> fetched back
-> found by name -> deleted), in both formats, and what a drain does when the store fails or the checkpoint goes
while it drains."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from memsnap import manifest
from memsnap.catalog import DURABLE, STAGED, Catalog, CheckpointRecord, now_ms
from memsnap.drain import DrainService
from memsnap.errors import IntegrityFailure
from memsnap.repository import Repository
from memsnap.store import Codec, PosixStore, StoreUnavailable
from memsnap.store.chunked import ChunkOpts
from memsnap.tier import MemoryTier

KEY = b"k" * 32
PAGES = os.urandom(3 << 20)


class Node:
    """A catalog, a tier and a repository over one temp dir; store shared when given."""

    def __init__(self, tmp: Path, fmt: str, store: PosixStore | None = None) -> None:
        state = tmp / "state"
        state.mkdir(parents=True, exist_ok=True)
        self.catalog = Catalog(state)
        self.tier = MemoryTier(tmp / "tier")
        self.store = store or PosixStore(tmp / "store", create=True)
        opts = ChunkOpts(format=fmt, avg=64 << 10, state_dir=str(state))
        self.repo = Repository(self.store, KEY, Codec(), chunk_opts=opts)
        self.drain = DrainService(self.repo, self.catalog, self.tier, concurrency=1, retry_initial_s=0.05,
                                  retry_max_s=0.1)

    def staged(self, ckpt_id: str, name: str = "train") -> CheckpointRecord:
        """A signed tier copy of a checkpoint of job-1 (uid 1000), cataloged STAGED."""
        d = self.tier.new_staging(ckpt_id)
        (d / "pages-1.img").write_bytes(PAGES)
        (d / "core-1.img").write_bytes(b"core" * 64)
        body = {"id": ckpt_id, "job": "job-1", "uid": 1000, "name": name, "pid": 7, "created_ms": now_ms(),
                "files": manifest.describe_files(d)}
        manifest.write(d, manifest.sign(body, KEY))
        self.tier.publish(d, ckpt_id)
        rec = CheckpointRecord(id=ckpt_id, state=STAGED, pid=7, owner_uid=1000, created_ms=now_ms(), job="job-1",
                               name=name, size_bytes=len(PAGES) + 256, in_tier=True)
        self.catalog.add_checkpoint(rec)
        return rec

    def wait_state(self, ckpt_id: str, state: str, timeout: float = 20.0) -> CheckpointRecord | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            rec = self.catalog.get_checkpoint(ckpt_id)
            if (rec is None and state == "gone") or (rec is not None and rec.state == state):
                return rec
            time.sleep(0.02)
        raise AssertionError(f"{ckpt_id} never {state}: {self.catalog.get_checkpoint(ckpt_id)}")


@pytest.fixture(params=["files", "chunked"])
def node(request: pytest.FixtureRequest, tmp_path: Path) -> Node:
    n = Node(tmp_path / "a", request.param)
    n.drain.start([])
    yield n  # type: ignore[misc]
    n.drain.stop()


def test_staged_durable_fetched_found_and_deleted_in_turn(node: Node, tmp_path: Path) -> None:
    rec = node.staged("ck-1")
    node.drain.enqueue(rec.id)
    durable = node.wait_state(rec.id, DURABLE)
    assert durable is not None and durable.in_store and durable.stored_bytes > 0 and durable.last_error == ""
    stored = node.repo.stored_manifest(durable)
    assert set(stored.man.files) == {"pages-1.img", "core-1.img"}
    # fetched back: the same bytes, and a tier manifest that verifies bound to the record
    dest = tmp_path / "fetched"
    dest.mkdir(mode=0o700)
    node.repo.fetch(durable, dest)
    assert (dest / "pages-1.img").read_bytes() == PAGES
    manifest.verify_dir(dest, KEY, bound_to=(rec.id, rec.job, rec.owner_uid))
    # found by name, bound to its id; another name finds nothing
    assert [m.man.id for m in node.repo.find("train")] == ["ck-1"]
    assert node.repo.find("eval") == [] and node.repo.find("../x") == []
    # the same store's id on every call, and on a second repository over it
    assert node.repo.id() and node.repo.id() == Repository(node.store, KEY, Codec()).id()
    node.repo.delete(durable)
    with pytest.raises(IntegrityFailure, match="no manifest"):
        node.repo.stored_manifest(durable)


def test_a_stored_manifest_is_bound_to_its_record(node: Node) -> None:
    rec = node.staged("ck-1")
    node.drain.enqueue(rec.id)
    node.wait_state(rec.id, DURABLE)
    other = CheckpointRecord(id="ck-1", state=DURABLE, pid=7, owner_uid=1001, created_ms=1, job="job-1")
    with pytest.raises(IntegrityFailure, match="swapped"):
        node.repo.stored_manifest(other)


def test_a_store_that_fails_twice_costs_two_attempts_then_the_checkpoint_is_durable(node: Node,
                                                                                     monkeypatch: pytest.MonkeyPatch
                                                                                     ) -> None:
    real = node.store.open_writer
    fails = {"n": 2}

    def flaky(key: str) -> object:
        if fails["n"] > 0:
            fails["n"] -= 1
            raise StoreUnavailable("store down (test)")
        return real(key)

    monkeypatch.setattr(node.store, "open_writer", flaky)
    rec = node.staged("ck-1")
    node.drain.enqueue(rec.id)
    durable = node.wait_state(rec.id, DURABLE)
    assert durable is not None and durable.drain_attempts == 3 and durable.last_error == ""


def test_a_checkpoint_deleted_while_it_drains_leaves_nothing_in_the_store(node: Node,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    real = node.repo.put

    def deleted_meanwhile(rec: CheckpointRecord, *a: object, **kw: object) -> object:
        node.catalog.delete_checkpoint(rec.id)  # (memsnapctl delete, while the upload runs)
        return real(rec, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(node.repo, "put", deleted_meanwhile)
    rec = node.staged("ck-1")
    node.drain.enqueue(rec.id)
    node.wait_state(rec.id, "gone")
    end = time.monotonic() + 10
    while any(k.startswith("ck-1/") for k in node.store.list("")) and time.monotonic() < end:
        time.sleep(0.05)
    assert not [k for k in node.store.list("") if k.startswith("ck-1/")]
    assert node.repo.find("train") == []


def test_two_nodes_sharing_a_store_reuse_chunks_and_find_each_others_checkpoints(tmp_path: Path) -> None:
    a = Node(tmp_path / "a", "chunked")
    b = Node(tmp_path / "b", "chunked", store=a.store)
    for n in (a, b):
        n.drain.start([])
    try:
        a.drain.enqueue(a.staged("ck-a").id)
        a.wait_state("ck-a", DURABLE)
        b.drain.enqueue(b.staged("ck-b").id)
        rec_b = b.wait_state("ck-b", DURABLE)
        assert rec_b is not None and rec_b.stored_bytes < len(PAGES) // 4  # a's chunks, not uploaded again
        assert sorted(m.man.id for m in a.repo.find("train")) == ["ck-a", "ck-b"]
    finally:
        for n in (a, b):
            n.drain.stop()


def test_a_stored_copy_is_adopted_by_id_from_its_signed_manifest_and_nothing_else(node: Node) -> None:
    """What a move's target (--via-store) and a restore by name on another node catalog: the signed manifest's
    own fields; one signed by another key, or filed under another id, is refused."""
    from memsnap.repository import adopted_record

    rec = node.staged("ck-1")
    node.drain.enqueue(rec.id)
    node.wait_state(rec.id, DURABLE)
    got = adopted_record(node.repo.signed_manifest("ck-1"))
    assert (got.id, got.job, got.owner_uid, got.name, got.state) == ("ck-1", "job-1", 1000, "train", DURABLE)
    assert got.in_store and not got.in_tier and "home" not in got.meta
    assert adopted_record(node.repo.signed_manifest("ck-1"), "node-a").meta["home"] == "node-a"
    with pytest.raises(IntegrityFailure, match="signature"):
        Repository(node.store, b"x" * 32, Codec()).signed_manifest("ck-1")
    key = next(k for k in node.store.list("ck-1/") if k.endswith("manifest.json"))
    with node.store.open_reader(key) as r, node.store.open_writer(key.replace("ck-1", "ck-2")) as w:
        w.write(r.read())
        w.commit()
    with pytest.raises(IntegrityFailure, match="the one of 'ck-1'"):
        node.repo.signed_manifest("ck-2")
    with pytest.raises(IntegrityFailure, match="no manifest"):
        node.repo.signed_manifest("ck-3")
