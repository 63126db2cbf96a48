"""memsnap.pageserver: pagemap parsing, (pid, vaddr, nr_pages) -> pages image offsets, and the page-server
protocol as `criu lazy-pages` speaks it (CRIU 4.1 criu/page-xfer.c), against real dumps (by the shipped 4.1.1;
by 4.2.1 too with MEMSNAP_TEST_CRIU_421) and synthetic images; tests/unit/test_criu_formats.py has both versions'
formats byte for byte."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memsnap.pageserver.images import (
    IMG_COMMON_MAGIC,
    PAGE,
    PAGEMAP_MAGIC,
    PE_LAZY,
    PE_PARENT,
    PE_PRESENT,
    ImageError,
    PageIndex,
    _fields,
    parse_pagemap,
)
from memsnap.pageserver.server import PS_IOV_ADD_F, PS_IOV_FORCE_CLOSE, PS_IOV_GET, PageServer
from memsnap.pageserver.sources import DirPageSource, SourceFailed, fixed_blocks
from memsnap.pageserver.wire import IOV_41 as IOV

# The criu memsnap ships (scripts/install-criu.sh), and, when MEMSNAP_TEST_CRIU_421 names one, a CRIU 4.2.1 too
# (CRIU_VERSION=4.2.1 CRIU_PREFIX=/opt/criu-4.2.1 scripts/install-criu.sh): CI builds only the first, and a test
# it cannot run must not turn into a skip there. The 4.2 formats are covered by test_criu_formats.py's fixtures.
CRIUS = {"4.1.1": "/usr/local/sbin/criu",
         **({"4.2.1": os.environ["MEMSNAP_TEST_CRIU_421"]} if os.environ.get("MEMSNAP_TEST_CRIU_421") else {})}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _msg(*fields: tuple[int, int]) -> bytes:
    return b"".join(_varint(num << 3) + _varint(v) for num, v in fields)


def pagemap_image(pages_id: int, entries: list[tuple[int, int, int]]) -> bytes:
    """A pagemap-*.img as CRIU writes it: magics, then size-prefixed PagemapHead and PagemapEntry messages."""
    msgs = [_msg((1, pages_id))] + [_msg((1, v), (2, n), (4, f)) for v, n, f in entries]
    return struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC) + b"".join(
        struct.pack("<I", len(m)) + m for m in msgs)


BASE = 0x7F0000000000
# Entry order is file order: [eager 1 page][lazy 3 pages][hole in the parent][lazy 2 pages]
ENTRIES = [(BASE, 1, PE_PRESENT), (BASE + 4 * PAGE, 3, PE_PRESENT | PE_LAZY), (BASE + 8 * PAGE, 2, PE_PARENT),
           (BASE + 10 * PAGE, 2, PE_PRESENT | PE_LAZY)]


def test_a_synthetic_pagemap_parses_with_its_flags():
    pm = parse_pagemap(pagemap_image(3, ENTRIES))
    assert pm.pages_id == 3 and pm.pages_file == "pages-3.img"
    assert [(e.vaddr, e.nr_pages, e.present, e.lazy) for e in pm.entries] == [
        (BASE, 1, True, False), (BASE + 4 * PAGE, 3, True, True), (BASE + 8 * PAGE, 2, False, False),
        (BASE + 10 * PAGE, 2, True, True)]


@pytest.mark.parametrize("data", [b"", b"\x19\x43\x56\x54\x00\x00\x00\x00",
                                  pagemap_image(1, ENTRIES)[:-3],
                                  struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC)],
                         ids=["empty", "other-magic", "truncated", "no-head"])
def test_a_broken_pagemap_is_refused(data):
    with pytest.raises(ImageError):
        parse_pagemap(data)


def test_requests_map_to_offsets_in_the_pages_image():
    idx = PageIndex.from_images({"pagemap-7.img": pagemap_image(3, ENTRIES), "pages-3.img": b"ignored"})
    assert idx.locate(7, BASE, 1) == [("pages-3.img", 0, PAGE)]
    assert idx.locate(7, BASE + 5 * PAGE, 2) == [("pages-3.img", 2 * PAGE, 2 * PAGE)]
    # The hole takes no room in the pages image: the next entry follows the previous one.
    assert idx.locate(7, BASE + 10 * PAGE, 2) == [("pages-3.img", 4 * PAGE, 2 * PAGE)]
    for pid, vaddr, n in [(7, BASE + PAGE, 1), (7, BASE + 8 * PAGE, 1), (7, BASE + 6 * PAGE, 2), (8, BASE, 1),
                          (7, BASE + 1, 1)]:
        with pytest.raises(KeyError):
            idx.locate(pid, vaddr, n)
    assert idx.ranges(lazy=True) == [("pages-3.img", PAGE, 5 * PAGE)]  # adjacent in the file: one range
    assert idx.ranges(lazy=False) == [("pages-3.img", 0, PAGE)]


def test_a_request_across_adjacent_entries_maps_to_one_range():
    idx = PageIndex.from_images({"pagemap-1.img": pagemap_image(1, [(BASE, 2, PE_PRESENT | PE_LAZY),
                                                                    (BASE + 2 * PAGE, 2, PE_PRESENT | PE_LAZY)])})
    assert idx.locate(1, BASE + PAGE, 2) == [("pages-1.img", PAGE, 2 * PAGE)]


@pytest.fixture(scope="module", params=list(CRIUS))
def real_dump(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dump by CRIU 4.1.1 or 4.2.1 (their pagemaps differ) of a small Python process whose 4 MiB buffer holds a
    known pattern."""
    criu = CRIUS[request.param]
    assert os.path.exists(criu), f"no CRIU {request.param} at {criu} (scripts/install-criu.sh builds it)"
    if os.geteuid() != 0:
        pytest.skip("dumps a process: needs root (the root tier runs it)")
    d = tmp_path_factory.mktemp("dump")
    code = ("import ctypes,sys,time\nb=bytearray(4<<20)\n"
            "for i in range(0,len(b),4096): b[i:i+8]=(0xC0FFEE00+i//4096).to_bytes(8,'little')\n"
            "print(ctypes.addressof((ctypes.c_char*1).from_buffer(b)), flush=True)\n"
            "while True: time.sleep(1)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        assert p.stdout is not None
        (d / "buffer").write_text(p.stdout.readline().decode().strip())
        r = subprocess.run([criu, "dump", "-t", str(p.pid), "-D", str(d), "--shell-job", "-o", "dump.log"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (d / "dump.log").read_text()[-2000:]
        (d / "pid").write_text(str(p.pid))
        (d / "criu").write_text(request.param)
    finally:
        p.kill()
        p.wait()
    return d


@pytest.mark.root
def test_a_real_dumps_pagemap_indexes_its_whole_pages_image(real_dump):
    files = {p.name: p.read_bytes() for p in real_dump.glob("pagemap-*.img")}
    idx = PageIndex.from_images(files)
    pid = int((real_dump / "pid").read_text())
    assert list(idx.maps) == [pid]
    pages = real_dump / idx.pages_file(pid)
    lazy, eager = idx.ranges(lazy=True), idx.ranges(lazy=False)
    assert sum(n for _, _, n in lazy) + sum(n for _, _, n in eager) == pages.stat().st_size
    assert sum(n for _, _, n in lazy) >= 4 << 20  # the buffer is private anonymous memory: lazy


@pytest.mark.root
def test_a_real_dump_counts_pages_in_the_field_of_its_criu_version(real_dump):
    """4.1.1: nr_pages in field 2; 4.2.1: field 2 (compat_nr_pages) is 0, the count is in field 5."""
    raw = next(real_dump.glob("pagemap-*.img")).read_bytes()
    pos, entries = 8, []
    while pos < len(raw):
        (n,) = struct.unpack_from("<I", raw, pos)
        entries.append(dict(_fields(raw[pos + 4:pos + 4 + n])))
        pos += 4 + n
    entries = entries[1:]  # (after the head)
    assert entries
    if (real_dump / "criu").read_text() == "4.1.1":
        assert all(f[2] > 0 and 5 not in f for f in entries)
    else:
        assert all(f[2] == 0 and f[5] > 0 for f in entries)


@pytest.mark.root
def test_the_real_dumps_pattern_is_where_the_index_says(real_dump):
    files = {p.name: p.read_bytes() for p in real_dump.glob("pagemap-*.img")}
    idx = PageIndex.from_images(files)
    pid = int((real_dump / "pid").read_text())
    buf = int((real_dump / "buffer").read_text())  # address of the buffer's first byte in the dumped process
    with open(real_dump / idx.pages_file(pid), "rb") as f:
        for k in range(0, 1024, 37):
            vaddr = buf + k * PAGE
            ((name, off, n),) = idx.locate(pid, vaddr - vaddr % PAGE, 1)
            f.seek(off + vaddr % PAGE)
            assert int.from_bytes(f.read(8), "little") == 0xC0FFEE00 + k


# -- the protocol ------------------------------------------------------------------------------------
def _serve(tmp_path: Path, content: bytes, **kw) -> tuple[PageServer, socket.socket, list[str]]:
    (tmp_path / "pages-3.img").write_bytes(content)
    idx = PageIndex.from_images({"pagemap-7.img": pagemap_image(3, ENTRIES)})
    ours, theirs = socket.socketpair()
    failures: list[str] = []
    src = kw.pop("source", None) or DirPageSource(tmp_path)
    server = PageServer(ours, idx, src, iov=IOV, on_fail=failures.append, name="t", **kw).start()
    return server, theirs, failures


def _get(sk: socket.socket, vaddr: int, n: int, pid: int = 7) -> None:
    sk.sendall(IOV.pack(PS_IOV_GET, n, vaddr, pid))


def _reply(sk: socket.socket) -> tuple[tuple[int, int, int, int], bytes]:
    head = IOV.unpack(_recv(sk, IOV.size))
    return head, _recv(sk, head[1] * PAGE)


def _recv(sk: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = sk.recv(n - len(buf))
        assert got, "the page server closed the socket"
        buf += got
    return buf


def _pages(n: int) -> bytes:
    return b"".join(bytes([i + 1]) * PAGE for i in range(n))


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "on-demand"])
def test_requests_are_answered_in_order_with_the_pages_then_close_gets_status_0(tmp_path, prefetch):
    content = _pages(6)
    server, sk, failures = _serve(tmp_path, content, prefetch=prefetch)
    _get(sk, BASE + 10 * PAGE, 2)
    _get(sk, BASE + 4 * PAGE, 1)
    _get(sk, BASE + 5 * PAGE, 2)
    for vaddr, n, off in [(BASE + 10 * PAGE, 2, 4), (BASE + 4 * PAGE, 1, 1), (BASE + 5 * PAGE, 2, 2)]:
        (cmd, nr, va, dst), data = _reply(sk)
        assert (cmd, nr, va, dst) == (PS_IOV_ADD_F | PE_PRESENT << 16, n, vaddr, 7)
        assert data == content[off * PAGE:(off + n) * PAGE]
    sk.sendall(IOV.pack(PS_IOV_FORCE_CLOSE, 0, 0, 0))
    assert struct.unpack("<i", _recv(sk, 4)) == (0,)
    assert server.ok.wait(5) and not failures and not server.error
    server.close()


def test_a_request_for_pages_the_image_lacks_fails_the_server(tmp_path):
    server, sk, failures = _serve(tmp_path, _pages(6))
    _get(sk, BASE + PAGE, 1)  # (between entries)
    assert server.done.wait(5)
    assert failures and "not in the image" in failures[0] and not server.ok.is_set()
    assert sk.recv(1) == b""  # lazy-pages sees its socket end, fails, and its supervisor kills the job
    server.close()


class _Broken(DirPageSource):
    def __init__(self, root: Path, integrity: bool) -> None:
        super().__init__(root)
        self.integrity = integrity
        self.calls = 0

    def read_at(self, name: str, offset: int, length: int) -> bytes:
        self.calls += 1
        raise SourceFailed("chunk 1 does not verify" if self.integrity else "store unreachable", self.integrity)


@pytest.mark.parametrize("integrity", [True, False], ids=["tampered", "unreachable"])
def test_a_source_that_fails_fails_the_server_with_its_reason(tmp_path, integrity, monkeypatch):
    monkeypatch.setattr("memsnap.pageserver.server._RETRIES", (0.01, 0.01))
    (tmp_path / "pages-3.img").write_bytes(_pages(6))
    src = _Broken(tmp_path, integrity)
    server, sk, failures = _serve(tmp_path, _pages(6), source=src, prefetch=False)
    _get(sk, BASE + 4 * PAGE, 1)
    assert server.done.wait(5)
    assert failures == ["chunk 1 does not verify" if integrity else "store unreachable"]
    assert src.calls == (1 if integrity else 3)  # a chunk that does not verify is never asked for again
    server.close()


@pytest.mark.parametrize("held", [True, False], ids=["while-criu-restores", "after"])
def test_a_failed_page_is_never_answered_and_the_tasks_die_before_the_socket_ends(tmp_path, held, monkeypatch):
    # Before: while CRIU restored (held), a page that could not be had was answered with zeros, and the socket
    # was shut before on_fail killed the tasks.
    monkeypatch.setattr("memsnap.pageserver.server._RETRIES", (0.01,))
    (tmp_path / "pages-3.img").write_bytes(_pages(6))
    seen: list[str] = []
    ours, sk = socket.socketpair()
    idx = PageIndex.from_images({"pagemap-7.img": pagemap_image(3, ENTRIES)})

    def on_fail(why: str) -> None:  # (LazyGuard.fail: kills the tasks, then lazy-pages)
        try:
            got = sk.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            seen.append(f"lazy-pages got {got!r} before the tasks died")
        except BlockingIOError:
            seen.append("tasks killed while lazy-pages still waits")

    server = PageServer(ours, idx, _Broken(tmp_path, False), iov=IOV, on_fail=on_fail, name="t", prefetch=False,
                        held=held).start()
    _get(sk, BASE + 4 * PAGE, 1)
    assert server.done.wait(5)
    assert seen == ["tasks killed while lazy-pages still waits"]
    assert sk.recv(1) == b""  # then the socket ends, with no reply: no zero page
    server.close()


class _SlowMiddle(DirPageSource):
    """2-page blocks; the block at [2, 4) pages takes 2 s to come (a fetch still on its way)."""

    def blocks(self, name: str) -> list[tuple[int, int]]:
        return fixed_blocks(os.fstat(self._fd(name)).st_size, 2 * PAGE)

    def read_at(self, name: str, offset: int, length: int) -> bytes:
        if offset < 4 * PAGE and offset + length > 2 * PAGE:
            time.sleep(2.0)
        return super().read_at(name, offset, length)


def test_a_fault_behind_a_background_request_never_waits_for_its_slow_blocks(tmp_path):
    # lazy-pages reads replies in order. Its background push asks for 3 pages ([1, 4) in the pages image: the
    # block [0, 2) comes at once, [2, 4) takes 2 s); a fault comes right behind it. Before, the push's reply
    # waited for the whole request, and the fault behind it 2 s too; now the push gets the page in memory
    # (lazy-pages asks for the rest later) and the fault its page at once.
    content = _pages(6)
    (tmp_path / "pages-3.img").write_bytes(content)
    idx = PageIndex.from_images({"pagemap-7.img": pagemap_image(3, ENTRIES)})
    ours, sk = socket.socketpair()
    server = PageServer(ours, idx, _SlowMiddle(tmp_path), iov=IOV, on_fail=lambda why: None, name="t",
                        prefetch=False).start()
    t0 = time.monotonic()
    _get(sk, BASE + 4 * PAGE, 3)  # (the push)
    _get(sk, BASE + 10 * PAGE, 1)  # (the fault)
    (cmd, nr, va, _), data = _reply(sk)
    assert (nr, va) == (1, BASE + 4 * PAGE) and data == content[PAGE:2 * PAGE]  # short: what was there
    (cmd, nr, va, _), data = _reply(sk)
    assert (nr, va) == (1, BASE + 10 * PAGE) and data == content[4 * PAGE:5 * PAGE]
    assert time.monotonic() - t0 < 1.5, "the fault waited for the push's slow block"
    # lazy-pages asks for the rest later: it comes once its block is in (fetched ahead meanwhile).
    _get(sk, BASE + 5 * PAGE, 2)
    (cmd, nr, va, _), data = _reply(sk)
    assert (nr, va) == (2, BASE + 5 * PAGE) and data == content[2 * PAGE:4 * PAGE]
    assert server.short_replies == 1 and server.stats()["faults"] == 1
    server.close()


def test_lazy_pages_going_away_before_close_is_a_failure(tmp_path):
    server, sk, failures = _serve(tmp_path, _pages(6))
    sk.close()
    assert server.done.wait(5)
    assert failures and "before every page arrived" in failures[0]
    server.close()


def test_prefetch_fills_the_cache_so_requests_hit_it(tmp_path):
    server, sk, failures = _serve(tmp_path, _pages(6))
    deadline = time.monotonic() + 5
    while server.cache.prefetched_bytes < 5 * PAGE and time.monotonic() < deadline:
        time.sleep(0.01)
    _get(sk, BASE + 4 * PAGE, 3)
    _get(sk, BASE + 10 * PAGE, 2)
    _reply(sk)
    _reply(sk)
    assert server.cache.hits >= 2 and server.cache.misses == 0
    assert server.cache.cached_bytes == 0  # every lazy page was served: the block left memory
    sk.sendall(IOV.pack(PS_IOV_FORCE_CLOSE, 0, 0, 0))
    assert server.ok.wait(5)
    server.close()


class _PageBlocks(DirPageSource):
    """Fetched a page at a time, each read recorded (page number)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[int] = []

    def read_at(self, name: str, offset: int, length: int) -> bytes:
        self.reads.append(offset // PAGE)
        return super().read_at(name, offset, length)

    def blocks(self, name: str) -> list[tuple[int, int]]:
        return fixed_blocks(os.fstat(self._fd(name)).st_size, PAGE)


def test_the_prefetch_waits_while_the_jobs_faults_wait_on_the_store_then_streams_the_rest(tmp_path):
    # A fault's block shares the link with every prefetch in flight: the prefetch holds off while the job
    # faults (here: the quiet time never passes; the hold ends after hold_s), then fetches the rest in order.
    (tmp_path / "pages-3.img").write_bytes(_pages(6))
    src = _PageBlocks(tmp_path)
    server, sk, failures = _serve(tmp_path, _pages(6), source=src, quiet_s=600, hold_s=2)
    _get(sk, BASE + 10 * PAGE, 1)  # (the job faults on pages-3.img's page 4)
    _reply(sk)
    assert src.reads == [4]  # the prefetch did not start meanwhile
    deadline = time.monotonic() + 30
    while server.cache.prefetched_bytes < 4 * PAGE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert src.reads == [4, 1, 2, 3, 5]  # then it streamed the other lazy pages, in file order
    assert server.cache.fault_waits == 1
    sk.sendall(IOV.pack(PS_IOV_FORCE_CLOSE, 0, 0, 0))
    assert server.ok.wait(5) and not failures
    server.close()


def test_recovery_removes_the_dirs_of_lazy_restores_from_the_store(tmp_path):
    # Their page server died with the daemon (lazy-pages failed, its supervisor killed the job): nothing
    # will read them again.
    from fakes import make_engine

    e = make_engine(tmp_path)
    stale = e.work_root / "ck-a.lazystore-abc123"
    (stale / "images").mkdir(parents=True)
    (stale / "images" / "pages-1.img").write_bytes(b"x")
    other = e.work_root / "ck-a.restore-abc123"
    other.mkdir()
    e.recover()
    assert not stale.exists() and other.exists()
