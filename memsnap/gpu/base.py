"""The driver interface every CUDA checkpoint backend implements, and the CUDA process states."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

# (UUID at checkpoint time, UUID to restore onto), as nvidia-smi prints them: "GPU-xxxxxxxx-...".
GpuPairs = Sequence[tuple[str, str]]


class ProcessState(enum.IntEnum):
    """CUprocessState: RUNNING -lock-> LOCKED -checkpoint-> CHECKPOINTED -restore-> LOCKED -unlock-> RUNNING.

    CUDA 13.4 adds CHECKPOINTING and RESTORING: another caller's checkpoint or restore is under way.
    They are transient (IN_PROGRESS): wait for them to end, never treat them as failures.
    """

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3
    CHECKPOINTING = 4
    RESTORING = 5


IN_PROGRESS = frozenset({ProcessState.CHECKPOINTING, ProcessState.RESTORING})


class GpuDriver(Protocol):
    """One CUDA checkpoint backend; every call blocks and raises GpuError on failure."""

    name: str

    def lock(self, pid: int, timeout_ms: int) -> None:
        """RUNNING -> LOCKED; on timeout the process stays RUNNING."""

    def checkpoint(self, pid: int) -> None:
        """LOCKED -> CHECKPOINTED: device memory moves into host memory, the GPU is released."""

    def restore(self, pid: int, gpu_pairs: GpuPairs = ()) -> None:
        """CHECKPOINTED -> LOCKED, optionally onto other GPUs (needs driver >= 580)."""

    def unlock(self, pid: int) -> None:
        """LOCKED -> RUNNING."""

    def get_state(self, pid: int) -> ProcessState:
        """The process's CUDA checkpoint state."""
        ...

    def restore_thread_id(self, pid: int) -> int:
        """The tid of the process's CUDA restore thread; GpuError when it has no CUDA state."""
        ...

    def driver_version(self) -> int:
        """CUDA driver API version as cuDriverGetVersion reports it (13000 = CUDA 13.0); 0 if unknown."""
        ...
