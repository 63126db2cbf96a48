"""Manifest: one typed definition of the image format that reads and writes the same JSON as before."""

from __future__ import annotations

import json
from pathlib import Path

from fakes import KEY, add_ckpt, make_engine

from memsnap import manifest
from memsnap.catalog import DUMPING, STAGED
from memsnap.manifest import Manifest
from memsnap.tiers import publish_image

# The body every memsnap since format 1 wrote for a plain checkpoint (engine.manifest_body before Manifest).
OLD_BODY = {
    "id": "ck-20260101-000000-abcdef", "pid": 42, "job": "job-1", "name": "train", "uid": 1000,
    "argv": ["python3", "train.py"], "host": "node-a", "kernel": "6.8.0", "criu_version": "4.1.1",
    "memsnap_version": "0.1.0", "created_ms": 1767225600000, "frozen_ms": 12.5, "freezing_ms": 0.5,
    "dump_ms": 30.25, "own_pidns": True, "own_mntns": False, "log_path": "/var/log/job-1.log", "gpus": [],
    "files": {"pages-1.img": {"size": 4096, "blake3": "00" * 32}},
}


def test_an_old_manifest_reads_back_to_the_same_body() -> None:
    assert Manifest.from_dict(OLD_BODY).body() == OLD_BODY


def test_an_old_signed_manifest_signs_to_the_same_bytes() -> None:
    old = manifest.sign(OLD_BODY, KEY)
    new = Manifest.from_dict(old).sign(KEY)
    assert json.dumps(new, sort_keys=True) == json.dumps(old, sort_keys=True)
    manifest.verify_signature(new, KEY)


def test_optional_fields_appear_only_when_set() -> None:
    body = Manifest.from_dict({**OLD_BODY, "pages_remote": True, "received_at": {"host": "b", "unix_ms": 1}}).body()
    assert body["pages_remote"] is True and body["received_at"] == {"host": "b", "unix_ms": 1}
    assert "pages_remote" not in Manifest.from_dict(OLD_BODY).body()


def test_unknown_keys_survive_a_round_trip() -> None:
    assert Manifest.from_dict({**OLD_BODY, "future": 7}).body()["future"] == 7


def test_catalog_meta_is_the_same_whichever_way_an_image_arrived() -> None:
    meta = Manifest.from_dict(OLD_BODY).catalog_meta()
    assert meta == {"argv": ["python3", "train.py"], "host": "node-a", "criu_version": "4.1.1", "own_pidns": True,
                    "own_mntns": False, "log_path": "/var/log/job-1.log", "gpus": [], "freezing_ms": 0.5}
    assert Manifest.from_dict({**OLD_BODY, "pages_remote": True}).catalog_meta()["pages_remote"] is True


def test_publish_image_signs_publishes_and_catalogs(tmp_path: Path) -> None:
    e = make_engine(tmp_path)
    man = Manifest.from_dict({**OLD_BODY, "files": {}})
    add_ckpt(e, man.id, DUMPING, 42, meta={"stop": False})
    staging = e.tier.new_staging(man.id)
    (staging / "pages-1.img").write_bytes(b"x" * 100)
    man.files = manifest.describe_files(staging)
    assert publish_image(e.tier, e.catalog, KEY, staging, man, keep_meta={"stop": False}) == 100
    rec = e.catalog.get_checkpoint(man.id)
    assert rec is not None and rec.state == STAGED and rec.in_tier and rec.size_bytes == 100
    assert rec.meta["stop"] is False and rec.meta["host"] == "node-a" and rec.meta["fingerprint"]
    manifest.verify_dir(e.tier.path(man.id), KEY, bound_to=(man.id, "job-1", 1000))
