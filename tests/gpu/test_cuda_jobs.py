"""GPU jobs as they really run (issue 31), through memsnapd on a real GPU:

1. One job, two CUDA processes (what torchrun or DataLoader workers make): both are locked, then checkpointed
   and restored in parallel; both keep their device memory; the tier reservation counted their device bytes
   (show: device_bytes) and the phases say where the time went.
2. The phases of a checkpoint and a restore account for (most of) their wall time: gpu_lock, gpu_checkpoint,
   dump, publish; criu_restore, gpu_restore, gpu_unlock.
3. A held GPU job whose move fails on the target (a failpoint there) resumes on the source with its CUDA
   state restored: its device memory sums the same afterwards.
Numbers go to gpu.json (conftest.Results) like the rest of tests/gpu.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.conftest import Results, child_env
from tests.gpu.test_cuda_roundtrip import GIB, HOLD, ctl, lines, no_room, wait_for

pytestmark = pytest.mark.gpu


def _phases(shown: dict[str, Any], key: str = "phases") -> dict[str, float]:
    return {p["name"]: int(p["ms"]) / 1000 for p in shown.get(key, [])}


def _run_hold(d: Any, name: str, tmp: Path, gibs: list[int]) -> tuple[int, Path, Path]:
    """A job of len(gibs) CUDA processes under one shell, each holding gibs[i] GiB; (pid, log, go file)."""
    go = tmp / f"go-{name}"
    cmds = " & ".join(f"{sys.executable} {HOLD} --gib {g} --go-file {go}" for g in gibs)
    job = ctl(d, "run", "--name", name, "--", "sh", "-c", f"{cmds} & wait")
    pid, log = int(job["pid"]), Path(job["log"])
    wait_for(lambda: len(lines(log, "ready")) >= len(gibs) or not Path(f"/proc/{pid}").exists(), 240,
             f"{len(gibs)} processes to fill {sum(gibs)} GiB")
    assert len(lines(log, "ready")) == len(gibs), f"the job died: {log.read_text(errors='replace')[-3000:]}"
    return pid, log, go


def _sums(log: Path, word: str) -> list[str]:
    return sorted(r[2] for r in lines(log, word))


def test_two_cuda_processes_in_one_job_checkpoint_and_restore_in_parallel(
    daemon: Any, results: Results, tmp_path: Path, kill_after: list[int]
) -> None:
    gibs = [int(g) for g in os.environ.get("MEMSNAP_GPU_TWO_PROCESS_GIB", "1,2").split(",")]
    why = no_room(sum(gibs), Path(daemon.tier), copies=2)
    if why:
        pytest.skip(why)
    pid, log, go = _run_hold(daemon, "gpu-two", tmp_path, gibs)
    kill_after.append(pid)
    t0 = time.monotonic()
    ck = ctl(daemon, "checkpoint", str(pid), "--stop", timeout=600)
    t1 = time.monotonic()
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), 60, "the stopped job to be gone")
    rs = ctl(daemon, "restore", ck["id"], timeout=600)
    t2 = time.monotonic()
    new_pid = int(rs["pid"])
    kill_after.append(new_pid)
    shown = ctl(daemon, "show", ck["id"])
    go.touch()
    wait_for(lambda: len(lines(log, "done")) >= len(gibs) or not Path(f"/proc/{new_pid}").exists(), 240,
             "both restored processes to re-sum their memory")
    row = {"gibs": gibs, "checkpoint_s": round(t1 - t0, 3), "restore_s": round(t2 - t1, 3),
           "image_bytes": shown.get("size_bytes"), "device_bytes": shown.get("device_bytes"),
           "host_bytes": shown.get("host_bytes"), "cuda_pids": sorted({g["pid"] for g in shown.get("gpus", [])}),
           "phases": _phases(shown), "restore_phases": _phases(shown, "restore_phases"),
           "same_sums": _sums(log, "done") == _sums(log, "ready")}
    results.put("two_cuda_processes", row)
    assert len(row["cuda_pids"]) == len(gibs), f"memsnap did not see {len(gibs)} CUDA processes: {row}"
    assert int(shown["device_bytes"]) >= 0.9 * sum(gibs) * GIB, row  # (what the reservation counted too)
    assert {"gpu_lock", "gpu_checkpoint", "dump", "publish"} <= set(row["phases"]), row
    assert {"criu_restore", "gpu_restore", "gpu_unlock"} <= set(row["restore_phases"]), row
    assert row["same_sums"], f"device memory changed across checkpoint/restore: {row}"


def test_phases_account_for_the_checkpoint_and_restore_time(
    daemon: Any, results: Results, tmp_path: Path, kill_after: list[int]
) -> None:
    gib = int(os.environ.get("MEMSNAP_GPU_PHASE_GIB", "1"))
    why = no_room(gib, Path(daemon.tier), copies=2)
    if why:
        pytest.skip(why)
    pid, log, go = _run_hold(daemon, "gpu-phases", tmp_path, [gib])
    kill_after.append(pid)
    t0 = time.monotonic()
    ck = ctl(daemon, "checkpoint", str(pid), timeout=600)  # leave-running: the GPU comes back at once
    wall = time.monotonic() - t0
    shown = ctl(daemon, "show", ck["id"])
    ph = _phases(shown)
    accounted = sum(v for k, v in ph.items() if k != "freeze")  # (freeze is part of dump)
    t1 = time.monotonic()
    ctl(daemon, "stop", str(pid), timeout=120)
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), 60, "the job to stop")
    rs = ctl(daemon, "restore", ck["id"], timeout=600)
    restore_wall = time.monotonic() - t1
    kill_after.append(int(rs["pid"]))
    rph = _phases(ctl(daemon, "show", ck["id"]), "restore_phases")
    go.touch()
    row = {"gib": gib, "checkpoint_wall_s": round(wall, 3), "checkpoint_phases": ph,
           "checkpoint_accounted_s": round(accounted, 3), "restore_wall_s": round(restore_wall, 3),
           "restore_phases": rph, "restore_response_phases": {p["name"]: p["ms"] for p in rs.get("phases", [])}}
    results.put("phases_1_job", row)
    assert list(ph)[:3] == ["gpu_describe", "gpu_lock", "gpu_checkpoint"], row
    assert {"dump", "publish", "gpu_restore", "gpu_unlock"} <= set(ph), row
    # (the rest: the RPC, the tier reservation's own scan, preflight and the probe of each CUDA process)
    assert 0.5 * wall <= accounted <= wall + 0.5, f"the phases do not account for the checkpoint's time: {row}"
    assert {"criu_restore", "gpu_restore", "gpu_unlock"} <= set(rph), row
    wait_for(lambda: lines(log, "done"), 240, "the restored job to re-sum its memory")
    assert _sums(log, "done") == _sums(log, "ready"), row


def test_a_held_gpu_job_whose_move_fails_resumes_here_with_its_cuda_state(
    criu: str, results: Results, tmp_path: Path, kill_after: list[int]
) -> None:
    import secrets

    from tests.helpers import token_daemon

    why = no_room(1, copies=3)
    if why:
        pytest.skip(why)
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    env = child_env(MEMSNAP_CRIU=criu)
    a = token_daemon(tmp_path / "a", token, env=env).start(timeout=90)
    b = token_daemon(tmp_path / "b", token, env={**env, "MEMSNAP_FAILPOINTS": "record-restored-fails"})
    try:
        b.start(timeout=90)
        pid, log, go = _run_hold(a, "gpu-held", tmp_path, [1])
        kill_after.append(pid)
        r = a.ctl("--json", "migrate", str(pid), "--to", b.address, timeout=600)
        row: dict[str, Any] = {"migrate_rc": r.returncode, "stderr": r.stderr[-800:]}
        results.put("held_gpu_job_rollback", row)
        assert r.returncode != 0 and "resumed on this node" in r.stderr, r.stderr
        go.touch()
        wait_for(lambda: lines(log, "done") or not Path(f"/proc/{pid}").exists(), 180,
                 "the job resumed on the source to re-sum its device memory (it hangs if its CUDA state was "
                 "left checkpointed)")
        row["same_sum"] = _sums(log, "done") == _sums(log, "ready")
        results.put("held_gpu_job_rollback", row)
        assert row["same_sum"], f"{row}\n{log.read_text(errors='replace')[-2000:]}"
        assert "CUDA state of held pid" in a.log.read_text(errors="replace")
    finally:
        a.cleanup()
        b.cleanup()
