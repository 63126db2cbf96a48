"""memsnap.manifest refuses every image that is not exactly the one it signed (fast, no daemon, no root)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import blake3
import pytest

from memsnap import manifest, safefs
from memsnap.manifest import IntegrityError

KEY = b"k" * 32
OTHER_KEY = b"o" * 32
BOUND = ("ck-1", "job-1", 1000)


def _image(tmp_path: Path, files: dict[str, bytes] | None = None, **extra: Any) -> Path:
    """A signed images dir bound to BOUND, as the engine writes one."""
    d = tmp_path / "img"
    d.mkdir()
    for name, data in (files or {"pages-1.img": b"p" * 5000, "core-1.img": b"core"}).items():
        (d / name).write_bytes(data)
    body = {"id": BOUND[0], "job": BOUND[1], "uid": BOUND[2], "pid": 42, "name": "",
            "files": manifest.describe_files(d), **extra}
    manifest.write(d, manifest.sign(body, KEY))
    return d


def _edit(d: Path, change: Any, key: bytes | None = None) -> None:
    """Rewrites manifest.json after change(m); re-signed with key when given (else the old signature stays)."""
    m = json.loads((d / manifest.MANIFEST).read_text())
    change(m)
    if key is not None:
        m = manifest.sign(m, key)
    (d / manifest.MANIFEST).write_text(json.dumps(m))


def _refused(d: Path, match: str, **kw: Any) -> None:
    with pytest.raises(IntegrityError, match=match) as e:
        manifest.verify_dir(d, KEY, bound_to=BOUND, **kw)
    assert str(e.value).startswith("integrity check failed: ")  # what DATA_LOSS answers begin with


def test_an_untouched_image_verifies_and_returns_its_manifest(tmp_path: Path) -> None:
    d = _image(tmp_path)
    m = manifest.verify_dir(d, KEY, bound_to=BOUND)
    assert m.id == "ck-1" and m.pid == 42
    assert m.files["core-1.img"] == {"size": 4, "blake3": blake3.blake3(b"core").hexdigest()}
    raw = manifest.verify_dir_signature_only(d, KEY, bound_to=BOUND)
    assert raw["format"] == manifest.FORMAT and manifest.Manifest.parse(raw) == m
    assert manifest.verify_dir(d, KEY) == m  # no binding asked: still checked for signature and files


@pytest.mark.parametrize(("field", "value"), [("argv", "python3 train.py"), ("own_pidns", "yes"), ("pid", "42"),
                                              ("log_path", ["/x"]), ("gpus", {"0": 1})])
def test_a_signed_manifest_with_a_field_of_the_wrong_type_is_refused(tmp_path: Path, field: str,
                                                                      value: Any) -> None:
    """What a restore reads of its manifest (argv, own_pidns, the log path, the GPUs) has the type memsnap writes,
    or the image is refused as corrupt: never an error deep inside a restore."""
    d = _image(tmp_path)
    _edit(d, lambda m: m.update({field: value}), key=KEY)
    _refused(d, f"bad {field!r}")


def test_a_signed_manifest_without_its_pid_is_refused(tmp_path: Path) -> None:
    d = _image(tmp_path)
    _edit(d, lambda m: m.pop("pid"), key=KEY)
    _refused(d, "lacks a field")


def test_sign_replaces_an_old_signature_and_sets_the_format() -> None:
    signed = manifest.sign({"files": {}, "signature": "forged", "format": 99}, KEY)
    assert signed["format"] == manifest.FORMAT
    manifest.verify_signature(signed, KEY)
    assert signed["signature"] != "forged"


@pytest.mark.parametrize("sig", [None, 1, ["x"]], ids=["absent", "int", "list"])
def test_unsigned_manifest_is_refused(tmp_path: Path, sig: Any) -> None:
    d = _image(tmp_path)
    _edit(d, lambda m: m.pop("signature") if sig is None else m.update(signature=sig))
    _refused(d, "not signed")
    with pytest.raises(IntegrityError, match="not signed"):
        manifest.verify_dir_signature_only(d, KEY)


@pytest.mark.parametrize("field,value", [("id", "ck-2"), ("uid", 0), ("argv", ["sh"]), ("files", {})])
def test_edited_manifest_is_refused(tmp_path: Path, field: str, value: Any) -> None:
    d = _image(tmp_path)
    _edit(d, lambda m: m.update({field: value}))
    _refused(d, "signature does not match")


def test_edited_file_entry_is_refused(tmp_path: Path) -> None:
    d = _image(tmp_path)
    _edit(d, lambda m: m["files"]["core-1.img"].update(size=5))
    _refused(d, "signature does not match")


def test_manifest_signed_with_another_key_is_refused(tmp_path: Path) -> None:
    d = _image(tmp_path)
    _edit(d, lambda m: None, key=OTHER_KEY)
    _refused(d, "signature does not match")
    with pytest.raises(IntegrityError, match="signature does not match"):
        manifest.verify_dir_signature_only(d, KEY)
    manifest.verify_dir(d, OTHER_KEY, bound_to=BOUND)  # the same bytes verify under their own key


def test_a_signature_of_different_length_is_refused(tmp_path: Path) -> None:
    d = _image(tmp_path)
    _edit(d, lambda m: m.update(signature=m["signature"][:-2]))
    _refused(d, "signature does not match")


@pytest.mark.parametrize("bound", [("ck-2", "job-1", 1000), ("ck-1", "job-2", 1000), ("ck-1", "job-1", 1001),
                                   ("ck-1", "job-1", 0)], ids=["other-id", "other-job", "other-uid", "root"])
def test_a_signed_manifest_of_another_checkpoint_job_or_owner_is_refused(tmp_path: Path,
                                                                         bound: tuple[str, str, int]) -> None:
    d = _image(tmp_path)
    with pytest.raises(IntegrityError, match="swapped"):
        manifest.verify_dir(d, KEY, bound_to=bound)
    with pytest.raises(IntegrityError, match="swapped"):
        manifest.verify_dir_signature_only(d, KEY, bound_to=bound)


@pytest.mark.parametrize("fmt", [None, 0, 2, "1"])
def test_unknown_format_is_refused_even_when_signed(tmp_path: Path, fmt: Any) -> None:
    m = manifest.sign({"id": "ck-1", "job": "job-1", "uid": 1000, "files": {}}, KEY)
    m["format"] = fmt
    m = {k: v for k, v in m.items() if k != "signature"}
    m["signature"] = manifest.hmac.new(KEY, manifest._canonical(m), manifest.hashlib.sha256).hexdigest()
    manifest.verify_signature(m, KEY)
    with pytest.raises(IntegrityError, match="format"):
        manifest.check_binding(m, *BOUND)


def test_the_binding_refusal_names_both_checkpoints() -> None:
    m = manifest.sign({"id": "ck-2", "job": "job-2", "uid": 7, "files": {}}, KEY)
    with pytest.raises(IntegrityError) as e:
        manifest.check_binding(m, *BOUND)
    assert str(e.value) == ("integrity check failed: the signed manifest belongs to checkpoint 'ck-2' (job 'job-2', "
                            "uid 7), not to ck-1 (job 'job-1', uid 1000): the image was swapped")
    m["format"] = 2
    with pytest.raises(IntegrityError, match=r"^integrity check failed: manifest format 2 is not one"):
        manifest.check_binding(m, *BOUND)


def test_a_manifest_without_binding_fields_is_refused() -> None:
    m = manifest.sign({"files": {}}, KEY)
    with pytest.raises(IntegrityError, match="swapped"):
        manifest.check_binding(m, *BOUND)
    manifest.check_binding(manifest.sign({"id": "ck-1", "job": "job-1", "uid": 1000}, KEY), *BOUND)


def test_an_unexpected_extra_file_is_refused(tmp_path: Path) -> None:
    d = _image(tmp_path)
    (d / "planted.img").write_bytes(b"x")
    _refused(d, r"unexpected files \['planted.img'\]")


def test_stats_restore_left_by_criu_is_not_an_extra_file(tmp_path: Path) -> None:
    d = _image(tmp_path)
    (d / "stats-restore").write_bytes(b"s")
    manifest.verify_dir(d, KEY, bound_to=BOUND)
    (d / "stats-dump").write_bytes(b"s")  # only the one CRIU writes on restore is let through
    _refused(d, "unexpected files")


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    d = _image(tmp_path)
    (d / "core-1.img").unlink()
    _refused(d, "core-1.img is missing")


@pytest.mark.parametrize("data", [b"cor", b"core!"], ids=["shorter", "longer"])
def test_a_file_of_the_wrong_size_is_refused(tmp_path: Path, data: bytes) -> None:
    d = _image(tmp_path)
    (d / "core-1.img").write_bytes(data)
    _refused(d, "core-1.img has")


def test_same_size_other_bytes_is_a_checksum_mismatch(tmp_path: Path) -> None:
    d = _image(tmp_path)
    (d / "core-1.img").write_bytes(b"CORE")
    _refused(d, "checksum mismatch in core-1.img")


@pytest.mark.parametrize("name", ["../core-1.img", "sub/x", ".hidden", "", "manifest.json"])
def test_a_bad_file_name_in_a_signed_manifest_is_refused(tmp_path: Path, name: str) -> None:
    d = _image(tmp_path)
    outside = tmp_path / "core-1.img"
    outside.write_bytes(b"core")  # what ../core-1.img would reach
    _edit(d, lambda m: m["files"].update({name: {"size": 4, "blake3": blake3.blake3(b"core").hexdigest()}}),
          key=KEY)
    _refused(d, "bad file name")


def test_a_subdirectory_or_symlink_in_the_images_dir_is_refused(tmp_path: Path) -> None:
    d = _image(tmp_path)
    (d / "sub").mkdir()
    _refused(d, "holds directory 'sub'")
    (d / "sub").rmdir()
    os.symlink("/etc/passwd", d / "link")
    _refused(d, "integrity check failed")


def test_missing_unreadable_or_listless_manifest_is_refused(tmp_path: Path) -> None:
    d = _image(tmp_path)
    body = (d / manifest.MANIFEST).read_text()
    (d / manifest.MANIFEST).unlink()
    _refused(d, "has no manifest")
    (d / manifest.MANIFEST).write_text(body[:-5])
    _refused(d, "unreadable manifest")
    for bad in ("[]", '{"files": []}', '{"signature": "x"}'):
        (d / manifest.MANIFEST).write_text(bad)
        _refused(d, "no file list")


def test_a_symlinked_manifest_or_images_dir_is_refused(tmp_path: Path) -> None:
    d = _image(tmp_path)
    real = tmp_path / "real.json"
    (d / manifest.MANIFEST).rename(real)
    os.symlink(real, d / manifest.MANIFEST)
    _refused(d, "unreadable manifest")
    link = tmp_path / "imglink"
    os.symlink(d, link)
    with pytest.raises(IntegrityError, match="cannot open"):
        manifest.verify_dir(link, KEY)


def test_trusted_fingerprint_skips_only_the_untouched_files(tmp_path: Path) -> None:
    d = _image(tmp_path)
    fp = manifest.fingerprint(d)
    assert set(fp) == {"pages-1.img", "core-1.img"}
    manifest.verify_dir(d, KEY, trusted=fp, bound_to=BOUND)
    (d / "pages-1.img").write_bytes(b"q" * 5000)  # same size, new bytes: its fingerprint no longer matches
    assert manifest.fingerprint(d)["pages-1.img"] != fp["pages-1.img"]
    _refused(d, "checksum mismatch in pages-1.img", trusted=fp)
    _refused(d, "checksum mismatch in pages-1.img", trusted={})


def test_a_trusted_fingerprint_does_not_excuse_a_wrong_size(tmp_path: Path) -> None:
    d = _image(tmp_path)
    fp = manifest.fingerprint(d)
    (d / "core-1.img").write_bytes(b"cor")
    _refused(d, "core-1.img has 3 bytes", trusted=fp)


def test_describe_files_hashes_big_and_small_files_and_refuses_symlinks(tmp_path: Path) -> None:
    big = os.urandom(1024) * (9 * 1024)  # 9 MiB: the mmap path
    d = _image(tmp_path, {"big.img": big, "small.img": b"s"})
    got = manifest.describe_files(d)
    assert got == {"big.img": {"size": len(big), "blake3": blake3.blake3(big).hexdigest()},
                   "small.img": {"size": 1, "blake3": blake3.blake3(b"s").hexdigest()}}
    assert manifest.file_blake3(d / "big.img") == blake3.blake3(big).hexdigest()
    os.symlink(d / "small.img", d / "alias.img")
    with pytest.raises(IntegrityError):
        manifest.describe_files(d)
    with pytest.raises(OSError):
        manifest.file_blake3(d / "alias.img")


def test_write_makes_every_image_file_and_the_manifest_0600(tmp_path: Path) -> None:
    d = _image(tmp_path)
    for p in d.iterdir():
        assert stat.S_IMODE(os.lstat(p).st_mode) == 0o600, p


def test_hmac_key_is_created_0600_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "hmac.key"
    key = manifest.load_or_create_key(path)
    assert len(key) == 32 and stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    assert manifest.load_or_create_key(path) == key
    path.write_bytes(b"short")  # too short to be one of ours: replaced
    new = manifest.load_or_create_key(path)
    assert len(new) == 32 and new != b"short" and path.read_bytes() == new
    os.chmod(path, 0o640)
    with pytest.raises(safefs.UnsafePath):
        manifest.load_or_create_key(path)


def test_hmac_key_created_by_another_process_first_is_the_one_used(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "hmac.key"
    theirs = b"t" * 32
    real = safefs.write_new

    def lose_the_race(dfd: int, name: str, data: bytes, mode: int = 0o600) -> bool:
        assert real(dfd, name, theirs, 0o600)  # the other process wins: its key is on disk
        return False

    monkeypatch.setattr(manifest.safefs, "write_new", lose_the_race)
    assert manifest.load_or_create_key(path) == theirs  # everyone signs with the key on disk
