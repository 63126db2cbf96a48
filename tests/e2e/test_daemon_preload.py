"""What memsnapd leaves out of its start it loads right after, so the first drain does not wait for it."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import DaemonProc, wait_for


def test_memsnapd_loads_the_chunk_cutters_numpy_once_it_answers(make_daemon) -> None:
    d: DaemonProc = make_daemon("preload").start()
    assert d.proc is not None
    maps = Path(f"/proc/{d.proc.pid}/maps")  # (numpy's C core, mapped once numpy is imported)
    wait_for(lambda: "_multiarray_umath" in maps.read_text(), 30, 0.1, "memsnapd to import numpy after its start")
