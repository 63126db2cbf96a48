"""Unit tests of memsnap.gpu: struct layouts, preflight, suspend/resume ordering, detection, CLI argv."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from memsnap.engine import GpuHook
from memsnap.errors import FailedPrecondition, InvalidArgument, MemsnapError
from memsnap.gpu import bindings as b
from memsnap.gpu import criuenv, detect, preflight
from memsnap.gpu.base import ProcessState
from memsnap.gpu.checkpointer import GpuCheckpointer
from memsnap.gpu.cli import CudaCheckpointCli
from memsnap.gpu.driver import DriverApi, load_driver
from memsnap.gpu.errors import GpuError, GpuPreflightError, GpuUnavailable
from memsnap.gpu.hook import NvidiaGpuHook, load_hook

OLD = "GPU-00112233-4455-6677-8899-aabbccddeeff"
NEW = "GPU-ffeeddcc-bbaa-9988-7766-554433221100"

# -- a fake libcuda: a small state machine that records every call -------------------------------
ILLEGAL_STATE, TIMEOUT, NOT_INITIALIZED = 401, 909, 3
# c_char_p results point into these bytes, so they must live for the whole run.
_NAMES = {ILLEGAL_STATE: b"CUDA_ERROR_ILLEGAL_STATE", TIMEOUT: b"CUDA_ERROR_TIMEOUT", NOT_INITIALIZED: b"X"}
_TEXTS = {ILLEGAL_STATE: b"operation not permitted in this state", TIMEOUT: b"the operation timed out"}
_MOVES = {
    "Lock": (ProcessState.RUNNING, ProcessState.LOCKED),
    "Checkpoint": (ProcessState.LOCKED, ProcessState.CHECKPOINTED),
    "Restore": (ProcessState.CHECKPOINTED, ProcessState.LOCKED),
    "Unlock": (ProcessState.LOCKED, ProcessState.RUNNING),
}


class FakeLib:
    """Records (call, pid) and moves each pid through CUprocessState like the driver does."""

    def __init__(self, pids: Sequence[int] = (), version: int = 13000) -> None:
        self.states = {p: ProcessState.RUNNING for p in pids}
        self.version = version
        self.fail: dict[tuple[str, int], int] = {}
        self.calls: list[tuple[str, int]] = []
        self.lock_timeouts: list[int] = []
        self.restore_pairs: list[list[tuple[bytes, bytes]]] = []

    def cuInit(self, flags: int) -> int:
        self.calls.append(("Init", flags))
        return 0

    def cuDriverGetVersion(self, out: Any) -> int:
        out.contents.value = self.version
        return 0

    def cuGetErrorName(self, result: int, out: Any) -> int:
        out.contents.value = _NAMES.get(result)
        return 0 if result in _NAMES else 1

    def cuGetErrorString(self, result: int, out: Any) -> int:
        out.contents.value = _TEXTS.get(result)
        return 0 if result in _TEXTS else 1

    def _move(self, op: str, pid: int) -> int:
        self.calls.append((op, pid))
        if (op, pid) in self.fail:
            return self.fail[(op, pid)]
        src, dst = _MOVES[op]
        if self.states.get(pid) is not src:
            return ILLEGAL_STATE
        self.states[pid] = dst
        return 0

    def cuCheckpointProcessLock(self, pid: int, args: Any) -> int:
        self.lock_timeouts.append(args.contents.timeoutMs)
        assert bytes(args.contents)[4:] == bytes(60)
        return self._move("Lock", pid)

    def cuCheckpointProcessCheckpoint(self, pid: int, args: Any) -> int:
        assert bytes(args.contents) == bytes(64)
        return self._move("Checkpoint", pid)

    def cuCheckpointProcessRestore(self, pid: int, args: Any) -> int:
        a = args.contents
        self.restore_pairs.append(
            [
                (bytes(a.gpuPairs[i].oldUuid.bytes), bytes(a.gpuPairs[i].newUuid.bytes))
                for i in range(a.gpuPairsCount)
            ]
        )
        assert bytes(a.reserved) == bytes(len(a.reserved)) and a.reserved1 == 0
        return self._move("Restore", pid)

    def cuCheckpointProcessUnlock(self, pid: int, args: Any) -> int:
        assert bytes(args.contents) == bytes(64)
        return self._move("Unlock", pid)

    def cuCheckpointProcessGetState(self, pid: int, out: Any) -> int:
        self.calls.append(("GetState", pid))
        if pid not in self.states:
            return NOT_INITIALIZED
        out.contents.value = int(self.states[pid])
        return 0

    def cuCheckpointProcessGetRestoreThreadId(self, pid: int, out: Any) -> int:
        if pid not in self.states:
            return NOT_INITIALIZED
        out.contents.value = pid + 1
        return 0


def _ops(lib: FakeLib) -> list[tuple[str, int]]:
    """The state-changing calls, without queries."""
    return [c for c in lib.calls if c[0] in _MOVES or c[0] == "dump"]


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


def test_field_offsets_follow_cuda_h_declaration_order() -> None:
    assert b.CUcheckpointLockArgs.timeoutMs.offset == 0
    assert b.CUcheckpointLockArgs.reserved0.offset == 4
    assert b.CUcheckpointLockArgs.reserved1.offset == 8
    assert b.CUcheckpointRestoreArgs.gpuPairs.offset == 0
    assert b.CUcheckpointRestoreArgs.gpuPairsCount.offset == 8
    assert b.CUcheckpointRestoreArgs.reserved1.offset == 56
    assert ctypes.sizeof(b.CUuuid) == 16
    assert ctypes.sizeof(b.CUcheckpointGpuPair) == 32
    assert b.CUcheckpointGpuPair.newUuid.offset == 16


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
        (F(610, ipc_memory=True), None),
        (F(None), "cannot determine the NVIDIA driver version"),
        (F(565), "upgrade the driver to >= 570"),
        (F(None, cuda_api_version=12060), "upgrade the NVIDIA driver to >= 570"),
        (F(570, remap_requested=True), "needs NVIDIA driver >= 580 (found 570)"),
        (F(580, cuda_api_version=12090, remap_requested=True), "needs NVIDIA driver >= 580"),
        (F(580, mig_enabled=True), "MIG disabled"),
        (F(580, mps_running=True), "nvidia-cuda-mps-control"),
        (F(580, uvm_managed=True), "cudaMallocManaged"),
        (F(580, ipc_memory=True), "needs NVIDIA driver >= 610 (driver 580 here)"),
        (F(580, untracked_pids=(7, 8)), "pid 7, 8 holds /dev/nvidia*"),
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
    assert _ops(lib) == [
        ("Lock", 10),
        ("Lock", 20),
        ("Checkpoint", 10),
        ("Checkpoint", 20),
        ("dump", 0),
        ("Restore", 10),
        ("Unlock", 10),
        ("Restore", 20),
        ("Unlock", 20),
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
    seconds = ckpt.restore([10, 20], {OLD: NEW})
    assert set(seconds) == {"restore", "unlock"}
    assert _ops(lib)[4:] == [("dump", 0), ("Restore", 10), ("Restore", 20), ("Unlock", 10), ("Unlock", 20)]
    assert lib.restore_pairs[-1] == [(b.uuid_bytes(OLD), b.uuid_bytes(NEW))]
    assert set(lib.states.values()) == {ProcessState.RUNNING}


def test_second_checkpoint_failure_rolls_everything_back() -> None:
    lib, ckpt = _setup([10, 20])
    lib.fail[("Checkpoint", 20)] = ILLEGAL_STATE
    with pytest.raises(GpuError, match="CUDA_ERROR_ILLEGAL_STATE"):
        ckpt.suspend([10, 20], timeout_ms=5000)
    assert _ops(lib)[4:] == [("Restore", 10), ("Unlock", 10), ("Unlock", 20)]
    assert set(lib.states.values()) == {ProcessState.RUNNING}


def test_lock_timeout_unlocks_the_others_and_leaves_the_timed_out_pid_alone() -> None:
    lib, ckpt = _setup([10, 20, 30])
    lib.fail[("Lock", 20)] = TIMEOUT
    with pytest.raises(GpuError, match="CUDA_ERROR_TIMEOUT"):
        ckpt.suspend([10, 20, 30], timeout_ms=100)
    assert _ops(lib) == [("Lock", 10), ("Lock", 20), ("Unlock", 10)]
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
    assert _ops(lib)[-4:] == [("Restore", 10), ("Unlock", 10), ("Restore", 20), ("Unlock", 20)]


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
    with pytest.raises(InvalidArgument, match="bad GPU map"):
        ckpt.restore([10], {"nonsense": NEW})


def test_probe_splits_cuda_and_nvml_only_pids() -> None:
    _, ckpt = _setup([10])
    assert ckpt.probe([10, 77]) == ([10], [77])


# -- detection over a fake /proc -----------------------------------------------------------------
def _proc(
    root: Path,
    tree: dict[int, list[int]],
    fds: dict[int, list[str]],
    nspid: dict[int, int] | None = None,
    children_files: bool = True,
) -> str:
    parents = {kid: pid for pid, kids in tree.items() for kid in kids}
    for pid in set(tree) | set(parents):
        d = root / str(pid)
        (d / "task" / str(pid)).mkdir(parents=True)
        if children_files:
            (d / "task" / str(pid) / "children").write_text(" ".join(map(str, tree.get(pid, []))) + " ")
        (d / "stat").write_text(f"{pid} (py (x) y) S {parents.get(pid, 1)} 0 0\n")
        (d / "comm").write_text("python\n")
        inner = f"\t{nspid[pid]}" if nspid and pid in nspid else ""
        (d / "status").write_text(f"Name:\tpython\nNSpid:\t{pid}{inner}\n")
        (d / "fd").mkdir()
        for i, target in enumerate(fds.get(pid, ["/dev/null"])):
            os.symlink(target, d / "fd" / str(i))
    return str(root)


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


def _smi_runner(gpus: str, apps: str, rc: int = 0) -> tuple[list[list[str]], Any]:
    seen: list[list[str]] = []

    def run(argv: Sequence[str], timeout: float | None) -> tuple[int, str]:
        seen.append(list(argv))
        return rc, gpus if "--query-gpu" in argv[1] else apps

    return seen, run


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
    with pytest.raises(GpuError, match="driver API"):
        cli.restore(7, [(OLD, NEW)])
    assert all(a[2] != "restore" for a in run.argv if len(a) > 2)


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


# -- the engine's hook ---------------------------------------------------------------------------
def _hook_world(tmp_path: Path) -> tuple[FakeLib, list[int], NvidiaGpuHook]:
    proc = _proc(
        tmp_path,
        {100: [101, 102]},
        {101: ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"], 102: ["/dev/nvidia0"]},
        nspid={100: 1, 101: 2, 102: 3},
    )
    _, run = _smi_runner(
        f"0, {OLD}, NVIDIA H200, 580.65.06, 143771, 20480, Disabled, Enabled\n", f"101, 2048, {OLD}\n"
    )
    lib = FakeLib([101])
    loads: list[int] = []

    def loader() -> DriverApi:
        loads.append(1)
        return DriverApi(lib)

    return lib, loads, NvidiaGpuHook(loader, run, proc)


def test_hook_fits_the_engine_protocol_and_describes_the_tree(tmp_path: Path) -> None:
    _, loads, hook = _hook_world(tmp_path)
    as_engine_sees_it: GpuHook = hook
    desc = as_engine_sees_it.describe(100)
    assert [d["pid"] for d in desc] == [101, 102]
    assert desc[0]["ns_pid"] == 2 and desc[0]["uses_uvm_fd"] is True
    assert desc[0]["gpus"] == [{"uuid": OLD, "model": "NVIDIA H200", "bytes": 2048 << 20}]
    assert desc[0]["device_bytes"] == 2048 << 20 and desc[0]["driver_version"] == "580.65.06"
    assert desc[1]["device_bytes"] == 0
    assert loads == []  # describing never initialises CUDA


def test_hook_refuses_forked_children_without_cuda_state(tmp_path: Path) -> None:
    lib, _, hook = _hook_world(tmp_path)
    with pytest.raises(GpuPreflightError, match="pid 102 holds /dev/nvidia"):
        hook.suspend(100, 5000)
    assert _ops(lib) == []


def test_hook_suspend_then_restore(tmp_path: Path) -> None:
    lib, _, hook = _hook_world(tmp_path)
    for fd in (tmp_path / "102" / "fd").iterdir():
        fd.unlink()
    with hook.suspend(100, 5000) as sus:
        assert sus.pids == (101,) and sus.device_bytes == {101: 2048 << 20}
        sus.release()
    assert lib.states[101] is ProcessState.CHECKPOINTED
    hook.restore(100, {OLD: NEW})
    assert _ops(lib)[-2:] == [("Restore", 101), ("Unlock", 101)]
    assert lib.restore_pairs[-1] == [(b.uuid_bytes(OLD), b.uuid_bytes(NEW))]
    hook.restore(100, None)  # nothing checkpointed any more: a no-op
    assert len(_ops(lib)) == 4


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda root: (root / "100" / "comm").write_text("nvidia-cuda-mps\n"), "MPS"),
        (lambda root: (root / "101" / "environ").write_bytes(b"A=1\0MEMSNAP_GPU_MANAGED=1\0"), "managed"),
        (lambda root: (root / "101" / "environ").write_bytes(b"MEMSNAP_GPU_IPC=1\0"), ">= 610"),
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
    none = NvidiaGpuHook(lambda: None, hook._runner, str(tmp_path))
    with pytest.raises(GpuUnavailable, match="driver >= 570"):
        none.suspend(100, 5000)
    monkeypatch.setattr("memsnap.gpu.hook.shutil.which", lambda _: None)
    assert load_hook(str(tmp_path)) is None
    (tmp_path / "driver" / "nvidia").mkdir(parents=True)
    (tmp_path / "driver" / "nvidia" / "version").write_text(
        "NVRM version: NVIDIA UNIX Kernel Module  580.65.06\n"
    )
    assert isinstance(load_hook(str(tmp_path)), NvidiaGpuHook)
