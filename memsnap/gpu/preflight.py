"""Pure go/no-go decisions for checkpointing a CUDA job; each refusal is one line that says what to do."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from memsnap.gpu.errors import GpuPreflightError

MIN_CHECKPOINT_DRIVER = 570  # cuCheckpointProcess* and `cuda-checkpoint --action`
MIN_REMAP_DRIVER = 580  # CUcheckpointRestoreArgs.gpuPairs (CUDA 13.0)
# CUDA IPC memory: NVIDIA is quoted as supporting it from 610 only for processes started under
# `cuda-checkpoint --launch-job`, which memsnap does not do; until that is confirmed, IPC is refused.
MIN_IPC_DRIVER = 610
MIN_CHECKPOINT_CUDA_API = 12080  # cuDriverGetVersion of r570
MIN_REMAP_CUDA_API = 13000  # cuDriverGetVersion of r580


@dataclass(frozen=True)
class GpuFacts:
    """What preflight needs to know; driver_branch is the display driver major (580 for 580.65.06).

    cuda_api_version is cuDriverGetVersion's value (12080, 13000): a CUDA version, not the driver's.
    uvm_managed and ipc_memory are declared by the job: they cannot be observed from outside.
    untracked_pids hold /dev/nvidia* without CUDA state (NVML users), which CRIU cannot dump;
    untracked_reasons (same order) is what the driver answered for each (its CUresult name and text).
    """

    driver_branch: int | None
    cuda_api_version: int | None = None
    mig_enabled: bool = False
    mps_running: bool = False
    uvm_managed: bool = False
    ipc_memory: bool = False
    remap_requested: bool = False
    untracked_pids: tuple[int, ...] = ()
    untracked_reasons: tuple[str, ...] = ()


def _driver_problem(f: GpuFacts) -> str | None:
    """Refusal for a missing or too old driver, or None."""
    if f.driver_branch is None and f.cuda_api_version is None:
        return (
            "cannot determine the NVIDIA driver version: check that the nvidia kernel module is loaded "
            "(/proc/driver/nvidia/version) and nvidia-smi works"
        )
    if f.driver_branch is not None and f.driver_branch < MIN_CHECKPOINT_DRIVER:
        return (
            f"NVIDIA driver {f.driver_branch} has no CUDA checkpoint API: upgrade the driver to "
            f">= {MIN_CHECKPOINT_DRIVER}"
        )
    if f.cuda_api_version is not None and f.cuda_api_version < MIN_CHECKPOINT_CUDA_API:
        return (
            f"libcuda reports CUDA {f.cuda_api_version}, which has no checkpoint API: upgrade the NVIDIA "
            f"driver to >= {MIN_CHECKPOINT_DRIVER}"
        )
    return None


def _feature_problem(f: GpuFacts) -> str | None:
    """Refusal for a GPU feature the checkpoint API does not support, or None."""
    if f.mig_enabled:
        return (
            "a GPU of this job is in MIG mode, which CUDA checkpoint does not support: run the job on a "
            "GPU with MIG disabled (nvidia-smi -i N -mig 0)"
        )
    if f.mps_running:
        return (
            "the CUDA MPS daemon is running, which CUDA checkpoint does not support: stop it "
            "(echo quit | nvidia-cuda-mps-control) and restart the job without MPS"
        )
    if f.uvm_managed:
        return (
            "the job uses CUDA managed (UVM) memory, which CUDA checkpoint does not support: "
            "allocate with cudaMalloc instead of cudaMallocManaged, or checkpoint at the application level"
        )
    if f.ipc_memory:
        found = "an unknown driver" if f.driver_branch is None else f"driver {f.driver_branch}"
        return (
            f"the job shares GPU memory over CUDA IPC, which memsnap cannot checkpoint ({found} here; "
            f"NVIDIA supports it from driver {MIN_IPC_DRIVER} only for jobs started under "
            "`cuda-checkpoint --launch-job`, which memsnap does not do yet): stop sharing CUDA memory "
            "between processes"
        )
    return None


def _remap_problem(f: GpuFacts) -> str | None:
    """Refusal for a GPU UUID remap the driver cannot do, or None."""
    if not f.remap_requested:
        return None
    too_old = (f.driver_branch is not None and f.driver_branch < MIN_REMAP_DRIVER) or (
        f.cuda_api_version is not None and f.cuda_api_version < MIN_REMAP_CUDA_API
    )
    if too_old or f.driver_branch is None and f.cuda_api_version is None:
        found = f.driver_branch if f.driver_branch is not None else f"CUDA {f.cuda_api_version}"
        return (
            f"restoring onto different GPUs needs NVIDIA driver >= {MIN_REMAP_DRIVER} (found {found}): "
            "upgrade the driver or restore onto the GPUs the job was checkpointed on"
        )
    return None


def check(facts: GpuFacts) -> None:
    """None when the job can be checkpointed or restored; GpuPreflightError saying what to do otherwise."""
    problem = _driver_problem(facts) or _feature_problem(facts) or _remap_problem(facts)
    if problem is None and facts.untracked_pids:
        why = list(facts.untracked_reasons) + [""] * len(facts.untracked_pids)
        pids = ", ".join(f"{p} ({w})" if w else str(p) for p, w in zip(facts.untracked_pids, why, strict=False))
        problem = (
            f"pid {pids} holds /dev/nvidia* but the driver has no CUDA state for it (an NVML user, or a "
            "child forked from a CUDA process without exec), which CRIU cannot dump: let it exit, keep it "
            "out of the job's tree, or start such children with the 'spawn' method"
        )
    if problem is not None:
        raise GpuPreflightError(problem)


def facts_from_info(
    info: dict[str, Any],
    *,
    gpu_uuids: Iterable[str] | None = None,
    cuda_api_version: int | None = None,
    uvm_managed: bool = False,
    ipc_memory: bool = False,
    remap_requested: bool = False,
    untracked_pids: Iterable[int] = (),
) -> GpuFacts:
    """GpuFacts from detect.gpu_info(); MIG counts only on the job's GPUs when gpu_uuids is given."""
    wanted = None if gpu_uuids is None else set(gpu_uuids)
    gpus = [g for g in info.get("gpus", []) if wanted is None or g.get("uuid") in wanted]
    return GpuFacts(
        driver_branch=info.get("driver_branch"),
        cuda_api_version=cuda_api_version or None,
        mig_enabled=any(str(g.get("mig_mode", "")).lower() == "enabled" for g in gpus),
        mps_running=bool(info.get("mps_running")),
        uvm_managed=uvm_managed,
        ipc_memory=ipc_memory,
        remap_requested=remap_requested,
        untracked_pids=tuple(untracked_pids),
    )
