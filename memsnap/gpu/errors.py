"""Exceptions of the GPU checkpoint layer, mapped onto the engine's gRPC-coded errors."""

from __future__ import annotations

from memsnap.errors import FailedPrecondition, MemsnapError


class GpuError(MemsnapError):
    """A CUDA checkpoint operation failed; carries the driver's error name and text. The driver refused (or timed
    out locking) this job's processes: a precondition of the job, not a fault of memsnapd (never INTERNAL)."""

    code = "FAILED_PRECONDITION"

    def __init__(
        self,
        op: str,
        detail: str,
        *,
        pid: int | None = None,
        result: int | None = None,
        name: str | None = None,
    ) -> None:
        self.op = op
        self.detail = detail
        self.pid = pid
        self.result = result
        self.name = name
        where = op if pid is None else f"{op}(pid {pid})"
        label = f"{name}: " if name else ""
        super().__init__(f"{where} failed: {label}{detail}")


class GpuUnavailable(GpuError):
    """No usable CUDA checkpoint backend: libcuda lacks the API and cuda-checkpoint is missing."""

    code = "FAILED_PRECONDITION"


class GpuPreflightError(FailedPrecondition):
    """The job's GPU setup cannot be checkpointed; the message says what to do."""
