"""Several CUDA processes in one job: every stage of driver calls runs one thread per process, after the
previous stage ended for all of them; a failure in one process leaves every other one unlocked and running."""

from __future__ import annotations

import time
from typing import Any

import pytest

from memsnap.gpu.base import ProcessState
from memsnap.gpu.checkpointer import GpuCheckpointer
from memsnap.gpu.driver import DriverApi
from memsnap.gpu.errors import GpuError
from memsnap.gpu.recovery import recover_pids
from tests.unit.fake_cuda import ILLEGAL_STATE, TIMEOUT, FakeLib, stages

DELAY = 0.15  # seconds per driver call


def _slow(pids: list[int]) -> tuple[FakeLib, GpuCheckpointer]:
    lib = FakeLib(pids)
    lib.delay = {op: DELAY for op in ("Lock", "Checkpoint", "Restore", "Unlock")}
    return lib, GpuCheckpointer(DriverApi(lib))


def _ends(lib: FakeLib, op: str) -> list[float]:
    return [e for o, _, _, e in lib.spans if o == op]


def _starts(lib: FakeLib, op: str) -> list[float]:
    return [s for o, _, s, _ in lib.spans if o == op]


@pytest.mark.parametrize("n", [2, 4])
def test_each_stage_runs_every_process_at_once_and_ends_before_the_next(n: int) -> None:
    pids = [100 + i for i in range(n)]
    lib, ckpt = _slow(pids)
    t0 = time.monotonic()
    sus = ckpt.suspend(pids, timeout_ms=5000)
    suspended = time.monotonic() - t0
    sus.resume()
    for op in ("Lock", "Checkpoint", "Restore", "Unlock"):
        assert lib.max_overlap(op) == n, f"{op} calls did not overlap: {lib.spans}"
    # barriers: no checkpoint before every lock is taken; no unlock before every restore is done
    assert min(_starts(lib, "Checkpoint")) >= max(_ends(lib, "Lock"))
    assert min(_starts(lib, "Restore")) >= max(_ends(lib, "Checkpoint"))
    assert min(_starts(lib, "Unlock")) >= max(_ends(lib, "Restore"))
    # two stages of one call's time each, not 2 * n of them
    assert suspended < 2 * DELAY + 0.5 * DELAY * n, suspended
    assert set(sus.seconds) == {"lock", "checkpoint", "restore", "unlock"}
    assert all(DELAY * 0.9 <= s < DELAY * 3 for s in sus.seconds.values()), sus.seconds
    assert set(sus.pid_seconds["checkpoint"]) == set(pids)
    assert set(lib.states.values()) == {ProcessState.RUNNING}


def test_restore_after_criu_restores_all_then_unlocks_all_in_parallel() -> None:
    pids = [1, 2, 3]
    lib, ckpt = _slow(pids)
    for p in pids:
        lib.states[p] = ProcessState.CHECKPOINTED
    seconds = ckpt.restore(pids)
    assert lib.max_overlap("Restore") == 3 and lib.max_overlap("Unlock") == 3
    assert min(_starts(lib, "Unlock")) >= max(_ends(lib, "Restore"))
    assert seconds["restore"] < 2 * DELAY and seconds["unlock"] < 2 * DELAY
    assert set(lib.states.values()) == {ProcessState.RUNNING}


def test_one_failed_checkpoint_among_four_leaves_the_others_unlocked_and_running() -> None:
    pids = [10, 20, 30, 40]
    lib, ckpt = _slow(pids)
    lib.fail[("Checkpoint", 30)] = ILLEGAL_STATE
    journal: list[Any] = []
    with pytest.raises(GpuError, match=r"pid 30.*CUDA_ERROR_ILLEGAL_STATE"):
        ckpt.suspend(pids, timeout_ms=5000, journal=journal.append)
    assert stages(lib) == [
        ("Lock", frozenset(pids)),
        ("Checkpoint", frozenset(pids)),
        ("Restore", frozenset({10, 20, 40})),  # (30 never got checkpointed: asked, found LOCKED)
        ("Unlock", frozenset(pids)),
    ]
    assert ("GetState", 30) in lib.calls
    assert set(lib.states.values()) == {ProcessState.RUNNING}
    assert journal[0] == {"pids": pids, "starts": {str(p): 0.0 for p in pids}} and journal[-1] is None


def test_one_lock_timeout_among_three_unlocks_the_other_two() -> None:
    pids = [10, 20, 30]
    lib, ckpt = _slow(pids)
    lib.fail[("Lock", 20)] = TIMEOUT
    with pytest.raises(GpuError, match="CUDA_ERROR_TIMEOUT"):
        ckpt.suspend(pids, timeout_ms=100)
    assert stages(lib) == [("Lock", frozenset(pids)), ("Unlock", frozenset({10, 30}))]
    assert set(lib.states.values()) == {ProcessState.RUNNING}


def test_two_failures_are_both_named() -> None:
    pids = [10, 20, 30]
    lib, ckpt = _slow(pids)
    lib.fail[("Checkpoint", 10)] = ILLEGAL_STATE
    lib.fail[("Checkpoint", 30)] = ILLEGAL_STATE
    with pytest.raises(GpuError) as err:
        ckpt.suspend(pids, timeout_ms=5000)
    assert "pid 10" in str(err.value) and "pid 30" in str(err.value)
    assert set(lib.states.values()) == {ProcessState.RUNNING}


def test_a_failed_restore_after_criu_unlocks_nobody() -> None:
    pids = [1, 2, 3]
    lib, ckpt = _slow(pids)
    for p in pids:
        lib.states[p] = ProcessState.CHECKPOINTED
    lib.fail[("Restore", 2)] = ILLEGAL_STATE
    with pytest.raises(GpuError, match="pid 2"):
        ckpt.restore(pids)
    assert not any(op == "Unlock" for op, _, _, _ in lib.spans)


def test_a_failed_unlock_during_rollback_is_retried_alone_and_the_others_run() -> None:
    pids = [10, 20, 30]
    lib, ckpt = _slow(pids)
    sus = ckpt.suspend(pids, timeout_ms=5000)
    lib.fail[("Unlock", 20)] = ILLEGAL_STATE
    with pytest.raises(GpuError, match="pid 20"):
        sus.resume()
    assert lib.states[10] is ProcessState.RUNNING and lib.states[30] is ProcessState.RUNNING
    assert sus.pending == (20,)
    del lib.fail[("Unlock", 20)]
    sus.resume()
    assert sus.pending == () and set(lib.states.values()) == {ProcessState.RUNNING}


def test_crash_recovery_brings_every_process_back_in_parallel() -> None:
    pids = [1, 2, 3, 4]
    lib, _ = _slow(pids)
    lib.states.update({1: ProcessState.CHECKPOINTED, 2: ProcessState.CHECKPOINTED, 3: ProcessState.LOCKED})
    t0 = time.monotonic()
    out = recover_pids(DriverApi(lib), [*pids, 99], alive=lambda p: p != 99)
    took = time.monotonic() - t0
    assert out == {1: "restored", 2: "restored", 3: "unlocked", 4: "running", 99: "gone"}
    assert lib.max_overlap("Restore") == 2 and lib.max_overlap("Unlock") >= 2
    assert took < 4 * DELAY, took  # restore + unlock of one process, not of all three in a row
