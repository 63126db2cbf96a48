"""Suspending a job's CUDA state around a CRIU dump, and bringing it back after a restore.

Every driver call of one stage runs on its own thread, one per CUDA process, and a stage ends only
when all of its calls have (each GPU has its own link, so a job with one process per GPU pays the
slowest process, not the sum):

    journal(pids) -> lock all (with a timeout) -> checkpoint all -> [CRIU dump] -> restore all -> unlock all
                       |            |                                              |
                       any failed: every pid that got anywhere is restored and unlocked (in parallel), then raise

All locks come first, so the job stops at one point in all of its processes; a failure of one process
never leaves the others locked. The journal entry is written before the first lock, so a daemon killed
mid-way restores and unlocks them at its next start (recovery.recover_pids).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

from memsnap.gpu.base import GpuDriver, GpuPairs, ProcessState
from memsnap.gpu.errors import GpuError
from memsnap.gpu.parallel import each_pid
from memsnap.gpu.recovery import journal_entry, settle

# journal(entry) before the first lock, journal(None) once every pid is back to RUNNING or released.
Journal = Callable[[dict[str, Any] | None], None]

log = logging.getLogger(__name__)


def _joined(op: str, errors: Sequence[GpuError]) -> GpuError:
    """The one error, or one GpuError that names every failure."""
    if len(errors) == 1:
        return errors[0]
    return GpuError(op, "; ".join(str(e) for e in errors))


class GpuSuspension:
    """The CUDA state of a job, checkpointed into host memory until resume() or release().

    As a context manager it resumes on the way out (exception or not) unless release() was called:
    call release() once the CRIU dump has killed the processes, resume() after leave-running.
    """

    def __init__(
        self,
        driver: GpuDriver,
        pids: Sequence[int],
        device_bytes: Mapping[int, int] | None = None,
        journal: Journal | None = None,
    ) -> None:
        self._driver = driver
        self._journal = journal
        self.pids = tuple(pids)
        self.device_bytes = {p: device_bytes[p] for p in self.pids if device_bytes and p in device_bytes}
        # None: unknown (an operation on it failed); absent: never touched.
        self._states: dict[int, ProcessState | None] = {}
        # Wall time of each stage (lock, checkpoint, restore, unlock), all its pids at once.
        self.seconds: dict[str, float] = {}
        # The same per pid and stage: {"lock": {pid: s}, ...}, to see which process was slow.
        self.pid_seconds: dict[str, dict[int, float]] = {}
        self.released = False

    def _step(self, op: str, pid: int, call: Callable[[], None], after: ProcessState) -> None:
        """Run one driver call, tracking the state it leaves and the time it took."""
        self._states[pid] = None
        t0 = time.monotonic()
        call()
        self.pid_seconds.setdefault(op, {})[pid] = time.monotonic() - t0
        self._states[pid] = after

    def _stage(self, op: str, pids: Sequence[int], call: Callable[[int], None]) -> list[GpuError]:
        """call(pid) for every pid in parallel, timed as one stage; the GpuErrors."""
        if not pids:
            return []
        t0 = time.monotonic()
        errors = each_pid(op, pids, call)
        self.seconds[op] = self.seconds.get(op, 0.0) + time.monotonic() - t0
        return list(errors.values())

    def _lock(self, pid: int, timeout_ms: int) -> None:
        """RUNNING -> LOCKED."""
        self._step("lock", pid, lambda: self._driver.lock(pid, timeout_ms), ProcessState.LOCKED)

    def _checkpoint(self, pid: int) -> None:
        """LOCKED -> CHECKPOINTED."""
        self._step("checkpoint", pid, lambda: self._driver.checkpoint(pid), ProcessState.CHECKPOINTED)

    def _restore(self, pid: int) -> None:
        """CHECKPOINTED -> LOCKED; a pid in an unknown state is asked first (and left alone unless CHECKPOINTED)."""
        state = self._states.get(pid)
        if state is None:
            state = settle(self._driver, pid)
            self._states[pid] = state
        if state is ProcessState.CHECKPOINTED:
            self._step("restore", pid, lambda: self._driver.restore(pid), ProcessState.LOCKED)
        elif state is ProcessState.FAILED:
            raise GpuError("resume", "CUDA state is FAILED: the process must be restarted", pid=pid)

    def _unlock(self, pid: int) -> None:
        """LOCKED -> RUNNING."""
        self._step("unlock", pid, lambda: self._driver.unlock(pid), ProcessState.RUNNING)

    def run_stages(self, timeout_ms: int) -> None:
        """Lock every pid, then checkpoint every pid; the first stage that fails raises (nothing rolled back)."""
        for op, call in (("lock", lambda p: self._lock(p, timeout_ms)), ("checkpoint", self._checkpoint)):
            errors = self._stage(op, self.pids, call)
            if errors:
                raise _joined(op, errors)

    @property
    def pending(self) -> tuple[int, ...]:
        """Pids not yet back to RUNNING (empty after resume() or release())."""
        if self.released:
            return ()
        return tuple(p for p, s in self._states.items() if s is not ProcessState.RUNNING)

    def resume(self) -> None:
        """Restore then unlock every pid still suspended, all at once; idempotent, retries only what failed."""
        errors = self._stage("restore", self.pending, self._restore)
        failed = {e.pid for e in errors}
        locked = [p for p in self.pending if p not in failed and self._states.get(p) is ProcessState.LOCKED]
        errors += self._stage("unlock", locked, self._unlock)
        for exc in errors:
            log.error("could not resume CUDA state: %s", exc)
        if errors:
            raise _joined("resume", errors)
        self._settled()

    def release(self) -> None:
        """The CRIU dump killed the processes: their CUDA state lives in the image, nothing to resume."""
        self.released = True
        self._settled()

    def _settled(self) -> None:
        """Clear the journal: nothing is left for crash recovery to undo."""
        if self._journal is not None:
            journal, self._journal = self._journal, None
            journal(None)

    def record(self) -> dict[str, Any]:
        """What the manifest keeps: pids, device bytes per pid and the wall time of each stage."""
        return {
            "pids": list(self.pids),
            "device_bytes": {str(p): n for p, n in self.device_bytes.items()},
            "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
        }

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.pending:
            return
        try:
            self.resume()
        except GpuError as err:
            if exc is None:
                raise
            exc.add_note(f"and resuming the CUDA state failed: {err}")


class GpuCheckpointer:
    """Drives one GpuDriver for the CUDA processes of a job."""

    def __init__(self, driver: GpuDriver) -> None:
        self.driver = driver

    def probe(self, pids: Sequence[int]) -> tuple[list[int], dict[int, str]]:
        """(pids with CUDA state, {pid: why not} for the others): a CUDA restore thread is the tell.

        The reason is the driver's own answer (its CUresult name and text), never a guess: a pid may
        lack a restore thread because it is an NVML user, or for a reason only the driver knows.
        """
        cuda: list[int] = []
        other: dict[int, str] = {}
        for pid in pids:
            try:
                self.driver.restore_thread_id(pid)
            except GpuError as exc:
                other[pid] = f"{exc.name}: {exc.detail}" if exc.name else exc.detail
            else:
                cuda.append(pid)
        return cuda, other

    def checkpointed(self, pids: Sequence[int]) -> list[int]:
        """The pids whose CUDA state is CHECKPOINTED (after a CRIU restore: those to bring back)."""
        out: list[int] = []
        for pid in pids:
            try:
                if settle(self.driver, pid) is ProcessState.CHECKPOINTED:
                    out.append(pid)
            except GpuError:
                continue
        return out

    def suspend(
        self,
        pids: Sequence[int],
        timeout_ms: int,
        device_bytes: Mapping[int, int] | None = None,
        journal: Journal | None = None,
        starts: Mapping[int, float] | None = None,
    ) -> GpuSuspension:
        """Lock every pid, then checkpoint every pid (each stage in parallel); on any failure roll back
        what was done (in parallel) and re-raise.

        journal (if given) records the pids before the first lock, so that a daemon killed mid-way
        leaves a trace recovery.recover_pids() can undo; it is cleared once all is resumed or released.
        """
        if timeout_ms <= 0:
            raise ValueError("timeout_ms must be > 0: a lock without a timeout can hang the job forever")
        sus = GpuSuspension(self.driver, list(dict.fromkeys(pids)), device_bytes, journal)
        if journal is not None:
            journal(journal_entry(sus.pids, dict(starts or {})))
        try:
            sus.run_stages(timeout_ms)
        except BaseException as exc:
            try:
                sus.resume()
            except GpuError as err:
                exc.add_note(f"and rolling back the CUDA state failed: {err}")
            raise
        return sus

    def restore(self, pids: Sequence[int], pairs: Mapping[int, GpuPairs] | None = None) -> dict[str, float]:
        """After CRIU restored the tree: restore every pid (onto pairs[pid], see memsnap.gpu.remap), then
        unlock every pid; each stage in parallel. Returns each stage's wall time.

        pairs must already be complete and validated (remap.restore_pairs): the driver wants every
        checkpointed GPU of a process listed once a list is given. When a restore fails, nothing is
        unlocked: the job is unusable, kill its tree.
        """
        t0 = time.monotonic()
        errors = each_pid("restore", pids, lambda pid: self.driver.restore(pid, list((pairs or {}).get(pid, ()))))
        if errors:
            raise _joined("restore", list(errors.values()))
        t1 = time.monotonic()
        errors = each_pid("unlock", pids, self.driver.unlock)
        if errors:
            raise _joined("unlock", list(errors.values()))
        return {"restore": t1 - t0, "unlock": time.monotonic() - t1}
