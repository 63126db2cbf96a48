"""safefs decisions that the mutation run found unchecked (docs/mutation.md): whose files and directories
are accepted, which modes are set, and what is created or counted. Runs as root (chowns to nobody)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from memsnap import safefs

NOBODY = 65534

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="chowns files to another uid: needs root (CI is root)")]


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(p: Path) -> int:
    return p.stat().st_mode & 0o7777


def _secret(p: Path, owner: int = 0) -> Path:
    p.write_bytes(b"s3cret")
    p.chmod(0o600)
    os.chown(p, owner, owner)
    return p


# -- read_private: whose key file is accepted ------------------------------------------------------------
def test_read_private_accepts_our_own_file_by_default(tmp_path: Path) -> None:
    assert safefs.read_private(_secret(tmp_path / "k"), "key") == b"s3cret"


def test_read_private_accepts_the_owner_it_is_given_and_refuses_others(tmp_path: Path) -> None:
    theirs, ours = _secret(tmp_path / "theirs", NOBODY), _secret(tmp_path / "ours")
    assert safefs.read_private(theirs, "key", owner=NOBODY) == b"s3cret"
    with pytest.raises(safefs.UnsafePath, match="owned by uid 0"):
        safefs.read_private(ours, "key", owner=NOBODY)
    with pytest.raises(safefs.UnsafePath, match=f"owned by uid {NOBODY}"):
        safefs.read_private(theirs, "key")


def test_read_private_refuses_a_fifo_without_blocking_on_it(tmp_path: Path) -> None:
    fifo = tmp_path / "k"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(safefs.UnsafePath, match="not a regular file"):
        safefs.read_private(fifo, "key")


def test_read_private_reads_a_key_larger_than_one_read(tmp_path: Path) -> None:
    p = tmp_path / "k"
    data = bytes(range(256)) * 1024  # 256 KiB: several reads
    p.write_bytes(data)
    p.chmod(0o600)
    assert safefs.read_private(p, "key") == data


# -- roots: owner, mode, ancestors -------------------------------------------------------------------------
def test_check_root_accepts_a_private_dir_others_may_only_traverse(tmp_path: Path) -> None:
    d = tmp_path / "root"
    d.mkdir(mode=0o711)
    d.chmod(0o711)
    safefs.check_root(d, "tier")
    assert os.close(safefs.open_root(d)) is None


def test_check_root_and_open_root_accept_the_owner_they_are_given(tmp_path: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    safefs.check_root(d, "spool", owner=NOBODY)  # its root-owned parents are fine
    os.close(safefs.open_root(d, owner=NOBODY))
    with pytest.raises(safefs.UnsafePath, match="owned by uid"):
        safefs.check_root(d, "spool")


def test_open_root_refuses_a_private_dir_of_another_uid(tmp_path: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(safefs.UnsafePath, match="changed owner or mode"):
        safefs.open_root(d)


def test_ensure_root_sets_the_mode_asked_whatever_the_umask(tmp_path: Path) -> None:
    with umask(0o077):
        p = safefs.ensure_root(tmp_path / "a" / "b", "tier", mode=0o711)
    assert _mode(p) == 0o711 and _mode(p.parent) == 0o711


def test_chmod_dir_sets_the_mode_and_refuses_a_symlink(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    safefs.chmod_dir(d, 0o711)
    assert _mode(d) == 0o711
    (tmp_path / "link").symlink_to(d)
    with pytest.raises(OSError):
        safefs.chmod_dir(tmp_path / "link", 0o755)
    assert _mode(d) == 0o711


# -- below a root: what is created, and with which mode ----------------------------------------------------
def test_open_dir_sets_the_mode_of_what_it_creates_and_leaves_existing_dirs_alone(tmp_path: Path) -> None:
    existing = tmp_path / "old"
    existing.mkdir()
    existing.chmod(0o755)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with umask(0o077):
            os.close(safefs.open_dir(fd, "new", create=True, mode=0o711))
            os.close(safefs.open_dir(fd, "old"))
            os.close(safefs.open_dir(fd, "old", create=True, mode=0o700))
    finally:
        os.close(fd)
    assert _mode(tmp_path / "new") == 0o711 and _mode(existing) == 0o755


def test_open_dir_creates_private_dirs_by_default(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with umask(0):
            os.close(safefs.open_dir(fd, "new", create=True))
    finally:
        os.close(fd)
    assert _mode(tmp_path / "new") == 0o700


def test_open_path_creates_only_when_asked_and_with_the_mode_asked(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(FileNotFoundError):
            safefs.open_path(fd, "a/b")
        assert not (tmp_path / "a").exists()
        with umask(0o077):
            os.close(safefs.open_path(fd, "a/b", create=True, mode=0o711))
    finally:
        os.close(fd)
    assert _mode(tmp_path / "a") == 0o711 and _mode(tmp_path / "a" / "b") == 0o711


def test_write_new_gives_the_file_the_mode_asked(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert safefs.write_new(fd, "f", b"x", mode=0o644)
    finally:
        os.close(fd)
    assert _mode(tmp_path / "f") == 0o644 and [p.name for p in tmp_path.iterdir()] == ["f"]


# -- walking, removing and counting a tree -----------------------------------------------------------------
def _tree(root: Path) -> None:
    (root / "d" / "e").mkdir(parents=True)
    (root / "d" / "f").mkdir()
    (root / "d" / "f" / "other").write_bytes(b"x" * 10000)
    (root / "top").write_bytes(b"x" * 10)
    (root / "d" / "mid").write_bytes(b"x" * 100)
    (root / "d" / "e" / "low").write_bytes(b"x" * 1000)
    (root / "outside").write_bytes(b"x" * 7)


def test_walk_names_each_file_with_its_dir_relative_to_the_root(tmp_path: Path) -> None:
    _tree(tmp_path)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = sorted((rel, name, s.st_size) for rel, _, name, s in safefs.walk(fd))
    finally:
        os.close(fd)
    assert got == [("", "outside", 7), ("", "top", 10), ("d/", "mid", 100), ("d/e/", "low", 1000),
                   ("d/f/", "other", 10000)]


def test_tree_sizes_and_rmtree_count_every_file_below(tmp_path: Path) -> None:
    _tree(tmp_path)
    (tmp_path / "d" / "link").symlink_to(tmp_path / "outside")  # never followed, never counted
    d_fd = os.open(tmp_path / "d", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert safefs.tree_bytes(d_fd) == 11100  # (two subdirs: whatever the order, each one adds)
        assert safefs.tree_blocks_bytes(d_fd) == sum(
            p.stat().st_blocks * 512 for p in (tmp_path / "d").rglob("*") if p.is_file() and not p.is_symlink())
    finally:
        os.close(d_fd)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert safefs.rmtree(fd, "d") == 11100
        assert safefs.rmtree(fd, "gone") == 0
        with pytest.raises(FileNotFoundError):
            safefs.rmtree(fd, "gone", missing_ok=False)
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside", "top"]
