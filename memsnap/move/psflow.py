"""lazy-pages' page-server conversation as it crosses the target's relay: checked, so that nothing reaches
lazy-pages that it did not ask for, and timed.

criu/page-xfer.c: struct page_server_iov {u32 cmd; nr_pages; u64 vaddr; u64 dst_id}, with a u32 nr_pages (24 bytes)
up to CRIU 4.1 and a u64 one (32 bytes, padded after cmd) from 4.2. Nothing on the wire tells them apart: the flow
is given the layout of the target's CRIU (the one that runs lazy-pages), by its version (memsnap.pageserver.wire).
A source whose CRIU speaks the other layout misreads the requests, or answers with headers that match none of
them: the move fails (a broken tunnel, or a stall); what passes is always a reply to the request lazy-pages made.

    lazy-pages -> source   PS_IOV_GET (nr_pages at vaddr of task dst_id), one after another
    source -> lazy-pages   per request, in order: PS_IOV_ADD_F (same vaddr and dst_id, at most nr_pages), then
                           the pages
    lazy-pages -> source   PS_IOV_FORCE_CLOSE once every page is in place; the source answers an int32 status

lazy-pages reads replies first in, first out, and only while it has a request outstanding: its page-server
socket turning readable with none (bytes, or an EOF) is `BUG_ON(list_empty(&async_reads))` at page-xfer.c:1635,
after which its `criu restore` may never exit. So the relay passes a byte from the source only when it is part
of the reply lazy-pages waits for (or the final status), and an end of the stream only after the close; anything
else breaks the tunnel (memsnap.lazyguard then kills the tasks first, then lazy-pages).
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from memsnap.pageserver.wire import IovLayout

log = logging.getLogger("memsnap.move")

PS_IOV_ADD_F, PS_IOV_GET, PS_CMD_MASK = 6, 7, 0xFFFF
PS_IOV_CLOSE = (0x1023, 0x1024)  # PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE
PAGE = 4096
_MAX_PAGES = 1 << 20
_STATUS = 4  # the int32 answer to a close


class PageFlow:
    """Follows both directions of one page tunnel. sent() and received() return "" while the conversation is
    one lazy-pages can take, else what is wrong with it (the caller breaks the tunnel; nothing more passes).

    One-page requests are faults (lazy-pages asks for the faulting page alone; its background push asks for
    runs): each request is timed from leaving for the source until its reply's header is back. iov: the header
    layout of lazy-pages' CRIU (memsnap.pageserver.wire.iov_layout of its version)."""

    def __init__(self, iov: IovLayout) -> None:
        self.iov = iov
        self._out = b""  # a request's first bytes
        self._in = b""  # a reply header's first bytes
        self._skip = 0  # page bytes of the current reply still to come
        self._asked: deque[tuple[int, int, int, float]] = deque()  # (vaddr, nr_pages, dst_id, sent at)
        self.closing = False  # lazy-pages sent the close: the status, then the end of the stream
        self._status = 0  # status bytes passed
        self.broken = ""
        self.fault_ms: list[float] = []
        self.bulk_ms: list[float] = []
        self._lock = threading.Lock()

    def waiting(self) -> bool:
        """Whether lazy-pages waits for bytes from the source now."""
        with self._lock:
            return bool(self._asked or self._skip or self._in) or (self.closing and self._status < _STATUS)

    def sent(self, data: bytes, now: float) -> str:
        """lazy-pages -> source bytes."""
        with self._lock:
            if self.broken:
                return self.broken
            size = self.iov.size
            buf = self._out + data
            n = len(buf) - len(buf) % size
            for off in range(0, n, size):
                cmd, nr, vaddr, dst = self.iov.unpack(buf, off)
                if self.closing:
                    return self._break(f"lazy-pages sent {cmd:#x} after its close")
                if cmd & PS_CMD_MASK == PS_IOV_GET and 0 < nr <= _MAX_PAGES:
                    self._asked.append((vaddr, nr, dst, now))
                elif cmd in PS_IOV_CLOSE:
                    self.closing = True
                else:
                    return self._break(f"lazy-pages sent an unexpected request {cmd:#x} ({nr} pages at {vaddr:#x})")
            self._out = buf[n:]
            return ""

    def received(self, data: bytes, now: float) -> str:
        """source -> lazy-pages bytes, checked before they are passed on."""
        with self._lock:
            if self.broken:
                return self.broken
            view = memoryview(data)
            while view:
                if self._skip:
                    k = min(self._skip, len(view))
                    self._skip -= k
                    view = view[k:]
                    continue
                if not self._asked and not self._in:
                    if self.closing and self._status + len(view) <= _STATUS:
                        self._status += len(view)
                        return ""
                    return self._break(f"the source sent {len(view)} bytes while lazy-pages had no request "
                                       "outstanding")
                need = self.iov.size - len(self._in)
                self._in += bytes(view[:need])
                view = view[need:]
                if len(self._in) < self.iov.size:
                    return ""
                cmd, nr, vaddr, dst = self.iov.unpack(self._in)
                self._in = b""
                a_vaddr, a_nr, a_dst, t_sent = self._asked.popleft()
                if cmd & PS_CMD_MASK != PS_IOV_ADD_F or vaddr != a_vaddr or dst != a_dst or not 0 < nr <= a_nr:
                    return self._break(f"the source answered {cmd:#x} ({nr} pages at {vaddr:#x}) to a request "
                                       f"for {a_nr} pages at {a_vaddr:#x}")
                (self.fault_ms if a_nr == 1 else self.bulk_ms).append((now - t_sent) * 1000)
                self._skip = nr * PAGE
            return ""

    def ended(self) -> str:
        """The source's stream ended: "" when lazy-pages has all it asked for, its close answered."""
        with self._lock:
            if self.broken:
                return self.broken
            if self.closing and self._status == _STATUS:
                return ""
            if self._asked or self._skip or self._in:
                return self._break("the source's page server ended with a request of lazy-pages outstanding")
            return self._break("the source's page server ended before lazy-pages had every page")

    def _break(self, why: str) -> str:
        self.broken = why
        return why

    def summary(self) -> str:
        """'N faults, p50 X ms, p99 Y ms (M background requests, p50 Z ms)', or "" when nothing was timed."""
        if not (self.fault_ms or self.bulk_ms):
            return ""

        def q(xs: list[float], p: float) -> float:
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else 0.0

        return (f"{len(self.fault_ms)} faults, p50 {q(self.fault_ms, 0.5):.1f} ms, p99 {q(self.fault_ms, 0.99):.1f} "
                f"ms ({len(self.bulk_ms)} background requests, p50 {q(self.bulk_ms, 0.5):.1f} ms)")


__all__ = ["PageFlow"]
