"""CUDA state of checkpointed jobs, through NVIDIA's driver checkpoint API (driver >= 570).

Decision: memsnap drives the CUDA checkpoint API itself and keeps CRIU's CUDA plugin out.
CRIU 4.x ships plugins/cuda (cuda_plugin.so), which runs `cuda-checkpoint` (recent versions may
call libcuda) from CRIU's PAUSE_DEVICES / CHECKPOINT_DEVICES / RESUME_DEVICES_LATE hooks.
We do not use it, because:
  * the lock timeout and the guarantee that a job is never left locked must be ours: we lock
    every CUDA process with a timeout, then checkpoint them, and restore + unlock everything
    done so far when any step fails, before CRIU even starts; the plugin ties its lock to
    CRIU's --timeout and, by its own README, may leave GPU state locked after a fatal error;
  * GPU UUID remapping on restore (driver >= 580) is a per-request option (--gpu-map);
  * preflight (driver version, MIG, MPS, declared UVM/IPC use, NVML-only or forked holders of
    /dev/nvidia*) refuses with one line that says what to do, before anything is touched,
    instead of a failure deep in a CRIU log;
  * the manifest records the CUDA processes, their GPUs, device bytes and ns pids;
  * the CRIU we ship (scripts/install-criu.sh builds `make criu` only) needs neither the plugin
    nor `cuda-checkpoint` on PATH.
Dump: hook.describe -> hook.suspend (preflight, lock, checkpoint: device memory is now plain
host memory of the process and its /dev/nvidia* references are gone) -> plain CRIU dump ->
release() when the dump ended the tree, else resume(). Restore: plain CRIU restore, not
leave-stopped (the CUDA restore thread must run) -> hook.restore finds the tree's CHECKPOINTED
processes -> restore (with remap pairs) then unlock.
The plugin must stay out: at restore it would restore + unlock those processes itself (without
our remap), and a dump with it records it in the image inventory, so a restore without it is
refused. CRIU loads every *.so in its libdir (default /usr/lib/criu): run `criu swrk` with
CRIU_LIBS_DIR set to an empty directory (criuenv.criu_env()), or `--libdir EMPTY_DIR` on the
command line, or a `libdir` line in an RPC config_file.
Note: cuDriverGetVersion returns the CUDA API version (12080 on r570, 13000 on r580), not the
display driver version; detect.gpu_info() reports the driver branch (580) for preflight.
"""

from memsnap.gpu.base import GpuDriver, GpuPairs, ProcessState
from memsnap.gpu.checkpointer import GpuCheckpointer, GpuSuspension
from memsnap.gpu.cli import CudaCheckpointCli
from memsnap.gpu.criuenv import criu_env, plugin_free_libdir
from memsnap.gpu.detect import CudaProcess, device_bytes, find_cuda_processes, gpu_info, map_ns_pids
from memsnap.gpu.driver import DriverApi, load_driver
from memsnap.gpu.errors import GpuError, GpuPreflightError, GpuUnavailable
from memsnap.gpu.hook import NvidiaGpuHook, load_hook
from memsnap.gpu.preflight import GpuFacts, check, facts_from_info

__all__ = [
    "CudaCheckpointCli",
    "CudaProcess",
    "DriverApi",
    "GpuCheckpointer",
    "GpuDriver",
    "GpuError",
    "GpuFacts",
    "GpuPairs",
    "GpuPreflightError",
    "GpuSuspension",
    "GpuUnavailable",
    "NvidiaGpuHook",
    "ProcessState",
    "check",
    "criu_env",
    "device_bytes",
    "facts_from_info",
    "find_cuda_processes",
    "gpu_info",
    "load_driver",
    "load_hook",
    "map_ns_pids",
    "plugin_free_libdir",
]
