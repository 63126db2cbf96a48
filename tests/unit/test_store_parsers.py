"""Every parser of what a store (or the node's own chunk state) holds is total: any bytes give a value or a
clean refusal (a StoreError, IntegrityError or a MemsnapError with its status code), never RecursionError,
UnicodeDecodeError, OverflowError, AttributeError or TypeError.

Property-based (hypothesis): random bytes, mutations of valid objects (bytes flipped, cut, spliced; a subtree
of the JSON replaced by any JSON) and deep nesting (200,000 brackets in a 400 KB index: the planted pack of
issue #28 that made every drain fail with RecursionError). Hand-written cases miss the combinations.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memsnap import manifest
from memsnap.catalog import DURABLE, CheckpointRecord
from memsnap.errors import MemsnapError
from memsnap.manifest import IntegrityError
from memsnap.store import Codec, StoreError, StoreNotFound
from memsnap.store import chunks as chunks_mod
from memsnap.store.chunked import ChunkOpts, NodeChunks
from memsnap.store.chunkgc import ChunkIndex, read_record
from memsnap.store.chunks import chunked_storage, load_stored_manifest
from memsnap.store.packs import FOOTER, PACK_MAGIC, parse_tail, read_pack_index

SETTINGS = settings(max_examples=120, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(SETTINGS, max_examples=40)  # (a temp dir or a drain each: the whole file stays under ~20 s)
KEY = b"k" * 32
CID = "a" * 64
PID = "b" * 64

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=40)


def deep(n: int, shape: str) -> bytes:
    """n levels of nesting: lists, objects, both, cut short, or with brackets hidden in strings."""
    if shape == "list":
        return b"[" * n + b"]" * n
    if shape == "dict":
        return b'{"a":' * n + b"1" + b"}" * n
    if shape == "mixed":
        return b'[{"a":' * (n // 2) + b"[]" + b"}]" * (n // 2)
    if shape == "cut":
        return b"[" * n
    return b'["]]]]]]",' * n + b"0" + b"]" * n  # (closing brackets inside strings must not hide the depth)


DEEP = st.builds(deep, st.sampled_from([33, 70, 1000, 200_000]), st.sampled_from(["list", "dict", "mixed", "cut",
                                                                                   "hidden"]))


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """valid bytes, changed in one to three ways."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "splice-deep", "dup"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "splice-deep":
            data[at:at] = draw(DEEP)
        else:
            data[at:at] = data[at:at + draw(st.integers(1, 64))]
    return bytes(data)


@st.composite
def tree_mutated(draw: st.DrawFn, valid: Any) -> Any:
    """A copy of a JSON object with one subtree replaced by any JSON value (the root by any object)."""
    value = json.loads(json.dumps(valid))
    if draw(st.integers(0, 9)) == 0:
        return draw(st.dictionaries(st.text(max_size=8), JSON, max_size=6))
    parent: Any = value
    while True:
        keys = list(parent) if isinstance(parent, dict) else list(range(len(parent)))
        k = draw(st.sampled_from(keys))
        child = parent[k]
        if isinstance(child, dict | list) and child and draw(st.booleans()):
            parent = child
            continue
        parent[k] = draw(JSON)
        return value


class FakeStore:
    """Objects in memory: what the parsers read through (open_reader, read_tail, list)."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects

    def open_reader(self, key: str) -> io.BytesIO:
        if key not in self.objects:
            raise StoreNotFound(key)
        return io.BytesIO(self.objects[key])

    def read_tail(self, key: str, length: int) -> tuple[bytes, int]:
        data = self.open_reader(key).getvalue()
        return data[-length:], len(data)

    def list(self, prefix: str) -> list[str]:
        return sorted(k for k in self.objects if k.startswith(prefix))

    def list_with_mtime(self, prefix: str) -> list[tuple[str, int, float]]:
        return [(k, len(self.objects[k]), 0.0) for k in self.list(prefix)]

    def describe(self) -> str:
        return "fake:"


def _pack(entries: list[list[Any]], body: int = 4096) -> bytes:
    index = json.dumps({"v": 1, "chunks": entries}).encode()
    return b"\0" * body + index + FOOTER.pack(len(index), PACK_MAGIC)


def _pack_with_index(index: bytes) -> bytes:
    return b"\0" * 100 + index + FOOTER.pack(len(index), PACK_MAGIC)


VALID_PACK = _pack([[CID, 0, 100, 200], ["c" * 64, 100, 50, 4096]])


def _stored_manifest() -> dict[str, Any]:
    return {
        "id": "ck-1", "job": "job-1", "uid": 0, "pid": 7, "name": "train", "format": 2, "signature": "0" * 64,
        "files": {"pages-1.img": {"size": 300, "blake3": "d" * 64}, "core-1.img": {"size": 10, "blake3": "e" * 64}},
        "storage": {"layout": "chunked", "codec": "zstd", "chunk_avg": 1 << 20, "logical_bytes": 310,
                    "stored_bytes": 200, "new_bytes": 310, "packs": [PID],
                    "bundle": {"chunk": ["f" * 64, 0, 10, 0, 300, 10], "raw_bytes": 10},
                    "files": {"pages-1.img": {"chunks": [[CID, 0, 100, 0, 0, 90], ["c" * 64, 100, 200]]},
                              "core-1.img": {"bundle": [0, 10]}}},
    }


VALID_MANIFEST = json.dumps(_stored_manifest(), indent=1).encode()


def _tail_parsed(tail: bytes, size: int) -> None:
    try:
        got = parse_tail(tail, size, PID)
    except StoreError:
        return
    assert isinstance(got, int | list)


@SETTINGS
@given(st.binary(max_size=300), st.integers(0, 1 << 64))
def test_a_pack_tail_of_any_bytes_and_size_parses_or_is_refused(tail: bytes, size: int) -> None:
    _tail_parsed(tail, size)


@SETTINGS
@given(st.one_of(JSON.map(lambda v: json.dumps(v).encode()), DEEP, st.binary(max_size=200)))
def test_a_pack_whose_index_is_any_json_or_deep_nesting_or_bytes_is_refused_cleanly(index: bytes) -> None:
    pack = _pack_with_index(index)
    _tail_parsed(pack, len(pack))
    try:
        read_pack_index(FakeStore({"packs/bb/" + PID: pack}), PID)  # type: ignore[arg-type]
    except StoreError:
        pass


@SETTINGS
@given(st.data())
def test_a_mutated_valid_pack_parses_or_is_refused(data: st.DataObject) -> None:
    pack = data.draw(mutated(VALID_PACK))
    _tail_parsed(pack, len(pack))
    _tail_parsed(pack[-64:], len(pack))


def test_the_planted_pack_of_issue_28_is_refused_as_a_store_error() -> None:
    """A pack whose index nests 200,000 deep (valid footer, ~400 KB): RecursionError before."""
    pack = _pack_with_index(b'{"v": 1, "chunks": ' + deep(200_000, "list") + b"}")
    assert 390_000 < len(pack) < 410_000
    try:
        parse_tail(pack, len(pack), PID)
    except StoreError as exc:
        assert PID in str(exc)
    else:
        raise AssertionError("a 200,000-deep pack index parsed")


@SETTINGS
@given(st.one_of(st.binary(max_size=200), DEEP, JSON.map(lambda v: json.dumps(v).encode()),
                 mutated(b'{"chunks": [], "packs": []}')))
def test_a_sweep_record_of_any_bytes_reads_as_its_ids_or_as_unreadable(raw: bytes) -> None:
    got = read_record(FakeStore({"_gc/1-a.json": raw}), "_gc/1-a.json")  # type: ignore[arg-type]
    assert got is None or (isinstance(got[0], set) and isinstance(got[1], set))


def _use_stored(m: dict[str, Any]) -> None:
    """What gc's mark, a restore and a lazy restore do with a stored manifest: its parse gives a value or a
    StoreError (ChunkError: gc's chunked_storage) or IntegrityError (the repository's StoredManifest.parse)."""
    try:
        st = chunked_storage(m)
    except StoreError:
        pass
    else:
        assert st is None or isinstance(st.referenced_chunks() | st.referenced_packs(), set)
    try:
        stored = manifest.StoredManifest.parse(m)
    except IntegrityError:
        return
    from memsnap.repository import adopted_record

    assert adopted_record(stored).id == stored.man.id and isinstance(stored.tier_body(), dict)


@SETTINGS
@given(st.one_of(st.binary(max_size=300), DEEP, mutated(VALID_MANIFEST),
                 JSON.map(lambda v: json.dumps(v).encode())))
def test_a_stored_manifest_of_any_bytes_loads_or_is_refused_and_every_reader_of_it_is_total(raw: bytes) -> None:
    try:
        m = load_stored_manifest(FakeStore({"ck-1/manifest.json": raw}), "ck-1")  # type: ignore[arg-type]
    except StoreError:
        return
    assert isinstance(m, dict)
    _use_stored(m)


@SETTINGS
@given(st.data())
def test_a_valid_stored_manifest_with_any_subtree_replaced_is_read_or_refused(data: st.DataObject) -> None:
    _use_stored(data.draw(tree_mutated(_stored_manifest())))


@SLOW
@given(st.one_of(st.binary(max_size=300), DEEP, mutated(VALID_MANIFEST),
                 tree_mutated(_stored_manifest()).map(lambda v: json.dumps(v).encode())))
def test_a_tier_manifest_of_any_bytes_reads_or_is_refused_and_verifying_it_is_total(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "img"
        d.mkdir()
        (d / "manifest.json").write_bytes(raw)
        try:
            m = manifest.read(d)
        except IntegrityError:
            return
        for check in (lambda: manifest.verify_signature(m, KEY),
                      lambda: manifest.check_binding(m, "ck-1", "job-1", 0),
                      lambda: manifest.verify_dir(d, KEY)):
            try:
                check()
            except IntegrityError:
                pass


@SLOW
@given(st.binary(max_size=400), st.one_of(st.binary(max_size=200), DEEP, JSON.map(lambda v: json.dumps(v).encode())))
def test_the_nodes_chunk_index_files_of_any_bytes_load(index: bytes, state: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "index"
        path.write_bytes(index)
        path.with_name("index.gc").write_bytes(state)
        idx = ChunkIndex(path)
        assert len(idx) >= 0 and isinstance(idx.packs(), set)


@SLOW
@given(st.lists(st.one_of(st.binary(max_size=100), DEEP, JSON.map(lambda v: json.dumps(v).encode()),
                          JSON.map(lambda v: json.dumps({"id": "ck-1", "files": v}).encode())),
                max_size=4))
def test_the_nodes_chunk_maps_of_any_bytes_load(lines: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        node = NodeChunks("fake:", ChunkOpts(state_dir=tmp))
        assert node.maps_path is not None
        node.maps_path.parent.mkdir(parents=True)
        node.maps_path.write_bytes(b"\n".join(lines))
        node.tier_chunks({"ck-1": Path(tmp)})
        node.prepare({"ck-1"})


def _repo_over(objects: dict[str, bytes]) -> Any:
    from memsnap.repository import Repository

    return Repository(FakeStore(objects), KEY, Codec())  # type: ignore[arg-type]


@SLOW
@given(st.one_of(st.binary(max_size=300), DEEP, mutated(VALID_MANIFEST)))
def test_a_restore_or_an_adoption_by_name_meets_any_stored_manifest_with_a_status_code(raw: bytes) -> None:
    repo = _repo_over({"ck-1/manifest.json": raw, "_index/train/ck-1": b"", "_index/train/..": b""})
    rec = CheckpointRecord(id="ck-1", state=DURABLE, pid=1, owner_uid=0, created_ms=1, job="job-1")
    for call in (lambda: repo.stored_manifest(rec), lambda: repo.find("train")):
        try:
            call()
        except MemsnapError:
            pass


@SLOW
@given(st.lists(st.one_of(st.binary(max_size=200), DEEP, mutated(VALID_MANIFEST)),
                min_size=1, max_size=3))
def test_gcs_mark_skips_any_bytes_in_other_manifests_and_keeps_the_good_ones_chunks(raws: list[bytes]) -> None:
    from memsnap.gc import StoreSweeper

    objects = {f"ck-bad{i}/manifest.json": raw for i, raw in enumerate(raws)}
    objects["ck-good/manifest.json"] = VALID_MANIFEST
    keep = StoreSweeper(_repo_over(objects), None, 60.0, chunks_mod).mark(set())
    assert {CID, "c" * 64, PID} <= keep


def test_a_planted_deep_manifest_or_record_in_a_real_posix_store_is_refused_cleanly(tmp_path: Path) -> None:
    from memsnap.store.posix import PosixStore

    store = PosixStore(tmp_path / "store", create=True)
    for key in ("ck-x/manifest.json", "_gc/0000000000001-aa.json"):
        with store.open_writer(key) as w:
            w.write(deep(200_000, "dict"))
            w.commit()
    assert read_record(store, "_gc/0000000000001-aa.json") is None
    try:
        load_stored_manifest(store, "ck-x")
    except StoreError as exc:
        assert "ck-x/manifest.json" in str(exc)
    else:
        raise AssertionError("a 200,000-deep manifest loaded")
    assert os.path.getsize(tmp_path / "store" / "ck-x" / "manifest.json") > 1_000_000
