"""The ctypes driver backend, and picking a backend: libcuda first, then the cuda-checkpoint binary."""

from __future__ import annotations

import ctypes
import logging

from memsnap.gpu import bindings as b
from memsnap.gpu.base import GpuDriver, GpuPairs, ProcessState
from memsnap.gpu.errors import GpuError
from memsnap.gpu.runner import Runner
from memsnap.gpu.tool import CudaCheckpointCli

log = logging.getLogger(__name__)


class DriverApi:
    """GpuDriver over the CUDA driver API in libcuda.so.1 (cuInit is called once, here)."""

    name = "driver-api"

    def __init__(self, lib: b.CudaLibrary, *, init: bool = True) -> None:
        self._lib = lib
        if init:
            b.check(lib, lib.cuInit(0), "cuInit")
        self._version: int | None = None

    def driver_version(self) -> int:
        """cuDriverGetVersion, e.g. 12080 on r570 and 13000 on r580."""
        if self._version is None:
            out = ctypes.c_int(0)
            b.check(self._lib, self._lib.cuDriverGetVersion(ctypes.pointer(out)), "cuDriverGetVersion")
            self._version = out.value
        return self._version

    def lock(self, pid: int, timeout_ms: int) -> None:
        """cuCheckpointProcessLock with timeoutMs set and every reserved field zero."""
        args = b.CUcheckpointLockArgs()
        args.timeoutMs = timeout_ms
        rc = self._lib.cuCheckpointProcessLock(pid, ctypes.pointer(args))
        b.check(self._lib, rc, "cuCheckpointProcessLock", pid)

    def checkpoint(self, pid: int) -> None:
        """cuCheckpointProcessCheckpoint with zeroed args."""
        args = b.CUcheckpointCheckpointArgs()
        rc = self._lib.cuCheckpointProcessCheckpoint(pid, ctypes.pointer(args))
        b.check(self._lib, rc, "cuCheckpointProcessCheckpoint", pid)

    def restore(self, pid: int, gpu_pairs: GpuPairs = ()) -> None:
        """cuCheckpointProcessRestore; remapping is refused below CUDA 13.0, whose args lack gpuPairs."""
        args = b.CUcheckpointRestoreArgs()
        pairs = b.gpu_pair_array(gpu_pairs)  # kept alive until the call returns
        if gpu_pairs:
            version = self.driver_version()
            if version < b.CUDA_REMAP_API:
                raise GpuError(
                    "cuCheckpointProcessRestore",
                    f"GPU remapping needs CUDA driver API >= {b.CUDA_REMAP_API} (driver >= 580), found {version}",
                    pid=pid,
                )
            args.gpuPairs = ctypes.cast(pairs, ctypes.POINTER(b.CUcheckpointGpuPair))
            args.gpuPairsCount = len(gpu_pairs)
        rc = self._lib.cuCheckpointProcessRestore(pid, ctypes.pointer(args))
        b.check(self._lib, rc, "cuCheckpointProcessRestore", pid)

    def unlock(self, pid: int) -> None:
        """cuCheckpointProcessUnlock with zeroed args."""
        args = b.CUcheckpointUnlockArgs()
        rc = self._lib.cuCheckpointProcessUnlock(pid, ctypes.pointer(args))
        b.check(self._lib, rc, "cuCheckpointProcessUnlock", pid)

    def get_state(self, pid: int) -> ProcessState:
        """cuCheckpointProcessGetState."""
        out = ctypes.c_int(-1)
        rc = self._lib.cuCheckpointProcessGetState(pid, ctypes.pointer(out))
        b.check(self._lib, rc, "cuCheckpointProcessGetState", pid)
        try:
            return ProcessState(out.value)
        except ValueError:
            raise GpuError("cuCheckpointProcessGetState", f"unknown state {out.value}", pid=pid) from None

    def restore_thread_id(self, pid: int) -> int:
        """cuCheckpointProcessGetRestoreThreadId."""
        out = ctypes.c_int(0)
        rc = self._lib.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.pointer(out))
        b.check(self._lib, rc, "cuCheckpointProcessGetRestoreThreadId", pid)
        return out.value


def load_driver(
    libname: str = b.LIBCUDA, binary: str = "cuda-checkpoint", runner: Runner | None = None
) -> GpuDriver | None:
    """DriverApi when libcuda loads with the checkpoint API, else the cuda-checkpoint binary, else None."""
    try:
        return DriverApi(b.load_libcuda(libname))
    except GpuError as exc:
        log.info("CUDA driver API unusable (%s); trying %s", exc, binary)
    return CudaCheckpointCli.find(binary, runner)
