"""Bringing CUDA processes back to RUNNING: waiting out transient states, and recovery after a crash.

Before memsnapd locks any process it journals the pids (and their start times) in the checkpoint's
catalog row (GpuCheckpointer.suspend's `journal`). If the daemon dies before it restored and unlocked
them, the lock outlives it and the job hangs in its next CUDA call forever. At start-up,
Engine.recover hands each journaled entry to recover_pids(), which asks the driver for each pid's
state and restores and/or unlocks it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from memsnap.gpu.base import IN_PROGRESS, GpuDriver, ProcessState
from memsnap.gpu.errors import GpuError
from memsnap.gpu.parallel import each_pid

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
    """Restore and unlock every live pid a killed daemon (or a move that did not happen) left LOCKED or
    CHECKPOINTED.

    Returns pid -> what was done: "gone" (not alive, or the driver no longer knows it), "running"
    (nothing to do), "unlocked", "restored" (restored then unlocked), or "error: ..." (logged).
    Never raises for one pid: every other pid still gets its turn. As in GpuCheckpointer, every pid is
    restored first, then every pid unlocked, each stage with a thread per pid.
    """
    order = list(dict.fromkeys(pids))
    out: dict[int, str] = {}
    found: dict[int, ProcessState] = {}

    def restore(pid: int) -> None:
        if not alive(pid):
            out[pid] = "gone"
            return
        try:
            state = found[pid] = settle(driver, pid, settle_s, sleep)
        except GpuError as exc:
            # A pid with no CUDA state (it exited, or the number was reused) cannot be queried.
            log.info("CUDA recovery: pid %d has no queryable CUDA state (%s)", pid, exc)
            out[pid] = "gone"
            return
        if state is ProcessState.CHECKPOINTED:
            driver.restore(pid)
            out[pid] = "restored"
        elif state is ProcessState.FAILED:
            out[pid] = "error: CUDA state is FAILED: the process must be restarted"
        elif state is not ProcessState.LOCKED:
            out[pid] = "running"

    def unlock(pid: int) -> None:
        driver.unlock(pid)
        out[pid] = out.get(pid, "unlocked")

    for pid, exc in each_pid("recover", order, restore).items():
        out[pid] = f"error: {exc}"
    todo = [p for p in order if p not in out or out[p] == "restored"]
    for pid, exc in each_pid("recover", todo, unlock).items():
        out[pid] = f"error: {exc}"
    for pid in order:
        done, state = out.setdefault(pid, "error: recovery thread died"), found.get(pid)
        where = state.name if state is not None else "in an unknown state"
        if done.startswith("error"):
            log.error("CUDA recovery of pid %d left it %s: %s", pid, where, done)
        elif done not in ("running", "gone"):
            log.warning("CUDA recovery: pid %d was left %s (by a stopped daemon or a held move): %s", pid, where, done)
    return {p: out[p] for p in order}

