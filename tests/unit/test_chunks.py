"""Chunk store primitives on a real PosixStore: chunker, drain of a tier dir, reader, cache, index, sweep."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import blake3
import pytest

from memsnap import safefs
from memsnap.store.cache import ChunkCache
from memsnap.store.chunked import CacheFill, ChunkedDrain, TierChunks, fetch_chunked
from memsnap.store.chunkgc import ChunkIndex, sweep
from memsnap.store.chunks import (
    PAGE,
    ChunkedStorage,
    ChunkError,
    Chunking,
    ChunkReader,
    chunk_id,
    chunk_key,
    chunked_storage,
    encode_chunk,
)
from memsnap.store.posix import PosixStore

AVG = 64 << 10


def _st(m: dict[str, Any]) -> ChunkedStorage:
    """The parsed storage of a chunked stored manifest's JSON."""
    st = chunked_storage(m)
    assert st is not None
    return st


def _pages(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n * PAGE)


def test_chunks_tile_the_buffer_at_page_boundaries_within_min_and_max() -> None:
    c = Chunking(AVG)
    buf = _pages(2048, 1) + b"tail"
    bounds = c.boundaries(buf)
    assert bounds[0][0] == 0 and sum(n for _, n in bounds) == len(buf)
    assert all(a + n == b for (a, n), (b, _) in zip(bounds, bounds[1:], strict=False))
    assert all(off % PAGE == 0 for off, _ in bounds)
    assert all(c.min <= n <= c.max for _, n in bounds[:-1])
    assert 0.5 * len(buf) / AVG < len(bounds) < 2 * len(buf) / AVG


def test_zero_pages_are_cut_at_the_max_size_or_min_size() -> None:
    c = Chunking(AVG)
    bounds = c.boundaries(bytes(400 * PAGE))
    assert all(n in (c.min, c.max) for _, n in bounds[:-1])


def test_an_inserted_run_of_pages_leaves_the_later_chunks_unchanged() -> None:
    c = Chunking(AVG)
    old = _pages(4096, 2)
    new = old[: 1000 * PAGE] + _pages(3, 3) + old[1000 * PAGE :]
    ids = lambda b: [blake3.blake3(b[o : o + n]).hexdigest() for o, n in c.boundaries(b)]  # noqa: E731
    before, after = ids(old), ids(new)
    assert len(set(before) - set(after)) <= 2  # only the chunk(s) around the insertion changed
    # A fixed-size split would have changed every chunk after the insertion.
    fixed = lambda b: {blake3.blake3(b[o : o + AVG]).hexdigest() for o in range(0, len(b), AVG)}  # noqa: E731
    assert len(fixed(old) - fixed(new)) > len(before) // 2


def _tier(tmp: Path, pages: bytes, small: bytes = b"core" * 100) -> tuple[Path, dict[str, dict[str, object]]]:
    d = tmp / "tier"
    d.mkdir(exist_ok=True)
    (d / "pages-1.img").write_bytes(pages)
    (d / "core-1.img").write_bytes(small)
    files = {n: {"size": (d / n).stat().st_size, "blake3": blake3.blake3((d / n).read_bytes()).hexdigest()}
             for n in ("pages-1.img", "core-1.img")}
    return d, files


def _drain(store: Any, d: Path, files: dict, ckpt: str, index: ChunkIndex | None = None,
           level: int = 3) -> tuple[dict, ChunkedDrain]:
    job = ChunkedDrain(store, level, index if index is not None else ChunkIndex(None), Chunking(AVG), threads=2)
    with safefs.opened(os.open(d, os.O_RDONLY | os.O_DIRECTORY)) as sfd:
        storage = job.run(ckpt, sfd, files, None, lambda n: None)
    return {"id": ckpt, "files": files, "storage": storage}, job


@pytest.fixture
def store(tmp_path: Path) -> PosixStore:
    return PosixStore(tmp_path / "store", create=True)


def test_a_second_drain_of_the_same_pages_uploads_no_chunk(tmp_path: Path, store: PosixStore) -> None:
    pages = _pages(1024, 4)
    d, files = _tier(tmp_path, pages)
    m1, j1 = _drain(store, d, files, "ck-1")
    assert j1.stats.new_chunks == j1.stats.chunks > 0 and j1.stats.new_bytes == len(pages) + 400
    m2, j2 = _drain(store, d, files, "ck-2")
    assert j2.stats.new_chunks == 0 and j2.stats.reused_chunks == j2.stats.chunks
    assert j2.stats.stored_bytes < 2000  # the bundle only
    assert _st(m1).referenced_chunks() == _st(m2).referenced_chunks()


def test_reader_returns_the_raw_bytes_at_any_offset(tmp_path: Path, store: PosixStore) -> None:
    pages = _pages(700, 5)
    d, files = _tier(tmp_path, pages)
    m, _ = _drain(store, d, files, "ck-1", level=0)
    r = ChunkReader(store, _st(m))
    rng = random.Random(6)
    for _ in range(50):
        off, n = rng.randrange(len(pages)), rng.randrange(1, 300_000)
        assert r.read_at("pages-1.img", off, n) == pages[off : off + n]
    assert r.read_at("core-1.img", 4, 8) == (b"core" * 100)[4:12]
    refs = r.chunks("pages-1.img")
    assert refs[0].offset == 0 and refs[-1].offset + refs[-1].length == len(pages)


def test_reader_refuses_a_tampered_chunk(tmp_path: Path, store: PosixStore) -> None:
    d, files = _tier(tmp_path, _pages(300, 7))
    m, _ = _drain(store, d, files, "ck-1", level=0)
    ref = ChunkReader(store, _st(m)).chunks("pages-1.img")[1]
    p = store.root / chunk_key(ref.id)
    data = bytearray(p.read_bytes())
    data[100] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(ChunkError, match="does not match its id"):
        ChunkReader(store, _st(m)).read_at("pages-1.img", ref.offset, 10)


def test_fetch_writes_the_files_from_tier_chunks_cache_and_store(tmp_path: Path, store: PosixStore) -> None:
    pages = _pages(600, 8)
    d, files = _tier(tmp_path, pages)
    m, _ = _drain(store, d, files, "ck-1")
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    out = tmp_path / "out"
    out.mkdir()
    with safefs.opened(os.open(out, os.O_RDONLY | os.O_DIRECTORY)) as dfd:
        got = fetch_chunked(ChunkReader(store, _st(m)), dfd, TierChunks(), cache)
    assert (out / "pages-1.img").read_bytes() == pages and got["from_store"] == got["chunks"]
    # Warm cache: nothing more from the store.
    out2 = tmp_path / "out2"
    out2.mkdir()
    with safefs.opened(os.open(out2, os.O_RDONLY | os.O_DIRECTORY)) as dfd:
        got2 = fetch_chunked(ChunkReader(store, _st(m)), dfd, TierChunks(), cache)
    assert (out2 / "pages-1.img").read_bytes() == pages and got2["from_store"] == 0
    assert got2["from_cache"] == got2["chunks"]
    # Chunks of another checkpoint's tier copy count as local too.
    out3 = tmp_path / "out3"
    out3.mkdir()
    tier = TierChunks({d: {"pages-1.img": m["storage"]["files"]["pages-1.img"]["chunks"]}})
    with safefs.opened(os.open(out3, os.O_RDONLY | os.O_DIRECTORY)) as dfd:
        got3 = fetch_chunked(ChunkReader(store, _st(m)), dfd, tier)
    assert (out3 / "pages-1.img").read_bytes() == pages and got3["from_tier"] == got3["chunks"]


def test_a_chunk_the_index_lists_but_the_store_lost_is_uploaded_again(tmp_path: Path, store: PosixStore) -> None:
    d, files = _tier(tmp_path, _pages(500, 9))
    index = ChunkIndex(tmp_path / "index")
    m, _ = _drain(store, d, files, "ck-1", index)
    lost = sorted(_st(m).referenced_chunks())[0]
    (store.root / chunk_key(lost)).unlink()
    assert lost in ChunkIndex(tmp_path / "index")  # the index file still says present
    _, j2 = _drain(store, d, files, "ck-2", ChunkIndex(tmp_path / "index"))
    assert j2.stats.reuploaded_chunks == 1 and (store.root / chunk_key(lost)).is_file()


def test_cache_keeps_under_its_cap_and_drops_a_bad_entry(tmp_path: Path, store: PosixStore) -> None:
    d, files = _tier(tmp_path, _pages(400, 10))
    m, _ = _drain(store, d, files, "ck-1", level=0)
    cache = ChunkCache(tmp_path / "cache", 3 * AVG)
    r = ChunkReader(store, _st(m), cache, mem_chunks=1)
    r.read_at("pages-1.img", 0, 400 * PAGE)
    assert 0 < cache.size_bytes <= 3 * AVG
    cid = next(p.name for p in (tmp_path / "cache").iterdir())
    (tmp_path / "cache" / cid).write_bytes(b"junk")
    assert cache.get(cid, 4) is None and not (tmp_path / "cache" / cid).exists()


def _two_checkpoints(tmp: Path, store: Any, seed: int) -> tuple[Path, dict, dict]:
    """Two drained checkpoints whose pages share nothing (their small files are the same)."""
    d, files = _tier(tmp, _pages(400, seed))
    m1, _ = _drain(store, d, files, "ck-1")
    (d / "pages-1.img").write_bytes(_pages(400, seed + 1))
    files2 = dict(files, **{"pages-1.img": {"size": 400 * PAGE,
                                             "blake3": blake3.blake3((d / "pages-1.img").read_bytes()).hexdigest()}})
    m2, _ = _drain(store, d, files2, "ck-2")
    return d, m1, m2


def test_sweep_deletes_unreferenced_chunks_past_grace_and_keeps_young_ones(tmp_path: Path,
                                                                           store: PosixStore) -> None:
    d, m1, m2 = _two_checkpoints(tmp_path, store, 11)
    keep, old = _st(m2).referenced_chunks(), _st(m1).referenced_chunks() - _st(m2).referenced_chunks()
    assert old
    now = time.time()
    for cid in sorted(old)[: len(old) // 2]:  # half of ck-1's chunks are old, the other half just uploaded
        os.utime(store.root / chunk_key(cid), (now - 7200, now - 7200))
    dry = sweep(store, keep, grace_s=3600, dry_run=True, now=now)
    assert dry.deleted == len(old) // 2 and all((store.root / chunk_key(c)).exists() for c in old)
    res = sweep(store, keep, grace_s=3600, dry_run=False, now=now)
    assert (res.deleted, res.kept_in_grace) == (len(old) // 2, len(old) - len(old) // 2)
    assert res.bytes_freed == dry.bytes_freed > 0
    assert all((store.root / chunk_key(c)).exists() for c in keep)
    assert ChunkReader(store, _st(m2)).read_at("pages-1.img", 0, 400 * PAGE) == (d / "pages-1.img").read_bytes()


_SWEEP_CHILD = """
import sys, time
from memsnap.store.chunkgc import sweep
from memsnap.store.posix import PosixStore
keep = set(sys.argv[2].split(","))
sweep(PosixStore(sys.argv[1]), keep, grace_s=60, dry_run=False, now=time.time())
"""


def test_kill9_during_sweep_never_loses_a_referenced_chunk(tmp_path: Path, store: PosixStore) -> None:
    d, m1, m2 = _two_checkpoints(tmp_path, store, 13)
    old = _st(m1).referenced_chunks() - _st(m2).referenced_chunks()
    for p in (store.root / "chunks").rglob("*"):
        if p.is_file():
            os.utime(p, (time.time() - 3600, time.time() - 3600))
    env = {**os.environ, "MEMSNAP_FAILPOINTS": "sweep-deleted-one", "PYTHONPATH": str(Path(__file__).parents[2])}
    r = subprocess.run([sys.executable, "-c", _SWEEP_CHILD, str(store.root), ",".join(_st(m2).referenced_chunks())],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 137, r.stderr  # died after the first delete
    left = {p.name for p in (store.root / "chunks").rglob("*") if p.is_file()}
    assert len(old - left) == 1 and _st(m2).referenced_chunks() <= left
    assert ChunkReader(store, _st(m2)).read_at("pages-1.img", 0, 400 * PAGE) == (d / "pages-1.img").read_bytes()
    # A sweep run again finishes the job.
    assert sweep(store, _st(m2).referenced_chunks(), grace_s=60).deleted == len(old) - 1


def test_sweep_on_s3_deletes_only_unreferenced_chunks_past_grace(tmp_path: Path, s3_server) -> None:
    from memsnap.store.s3 import S3Store

    s3 = S3Store(s3_server.bucket, f"sweep-{time.time_ns()}", **s3_server.store_kwargs())
    d, m1, m2 = _two_checkpoints(tmp_path, s3, 15)
    old, keep = _st(m1).referenced_chunks() - _st(m2).referenced_chunks(), _st(m2).referenced_chunks()
    assert s3.touch(chunk_key(sorted(keep)[0])) and not s3.touch(chunk_key("0" * 64))
    assert sweep(s3, keep, grace_s=3600).deleted == 0  # everything is young
    res = sweep(s3, keep, grace_s=60, now=time.time() + 120)
    assert (res.deleted, res.kept_in_grace) == (len(old), 0) and res.bytes_freed > 0
    left = {k.rsplit("/", 1)[-1] for k, _, _ in s3.list_with_mtime("chunks/")}
    assert left == keep
    assert ChunkReader(s3, _st(m2)).read_at("pages-1.img", 0, 400 * PAGE) == (d / "pages-1.img").read_bytes()


_STORE_KEYS = [('chunk_size = "256K"', True), ('chunk_size = "8K"', False), ('chunk_size = 100001', False),
               ('chunk_size = "64M"', False), ('format = "whole"', True), ('format = "packs"', False),
               ('chunk_cache_size = ""', True)]


@pytest.mark.parametrize(("text", "ok"), _STORE_KEYS)
def test_store_chunk_keys_are_checked_when_the_config_loads(tmp_path: Path, text: str, ok: bool) -> None:
    from memsnap.config import ConfigError, load_config

    p = tmp_path / "memsnap.toml"
    p.write_text(f"[store]\n{text}\n")
    if ok:
        load_config(str(p), {})
    else:
        with pytest.raises(ConfigError, match="store"):
            load_config(str(p), {})


def test_a_checkpoint_adopted_from_a_chunked_stored_manifest_keeps_its_sizes(tmp_path: Path, store: PosixStore) -> None:
    from memsnap.manifest import StoredManifest

    d, files = _tier(tmp_path, _pages(300, 17))
    m, _ = _drain(store, d, files, "ck-1")
    body = {"id": "ck-1", "pid": 1, "job": "job-1", "name": "n", "uid": 0, "format": 2, **m}
    meta = StoredManifest.parse(body).catalog_meta()
    assert meta["store"] == {"format": "chunked", "logical_bytes": m["storage"]["logical_bytes"],
                             "stored_bytes": m["storage"]["stored_bytes"], "new_bytes": m["storage"]["new_bytes"]}
    assert meta["store"]["logical_bytes"] == 300 * PAGE + 400


# -- restore from the node's chunk cache (fetch_chunked's local copies) ------------------------------------
def _fetch(store: PosixStore, m: dict, out: Path, cache: ChunkCache | None, tier: TierChunks | None = None) -> dict:
    out.mkdir()
    with safefs.opened(os.open(out, os.O_RDONLY | os.O_DIRECTORY)) as dfd:
        return fetch_chunked(ChunkReader(store, _st(m)), dfd, tier or TierChunks(), cache)


def _warmed(tmp: Path, store: PosixStore, pages: bytes, level: int = 3) -> tuple[dict, ChunkCache]:
    """A drained checkpoint of pages, and a cache that a first fetch of it filled."""
    d, files = _tier(tmp, pages)
    m, _ = _drain(store, d, files, "ck-1", level=level)
    cache = ChunkCache(tmp / "cache", 1 << 30)
    _fetch(store, m, tmp / "out1", cache)
    return m, cache


def test_a_cache_entry_changed_in_place_is_dropped_and_its_chunk_fetched_from_the_store(
        tmp_path: Path, store: PosixStore) -> None:
    pages = _pages(600, 20)
    m, cache = _warmed(tmp_path, store, pages)
    entry = tmp_path / "cache" / m["storage"]["files"]["pages-1.img"]["chunks"][1][0]
    data = bytearray(entry.read_bytes())
    data[5] ^= 1  # same size: only the hash can tell
    entry.write_bytes(bytes(data))
    got = _fetch(store, m, tmp_path / "out2", cache)
    assert (tmp_path / "out2" / "pages-1.img").read_bytes() == pages
    assert got["from_store"] == 1 and got["from_cache"] == got["chunks"] - 1
    assert blake3.blake3(entry.read_bytes()).hexdigest() == entry.name  # cached again, from the store


def test_a_tier_chunk_changed_in_place_is_fetched_from_the_store(tmp_path: Path, store: PosixStore) -> None:
    pages = _pages(300, 21)
    d, files = _tier(tmp_path, pages)
    m, _ = _drain(store, d, files, "ck-1")
    refs = m["storage"]["files"]["pages-1.img"]["chunks"]
    with open(d / "pages-1.img", "r+b") as f:
        f.seek(refs[2][1] + 7)
        f.write(b"\xff")
    got = _fetch(store, m, tmp_path / "out", None, TierChunks({d: {"pages-1.img": refs}}))
    assert (tmp_path / "out" / "pages-1.img").read_bytes() == pages
    assert got["from_store"] == 1 and got["from_tier"] == got["chunks"] - 1


def test_a_refused_fetch_with_cached_and_stored_chunks_adds_nothing_to_the_cache(
        tmp_path: Path, store: PosixStore) -> None:
    m, _ = _warmed(tmp_path, store, _pages(600, 22))
    refs = m["storage"]["files"]["pages-1.img"]["chunks"]
    for cid, _o, _n in refs[len(refs) // 2:]:  # half the chunks leave the cache: they come from the store
        (tmp_path / "cache" / cid).unlink()
    (store.root / chunk_key(refs[-1][0])).write_bytes(b"tampered")
    kept = sorted(p.name for p in (tmp_path / "cache").iterdir())
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    with pytest.raises(ChunkError):
        _fetch(store, m, tmp_path / "out2", cache)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == kept  # nothing staged is left


def test_a_raw_chunk_that_starts_with_the_zstd_magic_comes_back_from_the_cache(
        tmp_path: Path, store: PosixStore) -> None:
    pages = b"\x28\xb5\x2f\xfd" + _pages(300, 23)[4:]
    m, cache = _warmed(tmp_path, store, pages, level=0)
    first, _o, n = m["storage"]["files"]["pages-1.img"]["chunks"][0]
    entry = tmp_path / "cache" / first
    assert entry.read_bytes()[:4] == pages[:4] and entry.stat().st_size != n  # stored as a zstd frame
    got = _fetch(store, m, tmp_path / "out2", cache)
    assert (tmp_path / "out2" / "pages-1.img").read_bytes() == pages and got["from_cache"] == got["chunks"]


def test_a_chunk_staged_twice_before_commit_is_cached_once_without_warnings(tmp_path: Path, caplog) -> None:
    # An image that holds the same chunk twice stages it twice in one fetch, from one thread, before the
    # commit: each staging needs a name of its own (the second used to clash with the first and delete it).
    raw = b"x" * 4096
    cid, stored = chunk_id(raw), encode_chunk(raw, 0)
    cache = ChunkCache(tmp_path / "cache", 1 << 20)
    with caplog.at_level(logging.WARNING, logger="memsnap.chunks"):
        staged = [cache.stage(cid, stored), cache.stage(cid, stored)]
        cache.commit([s for s in staged if s is not None])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert cache.size_bytes == len(stored) and sorted(p.name for p in (tmp_path / "cache").iterdir()) == [cid]
    assert cache.get(cid, len(raw)) == raw


class _SeesItsFile(ChunkedDrain):
    """Records, for each chunk read, whether fd was still the tier file the drain opened (its inode)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.inode = 0
        self.reads: list[bool] = []

    def _chunk(self, fd: int, off: int, n: int) -> tuple[str, str]:
        time.sleep(0.02)  # (still queued when the first result stops the drain)
        try:
            same = os.fstat(fd).st_ino == self.inode
        except OSError:
            same = False
        self.reads.append(same)
        return super()._chunk(fd, off, n)


def test_a_drain_stopped_between_chunks_reads_no_chunk_after_it_closed_the_file(tmp_path: Path,
                                                                               store: PosixStore) -> None:
    """A move commits (check_still_wanted raises in progress) while chunks are queued: every queued read ends
    before the tier file's fd is closed, so none reads the file that reuses its number."""
    d, files = _tier(tmp_path, _pages(512, 7))
    job = _SeesItsFile(store, 0, ChunkIndex(None), Chunking(AVG), threads=2)
    job.inode = (d / "pages-1.img").stat().st_ino

    class MovedAway(Exception):
        pass

    def progress(n: int) -> None:
        if n >= AVG // 4:  # a page chunk (the bundle's small files pass)
            raise MovedAway()

    with safefs.opened(os.open(d, os.O_RDONLY | os.O_DIRECTORY)) as sfd, pytest.raises(MovedAway):
        job.run("ck-1", sfd, files, None, progress)
    reads = len(job.reads)
    time.sleep(0.3)  # (a task the drain did not wait for would read now)
    assert len(job.reads) == reads and job.reads and all(job.reads), job.reads


def _fetch_fill_later(tmp: Path, store: PosixStore,
                      pages: bytes) -> tuple[dict[str, Any], ChunkCache, list[CacheFill], dict[str, int]]:
    """A drained checkpoint of pages fetched into tmp/out, its cache fill handed back instead of run."""
    d, files = _tier(tmp, pages)
    m, _ = _drain(store, d, files, "ck-1")
    cache = ChunkCache(tmp / "cache", 1 << 30)
    fills: list[CacheFill] = []
    (tmp / "out").mkdir()
    with safefs.opened(os.open(tmp / "out", os.O_RDONLY | os.O_DIRECTORY)) as dfd:
        got = fetch_chunked(ChunkReader(store, _st(m)), dfd, TierChunks(), cache, fill_later=fills.append)
    return m, cache, fills, got


def test_a_fetch_handed_a_later_fill_caches_nothing_until_the_fill_runs(tmp_path: Path, store: PosixStore) -> None:
    pages = _pages(600, 24)
    m, cache, fills, got = _fetch_fill_later(tmp_path, store, pages)
    assert (tmp_path / "out" / "pages-1.img").read_bytes() == pages and len(fills) == 1
    assert cache.size_bytes == 0  # the restore did not wait for the cache
    os.unlink(tmp_path / "out" / "pages-1.img")  # (the image may go meanwhile: the fill holds it open)
    assert fills[0].run() == got["from_store"] == got["chunks"]
    assert _fetch(store, m, tmp_path / "out2", cache)["from_cache"] == got["chunks"]


def test_a_later_fill_does_not_cache_a_chunk_changed_in_the_fetched_image(tmp_path: Path, store: PosixStore) -> None:
    m, cache, fills, got = _fetch_fill_later(tmp_path, store, _pages(600, 25))
    first = m["storage"]["files"]["pages-1.img"]["chunks"][0][0]
    with open(tmp_path / "out" / "pages-1.img", "r+b") as f:
        f.write(b"\xff")
    assert fills[0].run() == got["chunks"] - 1
    assert first not in cache and not (tmp_path / "cache" / first).exists()


def test_a_warm_cache_is_read_by_as_many_threads_as_the_store(tmp_path: Path, store: PosixStore,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pages = _pages(600, 21)
    d, files = _tier(tmp_path, pages)
    m, _ = _drain(store, d, files, "ck-1")
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    warm = tmp_path / "warm"
    warm.mkdir()
    with safefs.opened(os.open(warm, os.O_RDONLY | os.O_DIRECTORY)) as dfd:
        fetch_chunked(ChunkReader(store, _st(m)), dfd, TierChunks(), cache)  # (fills the cache)
    busy, most = [0], [0]
    lock = threading.Lock()
    real = ChunkCache.read_into

    def slow(self: ChunkCache, cid: str, buf: memoryview) -> bool:  # (a disk that answers in 20 ms)
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        time.sleep(0.02)
        try:
            return real(self, cid, buf)
        finally:
            with lock:
                busy[0] -= 1

    monkeypatch.setattr(ChunkCache, "read_into", slow)
    out = tmp_path / "out"
    out.mkdir()
    with safefs.opened(os.open(out, os.O_RDONLY | os.O_DIRECTORY)) as dfd:
        got = fetch_chunked(ChunkReader(store, _st(m)), dfd, TierChunks(), cache, threads=8)
    assert (out / "pages-1.img").read_bytes() == pages and got["from_cache"] == got["chunks"] > 16
    assert most[0] >= 6  # (8 readers, not one per CPU)


def test_same_filesystem_follows_a_missing_path_to_its_parent_and_tells_filesystems_apart(tmp_path: Path) -> None:
    from memsnap.drain import same_filesystem

    assert same_filesystem(str(tmp_path), str(tmp_path / "not" / "yet" / "made"))
    assert not same_filesystem(str(tmp_path), "/proc/self")
