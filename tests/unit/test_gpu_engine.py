"""The engine with a GPU job on the fake driver: a real `sleep` process as the job's root, two CUDA processes
below it in a fake /proc, the real NvidiaGpuAdapter over a fake libcuda and a fake nvidia-smi, and FakeCriu."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from memsnap import manifest, metrics, phases
from memsnap.config import QuotaConfig, UidQuota
from memsnap.engine import ROOT, Caller, DumpExtras, Engine
from memsnap.errors import QuotaExceeded, TierExhausted
from memsnap.gpu.adapter import NvidiaGpuAdapter
from memsnap.gpu.base import ProcessState
from memsnap.gpu.driver import DriverApi
from memsnap.quota import Quotas
from tests.unit.fake_cuda import FakeLib, fake_proc, ops, smi_runner, stages
from tests.unit.fakes import FakeCriu, Procs, make_engine, procs_fixture, state_of  # noqa: F401
from tests.unit.quiesce_job import Job

OLD = "GPU-00112233-4455-6677-8899-aabbccddeeff"
NEW = "GPU-ffeeddcc-bbaa-9988-7766-554433221100"
NODE_GPUS = (
    f"0, {OLD}, NVIDIA H200, 580.65.06, 143771, 20480, Disabled, Enabled\n"
    f"1, {NEW}, NVIDIA H200, 580.65.06, 143771, 0, Disabled, Enabled\n"
)
CUDA = (9001, 9002)  # one CUDA process per GPU, below the job's root
MIB = 1 << 20


@dataclass
class World:
    engine: Engine
    lib: FakeLib
    hook: NvidiaGpuAdapter
    pid: int  # the job's root: a real process


def make_world(tmp_path: Path, procs: Procs, capacity: int = 0, root: int = 0) -> World:
    """The GPU job's world; capacity: of the tier (0 = the filesystem's); root: the job's root (else a `sleep`)."""
    pid = root or procs.start()[0]
    dev = ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia-uvm"]
    root = fake_proc(tmp_path / "proc", {pid: list(CUDA)}, {c: dev for c in CUDA}, nspid={pid: 1, 9001: 2, 9002: 3})
    _, run = smi_runner(NODE_GPUS, f"9001, 1024, {OLD}\n9002, 2048, {NEW}\n")
    lib = FakeLib(CUDA)
    hook = NvidiaGpuAdapter(lambda: DriverApi(lib), run, root, alive=lambda p, start: p in lib.states)
    return World(make_engine(tmp_path, capacity, criu=FakeCriu(), gpu=hook), lib, hook, pid)


@pytest.fixture
def world(tmp_path: Path, procs: Procs) -> Iterator[World]:
    w = make_world(tmp_path, procs)
    yield w
    w.engine.catalog.close()


def test_a_held_gpu_job_that_resumes_here_gets_its_cuda_state_back(world: World) -> None:
    rec = world.engine.checkpoint(ROOT, str(world.pid), extras=DumpExtras(hold=True))
    assert state_of(world.pid) == "T"
    assert {world.lib.states[c] for c in CUDA} == {ProcessState.CHECKPOINTED}
    assert world.engine.catalog.get_checkpoint(rec.id).meta["gpu"]["pids"] == list(CUDA)  # type: ignore[union-attr]
    world.engine.resume_held(world.pid, rec.id)  # (a move that failed or was refused)
    assert state_of(world.pid) in ("S", "R")
    assert {world.lib.states[c] for c in CUDA} == {ProcessState.RUNNING}
    assert stages(world.lib)[-2:] == [("Restore", frozenset(CUDA)), ("Unlock", frozenset(CUDA))]
    cur = world.engine.catalog.get_checkpoint(rec.id)
    assert cur is not None and "gpu" not in cur.meta and not cur.meta.get("hold")
    world.engine.recover()  # nothing left for a restart to undo
    assert stages(world.lib)[-1] == ("Unlock", frozenset(CUDA))


def test_a_held_gpu_job_ended_after_its_move_leaves_no_cuda_journal(world: World) -> None:
    rec = world.engine.checkpoint(ROOT, str(world.pid), extras=DumpExtras(hold=True))
    world.engine.end_held(world.pid, "", rec.id)
    cur = world.engine.catalog.get_checkpoint(rec.id)
    assert cur is not None and "gpu" not in cur.meta
    assert not os.path.exists(f"/proc/{world.pid}") or state_of(world.pid) in ("Z", "")


# -- the tier reservation (and the quota) count device memory ----------------------------------------
def test_the_tier_reservation_counts_the_device_memory_of_every_cuda_process(tmp_path: Path, procs: Procs) -> None:
    w = make_world(tmp_path, procs, capacity=256 * MIB)  # room for the host memory of `sleep`, not 3 GiB more
    assert w.engine.dump_estimate(w.pid) >= (1024 + 2048) * MIB
    with pytest.raises(TierExhausted):
        w.engine.checkpoint(ROOT, str(w.pid))
    assert ops(w.lib) == [] and state_of(w.pid) in ("S", "R")  # refused before the GPU or the tree is touched
    assert w.engine.catalog.checkpoints() == []


def test_a_tier_quota_counts_device_memory(tmp_path: Path, procs: Procs) -> None:
    w = make_world(tmp_path, procs)
    me = os.getuid()  # (the job is a `sleep` of whoever runs the tests: root, or 65534 in the unit tier)
    q = Quotas(QuotaConfig(), (UidQuota(me, (("tier_bytes", 2 << 30),)),), w.engine)
    with pytest.raises(QuotaExceeded, match="memory tier"), q.admit_checkpoint(Caller(me, os.getgid()), str(w.pid)):
        pytest.fail("admitted a 3 GiB GPU job under a 2 GiB tier quota")
    q = Quotas(QuotaConfig(), (UidQuota(me, (("tier_bytes", 4 << 30),)),), w.engine)
    with q.admit_checkpoint(Caller(me, os.getgid()), str(w.pid)):
        pass


class RestoringCriu(FakeCriu):
    """FakeCriu whose restored tree has the CUDA processes below it (in the fake /proc), as CRIU's would."""

    def __init__(self, proc_root: Path) -> None:
        super().__init__()
        self.proc_root = proc_root

    def restore(self, images_dir: Path, work_dir: Path, opts: Any, notify: Any = None) -> int:
        pid = super().restore(images_dir, work_dir, opts, notify)
        task = self.proc_root / str(pid) / "task" / str(pid)
        task.mkdir(parents=True)
        (task / "children").write_text(" ".join(map(str, CUDA)) + " ")
        return pid


def test_a_restore_records_its_phases_gpu_stages_included(tmp_path: Path, procs: Procs) -> None:
    w = make_world(tmp_path, procs)
    w.engine.criu = RestoringCriu(tmp_path / "proc")
    rec = w.engine.checkpoint(ROOT, str(w.pid), stop=True)
    assert {w.lib.states[c] for c in CUDA} == {ProcessState.CHECKPOINTED}
    observed: list[str] = []
    w.engine.observe = lambda kind, result, s: observed.append(kind)
    res = w.engine.restore(ROOT, rec.id)
    try:
        assert list(res.phases) == ["verify", "criu_restore", "gpu_restore", "gpu_unlock"]
        assert {w.lib.states[c] for c in CUDA} == {ProcessState.RUNNING}
        cur = w.engine.catalog.get_checkpoint(rec.id)
        assert cur is not None and list(cur.meta["restore_phases"]) == list(res.phases)
        assert list(cur.meta["phases"]) == ["gpu_describe", "gpu_lock", "gpu_checkpoint", "freeze", "dump", "publish"]
        man = manifest.read(w.engine.tier.path(rec.id))  # (signed before the publish: the phases up to the dump)
        assert set(man["phases"]) == {"gpu_describe", "gpu_lock", "gpu_checkpoint", "freeze", "dump"}
        assert [k for k in observed if k.startswith("phase:")] == [f"phase:{p}" for p in res.phases]
    finally:
        os.kill(res.pid, 9)


def test_every_phase_has_a_histogram_label() -> None:
    assert set(phases.ALL) <= set(metrics.PHASES)


# -- quiesce hooks around the GPU ---------------------------------------------------------------------
def test_the_job_hears_quiesce_before_its_gpu_is_locked_and_resume_after_it_is_unlocked(
        tmp_path: Path, procs: Procs) -> None:
    job = Job(tmp_path, "--mode", "ack")
    try:
        w = make_world(tmp_path, procs, root=job.pid)
        seen: dict[str, list[str]] = {}
        lock, unlock = w.lib.cuCheckpointProcessLock, w.lib.cuCheckpointProcessUnlock

        def spy_lock(pid: int, args: Any) -> int:
            seen.setdefault("lock", job.lines())
            return lock(pid, args)

        def spy_unlock(pid: int, args: Any) -> int:
            seen.setdefault("unlock", job.lines())
            return unlock(pid, args)

        w.lib.cuCheckpointProcessLock = spy_lock  # type: ignore[method-assign]
        w.lib.cuCheckpointProcessUnlock = spy_unlock  # type: ignore[method-assign]
        rec = w.engine.checkpoint(ROOT, str(job.pid))
        assert seen == {"lock": ["ready", "quiesce"], "unlock": ["ready", "quiesce"]}
        assert job.lines() == ["ready", "quiesce", "resume"]
        cur = w.engine.catalog.get_checkpoint(rec.id)
        assert cur is not None and list(cur.meta["phases"]) == [
            "quiesce", "gpu_describe", "gpu_lock", "gpu_checkpoint", "freeze", "dump", "publish", "gpu_restore",
            "gpu_unlock",
            "quiesce_resume"]
        man = manifest.read(w.engine.tier.path(rec.id))  # (signed before the publish: the phases up to the dump)
        assert set(man["phases"]) == {"quiesce", "gpu_describe", "gpu_lock", "gpu_checkpoint", "freeze", "dump"}
    finally:
        job.kill()
