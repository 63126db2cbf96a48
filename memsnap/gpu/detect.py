"""Finding the CUDA processes of a job's process tree, and the GPU facts for the manifest and preflight.

A process counts as a GPU user when one of its fds points at /dev/nvidia*. `uses_uvm` only says that
/dev/nvidia-uvm is open: every CUDA process opens it (the driver reserves its address space through
it), so managed memory (cudaMallocManaged) cannot be told apart from ordinary device memory from the
outside, and /proc/<pid>/maps does not help either. memsnap therefore never refuses on the fd alone:
managed memory and CUDA IPC are facts the job declares (preflight refuses them), and anything
undeclared is caught by the driver, whose checkpoint then fails and is rolled back. A process with
/dev/nvidiactl or /dev/nvidiaN open but no CUDA state (an NVML user such as nvidia-smi) cannot be
checkpointed at all; GpuCheckpointer.probe() tells those apart.

Pids here are as seen from memsnapd's /proc (host pids). CRIU keeps pids inside the job's pid
namespace, but a restored tree gets new host pids: record ns_pid at dump and use map_ns_pids() after
restore.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memsnap.gpu.runner import Runner, run_subprocess

PROC = "/proc"
NVIDIA_DEV = "/dev/nvidia"
UVM_DEV = "/dev/nvidia-uvm"
_MIB = 1 << 20
_SMI_TIMEOUT_S = 20.0
_GPU_FIELDS = "index,uuid,name,driver_version,memory.total,memory.used,mig.mode.current,persistence_mode"
_APP_FIELDS = "pid,used_memory,gpu_uuid"
_VERSION = re.compile(r"\b(\d{3,})\.(\d+)(?:\.(\d+))?\b")


@dataclass(frozen=True)
class CudaProcess:
    """One process of the tree with NVIDIA device files open."""

    pid: int
    ns_pid: int
    devices: tuple[str, ...]
    uses_uvm: bool


def _children(pid: int, proc_root: str) -> list[int] | None:
    """Children from /proc/<pid>/task/*/children; None when the kernel lacks that file."""
    task_dir = Path(proc_root, str(pid), "task")
    try:
        tids = sorted(os.listdir(task_dir), key=lambda t: int(t) if t.isdigit() else 0)
    except OSError:
        return []
    kids: list[int] = []
    seen_file = False
    for tid in tids:
        try:
            text = (task_dir / tid / "children").read_text()
        except OSError:
            continue
        seen_file = True
        kids.extend(int(x) for x in text.split())
    return kids if seen_file else None


def _ppid_map(proc_root: str) -> dict[int, list[int]]:
    """Parent -> children from every /proc/<pid>/stat (fallback for kernels without children files)."""
    out: dict[int, list[int]] = {}
    for name in os.listdir(proc_root):
        if not name.isdigit():
            continue
        try:
            stat = Path(proc_root, name, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1:
            out.setdefault(int(fields[1]), []).append(int(name))
    return out


def descendants(root: int, proc_root: str = PROC) -> list[int]:
    """root and every process below it, breadth first."""
    order, queue, seen = [root], [root], {root}
    ppids: dict[int, list[int]] | None = None
    while queue:
        pid = queue.pop(0)
        kids = _children(pid, proc_root)
        if kids is None:
            ppids = ppids if ppids is not None else _ppid_map(proc_root)
            kids = ppids.get(pid, [])
        for kid in kids:
            if kid not in seen:
                seen.add(kid)
                order.append(kid)
                queue.append(kid)
    return order


def nvidia_devices(pid: int, proc_root: str = PROC) -> tuple[str, ...]:
    """Sorted /dev/nvidia* paths that pid's fds point at."""
    fd_dir = Path(proc_root, str(pid), "fd")
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return ()
    found: set[str] = set()
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        if target.startswith(NVIDIA_DEV):
            found.add(target)
    return tuple(sorted(found))


def ns_pid(pid: int, proc_root: str = PROC) -> int:
    """pid as seen inside its own (innermost) pid namespace, from NSpid in /proc/<pid>/status."""
    try:
        for line in Path(proc_root, str(pid), "status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return pid


def find_cuda_processes(root: int, proc_root: str = PROC) -> list[CudaProcess]:
    """Processes of root's tree (root included) with /dev/nvidia* open, in tree order."""
    out: list[CudaProcess] = []
    for pid in descendants(root, proc_root):
        devices = nvidia_devices(pid, proc_root)
        if devices:
            out.append(CudaProcess(pid, ns_pid(pid, proc_root), devices, UVM_DEV in devices))
    return out


def map_ns_pids(root: int, ns_pids: Iterable[int], proc_root: str = PROC) -> dict[int, int]:
    """Namespace pid -> host pid for the given ns pids within root's (restored) tree."""
    wanted = set(ns_pids)
    out: dict[int, int] = {}
    for pid in descendants(root, proc_root):
        inner = ns_pid(pid, proc_root)
        if inner in wanted:
            out[inner] = pid
    return out


def declared(pid: int, name: str, proc_root: str = PROC) -> bool:
    """Whether pid was started with NAME=1 in its environment (how a job declares UVM or IPC use)."""
    try:
        env = Path(proc_root, str(pid), "environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{name}=1".encode() in env


def mps_running(proc_root: str = PROC) -> bool:
    """True when an MPS control daemon or server runs (comm 'nvidia-cuda-mps', truncated to 15)."""
    try:
        names = os.listdir(proc_root)
    except OSError:
        return False
    for name in names:
        if name.isdigit():
            try:
                if Path(proc_root, name, "comm").read_text().startswith("nvidia-cuda-mps"):
                    return True
            except OSError:
                continue
    return False


def driver_branch(version: str) -> int:
    """Display driver major from '580.65.06' or the /proc/driver/nvidia/version text: 580."""
    m = _VERSION.search(version)
    if m is None:
        raise ValueError(f"no NVIDIA driver version in {version!r}")
    return int(m.group(1))


def kernel_driver_version(proc_root: str = PROC) -> str | None:
    """'580.65.06' from the loaded nvidia kernel module, None when it is not loaded."""
    try:
        text = Path(proc_root, "driver", "nvidia", "version").read_text()
    except OSError:
        return None
    m = _VERSION.search(text)
    return m.group(0) if m else None


def _mib(value: str) -> int | None:
    """'81559' (MiB, as --format=...,nounits prints it) to bytes; None for [N/A] and friends."""
    try:
        return int(float(value)) * _MIB
    except ValueError:
        return None


def _smi(runner: Runner, query: str, fields: str) -> list[list[str]] | None:
    """Rows of `nvidia-smi --query-X=fields --format=csv,noheader,nounits`; None when it fails."""
    rc, out = runner(
        ["nvidia-smi", f"--query-{query}={fields}", "--format=csv,noheader,nounits"], _SMI_TIMEOUT_S
    )
    if rc != 0:
        return None
    rows = csv.reader(out.splitlines(), skipinitialspace=True)
    return [[c.strip() for c in row] for row in rows if row]


def _gpu_rows(rows: list[list[str]]) -> list[dict[str, Any]]:
    """One dict per GPU row of the --query-gpu output."""
    gpus: list[dict[str, Any]] = []
    for r in rows:
        if len(r) < 8:
            continue
        gpus.append(
            {
                "index": int(r[0]) if r[0].isdigit() else r[0],
                "uuid": r[1],
                "name": r[2],
                "driver_version": r[3],
                "memory_total_bytes": _mib(r[4]),
                "memory_used_bytes": _mib(r[5]),
                "mig_mode": r[6],
                "persistence_mode": r[7],
            }
        )
    return gpus


def gpu_info(
    pids: Iterable[int] | None = None, runner: Runner = run_subprocess, proc_root: str = PROC
) -> dict[str, Any]:
    """Driver, GPUs and per-process device memory for the manifest; {} when the host has no NVIDIA GPU."""
    rows = _smi(runner, "gpu", _GPU_FIELDS)
    gpus = _gpu_rows(rows or [])
    version = gpus[0]["driver_version"] if gpus else kernel_driver_version(proc_root)
    if not gpus and version is None:
        return {}
    wanted = None if pids is None else set(pids)
    procs: list[dict[str, Any]] = []
    for r in _smi(runner, "compute-apps", _APP_FIELDS) or []:
        if len(r) >= 3 and r[0].isdigit() and (wanted is None or int(r[0]) in wanted):
            procs.append({"pid": int(r[0]), "used_bytes": _mib(r[1]), "gpu_uuid": r[2]})
    info: dict[str, Any] = {"driver_version": version, "gpus": gpus, "processes": procs}
    try:
        info["driver_branch"] = driver_branch(version) if version else None
    except ValueError:
        info["driver_branch"] = None
    info["mps_running"] = mps_running(proc_root)
    return info


def device_bytes(info: dict[str, Any]) -> dict[int, int]:
    """pid -> device bytes in use, summed over GPUs, from gpu_info()'s processes."""
    out: dict[int, int] = {}
    for p in info.get("processes", []):
        if p.get("used_bytes") is not None:
            out[p["pid"]] = out.get(p["pid"], 0) + p["used_bytes"]
    return out
