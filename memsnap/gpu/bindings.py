"""ctypes bindings for the CUDA driver checkpoint API in libcuda.so.1 (layouts as declared in cuda.h)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Protocol, cast

from memsnap.gpu.errors import GpuError, GpuUnavailable

LIBCUDA = "libcuda.so.1"
CUDA_SUCCESS = 0
ARGS_SIZE = 64
UUID_SIZE = 16
# cuDriverGetVersion value of CUDA 13.0 (driver r580): the first with gpuPairs in the restore args.
CUDA_REMAP_API = 13000


class CUuuid(ctypes.Structure):
    """CUuuid: 16 raw bytes (c_ubyte, so NULs survive)."""

    _fields_ = [("bytes", ctypes.c_ubyte * UUID_SIZE)]


class CUcheckpointLockArgs(ctypes.Structure):
    """Lock args: timeoutMs (0 = wait forever), then reserved words; 64 bytes."""

    _fields_ = [
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class CUcheckpointCheckpointArgs(ctypes.Structure):
    """Checkpoint args: 64 reserved bytes."""

    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class CUcheckpointGpuPair(ctypes.Structure):
    """One GPU remapping: the UUID at checkpoint time and the UUID to restore onto."""

    _fields_ = [("oldUuid", CUuuid), ("newUuid", CUuuid)]


class CUcheckpointRestoreArgs(ctypes.Structure):
    """Restore args (CUDA 13): gpuPairs, gpuPairsCount, reserved[52 - sizeof(ptr)], reserved1; 64 bytes."""

    _fields_ = [
        ("gpuPairs", ctypes.POINTER(CUcheckpointGpuPair)),
        ("gpuPairsCount", ctypes.c_uint),
        ("reserved", ctypes.c_ubyte * (52 - ctypes.sizeof(ctypes.c_void_p))),
        ("reserved1", ctypes.c_uint64),
    ]


class CUcheckpointUnlockArgs(ctypes.Structure):
    """Unlock args: 64 reserved bytes."""

    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class CudaLibrary(Protocol):
    """The libcuda entry points memsnap calls; each returns a CUresult."""

    def cuInit(self, flags: int, /) -> int: ...
    def cuDriverGetVersion(self, version: object, /) -> int: ...
    def cuGetErrorName(self, result: int, text: object, /) -> int: ...
    def cuGetErrorString(self, result: int, text: object, /) -> int: ...
    def cuCheckpointProcessLock(self, pid: int, args: object, /) -> int: ...
    def cuCheckpointProcessCheckpoint(self, pid: int, args: object, /) -> int: ...
    def cuCheckpointProcessRestore(self, pid: int, args: object, /) -> int: ...
    def cuCheckpointProcessUnlock(self, pid: int, args: object, /) -> int: ...
    def cuCheckpointProcessGetState(self, pid: int, state: object, /) -> int: ...
    def cuCheckpointProcessGetRestoreThreadId(self, pid: int, tid: object, /) -> int: ...


_P_INT = ctypes.POINTER(ctypes.c_int)
_P_STR = ctypes.POINTER(ctypes.c_char_p)
_SIGNATURES: dict[str, list[type]] = {
    "cuInit": [ctypes.c_uint],
    "cuDriverGetVersion": [_P_INT],
    "cuGetErrorName": [ctypes.c_int, _P_STR],
    "cuGetErrorString": [ctypes.c_int, _P_STR],
    "cuCheckpointProcessLock": [ctypes.c_int, ctypes.POINTER(CUcheckpointLockArgs)],
    "cuCheckpointProcessCheckpoint": [ctypes.c_int, ctypes.POINTER(CUcheckpointCheckpointArgs)],
    "cuCheckpointProcessRestore": [ctypes.c_int, ctypes.POINTER(CUcheckpointRestoreArgs)],
    "cuCheckpointProcessUnlock": [ctypes.c_int, ctypes.POINTER(CUcheckpointUnlockArgs)],
    "cuCheckpointProcessGetState": [ctypes.c_int, _P_INT],
    "cuCheckpointProcessGetRestoreThreadId": [ctypes.c_int, _P_INT],
}


def load_libcuda(name: str = LIBCUDA) -> CudaLibrary:
    """dlopen libcuda and type every symbol; GpuUnavailable if it or a checkpoint symbol is missing."""
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        raise GpuUnavailable("dlopen", f"{name}: {exc}") from exc
    for symbol, argtypes in _SIGNATURES.items():
        try:
            fn = getattr(lib, symbol)
        except AttributeError as exc:
            raise GpuUnavailable(
                "dlsym", f"{name} has no {symbol}: the NVIDIA driver is older than 570"
            ) from exc
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return cast(CudaLibrary, lib)


def _error_text(fn: Callable[[int, object], int], result: int) -> str | None:
    """Call cuGetErrorName/cuGetErrorString; None when the driver does not know the code."""
    out = ctypes.c_char_p()
    if fn(result, ctypes.pointer(out)) != CUDA_SUCCESS or not out.value:
        return None
    return out.value.decode(errors="replace")


def describe(lib: CudaLibrary, result: int) -> tuple[str, str]:
    """(CUDA_ERROR_NAME, driver's description) of a CUresult."""
    name = _error_text(lib.cuGetErrorName, result) or f"CUresult {result}"
    text = _error_text(lib.cuGetErrorString, result) or "unknown CUDA error"
    return name, text


def check(lib: CudaLibrary, result: int, op: str, pid: int | None = None) -> None:
    """Raise GpuError with the driver's error name and text unless result is CUDA_SUCCESS."""
    if result != CUDA_SUCCESS:
        name, text = describe(lib, result)
        raise GpuError(op, text, pid=pid, result=result, name=name)


def uuid_bytes(text: str) -> bytes:
    """'GPU-xxxxxxxx-xxxx-...' (as nvidia-smi prints it) to the 16 raw bytes of a CUuuid."""
    s = text.strip()
    if s[:4].upper() == "GPU-":
        s = s[4:]
    try:
        raw = bytes.fromhex(s.replace("-", ""))
    except ValueError:
        raw = b""
    if len(raw) != UUID_SIZE:
        raise ValueError(f"not a GPU UUID: {text!r} (expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
    return raw


def gpu_pair_array(pairs: Sequence[tuple[str, str]]) -> ctypes.Array[CUcheckpointGpuPair]:
    """A C array of CUcheckpointGpuPair from (old UUID, new UUID) strings."""
    arr = (CUcheckpointGpuPair * len(pairs))()
    for i, (old, new) in enumerate(pairs):
        arr[i].oldUuid = CUuuid.from_buffer_copy(uuid_bytes(old))
        arr[i].newUuid = CUuuid.from_buffer_copy(uuid_bytes(new))
    return arr
