"""A CRIU page server (the lazy-migration source side) that answers `criu lazy-pages` from a PageSource.

The protocol (criu/page-xfer.c), over the socket lazy-pages got as --ps-socket:

    lazy-pages -> us   page_server_iov {cmd = PS_IOV_GET, nr_pages, vaddr, dst_id = pid}
    us -> lazy-pages   page_server_iov {cmd = PS_IOV_ADD_F | PE_PRESENT << 16, same nr_pages, vaddr, dst_id}
                       then nr_pages * PAGE bytes
    ...                (replies in request order: lazy-pages matches them first in, first out)
    lazy-pages -> us   PS_IOV_FORCE_CLOSE (PS_IOV_CLOSE without --ps-socket) once every page is in place
    us -> lazy-pages   int32 status 0

page_server_iov is 24 bytes up to CRIU 4.1, 32 from 4.2 (a u64 nr_pages): the layout is the one of the CRIU
that runs lazy-pages, by its version (memsnap.pageserver.wire), never by what arrives.

lazy-pages asks for each faulting page as it faults, and, once the restore finished, for the rest of each
task's lazy memory in address order (64 KiB first, growing to 4 MiB per request, one request at a time).
So that those requests find their pages here instead of waiting on the store, a prefetcher streams every
block of the lazy ranges in the same order into memory (at most ahead_bytes ahead), several blocks in
flight at once; a faulting page never waits behind it (it is read on its own). A block leaves memory as
soon as its last lazy page was served.

The job's faults come first: the link is one pipe, and a fault's block shares it with every block in flight
(measured through the benchmark's sshfs store: 7 ms for a 1 MiB chunk alone, 27 ms with two prefetch streams,
76 ms with eight). So the prefetch starts only once the job's faults went quiet (no fault waited on the
store for quiet_s), and pauses again whenever one does, for at most hold_s after it was let start: a job that
never stops faulting still gets its memory streamed.

A page that cannot be had (the store failed, a chunk did not verify) fails the server, and no request is
answered from then on (never with zeros): on_fail kills the restored (or restoring) tasks first, then
lazy-pages (memsnap.lazyguard), and only then is the socket shut.
"""

from __future__ import annotations

import bisect
import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from memsnap.backoff import retrying
from memsnap.pageserver.images import PAGE, PE_PRESENT, PageIndex
from memsnap.pageserver.sources import PageSource, SourceFailed
from memsnap.pageserver.wire import IovLayout

log = logging.getLogger("memsnap.pageserver")

PS_IOV_ADD_F = 6
PS_IOV_GET = 7
PS_IOV_CLOSE = 0x1023
PS_IOV_FORCE_CLOSE = 0x1024
PS_CMD_BITS = 16
_MAX_REQUEST_PAGES = 1 << 20  # (4 GiB: lazy-pages asks for 4 MiB at most)
_RETRIES = (0.2, 0.5, 1.0)  # seconds between attempts at a block the store failed to give


def read_retrying(source: PageSource, name: str, offset: int, length: int) -> bytes:
    """source.read_at, tried again (a few times, soon) when the store failed; never when a chunk did not
    verify."""
    def again(_: int, exc: Exception) -> None:
        log.warning("reading %s at %d: %s; trying again", name, offset, exc)

    return retrying(lambda: source.read_at(name, offset, length), _store_failed, _RETRIES, on_retry=again)


def _store_failed(exc: Exception) -> bool:
    return isinstance(exc, SourceFailed) and not exc.integrity


@dataclass
class _Block:
    name: str
    start: int
    end: int
    remaining: int  # lazy bytes in it not served yet
    data: bytes | None = None
    fetching: bool = False
    ready: threading.Event = field(default_factory=threading.Event)


class BlockCache:
    """The lazy ranges cut into the source's blocks; a prefetcher fills them in order, requests drain them."""

    def __init__(self, source: PageSource, lazy_ranges: list[tuple[str, int, int]], ahead_bytes: int,
                 quiet_s: float = 0.05, hold_s: float = 1.0) -> None:
        self.source = source
        self.ahead_bytes = max(ahead_bytes, 1)
        self.quiet_s, self.hold_s = quiet_s, hold_s
        self.order: list[_Block] = []
        self._by_file: dict[str, tuple[list[int], list[_Block]]] = {}
        by_name: dict[str, list[tuple[int, int]]] = {}
        for name, off, n in lazy_ranges:
            by_name.setdefault(name, []).append((off, off + n))
        for name, spans in by_name.items():
            starts, blocks = [], []
            j = 0
            for b_off, b_len in source.blocks(name):
                b_end = b_off + b_len
                lazy = 0
                while j < len(spans) and spans[j][1] <= b_off:
                    j += 1
                k = j
                while k < len(spans) and spans[k][0] < b_end:
                    lazy += min(b_end, spans[k][1]) - max(b_off, spans[k][0])
                    k += 1
                if lazy:
                    blk = _Block(name, b_off, b_end, lazy)
                    starts.append(b_off)
                    blocks.append(blk)
                    self.order.append(blk)
            self._by_file[name] = (starts, blocks)
        self.total_bytes = sum(b.end - b.start for b in self.order)
        self.cached_bytes = 0
        self.prefetched_bytes = 0
        self.fetched_bytes = 0
        self.hits = self.misses = self.waits = 0
        self.t_prefetched = 0.0  # when the prefetcher had fetched its last block
        self.urgent = 0  # blocks fetched for a waiting request right now
        self.t_open = 0.0  # when the prefetch was let start (open_prefetch)
        self.t_fault = 0.0  # when a fault last finished waiting on the store
        self.fault_waits = 0  # faults (one-page requests) that waited on the store
        self.fault_wait_s = 0.0  # their waiting, in all
        self._next = 0
        self._cv = threading.Condition()

    def _blocks_over(self, name: str, off: int, end: int) -> list[_Block]:
        starts, blocks = self._by_file.get(name, ([], []))
        i = max(bisect.bisect_right(starts, off) - 1, 0)
        out = []
        while i < len(blocks) and blocks[i].start < end:
            if blocks[i].end > off:
                out.append(blocks[i])
            i += 1
        return out

    def read(self, name: str, off: int, length: int, fault: bool = False) -> bytes:
        """Bytes [off, off + length) of name; each byte of a lazy range is counted served once."""
        parts = self.read_parts(name, off, length, fault)
        return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)

    def read_parts(self, name: str, off: int, length: int, fault: bool = False,
                   short: bool = False, have: int = 0) -> list[bytes | memoryview]:
        """read(), as pieces that are not copied together.

        A block that is neither in memory nor on its way is fetched whole, at once, and the prefetcher starts
        no fetch meanwhile: a faulting page must not queue behind the stream (the link is shared). fault: the
        job itself waits on these bytes (a one-page request); its waiting pauses the prefetch (quiet_s).
        short: fewer bytes will do (lazy-pages' background push takes a shorter answer and asks for the rest
        later): it stops before the first block not in memory once there is something to answer with (have
        bytes already, or this call's first), so that no fault queued behind it waits for that fetch."""
        end = off + length
        parts: list[bytes | memoryview] = []
        pos = off
        for blk in self._blocks_over(name, off, end):
            if short and (have or pos > off):
                with self._cv:
                    if blk.data is None or blk.start > pos:
                        return parts
            if blk.start > pos:  # (a gap between blocks: not lazy)
                parts.append(read_retrying(self.source, name, pos, blk.start - pos))
                pos = blk.start
            hi = min(end, blk.end)
            with self._cv:
                mine = blk.data is None and not blk.fetching and blk.remaining > 0
                if mine:
                    blk.fetching = True
                    self.urgent += 1
                    self.cached_bytes += blk.end - blk.start
                waiting = blk.fetching and not mine
            t_wait = time.monotonic()
            if mine:
                self.misses += 1
                self._fetch(blk, urgent=True)
            elif waiting:
                self.waits += 1
                blk.ready.wait()
            if fault and (mine or waiting):
                self._faulted(time.monotonic() - t_wait)
            data = blk.data
            if data is not None:
                parts.append(memoryview(data)[pos - blk.start:hi - blk.start])  # (no copy)
                self.hits += 0 if mine else 1
            else:  # (served before, or its fetch failed: read it on its own)
                parts.append(read_retrying(self.source, name, pos, hi - pos))
            self._served(blk, hi - pos)
            pos = hi
        if pos < end and not (short and (have or pos > off)):
            parts.append(read_retrying(self.source, name, pos, end - pos))
        return parts

    def ahead(self, name: str, pos: int, n: int) -> list[_Block]:
        """The next n blocks of name from pos that are neither in memory nor on their way, marked fetching (the
        caller fetches them: where lazy-pages' background push will ask next)."""
        starts, blocks = self._by_file.get(name, ([], []))
        i = max(bisect.bisect_right(starts, pos) - 1, 0)
        out: list[_Block] = []
        with self._cv:
            for blk in blocks[i:i + n + 1]:
                if blk.end > pos and blk.data is None and not blk.fetching and blk.remaining > 0 and len(out) < n:
                    blk.fetching = True
                    self.cached_bytes += blk.end - blk.start
                    out.append(blk)
        return out

    def _fetch(self, blk: _Block, urgent: bool = False) -> None:
        """Fetches a block marked fetching (its bytes already counted in cached_bytes)."""
        try:
            data = read_retrying(self.source, blk.name, blk.start, blk.end - blk.start)
        except BaseException:
            with self._cv:
                self.cached_bytes -= blk.end - blk.start
                blk.fetching = False
                self.urgent -= 1 if urgent else 0
                self._cv.notify_all()
            blk.ready.set()
            raise
        with self._cv:
            self.prefetched_bytes += 0 if urgent else len(data)
            self.fetched_bytes += len(data)
            blk.fetching = False
            self.urgent -= 1 if urgent else 0
            if blk.remaining > 0:
                blk.data = data
            else:
                self.cached_bytes -= len(data)
            self._cv.notify_all()
        blk.ready.set()

    def _faulted(self, waited: float) -> None:
        with self._cv:
            self.fault_waits += 1
            self.fault_wait_s += waited
            self.t_fault = time.monotonic()

    def open_prefetch(self) -> None:
        """The prefetch may start (once the faults went quiet: see the module's doc)."""
        with self._cv:
            self.t_open = self.t_fault = time.monotonic()
            self._cv.notify_all()

    def _held(self) -> float:
        """Seconds the prefetch still holds off for the job's faults (0: it may go)."""
        now = time.monotonic()
        if now - self.t_open >= self.hold_s:
            return 0.0
        return max(0.0, self.t_fault + self.quiet_s - now)

    def _served(self, blk: _Block, n: int) -> None:
        with self._cv:
            blk.remaining -= n
            if blk.remaining <= 0 and blk.data is not None:
                self.cached_bytes -= len(blk.data)
                blk.data = None
                self._cv.notify_all()

    def prefetch_one(self, stop: threading.Event) -> bool:
        """Fetches the next block due (waits while ahead_bytes are cached or a fault's block is on its way);
        False when none is left."""
        with self._cv:
            while True:
                while self._next < len(self.order) and (self.order[self._next].remaining <= 0 or
                                                        self.order[self._next].fetching or
                                                        self.order[self._next].data is not None):
                    self._next += 1
                if self._next >= len(self.order) or stop.is_set():
                    if self._next >= len(self.order) and not self.t_prefetched:
                        self.t_prefetched = time.monotonic()
                    return False
                held = self._held()
                if self.cached_bytes < self.ahead_bytes and not self.urgent and not held:
                    break
                self._cv.wait(min(held, 0.5) if held else 0.5)
            blk = self.order[self._next]
            self._next += 1
            blk.fetching = True
            self.cached_bytes += blk.end - blk.start  # (reserved before the fetch)
        self._fetch(blk)
        return True

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()


class PageServer:
    """Serves one `criu lazy-pages` over sock from source, using index to find the pages; iov is the header
    layout of that lazy-pages' CRIU (memsnap.pageserver.wire.iov_layout of its version).

    on_fail(why) is called once when a page cannot be had (or the peer breaks the protocol), before the socket
    is shut: it must kill the tasks (and lazy-pages) first. ok is set once lazy-pages said every page arrived
    and the source confirmed all it served (source.finish()). held: no prefetch until release() (CRIU's
    restore, whose faults get the link and the CPU meanwhile).
    """

    def __init__(self, sock: socket.socket, index: PageIndex, source: PageSource, *, iov: IovLayout,
                 prefetch: bool = True,
                 ahead_bytes: int = 256 << 20, prefetchers: int = 8, workers: int = 4, quiet_s: float = 0.05,
                 hold_s: float = 1.0,
                 on_fail: Callable[[str], None] | None = None, name: str = "",
                 on_first_request: Callable[[], None] | None = None, held: bool = False) -> None:
        self.sock = sock
        self.iov = iov
        self.index = index
        self.source = source
        self.name = name
        self.cache = BlockCache(source, index.ranges(lazy=True), ahead_bytes, quiet_s=quiet_s, hold_s=hold_s)
        self.prefetch = prefetch
        self.prefetchers = prefetchers
        self.on_fail = on_fail or (lambda why: None)
        self.on_first_request = on_first_request or (lambda: None)
        self.error = ""
        self.ok = threading.Event()
        self.done = threading.Event()  # served to the end, or failed
        self.requests = 0
        self.served_bytes = 0
        self.short_replies = 0  # background requests answered with fewer pages (what was in memory)
        self.fault_ms: list[float] = []  # each fault: from its request to its reply sent
        self.t_start = 0.0
        self.t_first_request = 0.0
        self.t_closed = 0.0
        self.t_failed = 0.0
        self._stop = threading.Event()
        self._released = threading.Event()  # (held: see release())
        if not held:
            self._released.set()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"pageserver-{name}")
        self._ahead = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"pageserver-{name}-ahead")
        self._prefetch_stop = threading.Event()
        self._prefetching = False
        self._replies: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> PageServer:
        self.t_start = time.monotonic()
        self._spawn([(self._receive, "rx"), (self._reply, "tx")])
        if self._released.is_set():
            self._start_prefetch()
        return self

    def _spawn(self, targets: list[tuple[Callable[[], None], str]]) -> None:
        for fn, tag in targets:
            t = threading.Thread(target=fn, name=f"pageserver-{self.name}-{tag}", daemon=True)
            t.start()
            self._threads.append(t)

    def _start_prefetch(self) -> None:
        with self._lock:
            if not self.prefetch or self._prefetching:
                return
            self._prefetching = True
        self.cache.open_prefetch()
        self._spawn([(self._prefetch, f"pf{i}") for i in range(self.prefetchers)])

    # -- failure ---------------------------------------------------------------------------------
    def fail(self, why: str) -> None:
        """Ends serving: no request is answered from now on; on_fail kills the tasks (then lazy-pages) before
        the socket is shut."""
        with self._lock:
            if self.error or self.ok.is_set():
                return
            self.error = why
            self.t_failed = time.monotonic()
        log.error("lazy restore %s: %s; ending the page server", self.name, why)
        self._prefetch_stop.set()
        self.cache.wake()
        try:
            self.on_fail(why)
        except Exception:
            log.exception("lazy restore %s: on_fail raised", self.name)
        self._end()

    def _end(self) -> None:
        self._stop.set()
        _shutdown(self.sock)
        self._replies.put(None)
        self.done.set()

    def release(self) -> None:
        """CRIU's restore call returned: the prefetch may start (held: not while CRIU restores, whose faults
        get the link and the CPU)."""
        self._released.set()
        if not self.error:
            self._start_prefetch()

    def close(self) -> None:
        """Stops every thread (after done, or to give up) and closes the socket."""
        self._prefetch_stop.set()
        self._end()
        self.cache.wake()
        for t in self._threads:
            t.join(5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._ahead.shutdown(wait=True, cancel_futures=True)
        self.sock.close()

    # -- threads ---------------------------------------------------------------------------------
    def _prefetch(self) -> None:
        try:
            while not self._prefetch_stop.is_set() and self.cache.prefetch_one(self._prefetch_stop):
                pass
        except SourceFailed as exc:
            self.fail(str(exc))
        except Exception as exc:
            self.fail(f"prefetch failed: {exc}")

    def _receive(self) -> None:
        try:
            while not self._stop.is_set():
                head = _recv_exact(self.sock, self.iov.size)
                if head is None:
                    if not self.ok.is_set():
                        self.fail("lazy-pages closed its socket before every page arrived")
                    return
                cmd, nr, vaddr, dst = self.iov.unpack(head)
                if cmd in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                    self._replies.put(("close", cmd))
                    return
                if cmd != PS_IOV_GET or not 0 < nr <= _MAX_REQUEST_PAGES:
                    self.fail(f"lazy-pages sent an unexpected request {cmd:#x} ({nr} pages)")
                    return
                if not self.t_first_request:
                    self.t_first_request = time.monotonic()
                    self.on_first_request()
                self.requests += 1
                self._replies.put((self._pool.submit(self._pages, dst, vaddr, nr), dst, vaddr, nr, time.monotonic()))
        except OSError as exc:
            if not self._stop.is_set():
                self.fail(f"the page socket broke: {exc}")

    def _pages(self, pid: int, vaddr: int, nr: int) -> list[bytes | memoryview]:
        """The pages asked for; a background push's request (more than one page) gets what is in memory (at
        least its first block), and the blocks after it start to come (see BlockCache.read_parts)."""
        if self.error:
            raise SourceFailed(self.error)
        try:
            spans = self.index.locate(pid, vaddr, nr)
        except KeyError as exc:
            raise SourceFailed(f"lazy-pages asked for pages the image does not have: {exc}") from exc
        parts: list[bytes | memoryview] = []
        got, short, where = 0, nr > 1, ("", 0)
        for name, off, n in spans:
            more = self.cache.read_parts(name, off, n, fault=nr == 1, short=short, have=got)
            k = sum(len(p) for p in more)
            parts += more
            got += k
            where = (name, off + k)
            if k < n:
                break
        if got % PAGE or not PAGE <= got <= nr * PAGE or (got < nr * PAGE and not short):
            raise SourceFailed(f"got {got} bytes for {nr} pages at {vaddr:#x}")
        if short:
            if got < nr * PAGE:
                self.short_replies += 1
            for blk in self.cache.ahead(where[0], where[1], 2):
                self._ahead.submit(self._fetch_ahead, blk)
        return parts

    def _fetch_ahead(self, blk: Any) -> None:
        try:
            self.cache._fetch(blk)
        except SourceFailed:
            pass  # (whoever asks for it reads it again, and fails the server if it must)

    def _reply(self) -> None:
        while True:
            item = self._replies.get()
            if item is None or self._stop.is_set():
                return
            if len(item) == 2:  # lazy-pages is done: every page is in place
                self._closing()
                return
            future, pid, vaddr, nr, t_in = item
            try:
                data = future.result()
            except Exception as exc:  # never answered: the tasks die first (fail), then lazy-pages
                self.fail(str(exc) if isinstance(exc, SourceFailed) else f"serving a page failed: {exc}")
                return
            if self.error:
                return
            n = sum(len(p) for p in data) // PAGE  # (a background push may get fewer than nr)
            try:
                self.sock.sendall(self.iov.pack(PS_IOV_ADD_F | PE_PRESENT << PS_CMD_BITS, n, vaddr, pid))
                for part in data:
                    self.sock.sendall(part)
            except OSError as exc:
                self.fail(f"the page socket broke: {exc}")
                return
            self.served_bytes += n * PAGE
            if nr == 1:
                self.fault_ms.append((time.monotonic() - t_in) * 1000)

    def _closing(self) -> None:
        if not self.error:
            try:
                self.source.finish()  # (a source may confirm what it served only at its end)
            except SourceFailed as exc:
                self.fail(str(exc))
            except Exception as exc:
                self.fail(f"could not confirm the pages served: {exc}")
        if self.error:
            return
        self.t_closed = time.monotonic()
        self.ok.set()
        self._prefetch_stop.set()
        self.cache.wake()
        try:
            self.sock.sendall(struct.pack("<i", 0))
        except OSError:
            pass
        self.done.set()

    def stats(self) -> dict[str, float]:
        c = self.cache
        fm = sorted(self.fault_ms) or [0.0]
        return {"requests": self.requests, "served_bytes": self.served_bytes, "lazy_bytes": c.total_bytes,
                "faults": len(self.fault_ms), "fault_p50_ms": fm[len(fm) // 2], "fault_p99_ms": fm[int(len(fm) * .99)],
                "fault_max_ms": fm[-1], "short_replies": self.short_replies,
                "prefetched_bytes": c.prefetched_bytes, "cache_hits": c.hits, "cache_misses": c.misses,
                "cache_waits": c.waits, "fault_waits": c.fault_waits, "fault_wait_s": c.fault_wait_s,
                "seconds": (self.t_closed or time.monotonic()) - self.t_start,
                "prefetch_done_s": (c.t_prefetched - self.t_start) if c.t_prefetched else 0.0}


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if buf:
                raise OSError(f"short read ({len(buf)} of {n} bytes)")
            return None
        buf += chunk
    return bytes(buf)
