"""Packs (memsnap.store.packs): a drain's new chunks in a few objects, read back by ranged reads, learned by
other nodes from each pack's tail, and swept whole when nothing references them; on a real PosixStore and
moto's S3 server."""

from __future__ import annotations

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
from memsnap.store.chunked import ChunkedDrain, TierChunks, fetch_chunked
from memsnap.store.chunkgc import ChunkIndex, StoreGc, sweep
from memsnap.store.chunks import (
    PAGE,
    ChunkedStorage,
    ChunkError,
    Chunking,
    ChunkReader,
    chunked_storage,
    pack_key,
)
from memsnap.store.errors import StoreError
from memsnap.store.packs import FOOTER, PACK_MAGIC, Packer, PackFiles, parse_tail, read_pack_index
from memsnap.store.posix import PosixStore, on_local_fs
from memsnap.store.throttle import Throttle

AVG = 64 << 10
PACK = 512 << 10


def _st(m: dict[str, Any]) -> ChunkedStorage:
    """The parsed storage of a chunked stored manifest's JSON."""
    st = chunked_storage(m)
    assert st is not None
    return st


def _tier(tmp: Path, name: str, pages: bytes) -> tuple[Path, dict[str, Any]]:
    d = tmp / name
    d.mkdir()
    (d / "pages-1.img").write_bytes(pages)
    (d / "core-1.img").write_bytes(b"core" * 100)
    return d, {n: {"size": (d / n).stat().st_size, "blake3": blake3.blake3((d / n).read_bytes()).hexdigest()}
               for n in ("pages-1.img", "core-1.img")}


def _drain(store: Any, d: Path, files: dict[str, Any], ckpt: str, index: ChunkIndex,
           pack: int = PACK) -> tuple[dict[str, Any], ChunkedDrain]:
    job = ChunkedDrain(store, 0, index, Chunking(AVG), threads=2, trust_index=True, pack_size=pack)
    with safefs.opened(os.open(d, os.O_RDONLY | os.O_DIRECTORY)) as sfd:
        storage = job.run(ckpt, sfd, files, None, lambda n: None)
    return {"id": ckpt, "files": files, "storage": storage}, job


def _pages(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n * PAGE)


@pytest.fixture
def store(tmp_path: Path) -> PosixStore:
    return PosixStore(tmp_path / "store", create=True)


def test_a_drain_writes_its_new_chunks_and_small_files_into_packs_not_an_object_each(tmp_path: Path,
                                                                                    store: PosixStore) -> None:
    pages = _pages(1024, 1)  # 4 MiB: ~64 chunks
    d, files = _tier(tmp_path, "t", pages)
    m, job = _drain(store, d, files, "ck-1", ChunkIndex(None))
    packs = store.list("packs/")
    assert job.stats.new_chunks > 40 and not store.list("chunks/")
    assert len(packs) == job.stats.round_trips <= len(pages) // PACK and not store.list("ck-1/")  # (bundle too)
    assert {pack_key(p) for p in _st(m).referenced_packs()} == set(packs)
    assert ChunkReader(store, _st(m)).read_at("pages-1.img", 0, len(pages)) == pages
    assert ChunkReader(store, _st(m)).read_at("core-1.img", 0, 400) == b"core" * 100


def test_a_pack_holding_only_a_checkpoints_small_files_is_kept_by_the_sweep(tmp_path: Path,
                                                                            store: PosixStore) -> None:
    index = ChunkIndex(None)
    pages = _pages(300, 10)
    d1, f1 = _tier(tmp_path, "t1", pages)
    _drain(store, d1, f1, "ck-1", index)
    d2, f2 = _tier(tmp_path, "t2", pages)
    (d2 / "core-1.img").write_bytes(b"CORE" * 100)  # the same pages, other small files
    f2["core-1.img"]["blake3"] = blake3.blake3(b"CORE" * 100).hexdigest()
    m2, job = _drain(store, d2, f2, "ck-2", index)
    assert job.stats.new_chunks == 0 and job.stats.round_trips == 1  # a pack with the bundle alone
    sweep(store, _st(m2).referenced_chunks() | _st(m2).referenced_packs(), grace_s=0, now=time.time() + 1)
    assert ChunkReader(store, _st(m2)).read_at("core-1.img", 0, 400) == b"CORE" * 100


def test_a_chunk_changed_inside_a_pack_is_refused(tmp_path: Path, store: PosixStore) -> None:
    d, files = _tier(tmp_path, "t", _pages(300, 2))
    m, _ = _drain(store, d, files, "ck-1", ChunkIndex(None))
    ref = _st(m).files["pages-1.img"].chunks[2]
    assert ref.loc is not None
    p = store.root / pack_key(ref.loc[0])
    data = bytearray(p.read_bytes())
    data[ref.loc[1] + 100] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(ChunkError, match="does not match its id"):
        ChunkReader(store, _st(m)).read_at("pages-1.img", ref.offset, 10)


def test_a_manifest_locating_a_chunk_in_a_pack_it_does_not_list_is_refused(tmp_path: Path,
                                                                            store: PosixStore) -> None:
    d, files = _tier(tmp_path, "t", _pages(300, 3))
    m, _ = _drain(store, d, files, "ck-1", ChunkIndex(None))
    m["storage"]["files"]["pages-1.img"]["chunks"][0][3] = len(m["storage"]["packs"])
    with pytest.raises(ChunkError, match="bad chunk entry"):
        chunked_storage(m)


@pytest.mark.parametrize("cut", ["footer", "magic", "index", "entry past the chunks"])
def test_a_pack_tail_that_is_not_a_pack_index_is_refused(cut: str) -> None:
    body = b"x" * 1000
    index = json.dumps({"v": 1, "chunks": [["a" * 64, 0, 1000 if cut != "entry past the chunks" else 1001, 5]]})
    pack = body + index.encode() + FOOTER.pack(len(index), PACK_MAGIC)
    if cut == "footer":
        pack = pack[:-1]
    elif cut == "magic":
        pack = pack[:-8] + b"NOTAPACK"
    elif cut == "index":
        pack = body + b"{" + index.encode()[1:-1] + b"," + FOOTER.pack(len(index), PACK_MAGIC)
    with pytest.raises(ChunkError):
        parse_tail(pack, len(pack), "p" * 64)


def test_a_pack_index_longer_than_the_first_read_takes_a_second_one(tmp_path: Path, store: PosixStore) -> None:
    entries = []
    got: list[Any] = []
    packer = Packer(store, 1 << 30, lambda pid, e, n: got.append((pid, e)))
    for i in range(1500):  # ~110 bytes of index each: past TAIL_READ (64 KiB)
        raw = i.to_bytes(4, "little") * 16
        cid = blake3.blake3(raw).hexdigest()
        packer.add(cid, raw, len(raw))
        entries.append(cid)
    packer.close()
    ((pid, e),) = got
    assert [c for c, *_ in read_pack_index(store, pid)] == entries == [c for c, *_ in e]


class _FailingPacks:
    """A real store whose pack writes are slow, and whose write number `ok` fails."""

    def __init__(self, store: PosixStore, ok: int) -> None:
        self.store, self.left = store, ok

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def open_writer(self, key: str) -> Any:
        w = self.store.open_writer(key)
        if key.startswith("packs/"):
            real = w.write

            def write(data: Any) -> int:
                self.left -= 1
                if self.left == 0:
                    raise StoreError("injected: the store went away")
                time.sleep(0.02)  # (a slow store: both drain threads write at once, into two packs)
                return real(data)

            w.write = write
        return w


def test_a_drain_whose_pack_upload_fails_leaves_no_partial_pack_and_indexes_only_committed_ones(
        tmp_path: Path, store: PosixStore) -> None:
    d, files = _tier(tmp_path, "t", _pages(1024, 4))
    index = ChunkIndex(tmp_path / "index")
    with pytest.raises(StoreError, match="injected"):
        _drain(_FailingPacks(store, 30), d, files, "ck-1", index)
    assert store.cleanup_temps() == 0  # (the packs begun were removed, not left as temporaries)
    listed = {pid: {c for c, *_ in read_pack_index(store, pid)} for pid in
              (k.rsplit("/", 1)[-1] for k in store.list("packs/"))}
    known = ChunkIndex(tmp_path / "index")
    assert known.packs() == set(listed) and known.ids() == set().union(*listed.values())


class _SlowCommits:
    """A real store whose pack commits are slow (and commit number `fail`, when given, fails); it notes when
    each pack's first write and each commit's end happened."""

    def __init__(self, store: PosixStore, delay: float = 0.15, fail: int = 0) -> None:
        self.store, self.delay, self.fail = store, delay, fail
        self.first_write: list[float] = []
        self.committed_at: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def open_writer(self, key: str) -> Any:
        w = self.store.open_writer(key)
        real_write, real_commit = w.write, w.commit
        wrote = [False]

        def write(data: Any) -> int:
            if not wrote[0]:
                wrote[0] = True
                self.first_write.append(time.monotonic())
            return real_write(data)

        def commit() -> Any:
            time.sleep(self.delay)
            if len(self.committed_at) + 1 == self.fail:
                self.committed_at.append(-1.0)
                raise StoreError("injected: the commit failed")
            out = real_commit()
            self.committed_at.append(time.monotonic())
            return out

        w.write, w.commit = write, commit
        return w


def _fill(packer: Packer, packs: int, target: int) -> None:
    for i in range(packs * 4):
        raw = random.Random(i).randbytes(target // 4)
        packer.add(blake3.blake3(raw).hexdigest(), raw, len(raw))


def test_the_pack_writer_fills_the_next_pack_while_the_last_one_commits(store: PosixStore) -> None:
    slow = _SlowCommits(store)
    got: list[str] = []
    packer = Packer(slow, 64 << 10, lambda pid, e, n: got.append(pid))
    _fill(packer, 3, 64 << 10)
    packer.close()
    assert len(got) == 3 == len(slow.committed_at)
    # The second pack was begun before the first one's commit ended, the third before the second's.
    assert slow.first_write[1] < slow.committed_at[0] and slow.first_write[2] < slow.committed_at[1]
    assert {k.rsplit("/", 1)[-1] for k in store.list("packs/")} == set(got)


def test_after_a_failed_pack_commit_no_later_pack_is_committed_or_left_behind(store: PosixStore) -> None:
    slow = _SlowCommits(store, delay=0.05, fail=2)
    got: list[str] = []
    packer = Packer(slow, 64 << 10, lambda pid, e, n: got.append(pid))
    with pytest.raises(StoreError, match="injected"):
        _fill(packer, 6, 64 << 10)
        packer.close()
    packer.abort()  # (what a drain does when add() or close() raised)
    assert len(got) == 1  # only the pack committed before the failure is indexed
    assert {k.rsplit("/", 1)[-1] for k in store.list("packs/")} == set(got)
    assert store.cleanup_temps() == 0


def test_a_failed_commit_of_the_last_pack_is_raised_by_close_not_waited_on(store: PosixStore) -> None:
    slow = _SlowCommits(store, delay=0.0, fail=1)
    got: list[str] = []
    packer = Packer(slow, 64 << 10, lambda pid, e, n: got.append(pid))
    _fill(packer, 1, 64 << 10)  # (one pack: its commit comes with close())
    done: list[BaseException] = []

    def close() -> None:
        try:
            packer.close()
        except BaseException as exc:
            done.append(exc)

    t = threading.Thread(target=close, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "close() waited for ever after the last pack's commit failed"
    assert len(done) == 1 and isinstance(done[0], StoreError) and "injected" in str(done[0])
    assert got == [] and store.list("packs/") == [] and store.cleanup_temps() == 0


def test_an_aborted_packer_discards_the_packs_still_waiting_for_their_commit(store: PosixStore) -> None:
    slow = _SlowCommits(store, delay=0.3)
    got: list[str] = []
    packer = Packer(slow, 64 << 10, lambda pid, e, n: got.append(pid))
    _fill(packer, 3, 64 << 10)
    deadline = time.monotonic() + 10
    while len(slow.first_write) < 3 and time.monotonic() < deadline:  # (the third begun: the second handed off)
        time.sleep(0.005)
    packer.abort()  # (the first pack is committing, the second waits for its commit, the third is open)
    assert len(got) <= 1  # at most the commit in progress ended
    assert {k.rsplit("/", 1)[-1] for k in store.list("packs/")} == set(got)
    assert store.cleanup_temps() == 0


def test_a_node_learns_the_chunks_of_packs_another_node_wrote_since_its_last_drain(tmp_path: Path,
                                                                                  store: PosixStore) -> None:
    a = StoreGc(store, ChunkIndex(tmp_path / "ia"), "aaaaaaaaaaaa")
    b = StoreGc(store, ChunkIndex(tmp_path / "ib"), "bbbbbbbbbbbb")
    d1, f1 = _tier(tmp_path, "t1", _pages(300, 5))
    d2, f2 = _tier(tmp_path, "t2", _pages(300, 6))
    for gc, d, f, ck in ((a, d1, f1, "ck-1"), (b, d1, f1, "ck-2"), (a, d2, f2, "ck-3")):
        with gc.draining():
            _drain(store, d, f, ck, gc.index)
    packs_before = set(store.list("packs/"))
    with b.draining():  # b's index was filled before ck-3's packs existed
        m, job = _drain(store, d2, f2, "ck-4", b.index)
    assert job.stats.new_chunks == 0 and set(store.list("packs/")) == packs_before
    assert ChunkReader(store, _st(m)).read_at("pages-1.img", 0, 300 * PAGE) == (d2 / "pages-1.img").read_bytes()


def test_a_pack_stays_while_any_manifest_references_a_chunk_in_it(tmp_path: Path, store: PosixStore) -> None:
    index = ChunkIndex(None)
    old = _pages(300, 7)
    d1, f1 = _tier(tmp_path, "t1", old)
    m1, _ = _drain(store, d1, f1, "ck-1", index, pack=64 << 20)
    d2, f2 = _tier(tmp_path, "t2", old[: 100 * PAGE] + _pages(200, 8))
    m2, _ = _drain(store, d2, f2, "ck-2", index, pack=64 << 20)
    shared = _st(m1).referenced_packs() & _st(m2).referenced_packs()
    assert shared and _st(m1).referenced_chunks() - _st(m2).referenced_chunks()
    only1 = _st(m1).referenced_packs() - shared
    unused = sum(len(read_pack_index(store, p)) for p in only1)
    keep = _st(m2).referenced_chunks() | _st(m2).referenced_packs()  # ck-1 deleted: part of its packs is still used
    res = sweep(store, keep, grace_s=0, now=time.time() + 1)
    assert res.deleted == unused and all((store.root / pack_key(p)).is_file() for p in shared)
    assert ChunkReader(store, _st(m2)).read_at("pages-1.img", 0, 300 * PAGE) == (d2 / "pages-1.img").read_bytes()
    res = sweep(store, set(), grace_s=0, now=time.time() + 1)  # ck-2 deleted too
    assert not store.list("packs/")


def test_packs_on_s3_are_read_by_range_and_swept(tmp_path: Path, s3_server) -> None:
    from memsnap.store.s3 import S3Store

    s3 = S3Store(s3_server.bucket, f"packs-{time.time_ns()}", **s3_server.store_kwargs())
    pages = _pages(600, 9)
    d, files = _tier(tmp_path, "t", pages)
    m, job = _drain(s3, d, files, "ck-1", ChunkIndex(None))
    assert len(s3.list("packs/")) == len(_st(m).referenced_packs()) >= 2 and not s3.list("chunks/")
    assert ChunkReader(s3, _st(m)).read_at("pages-1.img", 0, len(pages)) == pages
    b = StoreGc(s3, ChunkIndex(tmp_path / "ib"), "bbbbbbbbbbbb")
    assert b.learn_packs() == 1 + len(_st(m).referenced_packs()) and _st(m).referenced_chunks() <= b.index.ids()
    res = sweep(s3, set(), grace_s=0, now=time.time() + 1)
    assert res.deleted == len(_st(m).referenced_chunks()) and not s3.list("packs/")
    with pytest.raises(StoreError):
        ChunkReader(s3, _st(m)).read_at("pages-1.img", 0, 10)


def test_a_ranged_read_returns_exactly_the_bytes_asked_at_any_offset(store: PosixStore) -> None:
    data = _pages(300, 11) + b"tail"
    with store.open_writer("packs/ab/" + "ab" * 32) as w:
        w.write(data)
        w.commit()
    rng = random.Random(12)
    for off, n in [(0, 1), (4095, 2), (len(data) - 3, 10), (len(data) + 5, 4)] + \
            [(rng.randrange(len(data)), rng.randrange(1, 3 << 20)) for _ in range(20)]:
        assert store.read_range("packs/ab/" + "ab" * 32, off, n) == data[off : off + n]


def test_a_packed_bundle_passes_through_the_drains_bandwidth_cap(tmp_path: Path, store: PosixStore) -> None:
    class Counted(Throttle):
        consumed = 0

        def consume(self, n: int) -> None:
            Counted.consumed += n

    index = ChunkIndex(None)
    pages = _pages(300, 13)
    d1, f1 = _tier(tmp_path, "t1", pages)
    _drain(store, d1, f1, "ck-1", index)
    d2, f2 = _tier(tmp_path, "t2", pages)
    (d2 / "core-1.img").write_bytes(b"CORE" * 100)  # the same pages: only the small files are new
    f2["core-1.img"]["blake3"] = blake3.blake3(b"CORE" * 100).hexdigest()
    job = ChunkedDrain(store, 0, index, Chunking(AVG), throttle=Counted(None), threads=2, trust_index=True,
                       pack_size=PACK)
    with safefs.opened(os.open(d2, os.O_RDONLY | os.O_DIRECTORY)) as sfd:
        job.run("ck-2", sfd, f2, None, lambda n: None)
    assert job.stats.new_chunks == 0 and Counted.consumed == 400


def test_a_fetch_opens_each_pack_once_for_all_its_chunks_and_closes_it(tmp_path: Path, store: PosixStore,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pages = _pages(600, 13)
    d, files = _tier(tmp_path, "t", pages)
    m, _ = _drain(store, d, files, "ck-1", ChunkIndex(None))
    packs = _st(m).referenced_packs()
    chunks_in_packs = [r for r in _st(m).refs() if r.loc is not None]
    assert len(chunks_in_packs) > 2 * len(packs) >= 4  # (several chunks in each pack)
    opened: list[str] = []
    real = PosixStore._open_object

    def counting(self: PosixStore, key: str) -> int:
        opened.append(key)
        return real(self, key)

    monkeypatch.setattr(PosixStore, "_open_object", counting)
    out = tmp_path / "out"
    out.mkdir()
    fds_before = len(os.listdir("/proc/self/fd"))
    with safefs.opened(os.open(out, os.O_RDONLY | os.O_DIRECTORY)) as dfd:
        fetch_chunked(ChunkReader(store, _st(m)), dfd, TierChunks())
    assert (out / "pages-1.img").read_bytes() == pages and (out / "core-1.img").read_bytes() == b"core" * 100
    assert sorted(opened) == sorted(pack_key(p) for p in packs)
    assert len(os.listdir("/proc/self/fd")) == fds_before


def test_a_fetch_past_its_open_file_cap_closes_the_least_recently_used_pack(tmp_path: Path, store: PosixStore,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pages = _pages(600, 14)
    d, files = _tier(tmp_path, "t", pages)
    m, _ = _drain(store, d, files, "ck-1", ChunkIndex(None))
    opened: list[str] = []
    real_open = PosixStore.open_ranges
    monkeypatch.setattr(PosixStore, "open_ranges", lambda self, key: opened.append(key) or real_open(self, key))
    reader = ChunkReader(store, _st(m))
    reader.packs = PackFiles(store, cap=1)
    fds_before = len(os.listdir("/proc/self/fd"))
    assert reader.read_at("pages-1.img", 0, len(pages)) == pages
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 1  # (one pack open at a time)
    assert len(set(opened)) > 1  # (several packs, one after another: each closed for the next)
    reader.packs.close()
    assert len(os.listdir("/proc/self/fd")) == fds_before


class _Ranges:
    def __init__(self) -> None:
        self.closed = False

    def read(self, offset: int, length: int) -> bytes:
        return b"f" * length

    def close(self) -> None:
        self.closed = True


class _RangeStore:
    def __init__(self) -> None:
        self.opened: dict[str, _Ranges] = {}

    def open_ranges(self, key: str) -> _Ranges:
        self.opened[key] = _Ranges()
        return self.opened[key]

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        return b"r" * length


def test_pack_files_close_a_pack_once_its_last_expected_chunk_was_read() -> None:
    s = _RangeStore()
    files = PackFiles(s)  # type: ignore[arg-type]
    files.expect(["a", "a", "b"])
    files.read("a", 0, 1)
    assert not s.opened["a"].closed  # (one more chunk of "a" to come)
    files.read("b", 0, 1)
    assert s.opened["b"].closed and not s.opened["a"].closed
    files.read("a", 1, 1)
    assert s.opened["a"].closed  # (its page cache given back before the fetch ends)
    assert files.read("a", 0, 1) == b"f" and not s.opened["a"].closed  # (read again after all: opened again)
    files.close()
    assert s.opened["a"].closed


def test_pack_files_at_the_cap_with_every_pack_in_use_read_by_range() -> None:
    s = _RangeStore()
    files = PackFiles(s, cap=1)  # type: ignore[arg-type]
    assert files._take("a") is s.opened["a"]  # (a read in "a" now)
    assert files.read("b", 0, 2) == b"rr"  # "a" is busy: "b" is read by range, "a" stays open
    assert not s.opened["a"].closed and "b" not in s.opened
    files._busy["a"] -= 1  # (that read ended)
    assert files.read("b", 0, 2) == b"ff" and s.opened["a"].closed  # "a" idle: closed for "b"
    files.close()
    assert s.opened["b"].closed and files.read("c", 0, 1) == b"r"  # (after close: by range)


_MOUNTS = """\
21 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
30 21 0:26 / /dev/shm rw,nosuid shared:5 - tmpfs tmpfs rw
40 21 0:50 / /mnt/store rw,relatime shared:9 - fuse.sshfs bench@10.0.0.2:/srv rw,user_id=0
41 40 0:51 / /mnt/store/local rw shared:10 - xfs /dev/vdb rw
42 21 0:52 / /nfs rw - nfs4 server:/export rw
"""


@pytest.mark.parametrize("path,local", [("/var/lib/memsnap/store", True), ("/dev/shm/store", True),
                                        ("/mnt/store/chunks", False), ("/mnt/store/local/x", True),
                                        ("/nfs/store", False), ("/mnt/storex", True)])
def test_packs_are_read_through_the_page_cache_only_on_a_local_filesystem(path: str, local: bool) -> None:
    assert on_local_fs(Path(path), _MOUNTS) is local


def test_a_store_on_this_machines_disk_reads_packs_through_the_page_cache(store: PosixStore) -> None:
    assert store.local is on_local_fs(store.root)
    data = _pages(40, 15)
    with store.open_writer("packs/cd/" + "cd" * 32) as w:
        w.write(data)
        w.commit()
    r = store.open_ranges("packs/cd/" + "cd" * 32)
    assert r.read(4097, 9000) == data[4097:13097] == store.read_range("packs/cd/" + "cd" * 32, 4097, 9000)
    store.local = not store.local  # (the other way reads the same bytes)
    assert r.read(4097, 9000) == data[4097:13097]
    r.close()
