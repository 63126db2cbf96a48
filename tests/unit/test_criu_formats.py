"""CRIU 4.1 and 4.2 formats, byte for byte: pagemap entries (4.2 counts pages in field 5, compat_nr_pages in
field 2 is 0) and the page-server header, struct page_server_iov (24 bytes up to 4.1, 32 from 4.2), as memsnap's
page server (memsnap.pageserver) and the lazy move's relay check (memsnap.move.psflow) read and write them.

The fixtures are the bytes CRIU writes (images/pagemap.proto, criu/page-xfer.c of v4.1.1 and v4.2), spelled out
in hex rather than built by the code under test."""

from __future__ import annotations

import random
import socket
import struct
from pathlib import Path

import pytest

from memsnap.move.psflow import PageFlow
from memsnap.pageserver.images import PAGE, ImageError, PageIndex, parse_pagemap
from memsnap.pageserver.server import PageServer
from memsnap.pageserver.sources import DirPageSource
from memsnap.pageserver.wire import IOV_41, IOV_42, IovLayout, UnknownCriuVersion, iov_layout
from tests.unit.test_pageserver import _recv

VA = 0x7F0000004000
MAGICS = "1943565425400856"  # IMG_COMMON_MAGIC, PAGEMAP_MAGIC (little-endian u32s)
HEAD = "0803"  # PagemapHead {pages_id: 3}
# PagemapEntry {vaddr: VA, nr_pages: 3, flags: PE_PRESENT | PE_LAZY}, as 4.1.1 writes it ...
LAZY_41 = "088080818080e01f" "1003" "2006"
# ... and as 4.2 does: compat_nr_pages (field 2) 0, nr_pages (field 5, uint64) 3.
LAZY_42 = "088080818080e01f" "1000" "2006" "2803"
# {vaddr: VA + 16 pages, 2 pages, flags: PE_PARENT}: a hole whose pages are in the parent.
HOLE_41 = "088080858080e01f" "1002" "2001"
HOLE_42 = "088080858080e01f" "1000" "2001" "2802"
# 4.2, 2**32 + 5 pages at 0x100000000000 (PE_PRESENT): a count a u32 cannot hold.
WIDE_42 = "0880808080808004" "1000" "2004" "288580808010"


def image(*msgs: str) -> bytes:
    """Magics, then each message with its u32 size."""
    out = bytes.fromhex(MAGICS)
    for m in msgs:
        b = bytes.fromhex(m)
        out += struct.pack("<I", len(b)) + b
    return out


# -- pagemap images --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lazy, hole", [(LAZY_41, HOLE_41), (LAZY_42, HOLE_42)], ids=["criu-4.1", "criu-4.2"])
def test_a_pagemap_entry_counts_its_pages_in_either_criu_version(lazy: str, hole: str) -> None:
    pm = parse_pagemap(image(HEAD, lazy, hole))
    assert pm.pages_file == "pages-3.img"
    assert [(e.vaddr, e.nr_pages, e.present, e.lazy) for e in pm.entries] == [
        (VA, 3, True, True), (VA + 16 * PAGE, 2, False, False)]
    idx = PageIndex.from_images({"pagemap-7.img": image(HEAD, lazy, hole)})
    assert idx.locate(7, VA + PAGE, 2) == [("pages-3.img", PAGE, 2 * PAGE)]
    assert idx.ranges(lazy=True) == [("pages-3.img", 0, 3 * PAGE)]


def test_a_42_entry_may_count_more_pages_than_a_u32_holds() -> None:
    (e,) = parse_pagemap(image(HEAD, WIDE_42)).entries
    assert (e.vaddr, e.nr_pages, e.present) == (0x100000000000, (1 << 32) + 5, True)


@pytest.mark.parametrize("entry", [
    "088080818080e01f" "1000" "2006",  # no pages in field 2, no field 5 (how 4.1 read a 4.2 image)
    "088080818080e01f" "1005" "2006" "2800",  # field 5 present and 0: it counts, as in CRIU
    "0880e0ffffffffffffff01" "1000" "2004" "2802",  # 2 pages at 2**64 - PAGE: the second past 2**64
    "088080818080e01f" "1000" "2004" "288080808080808008",  # 2**52 pages at VA: past 2**64
    "088080818080e01f" "2006",  # no field 2 (required in both schemas)
], ids=["zero-pages", "field-5-zero", "vaddr-past-2**64", "end-past-2**64", "no-field-2"])
def test_an_entry_without_pages_or_outside_the_address_space_is_refused(entry: str) -> None:
    with pytest.raises(ImageError):
        parse_pagemap(image(HEAD, entry))


def test_a_broken_42_image_only_ever_raises_image_error() -> None:
    good = image(HEAD, LAZY_42, HOLE_42, WIDE_42)
    rnd = random.Random(42)
    variants = [good[:n] for n in range(len(good))]
    for _ in range(400):
        b = bytearray(good)
        b[rnd.randrange(8, len(b))] = rnd.randrange(256)
        variants.append(bytes(b))
    for data in variants:
        try:
            parse_pagemap(data)
        except ImageError:
            pass


# -- the page-server header --------------------------------------------------------------------------------------
GET_41 = "07000000" "01000000" "00400000007f0000" "0700000000000000"  # PS_IOV_GET, 1 page at VA of task 7
GET_42 = "07000000" "00000000" "0100000000000000" "00400000007f0000" "0700000000000000"
ADD_41 = "06000400" "01000000" "00400000007f0000" "0700000000000000"  # PS_IOV_ADD_F | PE_PRESENT << 16
ADD_42 = "06000400" "00000000" "0100000000000000" "00400000007f0000" "0700000000000000"
CLOSE_41 = "24100000" + "00" * 20  # PS_IOV_FORCE_CLOSE
CLOSE_42 = "24100000" + "00" * 28
LAYOUTS = [(IOV_41, GET_41, ADD_41, CLOSE_41, LAZY_41), (IOV_42, GET_42, ADD_42, CLOSE_42, LAZY_42)]
IDS = ["criu-4.1", "criu-4.2"]


@pytest.mark.parametrize("version, layout", [("4.1.1", IOV_41), ("4.1", IOV_41), ("3.19", IOV_41),
                                             ("4.2", IOV_42), ("4.2.1", IOV_42), ("4.10.0", IOV_42),
                                             ("5.0", IOV_42)])
def test_the_header_layout_follows_criu_version(version: str, layout: IovLayout) -> None:
    assert iov_layout(version) is layout


@pytest.mark.parametrize("version", ["", "4", "v4.2", "4.2-rc1", "4.2.1.7", "x.y", "4." + "9" * 50])
def test_a_version_that_says_nothing_is_refused(version: str) -> None:
    with pytest.raises(UnknownCriuVersion):
        iov_layout(version)


@pytest.mark.parametrize("layout, get, add, close, _entry", LAYOUTS, ids=IDS)
def test_headers_are_the_bytes_criu_sends(layout: IovLayout, get: str, add: str, close: str, _entry: str) -> None:
    assert layout.size == len(bytes.fromhex(get)) == {IOV_41: 24, IOV_42: 32}[layout]
    assert layout.pack(7, 1, VA, 7) == bytes.fromhex(get)
    assert layout.pack(6 | 4 << 16, 1, VA, 7) == bytes.fromhex(add)
    assert layout.unpack(bytes.fromhex(close)) == (0x1024, 0, 0, 0)


def test_the_42_padding_is_not_read() -> None:
    """CRIU's requests are built with designated initializers: the 4 bytes after cmd are unspecified."""
    raw = bytearray.fromhex(GET_42)
    raw[4:8] = b"\xde\xad\xbe\xef"
    assert IOV_42.unpack(bytes(raw)) == (7, 1, VA, 7)


# -- memsnap's page server, as `criu lazy-pages` of either version talks to it -------------------------------------
def _serve(tmp_path: Path, layout: IovLayout, entry: str) -> tuple[PageServer, socket.socket, list[str], bytes]:
    content = b"".join(bytes([i + 1]) * PAGE for i in range(3))
    (tmp_path / "pages-3.img").write_bytes(content)
    idx = PageIndex.from_images({"pagemap-7.img": image(HEAD, entry)})
    ours, theirs = socket.socketpair()
    failures: list[str] = []
    server = PageServer(ours, idx, DirPageSource(tmp_path), iov=layout, on_fail=failures.append, name="t",
                        prefetch=False).start()
    theirs.settimeout(10)
    return server, theirs, failures, content


@pytest.mark.parametrize("layout, get, add, close, entry", LAYOUTS, ids=IDS)
def test_the_page_server_answers_lazy_pages_in_its_layout(tmp_path: Path, layout: IovLayout, get: str, add: str,
                                                         close: str, entry: str) -> None:
    server, sk, failures, content = _serve(tmp_path, layout, entry)
    try:
        sk.sendall(bytes.fromhex(get))
        assert _recv(sk, len(bytes.fromhex(add))) == bytes.fromhex(add)
        assert _recv(sk, PAGE) == content[:PAGE]
        sk.sendall(layout.pack(7, 2, VA + PAGE, 7))  # (the rest of the lazy run)
        assert layout.unpack(_recv(sk, layout.size)) == (6 | 4 << 16, 2, VA + PAGE, 7)
        assert _recv(sk, 2 * PAGE) == content[PAGE:]
        sk.sendall(bytes.fromhex(close))
        assert _recv(sk, 4) == b"\0\0\0\0"
        assert server.ok.wait(5) and not failures
    finally:
        server.close()
        sk.close()


def _failed(tmp_path: Path, layout: IovLayout, data: bytes, eof: bool = False) -> tuple[list[str], bytes]:
    """Feeds data (then an EOF) to a page server in layout: why it failed, and all it sent back."""
    server, sk, failures, _ = _serve(tmp_path, layout, LAZY_42)
    try:
        sk.sendall(data)
        if eof:
            sk.shutdown(socket.SHUT_WR)
        assert server.done.wait(5)
        return failures, sk.recv(1)
    finally:
        server.close()
        sk.close()


def test_a_42_request_to_a_server_in_the_41_layout_fails_it_without_an_answer(tmp_path: Path) -> None:
    """What 21 e2e tests met on 4.2.1 ("unexpected request 0x7 (0 pages)"): refused, never answered wrongly."""
    assert _failed(tmp_path, IOV_41, bytes.fromhex(GET_42)) == (
        ["lazy-pages sent an unexpected request 0x7 (0 pages)"], b"")


@pytest.mark.parametrize("nr", [0, (1 << 20) + 1, 1 << 32, (1 << 64) - 1])
def test_a_42_request_for_no_or_too_many_pages_fails_the_server(tmp_path: Path, nr: int) -> None:
    assert _failed(tmp_path, IOV_42, IOV_42.pack(7, nr, VA, 7)) == (
        [f"lazy-pages sent an unexpected request 0x7 ({nr} pages)"], b"")


def test_a_42_header_cut_short_fails_the_server(tmp_path: Path) -> None:
    failures, sent = _failed(tmp_path, IOV_42, bytes.fromhex(GET_42)[:24], eof=True)  # (a 4.1 header's worth)
    assert len(failures) == 1 and "short read (24 of 32 bytes)" in failures[0] and sent == b""


# -- the lazy move's relay check (PageFlow) ----------------------------------------------------------------------
@pytest.mark.parametrize("layout, get, add, close, _entry", LAYOUTS, ids=IDS)
def test_the_relay_follows_a_conversation_in_its_layout(layout: IovLayout, get: str, add: str, close: str,
                                                        _entry: str) -> None:
    flow = PageFlow(layout)
    out = bytes.fromhex(get) + layout.pack(7, 3, VA + PAGE, 7)
    for i in range(0, len(out), 5):  # (requests split anywhere)
        assert flow.sent(out[i:i + 5], 1.0) == ""
    back = bytes.fromhex(add) + b"p" * PAGE + layout.pack(6 | 4 << 16, 2, VA + PAGE, 7) + b"q" * 2 * PAGE
    for i in range(0, len(back), 7):
        assert flow.received(back[i:i + 7], 1.001) == ""
    assert not flow.waiting() and len(flow.fault_ms) == 1 and len(flow.bulk_ms) == 1
    assert flow.sent(bytes.fromhex(close), 1.1) == "" and flow.received(b"\0\0\0\0", 1.2) == ""
    assert flow.ended() == ""


def test_a_42_request_seen_in_the_41_layout_breaks_the_relay() -> None:
    assert "unexpected request 0x7 (0 pages" in PageFlow(IOV_41).sent(bytes.fromhex(GET_42), 1.0)


def test_41_replies_to_a_42_request_break_the_relay_before_a_byte_passes() -> None:
    """A source whose CRIU speaks the other layout: its reply does not match the request."""
    flow = PageFlow(IOV_42)
    assert flow.sent(bytes.fromhex(GET_42), 1.0) == ""
    assert "answered" in flow.received(bytes.fromhex(ADD_41) + b"p" * PAGE, 1.1)


@pytest.mark.parametrize("nr", [0, (1 << 20) + 1, 1 << 32, (1 << 64) - 1])
def test_a_42_request_for_no_or_too_many_pages_breaks_the_relay(nr: int) -> None:
    assert "unexpected request" in PageFlow(IOV_42).sent(IOV_42.pack(7, nr, VA, 7), 1.0)


def test_a_42_reply_with_more_pages_than_asked_breaks_the_relay() -> None:
    flow = PageFlow(IOV_42)
    assert flow.sent(bytes.fromhex(GET_42), 1.0) == ""
    assert "answered" in flow.received(IOV_42.pack(6 | 4 << 16, (1 << 32) + 1, VA, 7), 1.1)

