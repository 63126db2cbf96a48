"""glibc heap tuning for the daemon's bulk byte traffic (drains, fetches and moves).

At rest, big buffers go back to the OS as soon as they are freed (a small idle RSS); while a move streams
an image, or a drain or fetch moves one, buffers up to 8 MiB (its chunks, gRPC's) are kept and reused
instead of being a fresh mmap each (a page fault and a zeroed page per 4 KiB: a drain of 2 GiB in memsnapd
took 1.5x its time in a process without the setting). After a drain or fetch, release_memory() trims what
the worker threads' arenas keep. The measurements behind these settings are in docs/benchmarks.md ("Heap
tuning") and bench/results/dataplane-notes.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers
_M_TRIM_THRESHOLD = -1

# (mmap threshold, trim threshold). An explicit mmap threshold also pins the trim threshold, so both are set.
_IDLE_MALLOC = (1 << 20, 128 << 10)
_BULK_MALLOC = (8 << 20, 64 << 20)  # (above the largest chunk, 4x the 1 MiB average)
_bulk_lock = threading.Lock()
_bulk_users = 0


def _set_malloc(setting: tuple[int, int]) -> None:
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, setting[0])
        mallopt(_M_TRIM_THRESHOLD, setting[1])


def idle_heap() -> None:
    """Buffers of 1 MiB and more come from mmap and go back to the OS when freed. glibc's default, a
    threshold that rises after the first free, keeps them in per-thread arenas that malloc_trim cannot
    fully shrink. Set once when the daemon has a store (drains and fetches)."""
    _set_malloc(_IDLE_MALLOC)


@contextmanager
def bulk_transfer() -> Iterator[None]:
    """While a move streams an image, or a drain or fetch runs: keep freed buffers for reuse; afterwards hand
    them back."""
    global _bulk_users
    with _bulk_lock:
        _bulk_users += 1
        if _bulk_users == 1:
            _set_malloc(_BULK_MALLOC)
    try:
        yield
    finally:
        with _bulk_lock:
            _bulk_users -= 1
            if _bulk_users == 0:
                _set_malloc(_IDLE_MALLOC)
                release_memory()


def release_memory() -> None:
    """Hands the heap that a drain or fetch freed back to the OS (glibc keeps it otherwise in per-thread
    arenas, after raising its mmap threshold on the first big free)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)
