"""Hashing an image while CRIU writes it: the checkpoint call waits for the dump, not for a second pass.

After a dump, every image file's blake3 goes into the signed manifest. Hashed after CRIU returned, a 2 GiB
image cost ~0.4 s on the checkpoint call's critical path (1.4-1.8x raw CRIU's wall time, issue 30). CRIU
appends page data to pages-*.img strictly in order (memsnap.move.stream relies on the same), so a thread can
hash each pages file as it grows, on a core CRIU does not use; when CRIU returns, only the tail is left.

    hasher = DumpHasher(staging)      before CRIU starts: inotify on the staging dir, then the thread
    known = hasher.finish()           after CRIU returned: the tails; {name: Hashed}
    manifest.describe_files(staging, known)

describe_files() stays the one place that checks the files (regular, no links, no dirs) and takes a digest
from `known` only for a file whose inode, size, mtime and ctime are still the ones seen when its last byte
was hashed (after CRIU returned: nothing writes it any more); any other file is hashed there, as before.
The small files are left to it: they are written and rewritten in any order, and hash in microseconds.

The growing file is read through a read-only mapping of what it holds so far, not copied into a buffer: on
the tier's tmpfs a 1 GiB file hashed in 240 ms mapped against 330 ms through preadv, so the thread needs less
CPU to keep up with CRIU, and the tail left when CRIU returns (the checkpoint call waits for it) hashes
faster (what that did to the call was within this VM's noise: bench/results/dataplane-notes.md).
A mapping of a file that shrinks under it would fault (SIGBUS): nothing shrinks these files,
CRIU only appends to them in a staging dir only root can write, and the thread stops before it is removed.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import select
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from memsnap import safefs

log = logging.getLogger("memsnap.dumphash")

_IN_MODIFY, _IN_CLOSE_WRITE, _IN_MOVED_TO, _IN_CREATE = 0x2, 0x8, 0x80, 0x100
_EVENT = struct.Struct("iIII")
READ_BYTES = 4 << 20  # hashed at a time (the thread looks for stop() between pieces)
POLL_S = 0.005  # how often a growing file is looked at again


class Inotify:
    """The few inotify calls needed to learn when CRIU creates or closes an image file."""

    def __init__(self, path: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = int(self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        mask = _IN_CREATE | _IN_CLOSE_WRITE | _IN_MOVED_TO
        if self._libc.inotify_add_watch(self.fd, os.fsencode(path), mask) < 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"cannot watch {path}")

    def events(self, timeout: float) -> list[tuple[int, str]]:
        """(mask, file name) events, waiting up to timeout seconds for the first."""
        p = select.poll()  # (not select(): fd numbers above 1023 are fine)
        p.register(self.fd, select.POLLIN)
        if not p.poll(timeout * 1000):
            return []
        out: list[tuple[int, str]] = []
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return out
            off = 0
            while off + _EVENT.size <= len(buf):
                _wd, mask, _cookie, length = _EVENT.unpack_from(buf, off)
                name = buf[off + _EVENT.size: off + _EVENT.size + length].rstrip(b"\0")
                out.append((mask, os.fsdecode(name)))
                off += _EVENT.size + length

    def close(self) -> None:
        """Stops watching."""
        os.close(self.fd)


def stat_key(st: os.stat_result) -> tuple[int, int, int, int]:
    """What must not change between hashing a file and using its digest: inode, size, mtime, ctime."""
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@dataclass(frozen=True)
class Hashed:
    """A file's blake3, valid while its stat_key is `key`."""

    key: tuple[int, int, int, int]
    blake3: str


@dataclass
class _Tail:
    fd: int
    offset: int = 0
    hasher: Any = field(default_factory=blake3.blake3)


class DumpHasher:
    """Hashes the pages-*.img files of a staging dir while they grow; finish() returns what it hashed.

    Best effort: any error stops it (logged) and finish() returns what is complete, describe_files() hashes the
    rest. It never blocks the dump: it only reads.
    """

    def __init__(self, staging: Path) -> None:
        self._dfd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self._watch = Inotify(staging)
        except OSError:
            os.close(self._dfd)
            raise
        self._tails: dict[str, _Tail] = {}
        self._done = threading.Event()
        self._error = ""
        self.hashed_while_dumping = 0  # bytes hashed before finish() was called
        self.hashed_after = 0
        self._tid = 0  # the thread's, while it runs at SCHED_IDLE
        self._tid_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"dumphash-{staging.name}", daemon=True)
        self._thread.start()

    @property
    def hashed(self) -> int:
        """Bytes hashed so far (the thread's progress)."""
        return sum(t.offset for t in list(self._tails.values()))

    def finish(self) -> dict[str, Hashed]:
        """After CRIU returned: hashes the tails; {name: Hashed} for every pages file read to its end."""
        self._stop_thread()
        out: dict[str, Hashed] = {}
        try:
            if self._error:
                return out
            self._discover()
            for name, t in self._tails.items():
                n = self._pump(t)
                self.hashed_after += n
                st = os.fstat(t.fd)
                if st.st_size == t.offset:
                    out[name] = Hashed(stat_key(st), t.hasher.hexdigest())
        except (OSError, safefs.UnsafePath) as exc:
            log.info("hashing while dumping stopped: %s", exc)
            out = {}
        finally:
            self.close()
        return out

    def close(self) -> None:
        """Stops the thread and closes everything (idempotent)."""
        self._stop_thread()
        for t in self._tails.values():
            os.close(t.fd)
        self._tails = {}
        if self._dfd >= 0:
            os.close(self._dfd)
            self._dfd = -1
            self._watch.close()

    def _stop_thread(self) -> None:
        """Ends the thread, first at normal priority again: at SCHED_IDLE on a busy node it may wait seconds
        for the CPU it needs to see the stop (a park retried under load waited minutes for it)."""
        self._done.set()
        if self._thread is threading.current_thread():
            return
        with self._tid_lock:
            tid, self._tid = self._tid, 0
        if tid:
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass  # (it ended already)
        self._thread.join()

    def _run(self) -> None:
        with self._tid_lock:
            if not self._done.is_set():
                try:
                    # Only on a core nothing else wants: the job is frozen while CRIU and its parasite copy its
                    # pages, and on a small node hashing beside them stretched the freeze (2 GiB: 985 -> 1097 ms).
                    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # (this thread only, on Linux)
                    self._tid = threading.get_native_id()
                except OSError as exc:
                    log.debug("hashing while dumping at normal priority: %s", exc)
        try:
            while not self._done.is_set():
                if self._watch.events(POLL_S):
                    self._discover()
                for t in list(self._tails.values()):
                    self.hashed_while_dumping += self._pump(t, self._done.is_set)
        except (OSError, safefs.UnsafePath) as exc:
            self._error = str(exc)
            log.info("hashing while dumping stopped: %s", exc)

    def _discover(self) -> None:
        """Opens the pages files that appeared (through the dir fd: never a link, fifo or device)."""
        for name, _st in safefs.regular_files(self._dfd):
            if name.startswith("pages-") and name not in self._tails:
                self._tails[name] = _Tail(safefs.open_file(self._dfd, name))

    def _pump(self, t: _Tail, stop: Callable[[], bool] | None = None) -> int:
        """Hashes what was appended since the last call (until stop() turns true); returns how many bytes."""
        size = os.fstat(t.fd).st_size
        if size <= t.offset:
            return 0
        start = t.offset - t.offset % mmap.ALLOCATIONGRANULARITY  # (a mapping starts on a page)
        n = 0
        with mmap.mmap(t.fd, size - start, mmap.MAP_SHARED, mmap.PROT_READ, offset=start) as m, \
                memoryview(m) as mv:
            while t.offset < size and not (stop is not None and stop()):
                end = min(t.offset + READ_BYTES, size)
                with mv[t.offset - start: end - start] as piece:
                    t.hasher.update(piece)
                n += end - t.offset
                t.offset = end
        return n
