"""memsnap.safefs and its users never follow a symlink or trust a directory someone else controls (no daemon)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from memsnap import manifest, safefs
from memsnap.store import StoreUnavailable
from memsnap.store.posix import PosixStore, StoreTampered
from memsnap.tier import MemoryTier


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A directory outside every root, with a file that must survive every test."""
    v = tmp_path / "victim"
    v.mkdir()
    (v / "precious").write_text("keep me")
    return v


def _intact(victim: Path) -> bool:
    return (victim / "precious").read_text() == "keep me" and os.listdir(victim) == ["precious"]


def test_ensure_root_creates_private_dirs_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        root = safefs.ensure_root(tmp_path / "a" / "b", "test root")
    finally:
        os.umask(old)
    assert root == tmp_path / "a" / "b"
    assert _mode(tmp_path / "a") == 0o700 and _mode(root) == 0o700


@pytest.mark.parametrize("kind", ["symlink", "file", "group-writable", "other-owner", "loose-parent"])
def test_check_root_refuses_with_one_line(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "root"
    owner = os.geteuid()
    if kind == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        root.symlink_to(tmp_path / "real")
    elif kind == "file":
        root.write_text("")
    elif kind == "group-writable":
        root.mkdir()
        root.chmod(0o770)
    elif kind == "other-owner":
        root.mkdir(mode=0o700)
        owner += 1
    else:
        loose = tmp_path / "loose"
        loose.mkdir()
        loose.chmod(0o777)  # not sticky: anyone could rename root away and put their own in its place
        root = loose / "root"
        root.mkdir(mode=0o700)
    with pytest.raises(safefs.UnsafePath) as e:
        safefs.ensure_root(root, "test root", owner=owner)
    assert "\n" not in str(e.value) and str(root) in str(e.value)


def test_sticky_world_writable_parent_is_fine(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    safefs.ensure_root(shm / "tier", "test root")


def test_open_dir_and_open_file_refuse_symlinks_and_fifos(tmp_path: Path, victim: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "link").symlink_to(victim)
    (d / "flink").symlink_to(victim / "precious")
    os.mkfifo(d / "fifo")
    with safefs.opened(safefs.open_root(d)) as fd:
        with pytest.raises(safefs.UnsafePath, match="symbolic link"):
            safefs.open_dir(fd, "link")
        with pytest.raises(safefs.UnsafePath, match="symbolic link"):
            safefs.open_dir(fd, "link", create=True)
        with pytest.raises(safefs.UnsafePath, match="symbolic link"):
            safefs.open_file(fd, "flink")
        with pytest.raises(safefs.UnsafePath):
            safefs.open_file(fd, "fifo")  # never blocks, never opens
        with pytest.raises(FileExistsError):
            safefs.create_file(fd, "flink")
        with pytest.raises(safefs.UnsafePath):
            list(safefs.walk(fd))
    assert _intact(victim)


def test_rmtree_never_leaves_its_root(tmp_path: Path, victim: Path) -> None:
    d = tmp_path / "d"
    (d / "x" / "y").mkdir(parents=True)
    (d / "x" / "y" / "f").write_text("data")
    (d / "x" / "out").symlink_to(victim)
    (d / "top").symlink_to(victim)
    with safefs.opened(safefs.open_root(tmp_path)) as fd:
        assert safefs.rmtree(fd, "d") == 4
        assert safefs.rmtree(fd, "d") == 0
    assert not d.exists() and _intact(victim)


def test_write_atomic_replaces_a_planted_symlink_not_its_target(tmp_path: Path, victim: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "manifest.json").symlink_to(victim / "precious")
    (d / ".tmp-stale").write_text("x")
    old = os.umask(0)
    try:
        with safefs.opened(safefs.open_root(d)) as fd:
            safefs.write_atomic(fd, "manifest.json", b"{}")
    finally:
        os.umask(old)
    assert (d / "manifest.json").read_bytes() == b"{}" and not (d / "manifest.json").is_symlink()
    assert _mode(d / "manifest.json") == 0o600 and _intact(victim)


def test_hmac_key_is_0600_despite_a_stale_0644_tmp(tmp_path: Path, victim: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    stale = state / "hmac.tmp"
    stale.write_bytes(b"old")
    stale.chmod(0o644)
    key = manifest.load_or_create_key(state / "hmac.key")
    assert len(key) == 32 and _mode(state / "hmac.key") == 0o600
    assert manifest.load_or_create_key(state / "hmac.key") == key


@pytest.mark.parametrize("kind", ["0644", "0660", "symlink"])
def test_hmac_key_readable_by_others_is_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "hmac.key"
    if kind == "symlink":
        real = tmp_path / "real.key"
        real.write_bytes(os.urandom(32))
        real.chmod(0o600)
        path.symlink_to(real)
    else:
        path.write_bytes(os.urandom(32))
        path.chmod(int(kind, 8))
    with pytest.raises(safefs.UnsafePath, match=str(path)):
        manifest.load_or_create_key(path)


def _image(d: Path, key: bytes, ckpt_id: str = "ck-a", job: str = "job-a", uid: int = 1000) -> None:
    d.mkdir(mode=0o700)
    (d / "pages-1.img").write_bytes(os.urandom(1000))
    files = manifest.describe_files(d)
    manifest.write(d, manifest.sign({"id": ckpt_id, "job": job, "uid": uid, "pid": 1, "name": "", "files": files},
                                       key))


def test_manifest_is_bound_to_checkpoint_job_and_owner(tmp_path: Path) -> None:
    key = os.urandom(32)
    _image(tmp_path / "b", key, "ck-b", "job-b", 1000)
    manifest.verify_dir(tmp_path / "b", key, bound_to=("ck-b", "job-b", 1000))
    for wrong in [("ck-a", "job-b", 1000), ("ck-b", "job-a", 1000), ("ck-b", "job-b", 0)]:
        with pytest.raises(manifest.IntegrityError, match="swapped"):
            manifest.verify_dir(tmp_path / "b", key, bound_to=wrong)
        with pytest.raises(manifest.IntegrityError, match="swapped"):
            manifest.verify_dir_signature_only(tmp_path / "b", key, bound_to=wrong)


def test_manifest_refuses_symlinked_image_files(tmp_path: Path, victim: Path) -> None:
    key = os.urandom(32)
    d = tmp_path / "img"
    d.mkdir()
    (d / "inventory.img").symlink_to(victim / "precious")
    with pytest.raises(manifest.IntegrityError, match="symbolic link"):
        manifest.describe_files(d)
    with pytest.raises(manifest.IntegrityError, match="symbolic link"):
        manifest.write(d, {"files": {}})
    (d / "inventory.img").unlink()
    _image(tmp_path / "ok", key)
    (tmp_path / "ok" / "extra.img").symlink_to(victim / "precious")
    with pytest.raises(manifest.IntegrityError, match="symbolic link"):
        manifest.verify_dir(tmp_path / "ok", key)
    assert _intact(victim) and _mode(victim / "precious") != 0o600


def test_tier_refuses_a_symlinked_root(tmp_path: Path, victim: Path) -> None:
    (tmp_path / "tier").symlink_to(victim)
    with pytest.raises(safefs.UnsafePath, match="symbolic link"):
        MemoryTier(tmp_path / "tier")
    assert _intact(victim)


def test_tier_replaces_a_planted_staging_symlink_and_removes_only_inside(tmp_path: Path, victim: Path) -> None:
    root = tmp_path / "tier"
    root.mkdir(mode=0o700)
    (root / ".staging").symlink_to(victim)
    (root / "ck-x").symlink_to(victim)
    tier = MemoryTier(root)
    assert (root / ".staging").is_dir() and not (root / ".staging").is_symlink()
    assert not tier.has("ck-x")
    assert tier.remove("ck-x") == 0 and not os.path.lexists(root / "ck-x")
    s = tier.new_staging("ck-1")
    (s / "pages-1.img").write_bytes(b"x")
    tier.discard_staging("ck-1")
    a, b = tier.new_staging("ck-2", unique=True), tier.new_staging("ck-2", unique=True)
    assert a != b and a.is_dir() and b.is_dir()
    assert _mode(root) == _mode(root / ".staging") == _mode(a) == 0o700
    assert _intact(victim)


def test_store_delete_of_a_symlinked_checkpoint_dir_reports_tampering(tmp_path: Path, victim: Path) -> None:
    store = PosixStore(tmp_path / "store", create=True)
    with store.open_writer("ck-1/a.img") as w:
        w.write(b"x")
        w.commit()
    os.rename(store.root / "ck-1", store.root / "ck-1.moved")
    (store.root / "ck-1").symlink_to(victim)
    with pytest.raises(StoreTampered, match="symbolic link"):
        store.delete_prefix("ck-1/")
    with pytest.raises(StoreTampered):
        store.open_writer("ck-1/manifest.json")
    with pytest.raises(StoreTampered):
        store.open_reader("ck-1/precious")
    assert _intact(victim)


def test_store_refuses_a_symlinked_index_entry(tmp_path: Path, victim: Path) -> None:
    store = PosixStore(tmp_path / "store", create=True)
    (store.root / "_index").mkdir(mode=0o700)
    (store.root / "_index" / "job").symlink_to(victim)
    with pytest.raises(StoreTampered):
        store.open_writer("_index/job/ck-1")
    with pytest.raises(StoreTampered):
        store.list("_index/job/")
    assert _intact(victim)


def test_store_writer_renames_within_the_directory_it_opened(tmp_path: Path, victim: Path) -> None:
    store = PosixStore(tmp_path / "store", create=True)
    w = store.open_writer("ck-1/b.img")
    w.write(b"late")
    os.rename(store.root / "ck-1", store.root / "ck-1.moved")
    (store.root / "ck-1").symlink_to(victim)  # swapped while the object was being written
    w.commit()
    assert (store.root / "ck-1.moved" / "b.img").read_bytes() == b"late" and _intact(victim)


def test_store_root_must_be_private(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(StoreUnavailable, match="chmod 700"):
        PosixStore(root, create=True)


def test_write_new_never_replaces(tmp_path: Path, victim: Path) -> None:
    (tmp_path / "link").symlink_to(victim / "precious")
    with safefs.opened(safefs.open_root(tmp_path)) as fd:
        assert safefs.write_new(fd, "key", b"first")
        assert not safefs.write_new(fd, "key", b"second")
        assert not safefs.write_new(fd, "link", b"second")
    assert (tmp_path / "key").read_bytes() == b"first" and _mode(tmp_path / "key") == 0o600
    assert _intact(victim) and sorted(os.listdir(tmp_path)) == ["key", "link", "victim"]
