"""A fake libcuda for the GPU unit tests: the checkpoint API as a small state machine per pid that records
every call, optionally slow (a fixed delay per call) and recording which calls overlapped in time."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memsnap.gpu.base import ProcessState

ILLEGAL_STATE, TIMEOUT, NOT_INITIALIZED, NOT_SUPPORTED = 401, 909, 3, 801
# c_char_p results point into these bytes, so they must live for the whole run.
_NAMES = {
    ILLEGAL_STATE: b"CUDA_ERROR_ILLEGAL_STATE",
    TIMEOUT: b"CUDA_ERROR_TIMEOUT",
    NOT_INITIALIZED: b"CUDA_ERROR_NOT_INITIALIZED",
    NOT_SUPPORTED: b"CUDA_ERROR_NOT_SUPPORTED",
}
_TEXTS = {
    ILLEGAL_STATE: b"operation not permitted in this state",
    TIMEOUT: b"the operation timed out",
    NOT_SUPPORTED: b"operation not supported",
}
MOVES = {
    "Lock": (ProcessState.RUNNING, ProcessState.LOCKED),
    "Checkpoint": (ProcessState.LOCKED, ProcessState.CHECKPOINTED),
    "Restore": (ProcessState.CHECKPOINTED, ProcessState.LOCKED),
    "Unlock": (ProcessState.LOCKED, ProcessState.RUNNING),
}


class FakeLib:
    """Records (call, pid) and moves each pid through CUprocessState like the driver does.

    delay[op] makes each call of op take that long (outside any lock, so calls can overlap, as the real
    driver's do on separate GPUs); spans keeps (op, pid, start, end) of every state-changing call.
    """

    def __init__(self, pids: Sequence[int] = (), version: int = 13000) -> None:
        self.states = {p: ProcessState.RUNNING for p in pids}
        self.version = version
        self.fail: dict[tuple[str, int], int] = {}
        self.calls: list[tuple[str, int]] = []
        self.lock_timeouts: list[int] = []
        self.restore_pairs: list[list[tuple[bytes, bytes]]] = []
        # pid -> states GetState reports first (CUDA 13.4's CHECKPOINTING/RESTORING), before the real one
        self.transient: dict[int, list[ProcessState]] = {}
        self.tid_error: dict[int, int] = {}
        self.delay: dict[str, float] = {}
        self.spans: list[tuple[str, int, float, float]] = []
        self._mu = threading.Lock()

    def cuInit(self, flags: int) -> int:
        self.calls.append(("Init", flags))
        return 0

    def cuDriverGetVersion(self, out: Any) -> int:
        out.contents.value = self.version
        return 0

    def cuGetErrorName(self, result: int, out: Any) -> int:
        out.contents.value = _NAMES.get(result)
        return 0 if result in _NAMES else 1

    def cuGetErrorString(self, result: int, out: Any) -> int:
        out.contents.value = _TEXTS.get(result)
        return 0 if result in _TEXTS else 1

    def _move(self, op: str, pid: int) -> int:
        t0 = time.monotonic()
        with self._mu:
            self.calls.append((op, pid))
        if self.delay.get(op):
            time.sleep(self.delay[op])
        with self._mu:
            self.spans.append((op, pid, t0, time.monotonic()))
            if (op, pid) in self.fail:
                return self.fail[(op, pid)]
            src, dst = MOVES[op]
            if self.states.get(pid) is not src:
                return ILLEGAL_STATE
            self.states[pid] = dst
            return 0

    def cuCheckpointProcessLock(self, pid: int, args: Any) -> int:
        self.lock_timeouts.append(args.contents.timeoutMs)
        assert bytes(args.contents)[4:] == bytes(60)
        return self._move("Lock", pid)

    def cuCheckpointProcessCheckpoint(self, pid: int, args: Any) -> int:
        assert bytes(args.contents) == bytes(64)
        return self._move("Checkpoint", pid)

    def cuCheckpointProcessRestore(self, pid: int, args: Any) -> int:
        a = args.contents
        with self._mu:
            self.restore_pairs.append(
                [
                    (bytes(a.gpuPairs[i].oldUuid.bytes), bytes(a.gpuPairs[i].newUuid.bytes))
                    for i in range(a.gpuPairsCount)
                ]
            )
        assert bytes(a.reserved) == bytes(len(a.reserved)) and a.reserved1 == 0
        return self._move("Restore", pid)

    def cuCheckpointProcessUnlock(self, pid: int, args: Any) -> int:
        assert bytes(args.contents) == bytes(64)
        return self._move("Unlock", pid)

    def cuCheckpointProcessGetState(self, pid: int, out: Any) -> int:
        with self._mu:
            self.calls.append(("GetState", pid))
            if pid not in self.states:
                return NOT_INITIALIZED
            queued = self.transient.get(pid)
            out.contents.value = int(queued.pop(0) if queued else self.states[pid])
        return 0

    def cuCheckpointProcessGetRestoreThreadId(self, pid: int, out: Any) -> int:
        if pid in self.tid_error:
            return self.tid_error[pid]
        if pid not in self.states:
            return NOT_INITIALIZED
        out.contents.value = pid + 1
        return 0

    def max_overlap(self, op: str) -> int:
        """The most calls of op that were running at one moment."""
        mine = [(s, e) for o, _, s, e in self.spans if o == op]
        edges = sorted([(s, 1) for s, _ in mine] + [(e, -1) for _, e in mine])
        now = best = 0
        for _, step in edges:
            now += step
            best = max(best, now)
        return best


def ops(lib: FakeLib) -> list[tuple[str, int]]:
    """The state-changing calls, without queries."""
    return [c for c in lib.calls if c[0] in MOVES or c[0] == "dump"]


def stages(lib: FakeLib) -> list[tuple[str, frozenset[int]]]:
    """ops() grouped into stages: consecutive calls of one op (in any order: they run in parallel)."""
    out: list[tuple[str, set[int]]] = []
    for op, pid in ops(lib):
        if out and out[-1][0] == op and pid not in out[-1][1]:
            out[-1][1].add(pid)
        else:
            out.append((op, {pid}))
    return [(op, frozenset(p)) for op, p in out]


def fake_proc(
    root: Path,
    tree: dict[int, list[int]],
    fds: dict[int, list[str]],
    nspid: dict[int, int] | None = None,
    children_files: bool = True,
) -> str:
    """A fake /proc under root: the tree (parent -> children), each pid's fd targets and namespace pid."""
    parents = {kid: pid for pid, kids in tree.items() for kid in kids}
    for pid in set(tree) | set(parents):
        d = root / str(pid)
        (d / "task" / str(pid)).mkdir(parents=True)
        if children_files:
            (d / "task" / str(pid) / "children").write_text(" ".join(map(str, tree.get(pid, []))) + " ")
        (d / "stat").write_text(f"{pid} (py (x) y) S {parents.get(pid, 1)} 0 0\n")
        (d / "comm").write_text("python\n")
        inner = f"\t{nspid[pid]}" if nspid and pid in nspid else ""
        (d / "status").write_text(f"Name:\tpython\nNSpid:\t{pid}{inner}\n")
        (d / "fd").mkdir()
        for i, target in enumerate(fds.get(pid, ["/dev/null"])):
            os.symlink(target, d / "fd" / str(i))
    return str(root)


def smi_runner(gpus: str, apps: str, rc: int = 0) -> tuple[list[list[str]], Any]:
    """A fake nvidia-smi runner: the --query-gpu and --query-compute-apps outputs; (argv seen, runner)."""
    seen: list[list[str]] = []

    def run(argv: Sequence[str], timeout: float | None) -> tuple[int, str]:
        seen.append(list(argv))
        return rc, gpus if "--query-gpu" in argv[1] else apps

    return seen, run
