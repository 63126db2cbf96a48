"""CUDA jobs through the real daemon: a checkpointed+restored training run ends bit-identical; timings.

Runs only where `nvidia-smi -L` lists a GPU and torch sees CUDA; everywhere else it is skipped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, DaemonProc, job_output, wait_for

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_loop.py"
HOLD = HERE / "hold_memory.py"
RESULTS = REPO / "bench" / "results" / "gpu.json"
GIB = 1 << 30


def _gpu_ready() -> bool:
    """nvidia-smi lists a GPU and torch (in a child, so pytest never inits CUDA) sees CUDA."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], check=False, capture_output=True, text=True, timeout=30)
        if listed.returncode != 0 or "GPU " not in listed.stdout:
            return False
        torch_ok = subprocess.run(
            [sys.executable, "-c", "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"],
            check=False,
            capture_output=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return torch_ok.returncode == 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _gpu_ready(), reason="needs an NVIDIA GPU and torch with CUDA"),
]


def _ctl(d: DaemonProc, *args: str, timeout: float = 600) -> dict[str, Any]:
    """memsnapctl --json ARGS against the test daemon (MEMSNAP_SOCKET), parsed."""
    r = d.ctl("--json", *args, check=True, timeout=timeout)
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def _lines(log: str | Path, word: str, pid: int | None = None) -> list[list[str]]:
    """Fields of the 'WORD HOSTPID ...' log lines, optionally only those printed by host pid."""
    text = job_output(log)
    rows = [ln.split() for ln in text.splitlines() if ln.startswith(word + " ")]
    return [r for r in rows if pid is None or r[1] == str(pid)]


def _run_job(d: DaemonProc, jobs_to_kill: list[int], name: str, *argv: str) -> tuple[int, str]:
    """Start argv as a managed job (own PID namespace); (host pid, log path)."""
    job = _ctl(d, "run", "--name", name, "--", sys.executable, *argv)
    jobs_to_kill.append(int(job["pid"]))
    return int(job["pid"]), str(job["log"])


def _checkpoint_stop_restore(d: DaemonProc, pid: int, jobs_to_kill: list[int]) -> tuple[int, dict[str, Any]]:
    """checkpoint --stop, wait for the job to go, restore; (new host pid, timings)."""
    t0 = time.monotonic()
    ck = _ctl(d, "checkpoint", str(pid), "--stop")
    t1 = time.monotonic()
    assert ck["state"] == "staged", ck
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), 30, what="the stopped job to be gone")
    t2 = time.monotonic()
    rs = _ctl(d, "restore", ck["id"])
    t3 = time.monotonic()
    jobs_to_kill.append(int(rs["pid"]))
    timings = {
        "checkpoint_s": round(t1 - t0, 3),
        "restore_s": round(t3 - t2, 3),
        "frozen_ms": ck.get("frozen_ms"),
        "dump_ms": ck.get("dump_ms"),
        "image_bytes": ck.get("size_bytes"),
        "criu_restore_ms": rs.get("restore_ms"),
    }
    return int(rs["pid"]), timings


def test_training_resumes_to_the_bit_identical_final_loss(
    daemon: DaemonProc, jobs_to_kill: list[int]
) -> None:
    ref = subprocess.run(
        [sys.executable, str(TRAIN), "--steps", "600", "--sleep", "0"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    finals = [ln.split() for ln in ref.stdout.splitlines() if ln.startswith("final ")]
    assert finals, ref.stdout + ref.stderr
    want = finals[-1][2]

    pid, log = _run_job(daemon, jobs_to_kill, "gpu-train", str(TRAIN), "--steps", "600", "--sleep", "0.02")
    wait_for(lambda: any(int(r[2]) >= 100 for r in _lines(log, "step", pid)), 300, what="step 100")
    new_pid, _ = _checkpoint_stop_restore(daemon, pid, jobs_to_kill)
    assert not _lines(log, "final", pid), "the job finished before it was checkpointed"
    last_step = int(_lines(log, "step", pid)[-1][2])

    got = wait_for(lambda: _lines(log, "final", new_pid), 600, what="the restored run to finish")
    assert isinstance(got, list)
    resumed = _lines(log, "step", new_pid)
    assert resumed and int(resumed[0][2]) > last_step, "the restored run started over instead of resuming"
    assert got[-1][2] == want, f"final loss {got[-1][3]} after restore != {finals[-1][3]} uninterrupted"


def _free_gpu_bytes() -> int:
    """Free device memory of GPU 0."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.split()[0]) << 20


def _mem_available() -> int:
    """MemAvailable of the host."""
    m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    return int(m.group(1)) << 10 if m else 0


def _sizes() -> list[int]:
    """GiB to measure: MEMSNAP_GPU_BENCH_GIB (comma separated) or 1, 8, 32."""
    return [int(s) for s in os.environ.get("MEMSNAP_GPU_BENCH_GIB", "1,8,32").split(",") if s.strip()]


def _room_for(d: DaemonProc, gib: int) -> str | None:
    """Why gib GiB cannot be measured here (GPU, host memory or tier space), or None."""
    need = gib * GIB
    if _free_gpu_bytes() < need + 2 * GIB:
        return "not enough free GPU memory"
    # The checkpointed process holds its device memory in host RAM, and the tier holds the image.
    if _mem_available() < 2 * need + 4 * GIB:
        return "not enough host memory"
    tier = getattr(d, "tier", None)
    if tier is not None and Path(tier).exists() and shutil.disk_usage(tier).free < need + 2 * GIB:
        return "not enough room in the memory tier"
    return None


def _measure(d: DaemonProc, jobs_to_kill: list[int], gib: int, go: Path) -> dict[str, Any]:
    """Checkpoint --stop and restore a job holding gib GiB of device memory; its timings."""
    argv = (str(HOLD), "--gib", str(gib), "--go-file", str(go))
    pid, log = _run_job(d, jobs_to_kill, f"gpu-hold-{gib}", *argv)
    ready = wait_for(lambda: _lines(log, "ready", pid), 600, what=f"{gib} GiB to be filled")
    assert isinstance(ready, list)
    new_pid, timings = _checkpoint_stop_restore(d, pid, jobs_to_kill)
    go.touch()
    done = wait_for(lambda: _lines(log, "done", new_pid), 600, what="the restored job to re-sum its memory")
    assert isinstance(done, list)
    assert done[-1][2] == ready[-1][2], f"{gib} GiB of device memory changed across checkpoint/restore"
    return {"gib": gib, "device_bytes": gib * GIB, **timings}


def test_checkpoint_and_restore_time_vs_device_memory(
    daemon: DaemonProc, jobs_to_kill: list[int], tmp_path: Path
) -> None:
    gpu = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    results: list[dict[str, Any]] = []
    for gib in _sizes():
        why = _room_for(daemon, gib)
        if why is not None:
            results.append({"gib": gib, "skipped": why})
            continue
        results.append(_measure(daemon, jobs_to_kill, gib, tmp_path / f"go-{gib}"))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    report = {"gpu": gpu, "unix_time": int(time.time()), "results": results}
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    assert any("checkpoint_s" in r for r in results), f"no size fitted this machine: {results}"
