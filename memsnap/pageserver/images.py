"""CRIU's pagemap images, read by hand: which pages of a process sit where in its pages-<id>.img.

An image file is a magic header (IMG_COMMON_MAGIC, then the image's own magic) and length-prefixed
protobuf messages: one PagemapHead {pages_id}, then one PagemapEntry per run of pages (images/pagemap.proto):

    1 vaddr (uint64)   2 nr_pages (uint32; CRIU >= 4.2: compat_nr_pages, written as 0)   3 in_parent (bool)
    4 flags (uint32)   5 nr_pages (uint64, CRIU >= 4.2 only)

As CRIU >= 4.2 reads them (criu/pagemap.c init_compat_pagemap_entry), an entry's page count is field 5 when the
entry has it, else field 2: images of both versions parse, whichever CRIU wrote them.

The pages of every entry with PE_PRESENT lie in pages-<pages_id>.img back to back, in entry order; PE_LAZY
marks those that `criu lazy-pages` asks for (private anonymous memory, not the stack), the rest are restored by
`criu restore` itself from the local pages image.
"""

from __future__ import annotations

import bisect
import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass

PAGE = mmap.PAGESIZE
IMG_COMMON_MAGIC = 0x54564319
PAGEMAP_MAGIC = 0x56084025
PE_PARENT = 1 << 0
PE_LAZY = 1 << 1
PE_PRESENT = 1 << 2

_ADDRESS_SPACE = 1 << 64  # an entry ends within it
PAGEMAP_NAME = re.compile(r"^pagemap-(\d+)\.img$")  # a task's (pagemap-shmem-* are restored by CRIU itself)


class ImageError(ValueError):
    """A CRIU image that does not parse."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ImageError("truncated or overlong varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _fields(msg: bytes) -> Iterator[tuple[int, int]]:
    """(field number, value) of a protobuf message's varint fields; other wire types are skipped."""
    pos = 0
    while pos < len(msg):
        key, pos = _varint(msg, pos)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(msg, pos)
            yield num, value
        elif wire == 1:
            pos += 8
        elif wire == 2:
            n, pos = _varint(msg, pos)
            pos += n
        elif wire == 5:
            pos += 4
        else:
            raise ImageError(f"unsupported protobuf wire type {wire}")
        if pos > len(msg):
            raise ImageError("truncated protobuf field")


@dataclass(frozen=True)
class PagemapEntry:
    """One run of pages of a process."""

    vaddr: int
    nr_pages: int
    flags: int = PE_PRESENT

    @property
    def present(self) -> bool:
        """Its pages are in the pages image."""
        return bool(self.flags & PE_PRESENT) and not self.flags & PE_PARENT

    @property
    def lazy(self) -> bool:
        """`criu lazy-pages` serves it (else `criu restore` reads it from the local pages image)."""
        return bool(self.flags & PE_LAZY)


@dataclass(frozen=True)
class Pagemap:
    """A pagemap image: the pages image it indexes and its entries, in file order."""

    pages_id: int
    entries: tuple[PagemapEntry, ...]

    @property
    def pages_file(self) -> str:
        return f"pages-{self.pages_id}.img"


def parse_pagemap(data: bytes) -> Pagemap:
    """Parses a pagemap-*.img (ImageError if it is not one)."""
    if len(data) < 8:
        raise ImageError("too short for a CRIU image")
    magic, kind = struct.unpack_from("<II", data)
    if magic != IMG_COMMON_MAGIC or kind != PAGEMAP_MAGIC:
        raise ImageError(f"not a pagemap image (magic {magic:#x} {kind:#x})")
    pos = 8
    msgs = []
    while pos < len(data):
        if pos + 4 > len(data):
            raise ImageError("truncated entry size")
        (n,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + n > len(data):
            raise ImageError("truncated entry")
        msgs.append(data[pos:pos + n])
        pos += n
    if not msgs:
        raise ImageError("a pagemap image without its head")
    head = dict(_fields(msgs[0]))
    if 1 not in head:
        raise ImageError("pagemap head without pages_id")
    return Pagemap(pages_id=head[1], entries=tuple(_entry(m) for m in msgs[1:]))


def _entry(msg: bytes) -> PagemapEntry:
    f = dict(_fields(msg))  # (a field given twice: the last one counts, as in protobuf)
    if 1 not in f or 2 not in f:  # (both required, in 4.1's schema and in 4.2's)
        raise ImageError("pagemap entry without vaddr or nr_pages")
    vaddr, nr_pages = f[1], f.get(5, f[2])  # CRIU >= 4.2: field 5, field 2 (compat_nr_pages) is 0
    if nr_pages <= 0 or vaddr + nr_pages * PAGE > _ADDRESS_SPACE:
        raise ImageError(f"pagemap entry of {nr_pages} pages at {vaddr:#x}")
    flags = f.get(4, PE_PRESENT)
    if f.get(3):  # in_parent (old images): the pages are in the parent's image
        flags |= PE_PARENT
    return PagemapEntry(vaddr=vaddr, nr_pages=nr_pages, flags=flags)


@dataclass(frozen=True)
class Extent:
    """Pages [vaddr, vaddr + nr_pages * PAGE) of a process at offset in its pages image."""

    vaddr: int
    nr_pages: int
    offset: int
    lazy: bool

    @property
    def end(self) -> int:
        return self.vaddr + self.nr_pages * PAGE


class PageIndex:
    """Maps (pid, vaddr, nr_pages) requests to byte ranges of pages images, from the tasks' pagemaps."""

    def __init__(self, maps: dict[int, Pagemap]) -> None:
        self.maps = maps
        self._extents: dict[int, list[Extent]] = {}
        self._starts: dict[int, list[int]] = {}
        for pid, pm in maps.items():
            off, out = 0, []
            for e in pm.entries:
                if not e.present:
                    continue
                out.append(Extent(e.vaddr, e.nr_pages, off, e.lazy))
                off += e.nr_pages * PAGE
            out.sort(key=lambda x: x.vaddr)
            for a, b in zip(out, out[1:], strict=False):
                if b.vaddr < a.end:
                    raise ImageError(f"pagemap of pid {pid} has overlapping entries at {b.vaddr:#x}")
            self._extents[pid] = out
            self._starts[pid] = [x.vaddr for x in out]

    @classmethod
    def from_images(cls, files: dict[str, bytes]) -> PageIndex:
        """From {file name: content} of the pagemap-<pid>.img files (other names are ignored)."""
        maps = {}
        for name, data in files.items():
            m = PAGEMAP_NAME.match(name)
            if m:
                maps[int(m.group(1))] = parse_pagemap(data)
        return cls(maps)

    def pages_file(self, pid: int) -> str:
        return self.maps[pid].pages_file

    def pages_files(self) -> set[str]:
        """The pages images that the tasks' pagemaps index."""
        return {pm.pages_file for pm in self.maps.values()}

    def locate(self, pid: int, vaddr: int, nr_pages: int) -> list[tuple[str, int, int]]:
        """[(pages file, offset, length)] holding exactly those pages, in address order; KeyError if any page
        is not in the image."""
        if pid not in self.maps:
            raise KeyError(f"no pagemap for pid {pid}")
        if nr_pages <= 0 or vaddr % PAGE:
            raise KeyError(f"bad request: {nr_pages} pages at {vaddr:#x}")
        name, ext, starts = self.pages_file(pid), self._extents[pid], self._starts[pid]
        out: list[tuple[str, int, int]] = []
        addr, end = vaddr, vaddr + nr_pages * PAGE
        i = bisect.bisect_right(starts, addr) - 1
        while addr < end:
            if i < 0 or i >= len(ext) or not ext[i].vaddr <= addr < ext[i].end:
                raise KeyError(f"page {addr:#x} of pid {pid} is not in the image")
            x = ext[i]
            n = min(end, x.end) - addr
            off = x.offset + (addr - x.vaddr)
            if out and out[-1][1] + out[-1][2] == off:
                out[-1] = (name, out[-1][1], out[-1][2] + n)
            else:
                out.append((name, off, n))
            addr += n
            i += 1
        return out

    def ranges(self, lazy: bool) -> list[tuple[str, int, int]]:
        """The lazy (or the eager) byte ranges of every pages image, in (task, offset) order, merged."""
        out: list[tuple[str, int, int]] = []
        for pid in sorted(self._extents):
            name = self.pages_file(pid)
            for x in sorted(self._extents[pid], key=lambda x: x.offset):
                if x.lazy != lazy:
                    continue
                n = x.nr_pages * PAGE
                if out and out[-1][0] == name and out[-1][1] + out[-1][2] == x.offset:
                    out[-1] = (name, out[-1][1], out[-1][2] + n)
                else:
                    out.append((name, x.offset, n))
        return out
