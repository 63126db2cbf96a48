"""Hashing an image while CRIU writes it (memsnap.dumphash) and describe_files() taking those digests only for
files that did not change since."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import blake3

from memsnap import manifest
from memsnap.dumphash import DumpHasher, Hashed


def _append_slowly(path: Path, data: bytes, pieces: int, pause: float) -> None:
    step = -(-len(data) // pieces)
    with open(path, "wb") as f:
        for i in range(0, len(data), step):
            f.write(data[i:i + step])
            f.flush()
            time.sleep(pause)


def test_a_pages_file_is_hashed_while_it_grows_and_its_digest_is_the_files(tmp_path: Path) -> None:
    data = random.Random(1).randbytes(24 << 20)
    hasher = DumpHasher(tmp_path)
    writer = threading.Thread(target=_append_slowly, args=(tmp_path / "pages-1.img", data, 24, 0.02))
    writer.start()
    writer.join()
    (tmp_path / "core-1.img").write_bytes(b"core")
    known = hasher.finish()
    assert set(known) == {"pages-1.img"}  # (small files are left to describe_files)
    assert known["pages-1.img"].blake3 == blake3.blake3(data).hexdigest()
    assert hasher.hashed_while_dumping > 0 and hasher.hashed_while_dumping + hasher.hashed_after == len(data)
    files = manifest.describe_files(tmp_path, known)
    assert files == {"core-1.img": {"size": 4, "blake3": blake3.blake3(b"core").hexdigest()},
                     "pages-1.img": {"size": len(data), "blake3": blake3.blake3(data).hexdigest()}}


def test_describe_files_uses_a_known_digest_only_while_the_file_is_unchanged(tmp_path: Path) -> None:
    p = tmp_path / "pages-1.img"
    p.write_bytes(b"a" * 8192)
    hasher = DumpHasher(tmp_path)
    known = hasher.finish()
    # A digest taken for these very bytes is used as it is (here a planted one shows it was not recomputed)...
    planted = {"pages-1.img": Hashed(known["pages-1.img"].key, "0" * 64)}
    assert manifest.describe_files(tmp_path, planted)["pages-1.img"]["blake3"] == "0" * 64
    # ...but once the file changed in place (same size; mtime and ctime move), it is hashed again.
    time.sleep(0.01)
    with open(p, "r+b") as f:
        f.write(b"b")
    assert manifest.describe_files(tmp_path, planted)["pages-1.img"]["blake3"] == \
        blake3.blake3(b"b" + b"a" * 8191).hexdigest()


def test_a_file_replaced_under_the_same_name_is_hashed_again(tmp_path: Path) -> None:
    p = tmp_path / "pages-1.img"
    p.write_bytes(b"x" * 4096)
    known = DumpHasher(tmp_path).finish()
    tmp = tmp_path / "other"
    tmp.write_bytes(b"y" * 4096)
    os.replace(tmp, p)  # (another inode)
    assert manifest.describe_files(tmp_path, known)["pages-1.img"]["blake3"] == blake3.blake3(b"y" * 4096).hexdigest()


def test_a_hasher_closed_after_a_failed_dump_leaves_no_descriptor_open(tmp_path: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    hasher = DumpHasher(tmp_path)
    (tmp_path / "pages-1.img").write_bytes(b"z" * 65536)
    time.sleep(0.05)
    hasher.close()
    hasher.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_close_stops_the_thread_between_reads_not_at_the_end_of_the_file(tmp_path: Path, monkeypatch) -> None:
    # A park retried on a busy node waited minutes for a starved SCHED_IDLE thread to hash a whole pages file
    # before it saw the stop. It now stops between reads (here of 4 KiB, so that the file takes long).
    monkeypatch.setattr("memsnap.dumphash.READ_BYTES", 4096)
    whole = tmp_path.parent / f"{tmp_path.name}-whole"
    whole.write_bytes(random.Random(2).randbytes(64 << 20))
    hasher = DumpHasher(tmp_path)
    os.rename(whole, tmp_path / "pages-1.img")  # (all of it there when the thread first reads it)
    deadline = time.monotonic() + 30
    while hasher.hashed == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    hasher.close()
    assert 0 < hasher.hashed_while_dumping < 64 << 20
