"""CRIU's page-server header, struct page_server_iov (criu/page-xfer.c), in the layout of the CRIU that speaks it.

    CRIU < 4.2    {u32 cmd; u32 nr_pages; u64 vaddr; u64 dst_id}                    24 bytes
    CRIU >= 4.2   {u32 cmd; u32 (padding); u64 nr_pages; u64 vaddr; u64 dst_id}     32 bytes

(4.2's afb2e6c3f/7e0da4d97, "pagemap: change PagemapEntry.nr_pages to uint64", made nr_pages a u64; the C
compiler pads after cmd.) Nothing on the wire says which: no version or feature is exchanged, the commands
(PS_IOV_*) and their numbers are unchanged, and each side just reads sizeof(struct page_server_iov) bytes. So the
layout is chosen from the version of the CRIU binary at the other end (criu swrk's VERSION answer, which memsnap
has anyway), never from the bytes, which a peer could shape. The padding is not read: CRIU builds its requests
with designated initializers, which leave it unspecified; ours is zero.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass


class UnknownCriuVersion(ValueError):
    """A CRIU version this module cannot tell the page-server layout of."""


@dataclass(frozen=True)
class IovLayout:
    """One layout of struct page_server_iov (little-endian, as CRIU's native order on the hosts memsnap runs on)."""

    name: str
    fmt: struct.Struct

    @property
    def size(self) -> int:
        return self.fmt.size

    def pack(self, cmd: int, nr_pages: int, vaddr: int, dst_id: int) -> bytes:
        return self.fmt.pack(cmd, nr_pages, vaddr, dst_id)

    def unpack(self, buf: bytes | bytearray | memoryview, offset: int = 0) -> tuple[int, int, int, int]:
        """(cmd, nr_pages, vaddr, dst_id) of the header at buf[offset:] (struct.error if buf is too short: callers
        pass whole headers)."""
        cmd, nr, vaddr, dst = self.fmt.unpack_from(buf, offset)
        return int(cmd), int(nr), int(vaddr), int(dst)


IOV_41 = IovLayout("CRIU < 4.2 (24 bytes)", struct.Struct("<IIQQ"))
IOV_42 = IovLayout("CRIU >= 4.2 (32 bytes)", struct.Struct("<I4xQQQ"))

_VERSION = re.compile(r"^(\d{1,4})\.(\d{1,4})(?:\.(\d{1,4}))?$")


def iov_layout(criu_version: str) -> IovLayout:
    """The page-server header of a CRIU by its version ('major.minor[.sublevel]', as memsnap.criu reports it)."""
    m = _VERSION.match(criu_version.strip())
    if not m:
        raise UnknownCriuVersion(f"cannot tell CRIU {criu_version!r}'s page-server header layout")
    return IOV_42 if (int(m.group(1)), int(m.group(2))) >= (4, 2) else IOV_41


__all__ = ["IOV_41", "IOV_42", "IovLayout", "UnknownCriuVersion", "iov_layout"]
