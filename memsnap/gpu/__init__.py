"""CUDA state of checkpointed jobs, through NVIDIA's driver checkpoint API (driver >= 570).

Decision: memsnap drives the CUDA checkpoint API itself and keeps CRIU's CUDA plugin out.
CRIU 4.x ships plugins/cuda (cuda_plugin.so). It never calls libcuda: it execs `cuda-checkpoint`
from PATH (and disables itself when that is missing or lacks --action) from CRIU's PAUSE_DEVICES,
CHECKPOINT_DEVICES and RESUME_DEVICES_LATE hooks. We do not use it, because:
  * the lock timeout and the guarantee that a job is never left locked must be ours: we lock
    every CUDA process with a timeout, then checkpoint them, and restore + unlock everything
    done so far when any step fails, before CRIU even starts; the pids are journaled in the
    catalog first, so a daemon killed in between is undone at restart (recovery.recover_pids);
    the plugin ties its lock to CRIU's --timeout and keeps its pid list in CRIU's memory only;
  * GPU UUID remapping on restore (driver >= 580) needs the full list of checkpointed GPUs
    (remap.py); the plugin's RESUME_DEVICES_LATE restores with no device map at all;
  * preflight (driver version, MIG, MPS, declared UVM/IPC use, NVML-only or forked holders of
    /dev/nvidia*) refuses with one line that says what to do, before anything is touched,
    instead of a failure deep in a CRIU log;
  * the manifest records the CUDA processes, every GPU each one enumerates, device bytes and ns pids;
  * the CRIU we ship (scripts/install-criu.sh builds `make criu` only) needs neither the plugin
    nor `cuda-checkpoint` on PATH.
Dump: adapter.describe -> adapter.suspend (preflight, journal, lock, checkpoint: device memory is now
plain host memory of the process and its /dev/nvidia* references are gone) -> plain CRIU dump ->
release() when the dump ended the tree, else resume(). Restore: plain CRIU restore, not
leave-stopped (the CUDA restore thread must run) -> adapter.restore finds the tree's CHECKPOINTED
processes -> checks the GPU map against this node -> restore (with complete pairs) then unlock.
Why the plugin must stay out (as read in CRIU 4.1's plugins/cuda/cuda_plugin.c): at dump, its
PAUSE_DEVICES leaves a process it finds already CHECKPOINTED alone but adds itself to the image
inventory; a restore of such an image then requires the plugin (and `cuda-checkpoint`), and its
RESUME_DEVICES_LATE restores + unlocks every process with a restore thread itself, without our
GPU map, before memsnap gets to it. CRIU loads every *.so in its libdir (default /usr/lib/criu):
memsnap.criu runs `criu swrk` with CRIU_LIBS_DIR set to an empty directory that
criuenv.plugin_free_libdir creates and checks (ours, writable by nobody else, no .so in it).

PID namespaces and /proc (the `memsnapctl run` case). Decision: on a node with an NVIDIA GPU, run
jobs get their own /proc (`memsnapctl run --own-proc`, the default there): a mount namespace with a
fresh procfs, which memsnap.criu dumps and restores (external host mounts, root "/"). Measured on an
H200 with r580 (tests/gpu, first device run): under `unshare --pid --fork` with the host's /proc,
CUDA does not even initialise (cudaErrorOperatingSystem); with `--mount-proc` it does, and the driver
round trip keeps device memory. The background:
  * The caller side is consistent: memsnapd calls cuCheckpointProcess*(pid) with host pids, from
    the host pid namespace, with the host /proc. NVIDIA's own CRIU integration works this way for
    containers (NVIDIA in checkpoint-restore/criu#2416: CRIU and cuda-checkpoint run outside the
    container, they need not enter its namespaces), and cuda-checkpoint "uses /proc to establish an
    IPC channel with the CUDA process" (NVIDIA in NVIDIA/cuda-checkpoint#41): the caller's /proc,
    addressed by the caller's pid, which is what we give it.
  * The target side is what failed: libcuda inside a job calls getpid() and then looks at
    /proc/<that pid> (strace in NVIDIA/cuda-checkpoint#10: getpid() = N, stat("/proc/N/ns/pid")).
    In a run job getpid() is the namespace pid (1 for the job's init) while /proc is the host's, so
    /proc/1 is the host's init. A container has its own /proc, so NVIDIA's tested setup never meets
    this. No NVIDIA document says what the driver uses it for.
  * tests/gpu keeps checking it on the device: the bit-identical training run as a `memsnapctl run`
    job (own pid and mount namespace) and as an adopted pid (host namespace), and a driver-only
    lock/checkpoint/restore/unlock under `unshare --pid --fork` with the host /proc (an expected
    failure) and with `--mount-proc`. Results: bench/results/gpu.json and README.
Note: cuDriverGetVersion returns the CUDA API version (12080 on r570, 13000 on r580), not the
display driver version; detect.gpu_info() reports the driver branch (580) for preflight.
"""

from memsnap.gpu.adapter import NvidiaGpuAdapter, load_adapter
from memsnap.gpu.base import GpuDriver, GpuPairs, ProcessState
from memsnap.gpu.checkpointer import GpuCheckpointer, GpuSuspension
from memsnap.gpu.criuenv import criu_env, plugin_free_libdir
from memsnap.gpu.detect import CudaProcess, device_bytes, find_cuda_processes, gpu_info, map_ns_pids
from memsnap.gpu.driver import DriverApi, load_driver
from memsnap.gpu.errors import GpuError, GpuPreflightError, GpuUnavailable
from memsnap.gpu.preflight import GpuFacts, check, facts_from_info
from memsnap.gpu.recovery import recover_pids, settle
from memsnap.gpu.remap import restore_pairs, visible_gpus
from memsnap.gpu.tool import CudaCheckpointCli

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
    "NvidiaGpuAdapter",
    "ProcessState",
    "check",
    "criu_env",
    "device_bytes",
    "facts_from_info",
    "find_cuda_processes",
    "gpu_info",
    "load_driver",
    "load_adapter",
    "map_ns_pids",
    "plugin_free_libdir",
    "recover_pids",
    "restore_pairs",
    "settle",
    "visible_gpus",
]
