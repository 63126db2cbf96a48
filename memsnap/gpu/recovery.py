"""Bringing CUDA processes back to RUNNING: waiting out transient states, and recovery after a crash.

Before memsnapd locks any process it journals the pids (and their start times) in the checkpoint's
catalog row (GpuCheckpointer.suspend's `journal`). If the daemon dies before it restored and unlocked
them, the lock outlives it and the job hangs in its next CUDA call forever. At start-up,
Engine.recover hands each journaled entry to recover_pids(), which asks the driver for each pid's
state and restores and/or unlocks it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from memsnap.gpu.base import IN_PROGRESS, GpuDriver, ProcessState
from memsnap.gpu.errors import GpuError

log = logging.getLogger(__name__)

SETTLE_TIMEOUT_S = 120.0
_POLL_S = 0.05


def settle(
    driver: GpuDriver,
    pid: int,
    timeout_s: float = SETTLE_TIMEOUT_S,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> ProcessState:
    """pid's state once it is not CHECKPOINTING or RESTORING (CUDA >= 13.4); GpuError after timeout_s."""
    deadline = clock() + timeout_s
    while True:
        state = driver.get_state(pid)
        if state not in IN_PROGRESS:
            return state
        if clock() >= deadline:
            raise GpuError("get-state", f"still {state.name} after {timeout_s:.0f} s", pid=pid)
        sleep(_POLL_S)


def journal_entry(pids: Iterable[int], starts: dict[int, float] | None = None) -> dict[str, Any]:
    """What the catalog keeps before the GPU step: {"pids": [...], "starts": {"pid": start_time}}."""
    pids = list(pids)
    return {"pids": pids, "starts": {str(p): (starts or {}).get(p, 0.0) for p in pids}}


def recover_pids(
    driver: GpuDriver,
    pids: Iterable[int],
    alive: Callable[[int], bool] = lambda pid: True,
    settle_s: float = SETTLE_TIMEOUT_S,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[int, str]:
    """Restore and unlock every live pid a killed daemon left LOCKED or CHECKPOINTED.

    Returns pid -> what was done: "gone" (not alive, or the driver no longer knows it), "running"
    (nothing to do), "unlocked", "restored" (restored then unlocked), or "error: ..." (logged).
    Never raises for one pid: every other pid still gets its turn. Each pid has a thread of its own.
    """
    out: dict[int, str] = {}

    def one(pid: int) -> None:
        out[pid] = _recover_one(driver, pid, alive, settle_s, sleep)

    order = list(dict.fromkeys(pids))
    threads = [threading.Thread(target=one, args=(p,), name=f"gpu-recover-{p}", daemon=True) for p in order]
    for t in threads:  # one thread per process, as GpuCheckpointer does: each GPU has its own link
        t.start()
    for t in threads:
        t.join()
    return {p: out.get(p, "error: recovery thread died") for p in order}


def _recover_one(
    driver: GpuDriver, pid: int, alive: Callable[[int], bool], settle_s: float, sleep: Callable[[float], None]
) -> str:
    """recover_pids for one pid: what was done."""
    if not alive(pid):
        return "gone"
    try:
        state = settle(driver, pid, settle_s, sleep)
    except GpuError as exc:
        # A pid with no CUDA state (it exited, or the number was reused) cannot be queried.
        log.info("CUDA recovery: pid %d has no queryable CUDA state (%s)", pid, exc)
        return "gone"
    try:
        if state is ProcessState.CHECKPOINTED:
            driver.restore(pid)
            driver.unlock(pid)
            done = "restored"
        elif state is ProcessState.LOCKED:
            driver.unlock(pid)
            done = "unlocked"
        elif state is ProcessState.FAILED:
            done = "error: CUDA state is FAILED: the process must be restarted"
        else:
            done = "running"
    except GpuError as exc:
        done = f"error: {exc}"
    if done.startswith("error"):
        log.error("CUDA recovery of pid %d left it %s: %s", pid, state.name, done)
    elif done != "running":
        log.warning("CUDA recovery: pid %d was left %s by a stopped daemon: %s", pid, state.name, done)
    return done
