"""PosixStore decisions the mutation run found unchecked (docs/mutation.md): reads never create, keys at any
depth, what delete and cleanup remove and in which order, and the health check's verdicts."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from memsnap.store import StoreFull, StoreNotFound, StoreUnavailable
from memsnap.store.posix import PosixStore
from tests.helpers import resident_pages


@pytest.fixture
def posix(tmp_path: Path) -> PosixStore:
    return PosixStore(tmp_path / "store", create=True)


def _put(store: PosixStore, key: str, data: bytes) -> None:
    with store.open_writer(key) as w:
        w.write(data)
        w.commit()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_reading_a_missing_key_creates_nothing(posix: PosixStore) -> None:
    assert not posix.exists("ck1/x.img") and posix.list("ck1/") == []
    with pytest.raises(StoreNotFound):
        posix.stat("ck1/sub/x.img")
    with pytest.raises(StoreNotFound):
        posix.open_reader("ck1/sub/x.img")
    assert list(posix.root.iterdir()) == []


def test_keys_below_several_dirs_round_trip(posix: PosixStore) -> None:
    _put(posix, "ck1/sub/deep/x.img", b"abc")
    assert posix.stat("ck1/sub/deep/x.img") == 3 and posix.exists("ck1/sub/deep/x.img")
    with posix.open_reader("ck1/sub/deep/x.img") as r:
        assert r.read() == b"abc"
    assert not posix.exists("ck1/sub") and not posix.exists("ck1/sub/deep")


def test_an_empty_object_exists(posix: PosixStore) -> None:
    _put(posix, "ck1/empty", b"")
    assert posix.exists("ck1/empty") and posix.stat("ck1/empty") == 0


def test_a_reader_closes_its_file(posix: PosixStore) -> None:
    _put(posix, "ck1/x.img", b"abc")
    before = _fds()
    for _ in range(3):
        with posix.open_reader("ck1/x.img") as r:
            r.read()
    assert _fds() == before


def test_delete_removes_the_manifest_before_any_image(posix: PosixStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # A delete cut short must never leave a manifest whose files are gone: it would look complete.
    for name in ("a.img", "manifest.json", "z.img"):
        _put(posix, f"ck1/{name}", b"x")
    _put(posix, "ck10/manifest.json", b"x")
    removed: list[str] = []
    real = os.unlink

    def unlink(path: str, *a: object, **kw: object) -> None:
        removed.append(path)
        real(path, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", unlink)
    posix.delete_prefix("ck1/")
    assert removed[0] == "manifest.json" and sorted(removed) == ["a.img", "manifest.json", "z.img"]
    assert posix.list("") == ["ck10/manifest.json"] and not (posix.root / "ck1").exists()


def test_cleanup_removes_only_temps_older_than_asked(posix: PosixStore) -> None:
    _put(posix, "ck1/x.img", b"x")
    old = [posix.root / "ck1" / ".tmp-old1", posix.root / "ck1" / ".tmp-old2"]
    fresh = posix.root / "ck1" / ".tmp-fresh"
    for p in [*old, fresh]:
        p.write_bytes(b"t")
    for p in old:
        os.utime(p, (1, 1))
    soon = time.time() + 3600  # ("fresh" whatever the time a loaded machine takes from here)
    os.utime(fresh, (soon, soon))
    assert posix.cleanup_temps(older_than_s=3600) == 2
    assert fresh.exists() and not any(p.exists() for p in old) and posix.exists("ck1/x.img")
    assert posix.cleanup_temps(older_than_s=1) == 0 and fresh.exists()
    assert posix.cleanup_temps() == 1 and not fresh.exists()


def test_cleanup_finds_the_temp_of_an_unfinished_writer(posix: PosixStore) -> None:
    w = posix.open_writer("ck1/x.img")
    w.write(b"half")
    assert posix.cleanup_temps() == 1
    w.abort()
    assert posix.list("") == [] and [p.name for p in (posix.root / "ck1").iterdir()] == []


# -- the health check ------------------------------------------------------------------------------------
def test_check_refuses_a_root_on_another_filesystem(posix: PosixStore, monkeypatch: pytest.MonkeyPatch) -> None:
    posix.check()
    real = os.lstat

    def lstat(path: object, *a: object, **kw: object) -> os.stat_result:
        s = real(path, *a, **kw)  # type: ignore[arg-type]
        if Path(str(path)) != posix.root:
            return s
        return os.stat_result((*s[:2], s.st_dev + 1, *s[3:10]))  # (an unmount shows the mount point's dev)

    monkeypatch.setattr(os, "lstat", lstat)
    with pytest.raises(StoreUnavailable, match="another filesystem"):
        posix.check()


def test_check_refuses_a_root_it_cannot_write(posix: PosixStore, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **kw: False if mode & os.W_OK else real(p, mode))
    with pytest.raises(StoreUnavailable, match="not writable"):
        posix.check()


@pytest.mark.parametrize(("bavail", "full"), [(0, True), (1, False)])
def test_check_refuses_a_full_root(bavail: int, full: bool, posix: PosixStore,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.statvfs

    class Vfs:
        def __init__(self, path: object) -> None:
            self._s = real(path)  # type: ignore[arg-type]
            self.f_bavail = bavail

        def __getattr__(self, name: str) -> object:
            return getattr(self._s, name)

    monkeypatch.setattr(os, "statvfs", Vfs)
    if full:
        with pytest.raises(StoreFull):
            posix.check()
    else:
        posix.check()


def test_check_gives_up_on_a_root_that_does_not_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = PosixStore(tmp_path / "store", create=True, check_timeout_s=0.2)
    hung = threading.Event()
    monkeypatch.setattr(store, "_probe", lambda: hung.wait(60))  # (a hung NFS mount)
    try:
        with pytest.raises(StoreUnavailable, match="did not answer"):
            store.check()
    finally:
        hung.set()


def test_a_root_that_appears_after_start_passes_the_check(tmp_path: Path) -> None:
    store = PosixStore(tmp_path / "store")  # (not there yet: a mount that comes later)
    with pytest.raises(StoreUnavailable):
        store.check()
    (tmp_path / "store").mkdir(mode=0o700)
    store.check()


def test_an_object_read_by_ranges_leaves_the_page_cache_when_closed(posix: PosixStore) -> None:
    # A fetch writes what it reads into the tier: the packs need not stay cached beside it (twice the image).
    data = os.urandom(8 << 20)
    _put(posix, "packs/p1", data)
    path = posix.root / "packs" / "p1"
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # (as a stored pack is long before a fetch reads it: only clean pages can be dropped)
    os.close(fd)
    assert path.read_bytes() == data and resident_pages(path) > 0  # (in the page cache now)
    r = posix.open_ranges("packs/p1")
    assert b"".join(r.read(off, 1 << 20) for off in range(0, len(data), 1 << 20)) == data
    r.close()
    assert resident_pages(path) == 0
