"""The engine's GpuAdapter: describe, preflight + suspend, and restore the CUDA processes of a tree.

A job declares what cannot be observed from outside through its environment: MEMSNAP_GPU_MANAGED=1
(it uses CUDA managed/UVM memory) and MEMSNAP_GPU_IPC=1 (it shares device memory over CUDA IPC).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

from memsnap import proc
from memsnap.gpu import detect, preflight, remap
from memsnap.gpu.base import GpuDriver
from memsnap.gpu.checkpointer import GpuCheckpointer, GpuSuspension, Journal
from memsnap.gpu.driver import load_driver
from memsnap.gpu.errors import GpuError, GpuUnavailable
from memsnap.gpu.recovery import recover_pids
from memsnap.gpu.runner import Runner, run_subprocess

log = logging.getLogger(__name__)

MANAGED_ENV = "MEMSNAP_GPU_MANAGED"
IPC_ENV = "MEMSNAP_GPU_IPC"
_CACHE_S = 10.0


class NvidiaGpuAdapter:
    """GpuAdapter for memsnap.engine; loads the driver (cuInit) only when a CUDA job is first seen."""

    def __init__(
        self,
        driver_loader: Callable[[], GpuDriver | None] = load_driver,
        runner: Runner = run_subprocess,
        proc_root: str = detect.PROC,
        alive: Callable[[int, float], bool] = proc.alive,
    ) -> None:
        self._loader = driver_loader
        self._alive = alive
        self._runner = runner
        self._proc = proc_root
        self._lock = threading.Lock()
        self._ckpt: GpuCheckpointer | None = None
        self._cache: tuple[int, float, list[detect.CudaProcess], dict[str, Any]] | None = None

    def checkpointer(self) -> GpuCheckpointer:
        """The GpuCheckpointer over the driver, loaded on first use; GpuUnavailable when there is none."""
        with self._lock:
            if self._ckpt is None:
                driver = self._loader()
                if driver is None:
                    raise GpuUnavailable(
                        "load",
                        "neither libcuda.so.1 with the checkpoint API nor cuda-checkpoint (with --action) "
                        "is usable: install NVIDIA driver >= 570",
                    )
                log.info("CUDA checkpoint backend: %s", driver.name)
                self._ckpt = GpuCheckpointer(driver)
            return self._ckpt

    def _scan(self, root_pid: int, fresh: bool) -> tuple[list[detect.CudaProcess], dict[str, Any]]:
        """CUDA processes of the tree and gpu_info for them, reusing describe()'s scan for a few seconds."""
        c = self._cache
        if not fresh and c is not None and c[0] == root_pid and time.monotonic() - c[1] < _CACHE_S:
            return c[2], c[3]
        procs = detect.find_cuda_processes(root_pid, self._proc)
        info = detect.gpu_info([p.pid for p in procs], self._runner, self._proc) if procs else {}
        self._cache = (root_pid, time.monotonic(), procs, info)
        return procs, info

    def describe(self, root_pid: int) -> list[dict[str, Any]]:
        """Per CUDA process of the tree: pid, ns pid, device files, GPUs (uuid, model, bytes), driver."""
        procs, info = self._scan(root_pid, fresh=True)
        node_gpus = info.get("gpus", [])
        models = {g["uuid"]: g["name"] for g in node_gpus}
        out: list[dict[str, Any]] = []
        for p in procs:
            apps = [a for a in info.get("processes", []) if a["pid"] == p.pid]
            gpus = [
                {"uuid": a["gpu_uuid"], "model": models.get(a["gpu_uuid"]), "bytes": a["used_bytes"]}
                for a in apps
            ]
            out.append(
                {
                    "pid": p.pid,
                    "ns_pid": p.ns_pid,
                    "devices": list(p.devices),
                    "uses_uvm_fd": p.uses_uvm,
                    "gpus": gpus,
                    # Every GPU its driver enumerates: what a remapping restore must list (memsnap.gpu.remap).
                    "visible_gpus": remap.visible_gpus(p.pid, node_gpus, self._proc),
                    "device_bytes": sum(g["bytes"] or 0 for g in gpus),
                    "driver_version": info.get("driver_version"),
                }
            )
        return out

    def device_bytes(self, root_pid: int) -> int:
        """Device memory in use by the tree's CUDA processes (nvidia-smi, i.e. NVML), 0 when it reports none;
        the scan is reused by describe() and suspend() for a few seconds."""
        procs, info = self._scan(root_pid, fresh=False)
        return sum(detect.device_bytes(info).values()) if procs else 0

    def suspend(self, root_pid: int, timeout_ms: int, journal: Journal | None = None) -> GpuSuspension:
        """Preflight, then lock + checkpoint every process of the tree that holds CUDA state.

        journal gets the pids before the first lock (and None once they are settled): the engine keeps
        it in the catalog so that recover() can unlock them if the daemon dies in between.
        """
        procs, info = self._scan(root_pid, fresh=False)
        pids = [p.pid for p in procs]
        uuids = {a["gpu_uuid"] for a in info.get("processes", [])}
        facts = preflight.facts_from_info(
            info,
            gpu_uuids=uuids or None,
            uvm_managed=any(detect.declared(p, MANAGED_ENV, self._proc) for p in pids),
            ipc_memory=any(detect.declared(p, IPC_ENV, self._proc) for p in pids),
        )
        preflight.check(facts)  # before cuInit: a too-old driver gets the clear message
        ckpt = self.checkpointer()
        cuda, other = ckpt.probe(pids)
        version = ckpt.driver.driver_version() or None
        preflight.check(
            dataclasses.replace(
                facts,
                cuda_api_version=version,
                untracked_pids=tuple(other),
                untracked_reasons=tuple(other.values()),
            )
        )
        starts: dict[int, float] = {}
        for pid in cuda:
            try:
                starts[pid] = proc.start_time(pid)
            except Exception:  # gone already: the lock will say so
                starts[pid] = 0.0
        return ckpt.suspend(cuda, timeout_ms, detect.device_bytes(info), journal=journal, starts=starts)

    def restore(
        self, root_pid: int, gpu_map: dict[str, str] | None, checkpointed: list[dict[str, Any]] | None = None
    ) -> dict[str, float]:
        """After CRIU restored the tree: restore (remapped by gpu_map) and unlock its checkpointed CUDA pids; the
        wall time of each stage (all pids in parallel).

        checkpointed is the manifest's "gpus" (describe() at dump time): the GPUs each process had,
        so that a remap lists every one of them and a missing GPU is refused before the driver is called.
        """
        ckpt = self.checkpointer()
        cuda = ckpt.checkpointed(detect.descendants(root_pid, self._proc))
        if not cuda:
            log.warning("restored tree %d has no checkpointed CUDA process; nothing to restore", root_pid)
            return {}
        had = remap.checkpointed_gpus(checkpointed or [])
        if not had and gpu_map:  # a manifest without GPU records: the map is all we know
            had = {0: [{"uuid": old} for old in gpu_map]}
        info = detect.gpu_info(None, self._runner, self._proc) if (had or gpu_map) else {}
        by_ns = remap.restore_pairs(had, gpu_map, info.get("gpus", [])) if had else {}
        version = ckpt.driver.driver_version() or None
        if by_ns or version is not None:
            # Only what would make the driver fail: the tree is already restored, MIG/MPS were checked at dump.
            facts = preflight.GpuFacts(info.get("driver_branch"), remap_requested=bool(by_ns))
            preflight.check(dataclasses.replace(facts, cuda_api_version=version))
        pairs: dict[int, list[tuple[str, str]]] = {}
        if by_ns:
            host_of = detect.map_ns_pids(root_pid, by_ns, self._proc)
            every = sorted({p for ps in by_ns.values() for p in ps})
            pairs = {pid: every for pid in cuda}
            pairs.update({host_of[ns]: ps for ns, ps in by_ns.items() if ns in host_of})
        seconds = ckpt.restore(cuda, pairs)
        log.info("CUDA state of pids %s restored in %.3f s", cuda, sum(seconds.values()))
        return seconds

    def recover(self, entry: dict[str, Any]) -> dict[int, str]:
        """Restore + unlock the journaled pids (GpuCheckpointer.suspend) a killed daemon left suspended."""
        pids = [int(p) for p in entry.get("pids", [])]
        starts = {str(k): float(v) for k, v in (entry.get("starts") or {}).items()}
        live = [p for p in pids if self._alive(p, starts.get(str(p), 0.0))]
        if not live:
            return {p: "gone" for p in pids}
        try:
            driver = self.checkpointer().driver
        except GpuError as exc:
            log.error("cannot recover the CUDA state of pids %s: %s", live, exc)
            return {p: f"error: {exc}" for p in live}
        return recover_pids(driver, pids, lambda p: p in live)


def load_adapter(proc_root: str = detect.PROC) -> NvidiaGpuAdapter | None:
    """The adapter when the NVIDIA kernel driver or nvidia-smi is present; None on CPU-only nodes."""
    if detect.kernel_driver_version(proc_root) is None and shutil.which("nvidia-smi") is None:
        return None
    return NvidiaGpuAdapter(proc_root=proc_root)
