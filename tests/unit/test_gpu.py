"""Unit tests of memsnap.gpu: struct layouts, preflight, suspend/resume ordering, detection, CLI argv."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from memsnap.collaborators import GpuAdapter
from memsnap.errors import FailedPrecondition, InvalidArgument, MemsnapError
from memsnap.gpu import bindings as b
from memsnap.gpu import criuenv, detect, preflight, remap
from memsnap.gpu.adapter import NvidiaGpuAdapter, load_adapter
from memsnap.gpu.base import ProcessState
from memsnap.gpu.checkpointer import GpuCheckpointer
from memsnap.gpu.driver import DriverApi, load_driver
from memsnap.gpu.errors import GpuError, GpuPreflightError, GpuUnavailable
from memsnap.gpu.recovery import recover_pids, settle
from memsnap.gpu.tool import CudaCheckpointCli
from tests.unit.fake_cuda import ILLEGAL_STATE, NOT_SUPPORTED, TIMEOUT, FakeLib, stages
from tests.unit.fake_cuda import fake_proc as _proc
from tests.unit.fake_cuda import ops as _ops
from tests.unit.fake_cuda import smi_runner as _smi_runner

OLD = "GPU-00112233-4455-6677-8899-aabbccddeeff"
NEW = "GPU-ffeeddcc-bbaa-9988-7766-554433221100"
THIRD = "GPU-0f0f0f0f-1e1e-2d2d-3c3c-4b4b4b4b4b4b"

def _setup(pids: Sequence[int] = (10, 20), version: int = 13000) -> tuple[FakeLib, GpuCheckpointer]:
    lib = FakeLib(pids, version)
    return lib, GpuCheckpointer(DriverApi(lib))


# -- struct layouts ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "struct",
    [
        b.CUcheckpointLockArgs,
        b.CUcheckpointCheckpointArgs,
        b.CUcheckpointRestoreArgs,
        b.CUcheckpointUnlockArgs,
    ],
)
def test_every_args_struct_is_64_zeroed_bytes(struct: type[ctypes.Structure]) -> None:
    assert ctypes.sizeof(struct) == b.ARGS_SIZE == 64
    assert bytes(struct()) == bytes(64)


# The declarations as cuda.h (CUDA 13.0, driver r580) has them; 12.8-13.4 lay them out the same.
CUDA_H = """
typedef struct CUuuid_st {
    char bytes[16];
} CUuuid;

typedef struct CUcheckpointLockArgs_st {
    unsigned int timeoutMs;
    unsigned int reserved0;
    cuuint64_t reserved1[7];
} CUcheckpointLockArgs;

typedef struct CUcheckpointCheckpointArgs_st {
    cuuint64_t reserved[8];
} CUcheckpointCheckpointArgs;

typedef struct CUcheckpointGpuPair_st {
    CUuuid oldUuid;
    CUuuid newUuid;
} CUcheckpointGpuPair;

typedef struct CUcheckpointRestoreArgs_st {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    char reserved[52 - sizeof(CUcheckpointGpuPair *)];
    cuuint64_t reserved1;
} CUcheckpointRestoreArgs;

typedef struct CUcheckpointUnlockArgs_st {
    cuuint64_t reserved[8];
} CUcheckpointUnlockArgs;
"""
_C_TYPES: dict[str, Any] = {"char": ctypes.c_char, "unsigned int": ctypes.c_uint, "cuuint64_t": ctypes.c_uint64}


def _structs_from_cuda_h(text: str) -> dict[str, type[ctypes.Structure]]:
    """Reference ctypes structs built from the C declarations alone (C layout rules are ctypes')."""
    out: dict[str, type[ctypes.Structure]] = {}
    for body, name in re.findall(r"typedef struct \w+ \{(.*?)\} (\w+);", text, re.S):
        fields: list[tuple[str, Any]] = []
        for ctype, ptr, field, dim in re.findall(r"^\s*([\w ]+?)\s*(\*?)\s*(\w+)(?:\[(.+)\])?;", body, re.M):
            t = _C_TYPES.get(ctype) or out[ctype]
            if ptr:
                t = ctypes.POINTER(t)
            if dim:
                n = eval(re.sub(r"sizeof\(\w+ \*\)", str(ctypes.sizeof(ctypes.c_void_p)), dim), {})
                t = t * n
            fields.append((field, t))
        out[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
    return out


@pytest.mark.parametrize("name", ["CUuuid", "CUcheckpointLockArgs", "CUcheckpointCheckpointArgs",
                                  "CUcheckpointGpuPair", "CUcheckpointRestoreArgs", "CUcheckpointUnlockArgs"])
def test_struct_layout_matches_cuda_h(name: str) -> None:
    ref = _structs_from_cuda_h(CUDA_H)[name]
    ours = getattr(b, name)
    assert ctypes.sizeof(ours) == ctypes.sizeof(ref)
    assert [f[0] for f in ours._fields_] == [f[0] for f in ref._fields_]
    for field, _ in ref._fields_:
        assert (getattr(ours, field).offset, getattr(ours, field).size) == (
            getattr(ref, field).offset,
            getattr(ref, field).size,
        ), field


def test_uuid_parsing_and_pair_array() -> None:
    assert b.uuid_bytes(OLD) == bytes.fromhex("00112233445566778899aabbccddeeff")
    assert b.uuid_bytes(OLD[4:]) == b.uuid_bytes(OLD)
    with pytest.raises(ValueError, match="not a GPU UUID"):
        b.uuid_bytes("MIG-1234")
    arr = b.gpu_pair_array([(OLD, NEW)])
    assert bytes(arr[0].oldUuid.bytes) == b.uuid_bytes(OLD)
    assert bytes(arr[0].newUuid.bytes) == b.uuid_bytes(NEW)


# -- DriverApi over the fake library -------------------------------------------------------------
def test_driver_api_passes_timeout_and_names_errors() -> None:
    lib, _ = _setup([10])
    api = DriverApi(lib)
    assert lib.calls[0] == ("Init", 0)
    assert api.driver_version() == 13000
    api.lock(10, 2500)
    assert lib.lock_timeouts == [2500]
    assert api.get_state(10) is ProcessState.LOCKED
    assert api.restore_thread_id(10) == 11
    with pytest.raises(GpuError) as err:
        api.restore(10)
    assert err.value.name == "CUDA_ERROR_ILLEGAL_STATE" and err.value.result == ILLEGAL_STATE
    assert (
        "cuCheckpointProcessRestore(pid 10) failed: CUDA_ERROR_ILLEGAL_STATE: operation not permitted"
        in str(err.value)
    )
    assert isinstance(err.value, MemsnapError)


def test_driver_api_remaps_only_from_cuda_13() -> None:
    lib = FakeLib([10], version=13000)
    lib.states[10] = ProcessState.CHECKPOINTED
    DriverApi(lib).restore(10, [(OLD, NEW)])
    assert lib.restore_pairs == [[(b.uuid_bytes(OLD), b.uuid_bytes(NEW))]]
    old = FakeLib([10], version=12080)
    old.states[10] = ProcessState.CHECKPOINTED
    with pytest.raises(GpuError, match="driver >= 580"):
        DriverApi(old).restore(10, [(OLD, NEW)])
    assert old.restore_pairs == []
    DriverApi(old).restore(10)
    assert old.restore_pairs == [[]]


# -- preflight -----------------------------------------------------------------------------------
F = preflight.GpuFacts


@pytest.mark.parametrize(
    ("facts", "message"),
    [
        (F(580), None),
        (F(570), None),
        (F(None, cuda_api_version=12080), None),
        (F(580, remap_requested=True), None),
        (F(None, cuda_api_version=13000, remap_requested=True), None),
        (F(610, ipc_memory=True), "cuda-checkpoint --launch-job"),
        (F(None), "cannot determine the NVIDIA driver version"),
        (F(565), "upgrade the driver to >= 570"),
        (F(None, cuda_api_version=12060), "upgrade the NVIDIA driver to >= 570"),
        (F(570, remap_requested=True), "needs NVIDIA driver >= 580 (found 570)"),
        (F(580, cuda_api_version=12090, remap_requested=True), "needs NVIDIA driver >= 580"),
        (F(580, mig_enabled=True), "MIG disabled"),
        (F(580, mps_running=True), "nvidia-cuda-mps-control"),
        (F(580, uvm_managed=True), "cudaMallocManaged"),
        (F(580, ipc_memory=True), "cannot checkpoint (driver 580 here"),
        (F(580, untracked_pids=(7, 8)), "pid 7, 8 holds /dev/nvidia*"),
        (
            F(580, untracked_pids=(7,), untracked_reasons=("CUDA_ERROR_NOT_SUPPORTED: x",)),
            "pid 7 (CUDA_ERROR_NOT_SUPPORTED: x)",
        ),
    ],
)
def test_preflight(facts: preflight.GpuFacts, message: str | None) -> None:
    if message is None:
        preflight.check(facts)
        return
    with pytest.raises(
        GpuPreflightError, match=message.replace("*", r"\*").replace("(", r"\(").replace(")", r"\)")
    ) as e:
        preflight.check(facts)
    assert "\n" not in str(e.value) and ": " in str(e.value)
    assert isinstance(e.value, FailedPrecondition)


def test_facts_from_info_counts_mig_on_the_jobs_gpus_only() -> None:
    info = {
        "driver_branch": 580,
        "mps_running": False,
        "gpus": [{"uuid": OLD, "mig_mode": "Disabled"}, {"uuid": NEW, "mig_mode": "Enabled"}],
    }
    assert preflight.facts_from_info(info, gpu_uuids=[OLD]).mig_enabled is False
    facts = preflight.facts_from_info(info, remap_requested=True, untracked_pids=[5])
    assert facts.mig_enabled and facts.remap_requested and facts.untracked_pids == (5,)
    assert facts.driver_branch == 580


# -- suspend / resume ordering and rollback ------------------------------------------------------
def test_lock_checkpoint_dump_restore_unlock_order() -> None:
    lib, ckpt = _setup([10, 20])
    with ckpt.suspend([10, 20], timeout_ms=5000, device_bytes={10: 1 << 30, 99: 1}) as sus:
        assert lib.states == {10: ProcessState.CHECKPOINTED, 20: ProcessState.CHECKPOINTED}
        lib.calls.append(("dump", 0))
        sus.resume()  # leave-running dump: give the GPU back
    # every stage for all pids (in parallel) before the next: lock, checkpoint | dump | restore, unlock
    assert stages(lib) == [
        ("Lock", frozenset({10, 20})),
        ("Checkpoint", frozenset({10, 20})),
        ("dump", frozenset({0})),
        ("Restore", frozenset({10, 20})),
        ("Unlock", frozenset({10, 20})),
    ]
    assert lib.lock_timeouts == [5000, 5000]
    rec = sus.record()
    assert rec["pids"] == [10, 20] and rec["device_bytes"] == {"10": 1 << 30}
    assert set(rec["seconds"]) == {"lock", "checkpoint", "restore", "unlock"}
    sus.resume()  # idempotent
    assert len(_ops(lib)) == 9


def test_released_dump_then_restore_after_criu() -> None:
    lib, ckpt = _setup([10, 20])
    with ckpt.suspend([10, 20], timeout_ms=5000) as sus:
        lib.calls.append(("dump", 0))
        sus.release()  # the dump killed the tree
    assert sus.pending == ()
    seconds = ckpt.restore([10, 20], {10: [(OLD, NEW)], 20: [(OLD, NEW)]})
    assert set(seconds) == {"restore", "unlock"}
    both = frozenset({10, 20})
    assert stages(lib)[2:] == [("dump", frozenset({0})), ("Restore", both), ("Unlock", both)]
    assert lib.restore_pairs[-1] == [(b.uuid_bytes(OLD), b.uuid_bytes(NEW))]
    assert set(lib.states.values()) == {ProcessState.RUNNING}


def test_second_checkpoint_failure_rolls_everything_back() -> None:
    lib, ckpt = _setup([10, 20])
    lib.fail[("Checkpoint", 20)] = ILLEGAL_STATE
    with pytest.raises(GpuError, match="CUDA_ERROR_ILLEGAL_STATE"):
        ckpt.suspend([10, 20], timeout_ms=5000)
    assert stages(lib)[2:] == [("Restore", frozenset({10})), ("Unlock", frozenset({10, 20}))]
    assert set(lib.states.values()) == {ProcessState.RUNNING}


def test_lock_timeout_unlocks_the_others_and_leaves_the_timed_out_pid_alone() -> None:
    lib, ckpt = _setup([10, 20, 30])
    lib.fail[("Lock", 20)] = TIMEOUT
    with pytest.raises(GpuError, match="CUDA_ERROR_TIMEOUT") as err:
        ckpt.suspend([10, 20, 30], timeout_ms=100)
    assert err.value.code == "FAILED_PRECONDITION"  # (a job whose GPU cannot be locked: never INTERNAL)
    # (all locks are asked at once: the others got theirs, and are unlocked again; nothing was checkpointed)
    assert stages(lib) == [("Lock", frozenset({10, 20, 30})), ("Unlock", frozenset({10, 30}))]
    assert ("GetState", 20) in lib.calls
    assert set(lib.states.values()) == {ProcessState.RUNNING}


def test_failed_rollback_is_attached_to_the_original_error() -> None:
    lib, ckpt = _setup([10, 20])
    lib.fail[("Checkpoint", 20)] = ILLEGAL_STATE
    lib.fail[("Restore", 10)] = ILLEGAL_STATE
    with pytest.raises(GpuError) as err:
        ckpt.suspend([10, 20], timeout_ms=5000)
    assert err.value.op == "cuCheckpointProcessCheckpoint"
    assert any("rolling back the CUDA state failed" in n for n in err.value.__notes__)


def test_exception_inside_with_resumes() -> None:
    lib, ckpt = _setup([10, 20])
    with pytest.raises(RuntimeError, match="criu dump failed"), ckpt.suspend([10, 20], timeout_ms=5000):
        raise RuntimeError("criu dump failed")
    assert set(lib.states.values()) == {ProcessState.RUNNING}
    assert stages(lib)[-2:] == [("Restore", frozenset({10, 20})), ("Unlock", frozenset({10, 20}))]


def test_resume_failure_inside_with_is_a_note_not_a_mask() -> None:
    lib, ckpt = _setup([10])
    lib.fail[("Unlock", 10)] = ILLEGAL_STATE
    with pytest.raises(KeyError) as err, ckpt.suspend([10], timeout_ms=5000):
        raise KeyError("x")
    assert any("resuming the CUDA state failed" in n for n in err.value.__notes__)
    assert lib.states[10] is ProcessState.LOCKED


def test_resume_retries_only_what_failed() -> None:
    lib, ckpt = _setup([10, 20])
    sus = ckpt.suspend([10, 20], timeout_ms=5000)
    lib.fail[("Unlock", 20)] = ILLEGAL_STATE
    with pytest.raises(GpuError):
        sus.resume()
    assert sus.pending == (20,)
    del lib.fail[("Unlock", 20)]
    sus.resume()
    assert not sus.pending
    assert set(lib.states.values()) == {ProcessState.RUNNING}
    assert _ops(lib)[-2:] == [("Unlock", 20), ("Unlock", 20)]


def test_suspend_refuses_a_lock_without_timeout() -> None:
    _, ckpt = _setup([10])
    with pytest.raises(ValueError, match="timeout_ms"):
        ckpt.suspend([10], timeout_ms=0)


def test_restore_unlocks_nothing_when_a_restore_fails() -> None:
    lib, ckpt = _setup([10, 20])
    for pid in (10, 20):
        lib.states[pid] = ProcessState.CHECKPOINTED
    lib.fail[("Restore", 20)] = ILLEGAL_STATE
    with pytest.raises(GpuError):
        ckpt.restore([10, 20])
    assert not any(op == "Unlock" for op, _ in _ops(lib))


def test_probe_reports_the_drivers_own_error_for_pids_without_cuda_state() -> None:
    lib, ckpt = _setup([10, 20])
    lib.tid_error[20] = NOT_SUPPORTED
    assert ckpt.probe([10, 20, 77]) == (
        [10],
        {20: "CUDA_ERROR_NOT_SUPPORTED: operation not supported", 77: "CUDA_ERROR_NOT_INITIALIZED: unknown CUDA error"},
    )


# -- detection over a fake /proc -----------------------------------------------------------------
def test_find_cuda_processes_walks_the_tree(tmp_path: Path) -> None:
    proc = _proc(
        tmp_path,
        {100: [101, 102], 101: [103], 200: [201]},
        {
            101: ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm", "pipe:[5]"],
            103: ["/dev/nvidia0"],
            201: ["/dev/nvidia1"],
        },
        nspid={100: 1, 101: 2, 103: 4},
    )
    assert detect.descendants(100, proc) == [100, 101, 102, 103]
    found = detect.find_cuda_processes(100, proc)
    assert [p.pid for p in found] == [101, 103]
    assert found[0] == detect.CudaProcess(101, 2, ("/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidiactl"), True)
    assert found[1].uses_uvm is False and found[1].ns_pid == 4
    assert detect.map_ns_pids(100, [2, 4, 9], proc) == {2: 101, 4: 103}
    assert detect.find_cuda_processes(999, proc) == []


def test_descendants_falls_back_to_ppid_scan(tmp_path: Path) -> None:
    proc = _proc(tmp_path, {100: [101], 101: [102]}, {}, children_files=False)
    assert detect.descendants(100, proc) == [100, 101, 102]


def test_mps_and_driver_version(tmp_path: Path) -> None:
    proc = _proc(tmp_path, {100: []}, {})
    assert detect.mps_running(proc) is False
    (tmp_path / "100" / "comm").write_text("nvidia-cuda-mps\n")
    assert detect.mps_running(proc) is True
    assert detect.kernel_driver_version(proc) is None
    (tmp_path / "driver" / "nvidia").mkdir(parents=True)
    (tmp_path / "driver" / "nvidia" / "version").write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)\n"
        "GCC version:  gcc version 13.3.0\n"
    )
    assert detect.kernel_driver_version(proc) == "580.65.06"
    assert detect.driver_branch("570.86.10") == 570


def test_gpu_info_parses_nvidia_smi(tmp_path: Path) -> None:
    proc = _proc(tmp_path, {100: []}, {})
    seen, run = _smi_runner(
        f"0, {OLD}, NVIDIA H200, 580.65.06, 143771, 20480, Disabled, Enabled\n",
        f"4242, 20000, {OLD}\n4243, [N/A], {OLD}\n77, 10, {OLD}\n",
    )
    info = detect.gpu_info([4242, 4243], run, proc)
    assert seen[0][:2] == ["nvidia-smi", "--query-gpu=" + detect._GPU_FIELDS]
    assert seen[0][2] == "--format=csv,noheader,nounits"
    assert seen[1][1] == "--query-compute-apps=pid,used_memory,gpu_uuid"
    assert info["driver_version"] == "580.65.06" and info["driver_branch"] == 580
    assert info["gpus"][0]["name"] == "NVIDIA H200" and info["gpus"][0]["memory_used_bytes"] == 20480 << 20
    assert info["processes"] == [
        {"pid": 4242, "used_bytes": 20000 << 20, "gpu_uuid": OLD},
        {"pid": 4243, "used_bytes": None, "gpu_uuid": OLD},
    ]
    assert detect.device_bytes(info) == {4242: 20000 << 20}
    assert info["mps_running"] is False


def test_gpu_info_is_empty_without_a_gpu(tmp_path: Path) -> None:
    proc = _proc(tmp_path, {100: []}, {})
    _, run = _smi_runner("", "", rc=127)
    assert detect.gpu_info(None, run, proc) == {}


# -- the cuda-checkpoint fallback ----------------------------------------------------------------
class FakeRunner:
    """Answers cuda-checkpoint invocations and records their argv."""

    def __init__(self, outputs: dict[str, tuple[int, str]] | None = None) -> None:
        self.argv: list[list[str]] = []
        self.timeouts: list[float | None] = []
        self.outputs = outputs or {}

    def __call__(self, argv: Sequence[str], timeout: float | None) -> tuple[int, str]:
        self.argv.append(list(argv))
        self.timeouts.append(timeout)
        key = argv[2] if argv[1] == "--action" else argv[1]
        return self.outputs.get(key, (0, ""))


def test_cli_builds_the_documented_argv() -> None:
    run = FakeRunner({"--get-state": (0, "checkpointed\n"), "--get-restore-tid": (0, "4321\n")})
    cli = CudaCheckpointCli("/usr/bin/cuda-checkpoint", run)
    cli.lock(42, 3000)
    cli.checkpoint(42)
    cli.restore(42)
    cli.unlock(42)
    assert cli.get_state(42) is ProcessState.CHECKPOINTED
    assert cli.restore_thread_id(42) == 4321
    exe = "/usr/bin/cuda-checkpoint"
    assert run.argv == [
        [exe, "--action", "lock", "--pid", "42", "--timeout", "3000"],
        [exe, "--action", "checkpoint", "--pid", "42"],
        [exe, "--action", "restore", "--pid", "42"],
        [exe, "--action", "unlock", "--pid", "42"],
        [exe, "--get-state", "--pid", "42"],
        [exe, "--get-restore-tid", "--pid", "42"],
    ]
    assert run.timeouts[0] == pytest.approx(33.0)
    assert cli.driver_version() == 0


def test_cli_errors_and_remap_refusal() -> None:
    run = FakeRunner({"lock": (1, "Could not lock: timeout"), "--get-state": (0, "weird")})
    cli = CudaCheckpointCli("cuda-checkpoint", run)
    with pytest.raises(GpuError, match=r"cuda-checkpoint lock\(pid 7\) failed: Could not lock: timeout"):
        cli.lock(7, 100)
    with pytest.raises(GpuError, match="unexpected output"):
        cli.get_state(7)


def test_cli_remaps_with_the_complete_device_map() -> None:
    run = FakeRunner({"--get-state": (0, "restoring\n")})
    cli = CudaCheckpointCli("cc", run)
    cli.restore(7, [(OLD, NEW), (NEW, OLD)])
    assert run.argv[-1] == ["cc", "--action", "restore", "--pid", "7", "--device-map", f"{OLD}={NEW},{NEW}={OLD}"]
    assert cli.get_state(7) is ProcessState.RESTORING


def test_cli_under_the_checkpointer() -> None:
    run = FakeRunner()
    with GpuCheckpointer(CudaCheckpointCli("cc", run)).suspend([5], timeout_ms=1000) as sus:
        sus.resume()
    assert [a[2] for a in run.argv] == ["lock", "checkpoint", "restore", "unlock"]


def test_cli_find_needs_action_support() -> None:
    assert CudaCheckpointCli.find("cc", FakeRunner(), which=lambda _: None) is None
    old = FakeRunner({"--help": (0, "--toggle --pid <pid>")})
    assert CudaCheckpointCli.find("cc", old, which=lambda n: f"/opt/{n}") is None
    new = FakeRunner({"--help": (0, "--action lock | checkpoint | restore | unlock --pid <pid>")})
    found = CudaCheckpointCli.find("cc", new, which=lambda n: f"/opt/{n}")
    assert found is not None and found.binary == "/opt/cc"


def test_load_driver_falls_back_to_the_binary(tmp_path: Path) -> None:
    exe = tmp_path / "cuda-checkpoint"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    run = FakeRunner({"--help": (0, "--action lock")})
    drv = load_driver(libname=str(tmp_path / "libcuda-missing.so.1"), binary=str(exe), runner=run)
    assert isinstance(drv, CudaCheckpointCli)
    assert load_driver(libname=str(tmp_path / "none.so"), binary=str(tmp_path / "none")) is None


# -- keeping CRIU's CUDA plugin out -------------------------------------------------------------
def test_criu_env_points_at_an_empty_plugin_dir(tmp_path: Path) -> None:
    env = criuenv.criu_env(tmp_path / "criu-plugins", {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "CRIU_LIBS_DIR": str(tmp_path / "criu-plugins")}
    assert list((tmp_path / "criu-plugins").iterdir()) == []
    (tmp_path / "criu-plugins" / "cuda_plugin.so").write_text("")
    with pytest.raises(RuntimeError, match="cuda_plugin.so"):
        criuenv.criu_env(tmp_path / "criu-plugins", {})


# -- the engine's adapter -------------------------------------------------------------------------
def _hook_world(tmp_path: Path) -> tuple[FakeLib, list[int], NvidiaGpuAdapter]:
    proc = _proc(
        tmp_path,
        {100: [101, 102]},
        {101: ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"], 102: ["/dev/nvidia0"]},
        nspid={100: 1, 101: 2, 102: 3},
    )
    _, run = _smi_runner(NODE_GPUS, f"101, 2048, {OLD}\n")
    lib = FakeLib([101])
    loads: list[int] = []

    def loader() -> DriverApi:
        loads.append(1)
        return DriverApi(lib)

    return lib, loads, NvidiaGpuAdapter(loader, run, proc, alive=lambda pid, start: pid in lib.states)


NODE_GPUS = (
    f"0, {OLD}, NVIDIA H200, 580.65.06, 143771, 20480, Disabled, Enabled\n"
    f"1, {NEW}, NVIDIA H200, 580.65.06, 143771, 0, Disabled, Enabled\n"
    f"2, {THIRD}, NVIDIA A100-SXM4-80GB, 580.65.06, 81920, 0, Disabled, Enabled\n"
)


def test_hook_fits_the_engine_protocol_and_describes_the_tree(tmp_path: Path) -> None:
    _, loads, hook = _hook_world(tmp_path)
    as_engine_sees_it: GpuAdapter = hook
    desc = as_engine_sees_it.describe(100)
    assert [d["pid"] for d in desc] == [101, 102]
    assert desc[0]["ns_pid"] == 2 and desc[0]["uses_uvm_fd"] is True
    assert desc[0]["gpus"] == [{"uuid": OLD, "model": "NVIDIA H200", "bytes": 2048 << 20}]
    # every GPU its driver enumerates (no CUDA_VISIBLE_DEVICES: all of the node's), for a later remap
    assert [g["uuid"] for g in desc[0]["visible_gpus"]] == [OLD, NEW, THIRD]
    assert desc[0]["device_bytes"] == 2048 << 20 and desc[0]["driver_version"] == "580.65.06"
    assert desc[1]["device_bytes"] == 0
    assert loads == []  # describing never initialises CUDA


def test_hook_refuses_forked_children_without_cuda_state(tmp_path: Path) -> None:
    lib, _, hook = _hook_world(tmp_path)
    why = "CUDA_ERROR_NOT_INITIALIZED: unknown CUDA error"
    with pytest.raises(GpuPreflightError, match=re.escape(f"pid 102 ({why}) holds /dev/nvidia")):
        hook.suspend(100, 5000)
    assert _ops(lib) == []


def _dumped(tmp_path: Path, env: bytes = b"") -> tuple[FakeLib, NvidiaGpuAdapter, list[dict[str, Any]]]:
    """The hook world after a --stop dump: 101 CHECKPOINTED, and the manifest's gpus."""
    lib, _, hook = _hook_world(tmp_path)
    for fd in (tmp_path / "102" / "fd").iterdir():
        fd.unlink()
    (tmp_path / "101" / "environ").write_bytes(env)
    gpus = hook.describe(100)
    with hook.suspend(100, 5000) as sus:
        assert sus.pids == (101,) and sus.device_bytes == {101: 2048 << 20}
        sus.release()
    assert lib.states[101] is ProcessState.CHECKPOINTED
    return lib, hook, gpus


def test_hook_suspend_then_restore_in_place_sends_no_pairs(tmp_path: Path) -> None:
    lib, hook, gpus = _dumped(tmp_path)
    hook.restore(100, None, gpus)
    assert _ops(lib)[-2:] == [("Restore", 101), ("Unlock", 101)]
    assert lib.restore_pairs[-1] == []
    hook.restore(100, None, gpus)  # nothing checkpointed any more: a no-op
    assert len(_ops(lib)) == 4


def test_hook_remap_sends_every_checkpointed_gpu_identity_filled(tmp_path: Path) -> None:
    lib, hook, gpus = _dumped(tmp_path, b"CUDA_VISIBLE_DEVICES=0,1\0")
    assert [g["uuid"] for g in gpus[0]["visible_gpus"]] == [OLD, NEW]
    hook.restore(100, {OLD: NEW, NEW: OLD}, gpus)
    assert lib.restore_pairs[-1] == [(b.uuid_bytes(OLD), b.uuid_bytes(NEW)), (b.uuid_bytes(NEW), b.uuid_bytes(OLD))]
    lib2, hook2, gpus2 = _dumped(tmp_path / "second")
    hook2.restore(100, {THIRD: THIRD, OLD: NEW, NEW: OLD}, gpus2)
    # the pairs the user did not name are filled in as identity pairs: the driver wants all of them
    assert lib2.restore_pairs[-1] == [
        (b.uuid_bytes(OLD), b.uuid_bytes(NEW)),
        (b.uuid_bytes(NEW), b.uuid_bytes(OLD)),
        (b.uuid_bytes(THIRD), b.uuid_bytes(THIRD)),
    ]


def test_full_identity_filled_map() -> None:
    had = {2: [{"uuid": OLD, "model": "H200"}, {"uuid": NEW, "model": "H200"}], 3: [{"uuid": OLD, "model": "H200"}]}
    node = [{"uuid": OLD, "name": "H200"}, {"uuid": NEW, "name": "H200"}, {"uuid": THIRD, "name": "H200"}]
    assert remap.restore_pairs(had, None, node) == {}
    assert remap.restore_pairs(had, {OLD: OLD}, node) == {}
    assert remap.restore_pairs(had, {OLD: THIRD}, node) == {2: [(OLD, THIRD), (NEW, NEW)], 3: [(OLD, THIRD)]}


def test_unnamed_gpus_and_a_silent_nvidia_smi_restore_in_place() -> None:
    had = {2: [{"uuid": OLD, "model": "H200"}, {"uuid": "[N/A]", "model": "H200"}]}
    assert remap.restore_pairs(had, None, []) == {}
    node = [{"uuid": OLD, "name": "H200"}, {"uuid": "[N/A]", "name": "H200"}, {"uuid": NEW, "name": "H200"}]
    assert remap.restore_pairs(had, {OLD: NEW}, node) == {2: [(OLD, NEW)]}
    with pytest.raises(GpuPreflightError, match="is not on this node"):
        remap.restore_pairs(had, {OLD: NEW}, [])


@pytest.mark.parametrize(
    ("gpu_map", "node", "error", "message"),
    [
        (None, [NEW], GpuPreflightError, f"GPU {OLD} (H200) of this checkpoint is not on this node"),
        ({OLD: THIRD}, [OLD, NEW], GpuPreflightError, f"(mapped to {THIRD}) is not on this node"),
        ({OLD: NEW}, [OLD, NEW], InvalidArgument, f"would both be restored onto {NEW}"),
        ({OLD: THIRD, NEW: THIRD}, [OLD, NEW, THIRD], InvalidArgument, "both map onto"),
        ({THIRD: OLD}, [OLD, NEW, THIRD], InvalidArgument, f"names {THIRD}, which this checkpoint did not use"),
        ({"nonsense": NEW}, [OLD, NEW], InvalidArgument, "bad GPU map entry"),
    ],
)
def test_refused_maps(gpu_map: dict[str, str] | None, node: list[str], error: type[Exception], message: str) -> None:
    had = {2: [{"uuid": OLD, "model": "H200"}, {"uuid": NEW, "model": "H200"}]}
    with pytest.raises(error, match=re.escape(message)):
        remap.restore_pairs(had, gpu_map, [{"uuid": u, "name": "H200"} for u in node])


def test_hook_refuses_a_map_onto_a_missing_or_other_gpu_before_the_driver(tmp_path: Path) -> None:
    lib, hook, gpus = _dumped(tmp_path)
    with pytest.raises(GpuPreflightError, match=f"cannot restore GPU {OLD} \\(NVIDIA H200\\) onto {THIRD}"):
        hook.restore(100, {OLD: THIRD, THIRD: OLD}, gpus)
    gone = [dict(g, visible_gpus=[{"uuid": "GPU-99999999-9999-9999-9999-999999999999", "model": "NVIDIA H200"}])
            for g in gpus]
    with pytest.raises(GpuPreflightError, match="is not on this node: restore with --gpu-map"):
        hook.restore(100, None, gone)
    assert _ops(lib)[-1] == ("Checkpoint", 101) and lib.states[101] is ProcessState.CHECKPOINTED


@pytest.mark.parametrize(
    ("visible", "want"),
    [
        (None, [OLD, NEW, THIRD]),
        ("", []),
        ("1", [NEW]),
        ("2,0", [THIRD, OLD]),
        (f"{NEW},0", [NEW, OLD]),
        ("GPU-ffeeddcc", [NEW]),
        ("1,7,0", [NEW]),  # as in CUDA, the first entry that matches nothing ends the list
        ("MIG-abc", [OLD, NEW, THIRD]),
    ],
)
def test_visible_gpus_follow_cuda_visible_devices(visible: str | None, want: list[str]) -> None:
    node = detect._gpu_rows([r.split(", ") for r in NODE_GPUS.splitlines()])
    assert [g["uuid"] for g in remap.select_visible(node, visible)] == want


# -- crash recovery and the transient states of CUDA 13.4 ---------------------------------------
@pytest.mark.parametrize("left", [ProcessState.LOCKED, ProcessState.CHECKPOINTED])
def test_recovery_unlocks_and_restores_what_a_killed_daemon_left(tmp_path: Path, left: ProcessState) -> None:
    lib, _, hook = _hook_world(tmp_path)
    for fd in (tmp_path / "102" / "fd").iterdir():
        fd.unlink()
    journal: list[dict[str, Any] | None] = []
    sus = hook.suspend(100, 5000, journal=journal.append)
    assert journal[0] is not None and journal[0]["pids"] == [101]  # journaled before the first lock
    assert _ops(lib)[0] == ("Lock", 101)
    if left is ProcessState.LOCKED:
        lib.states[101] = ProcessState.LOCKED  # the daemon died between lock and checkpoint
    del sus  # ... and never resumed or released anything
    assert lib.states[101] is left
    after_restart = NvidiaGpuAdapter(lambda: DriverApi(lib), hook._runner, str(tmp_path), alive=lambda p, s: True)
    done = after_restart.recover(journal[0])
    assert lib.states[101] is ProcessState.RUNNING
    assert done == {101: "restored" if left is ProcessState.CHECKPOINTED else "unlocked"}
    assert _ops(lib)[-1] == ("Unlock", 101)


def test_recovery_skips_dead_and_unknown_pids_and_keeps_going() -> None:
    lib = FakeLib([10, 20, 30])
    lib.states.update({10: ProcessState.CHECKPOINTED, 30: ProcessState.LOCKED})
    lib.fail[("Restore", 10)] = NOT_SUPPORTED
    out = recover_pids(DriverApi(lib), [10, 20, 30, 77, 88], alive=lambda p: p != 88)
    assert out[10].startswith("error: cuCheckpointProcessRestore(pid 10) failed: CUDA_ERROR_NOT_SUPPORTED")
    assert out[20] == "running" and out[30] == "unlocked" and out[77] == "gone" and out[88] == "gone"
    assert lib.states[30] is ProcessState.RUNNING


def test_journal_is_cleared_once_resumed_or_released() -> None:
    lib, ckpt = _setup([10])
    journal: list[Any] = []
    ckpt.suspend([10], 5000, journal=journal.append, starts={10: 12.5}).resume()
    assert journal == [{"pids": [10], "starts": {"10": 12.5}}, None]
    journal.clear()
    ckpt.suspend([10], 5000, journal=journal.append).release()
    assert journal[-1] is None and len(journal) == 2


def test_states_4_and_5_are_waited_on() -> None:
    lib = FakeLib([10, 20])
    lib.states[10] = ProcessState.CHECKPOINTED
    lib.transient[10] = [ProcessState.CHECKPOINTING, ProcessState.CHECKPOINTING]
    lib.states[20] = ProcessState.LOCKED
    lib.transient[20] = [ProcessState.RESTORING]
    naps: list[float] = []
    assert settle(DriverApi(lib), 10, sleep=naps.append) is ProcessState.CHECKPOINTED
    assert len(naps) == 2
    lib.transient[10] = [ProcessState.RESTORING]
    assert recover_pids(DriverApi(lib), [10, 20], sleep=naps.append) == {10: "restored", 20: "unlocked"}
    # a suspension whose state got unknown (a call failed) waits too, instead of failing
    lib2, ckpt = _setup([10])
    lib2.fail[("Checkpoint", 10)] = TIMEOUT
    lib2.transient[10] = [ProcessState.CHECKPOINTING]
    with pytest.raises(GpuError, match="CUDA_ERROR_TIMEOUT"):
        ckpt.suspend([10], 5000)
    assert lib2.states[10] is ProcessState.RUNNING


def test_settle_gives_up_after_its_timeout() -> None:
    lib = FakeLib([10])
    lib.transient[10] = [ProcessState.RESTORING] * 1000
    now = [0.0]

    def nap(s: float) -> None:
        now[0] += s

    with pytest.raises(GpuError, match="still RESTORING after 1 s"):
        settle(DriverApi(lib), 10, timeout_s=1.0, sleep=nap, clock=lambda: now[0])


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda root: (root / "100" / "comm").write_text("nvidia-cuda-mps\n"), "MPS"),
        (lambda root: (root / "101" / "environ").write_bytes(b"A=1\0MEMSNAP_GPU_MANAGED=1\0"), "managed"),
        (lambda root: (root / "101" / "environ").write_bytes(b"MEMSNAP_GPU_IPC=1\0"), "CUDA IPC"),
    ],
)
def test_hook_preflight_runs_before_cuda_is_touched(tmp_path: Path, setup: Any, message: str) -> None:
    lib, loads, hook = _hook_world(tmp_path)
    setup(tmp_path)
    with pytest.raises(GpuPreflightError, match=message):
        hook.suspend(100, 5000)
    assert loads == [] and lib.calls == []


def test_hook_without_a_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, hook = _hook_world(tmp_path)
    for fd in (tmp_path / "102" / "fd").iterdir():
        fd.unlink()
    none = NvidiaGpuAdapter(lambda: None, hook._runner, str(tmp_path))
    with pytest.raises(GpuUnavailable, match="driver >= 570"):
        none.suspend(100, 5000)
    monkeypatch.setattr("memsnap.gpu.adapter.shutil.which", lambda _: None)
    assert load_adapter(str(tmp_path)) is None
    (tmp_path / "driver" / "nvidia").mkdir(parents=True)
    (tmp_path / "driver" / "nvidia" / "version").write_text(
        "NVRM version: NVIDIA UNIX Kernel Module  580.65.06\n"
    )
    assert isinstance(load_adapter(str(tmp_path)), NvidiaGpuAdapter)


def test_engine_recover_hands_journaled_gpu_steps_to_the_hook(tmp_path: Path) -> None:
    from memsnap.catalog import DUMPING, STAGED, Catalog, CheckpointRecord
    from memsnap.criu import Criu
    from memsnap.engine import Engine, EngineConfig
    from memsnap.tier import MemoryTier

    class Hook:
        def __init__(self) -> None:
            self.entries: list[dict[str, Any]] = []

        def recover(self, entry: dict[str, Any]) -> dict[int, str]:
            self.entries.append(entry)
            return {p: "restored" for p in entry["pids"]}

    catalog = Catalog(tmp_path / "state")
    entry = {"pids": [4242], "starts": {"4242": 1.0}}
    for ck_id, state in (("ck-a", DUMPING), ("ck-b", STAGED), ("ck-c", STAGED)):
        meta = {"stop": False} if ck_id == "ck-c" else {"stop": False, "gpu": entry}
        catalog.add_checkpoint(CheckpointRecord(id=ck_id, state=state, pid=4242, owner_uid=0, created_ms=1, meta=meta))
    hook = Hook()
    engine = Engine(EngineConfig(tmp_path / "state"), catalog, MemoryTier(tmp_path / "tier"), Criu("/bin/true"),
                    b"k" * 32, gpu=hook)  # type: ignore[arg-type]
    engine.recover()
    assert hook.entries == [entry, entry]
    for ck_id in ("ck-a", "ck-b"):
        rec = catalog.get_checkpoint(ck_id)
        assert rec is not None and "gpu" not in rec.meta and rec.meta["stop"] is False
    engine.recover()
    assert len(hook.entries) == 2  # done once


# -- the device run's scripts (scripts/gpu): packing, and a clean skip without a usable GPU --------
REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_SMI = """#!/bin/sh
# A fake nvidia-smi: DRIVER empty means "no GPU" (exit 9, as nvidia-smi does without a driver).
[ -n "$FAKE_DRIVER" ] || { echo "NVIDIA-SMI has failed: no devices were found" >&2; exit 9; }
case "$*" in
  -L) echo "GPU 0: Fake GPU (UUID: GPU-00112233-4455-6677-8899-aabbccddeeff)" ;;
  *query-gpu=index*) echo "0, GPU-00112233-4455-6677-8899-aabbccddeeff, Fake GPU, $FAKE_DRIVER, 81920" ;;
  *query-gpu*) echo "Fake GPU, $FAKE_DRIVER, 81920 MiB" ;;
  *) echo "fake nvidia-smi, driver $FAKE_DRIVER" ;;
esac
"""


@pytest.fixture(scope="module")
def carry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """scripts/gpu/pack.sh's folder, built from PyPI and this node's CRIU (as CI has them)."""
    dest = tmp_path_factory.mktemp("carry") / "gpu-carry"
    r = subprocess.run(["bash", str(REPO_ROOT / "scripts/gpu/pack.sh"), str(dest)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return dest


def test_pack_builds_one_folder_within_64_mib(carry: Path) -> None:
    total = sum(f.stat().st_size for f in carry.rglob("*") if f.is_file())
    assert total <= 64 << 20
    wheels = {w.name.split("-")[0].lower().replace("_", "-") for w in (carry / "wheels").glob("*.whl")}
    pinned = {ln.split("==")[0] for ln in (REPO_ROOT / "scripts/gpu/wheels.txt").read_text().splitlines()
              if ln and not ln.startswith("#")}
    assert wheels == pinned
    assert all("cp312" in w.name or "abi3" in w.name or "none-any" in w.name for w in (carry / "wheels").iterdir())
    libs = {f.name for f in (carry / "lib").iterdir()}
    assert "libprotobuf-c.so.1" in libs and not any(n.startswith(("libc.so", "ld-linux")) for n in libs)
    version = subprocess.run([str(carry / "bin/criu"), "--version"], capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin"})
    assert version.returncode == 0 and "Version" in version.stdout


@pytest.mark.parametrize("driver", ["", "550.54.15"])
def test_run_sh_skips_cleanly_without_a_usable_gpu(carry: Path, tmp_path: Path, driver: str) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(FAKE_SMI)
    (fake / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "OUT": str(out), "FAKE_DRIVER": driver,
           "MEMSNAP_GPU_CARRY": str(carry), "MEMSNAP_GPU_BUDGET_S": "60"}
    env.pop("PYTHONPATH", None)
    r = subprocess.run(["bash", str(REPO_ROOT / "scripts/gpu/run.sh")], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    if not driver:
        assert json.loads((out / "gpu.json").read_text()) == {"skipped": "no NVIDIA GPU on this node"}
        assert "no NVIDIA GPU here" in r.stdout
        return
    junit = (out / "junit.xml").read_text()
    assert 'failures="0"' in junit and 'errors="0"' in junit and "skipped" in junit
    assert "needs NVIDIA driver &gt;= 570 (CUDA checkpoint API); found '550.54.15'" in junit
    assert "criu check" in (out / "node.txt").read_text()
    assert len(list(out.iterdir())) <= 8


def test_gpu_tests_fail_when_a_gpu_is_there_but_torch_cannot_use_it(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(FAKE_SMI)
    (fake / "nvidia-smi").chmod(0o755)
    # torch that has no CUDA (this node's CPU build, or a stub where torch is not installed at all)
    stub = tmp_path / "stub" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("def zeros(*a, **k):\n    raise RuntimeError('Torch not compiled with CUDA')\n")
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "FAKE_DRIVER": "580.65.06",
           "PYTHONPATH": f"{tmp_path / 'stub'}:{REPO_ROOT}", "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider",
                        f"--basetemp={tmp_path / 'pt'}", "-k", "host"], cwd=REPO_ROOT, capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "an NVIDIA GPU is present but torch cannot use it" in r.stdout
    assert "skipped" not in r.stdout.splitlines()[-1]


def test_gpu_test_tree_imports_neither_boto3_nor_moto() -> None:
    code = (
        "import sys, tests.conftest, tests.gpu.conftest, tests.gpu.test_cuda_roundtrip\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore', 'moto'))\n"
        "sys.exit(f'imported {bad}' if bad else 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "PATH": "/nonexistent"})
    assert r.returncode == 0, r.stdout + r.stderr
