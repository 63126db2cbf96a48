"""CRIU 4.1 and 4.2 formats, byte for byte: pagemap entries (4.2 counts pages in field 5, compat_nr_pages in
field 2 is 0) and the page-server header, struct page_server_iov (24 bytes up to 4.1, 32 from 4.2), as memsnap's
page server (memsnap.pageserver) and the lazy move's relay check (memsnap.move.psflow) read and write them.

The fixtures are the bytes CRIU writes (images/pagemap.proto, criu/page-xfer.c of v4.1.1 and v4.2), spelled out
in hex rather than built by the code under test."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest

from memsnap.pageserver.images import PAGE, ImageError, PageIndex, parse_pagemap

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


# -- real dumps of both CRIU versions -----------------------------------------------------------------------------
CRIUS = {"4.1.1": "/usr/local/sbin/criu", "4.2.1": "/opt/criu-4.2.1/sbin/criu"}


@pytest.mark.root
@pytest.mark.parametrize("version", list(CRIUS))
def test_a_real_dumps_pagemap_parses_whichever_criu_wrote_it(tmp_path: Path, version: str) -> None:
    """The entries of a real dump: 4.1.1 counts pages in field 2 only, 4.2.1 in field 5 with field 2 at 0; the
    index covers the pages image exactly, and the buffer's pattern is where it says."""
    import os
    import subprocess
    import sys

    from memsnap.pageserver.images import _fields

    criu = CRIUS[version]
    if not os.access(criu, os.X_OK) or os.geteuid() != 0:
        pytest.skip(f"needs root and CRIU {version} at {criu}")
    code = ("import ctypes,time\nb=bytearray(1<<20)\n"
            "for i in range(0,len(b),4096): b[i:i+8]=(0xC0FFEE00+i//4096).to_bytes(8,'little')\n"
            "print(ctypes.addressof((ctypes.c_char*1).from_buffer(b)), flush=True)\n"
            "while True: time.sleep(1)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        assert p.stdout is not None
        buf = int(p.stdout.readline())
        r = subprocess.run([criu, "dump", "-t", str(p.pid), "-D", str(tmp_path), "--shell-job", "-o", "dump.log"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (tmp_path / "dump.log").read_text()[-2000:]
    finally:
        p.kill()
        p.wait()
    raw = (tmp_path / f"pagemap-{p.pid}.img").read_bytes()
    pos, fields = 8, []
    while pos < len(raw):
        (n,) = struct.unpack_from("<I", raw, pos)
        fields.append(dict(_fields(raw[pos + 4:pos + 4 + n])))
        pos += 4 + n
    entries = fields[1:]
    assert entries
    if version.startswith("4.1"):
        assert all(f[2] > 0 and 5 not in f for f in entries)
    else:
        assert all(f[2] == 0 and f[5] > 0 for f in entries)
    idx = PageIndex.from_images({f"pagemap-{p.pid}.img": raw})
    lazy, eager = idx.ranges(lazy=True), idx.ranges(lazy=False)
    pages = tmp_path / idx.pages_file(p.pid)
    assert sum(n for _, _, n in lazy) + sum(n for _, _, n in eager) == pages.stat().st_size
    with open(pages, "rb") as f:
        for k in range(0, 256, 17):
            vaddr = buf + k * PAGE
            ((_, off, _),) = idx.locate(p.pid, vaddr - vaddr % PAGE, 1)
            f.seek(off + vaddr % PAGE)
            assert int.from_bytes(f.read(8), "little") == 0xC0FFEE00 + k
