"""A stored manifest is parsed once, where it enters (Repository.signed_manifest, after its signature): one that
memsnap does not write (a storage field missing, a value of another type) is refused there with the integrity
error, so that a fetch, a lazy restore or an adoption never meets a KeyError or TypeError (gRPC INTERNAL)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from memsnap import manifest
from memsnap.catalog import DURABLE, CheckpointRecord
from memsnap.errors import IntegrityFailure
from memsnap.manifest import IntegrityError, StoredManifest
from memsnap.repository import Repository, adopted_record
from memsnap.store import Codec, PosixStore

KEY = b"k" * 32
CID, CID2, PID = "a" * 64, "c" * 64, "b" * 64


def _body() -> dict[str, Any]:
    return {"id": "ck-1", "pid": 7, "job": "job-1", "name": "train", "uid": 1000, "created_ms": 1,
            "frozen_ms": 2.5, "dump_ms": 3.0, "host": "node-a",
            "files": {"pages-1.img": {"size": 300, "blake3": "d" * 64}, "core-1.img": {"size": 10, "blake3": "e" * 64}}}


def chunked() -> dict[str, Any]:
    """The JSON of a chunked (format 2) stored manifest, unsigned."""
    return {**_body(), "format": 2, "storage": {
        "layout": "chunked", "codec": "zstd", "chunk_avg": 1 << 20, "logical_bytes": 310, "stored_bytes": 200,
        "new_bytes": 310, "packs": [PID], "bundle": {"chunk": ["f" * 64, 0, 10, 0, 300, 10], "raw_bytes": 10},
        "files": {"pages-1.img": {"chunks": [[CID, 0, 100, 0, 0, 90], [CID2, 100, 200]]},
                  "core-1.img": {"bundle": [0, 10]}}}}


def whole_files() -> dict[str, Any]:
    """The JSON of a whole-file (format 1) stored manifest, unsigned."""
    return {**_body(), "format": 1, "storage": {"codec": "zstd", "files": {
        n: {"key": f"ck-1/{n}.zst", "stored_bytes": 5, "stored_blake3": "0" * 64, "codec": "zstd"}
        for n in ("pages-1.img", "core-1.img")}}}


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Sets (or, with value ..., removes) the field at a slash-separated path."""
    def apply(m: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        for p in parents:
            m = m[p]
        if value is ...:
            del m[last]
        else:
            m[last] = value
    return apply


MALFORMED_CHUNKED = {
    "no storage files": _set("storage/files", ...),
    "storage files a list": _set("storage/files", []),
    "a chunk list not a list": _set("storage/files/pages-1.img/chunks", "x"),
    "a chunk entry of 2 items": _set("storage/files/pages-1.img/chunks", [[CID, 0]]),
    "a chunk length a string": _set("storage/files/pages-1.img/chunks", [[CID, 0, "300"]]),
    "a file's blake3 missing": _set("files/core-1.img/blake3", ...),
    "a file's size a string": _set("files/core-1.img/size", "10"),
    "a bundled file and no bundle": _set("storage/bundle", None),
    "a bundle entry of another shape": _set("storage/bundle", {"chunk": "f" * 64}),
    "an old bundle without its hash": _set("storage/bundle", {"key": "ck-1/bundle", "raw_bytes": 10,
                                                              "stored_bytes": 9}),
    "a pack list of numbers": _set("storage/packs", [1]),
}
MALFORMED_WHOLE = {
    "no storage": _set("storage", ...),
    "a file's stored blake3 missing": _set("storage/files/core-1.img/stored_blake3", ...),
    "a file's key a number": _set("storage/files/core-1.img/key", 5),
    "a file's entry a list": _set("storage/files/core-1.img", []),
    "a file missing from storage": _set("storage/files/core-1.img", ...),
}
MALFORMED_EITHER = {
    "files a list": _set("files", []),
    "pid missing": _set("pid", ...),
    "uid a string": _set("uid", "1000"),
    "created_ms a string": _set("created_ms", "1"),
    "frozen_ms null": _set("frozen_ms", None),
    "dump_ms huge": _set("dump_ms", 1e400),
    "a file named ..": _set("files/..", {"size": 1, "blake3": "0" * 64}),
}
CASES = [(f"chunked: {k}", chunked, f) for k, f in {**MALFORMED_CHUNKED, **MALFORMED_EITHER}.items()] + \
        [(f"whole files: {k}", whole_files, f) for k, f in {**MALFORMED_WHOLE, **MALFORMED_EITHER}.items()]


def _repo_with(tmp_path: Path, m: dict[str, Any]) -> Repository:
    store = PosixStore(tmp_path / "store", create=True)
    with store.open_writer("ck-1/manifest.json") as w:
        # (JSON has no Infinity: a float too large for a double reads back as one, signature and all)
        w.write(json.dumps(manifest.sign(m, KEY, m["format"]), indent=1, sort_keys=True).encode()
                .replace(b"Infinity", b"1e400"))
        w.commit()
    return Repository(store, KEY, Codec())


REC = CheckpointRecord(id="ck-1", state=DURABLE, pid=7, owner_uid=1000, created_ms=1, job="job-1")


@pytest.mark.parametrize("make", [chunked, whole_files])
def test_a_valid_stored_manifest_parses_into_its_manifest_and_storage(tmp_path: Path, make: Any) -> None:
    repo = _repo_with(tmp_path, make())
    stored = repo.stored_manifest(REC)
    assert stored.man.id == "ck-1" and stored.man.uid == 1000 and set(stored.man.files) == {"pages-1.img",
                                                                                           "core-1.img"}
    assert "storage" not in stored.man.body()
    if make is chunked:
        st = stored.chunked
        assert st is not None and st.files["core-1.img"].bundle == (0, 10)
        assert st.referenced_chunks() == {CID, CID2, "f" * 64} and st.referenced_packs() == {PID}
        assert stored.catalog_meta()["store"] == {"format": "chunked", "logical_bytes": 310, "stored_bytes": 200,
                                                  "new_bytes": 310}
    else:
        assert stored.chunked is None and "store" not in stored.catalog_meta()
    rec = adopted_record(repo.signed_manifest("ck-1"))
    assert (rec.id, rec.job, rec.owner_uid, rec.name, rec.pid, rec.frozen_ms) == ("ck-1", "job-1", 1000, "train",
                                                                                  7, 2)
    # The tier manifest of a fetched copy: the stored body less its storage, re-signed as format 1.
    assert stored.tier_body() == _body()
    signed = manifest.sign(stored.tier_body(), KEY)
    assert signed["format"] == 1
    manifest.verify_signature(signed, KEY)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_a_malformed_stored_manifest_is_refused_where_it_is_parsed(tmp_path: Path, case: str) -> None:
    _, make, change = next(c for c in CASES if c[0] == case)
    m = make()
    change(m)
    with pytest.raises(IntegrityError, match="integrity check failed"):
        StoredManifest.parse(copy.deepcopy(m))
    repo = _repo_with(tmp_path, m)  # (signed: only the parse can refuse it)
    for call in (lambda: repo.signed_manifest("ck-1"), lambda: repo.stored_manifest(REC)):
        with pytest.raises(IntegrityFailure, match="integrity check failed"):
            call()


def test_an_unknown_format_is_refused_by_its_format(tmp_path: Path) -> None:
    m = {**chunked(), "format": 3}
    with pytest.raises(IntegrityFailure, match="format 3 is not one"):
        _repo_with(tmp_path, m).signed_manifest("ck-1")
