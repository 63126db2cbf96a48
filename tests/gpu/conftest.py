"""Fixtures for tests/gpu, which run on a GPU node that may lack CRIU, memsnap's deps and a registry.

Imports only the standard library and pytest at import time (memsnap and tests.helpers are imported
by the fixtures that need them). scripts/gpu/run.sh puts the carried CRIU and wheelhouse in place.

- No NVIDIA GPU (nvidia-smi absent or listing none): every test is skipped.
- Driver older than 570 (no checkpoint API): skipped, with the version found.
- A GPU, but torch cannot use it: FAIL (a broken node must not pass as "skipped").
- No CRIU ($MEMSNAP_CRIU, /usr/local/sbin/criu or criu on PATH): the tests that need it are
  skipped with the reason; the driver-only round trip still runs.
Results (JSON) go to $MEMSNAP_GPU_RESULTS, or pytest's temp dir: never into the checkout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
MIN_DRIVER = 570


def _smi(*args: str) -> tuple[int, str]:
    try:
        r = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return r.returncode, r.stdout + r.stderr


def _gpu_facts() -> dict[str, Any]:
    """What this node has: gpus listed by nvidia-smi and the driver version (empty when no GPU)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    rc, out = _smi("--query-gpu=index,uuid,name,driver_version,memory.total", "--format=csv,noheader,nounits")
    if rc != 0:
        return {"error": out.strip()[-500:]}
    rows = [[c.strip() for c in ln.split(",")] for ln in out.splitlines() if ln.strip()]
    gpus = [{"index": r[0], "uuid": r[1], "name": r[2], "memory_total_mib": r[4]} for r in rows if len(r) >= 5]
    version = rows[0][3] if rows and len(rows[0]) >= 4 else ""
    return {"gpus": gpus, "driver_version": version}


FACTS = _gpu_facts()


def driver_branch(version: str) -> int | None:
    m = re.match(r"(\d+)", version or "")
    return int(m.group(1)) if m else None


@pytest.fixture(scope="session", autouse=True)
def gpu_node() -> dict[str, Any]:
    """Skip without a GPU or with a driver < 570; FAIL when a GPU is there but torch cannot use it."""
    if not FACTS.get("gpus"):
        pytest.skip(f"needs an NVIDIA GPU: {FACTS.get('error') or 'nvidia-smi lists none'}")
    branch = driver_branch(FACTS["driver_version"])
    if branch is None or branch < MIN_DRIVER:
        pytest.skip(f"needs NVIDIA driver >= {MIN_DRIVER} (CUDA checkpoint API); found {FACTS['driver_version']!r}")
    code = "import torch; torch.zeros(1, device='cuda').add_(1); print(torch.__version__, torch.version.cuda)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    if r.returncode != 0:
        pytest.fail(f"an NVIDIA GPU is present but torch cannot use it:\n{r.stderr[-2000:]}", pytrace=False)
    return {**FACTS, "torch": r.stdout.strip()}


def criu_binary() -> str | None:
    """The CRIU memsnapd would use: $MEMSNAP_CRIU, /usr/local/sbin/criu, or criu on PATH."""
    env = os.environ.get("MEMSNAP_CRIU")
    if env:
        return env if os.access(env, os.X_OK) else None
    if os.access("/usr/local/sbin/criu", os.X_OK):
        return "/usr/local/sbin/criu"
    return shutil.which("criu")


@pytest.fixture(scope="session")
def criu() -> str:
    """Path of a usable criu; skips (with the reason) when there is none."""
    found = criu_binary()
    if found is None:
        where = os.environ.get("MEMSNAP_CRIU") or "/usr/local/sbin/criu or PATH"
        pytest.skip(f"CRIU not found ({where}): run scripts/install-criu.sh, or carry it (scripts/gpu/pack.sh)")
    if os.geteuid() != 0:
        pytest.skip("memsnapd and CRIU need root")
    return found


def child_env(**extra: str) -> dict[str, str]:
    """Environment for memsnapd, memsnapctl and workloads: this checkout first, then the carried deps."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1", **extra}


class Results:
    """The numbers issue 19 asks for; rewritten after every update so a killed run still leaves them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"unix_time": int(time.time())}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")


@pytest.fixture(scope="session")
def results(tmp_path_factory: pytest.TempPathFactory, gpu_node: dict[str, Any]) -> Results:
    out = os.environ.get("MEMSNAP_GPU_RESULTS")
    where = Path(out) if out else tmp_path_factory.mktemp("gpu-results")
    if where.resolve().is_relative_to(REPO):
        raise AssertionError(f"MEMSNAP_GPU_RESULTS={where} is inside the checkout: tests/gpu must not write there")
    r = Results(where / "gpu.json")
    r.put("node", gpu_node)
    return r


def deadline() -> float:
    """time.time() by which the run should be done ($MEMSNAP_GPU_DEADLINE, default: 10 minutes from now)."""
    return float(os.environ.get("MEMSNAP_GPU_DEADLINE", time.time() + 600))


@pytest.fixture(scope="session")
def daemon(criu: str, tmp_path_factory: pytest.TempPathFactory, results: Results) -> Iterator[Any]:
    """A real memsnapd (this checkout, the carried CRIU) on a temp socket, tier in /dev/shm."""
    from tests.helpers import DaemonProc  # needs memsnap's deps (grpc, protobuf): only now

    # Drains to the store are throttled to a trickle: they would compete with what is measured here
    # (and a 32 GiB image of random bytes would fill the node's disk).
    d = DaemonProc(tmp_path_factory.mktemp("memsnapd"), extra=["--drain-bandwidth", "1M"],
                   env=child_env(MEMSNAP_CRIU=criu))
    d.start(timeout=90)
    yield d
    log = d.log.read_text(errors="replace") if d.log.exists() else ""
    m = re.search(r"CUDA checkpoint backend: (\S+)", log)
    results.put("daemon_driver_path", m.group(1) if m else None)
    d.cleanup()
    out = os.environ.get("MEMSNAP_GPU_RESULTS")
    if out:
        Path(out, "memsnapd.log").write_text(log[-4_000_000:])


@pytest.fixture
def kill_after() -> Iterator[list[int]]:
    """Pids a test started (jobs, workloads): SIGKILLed at teardown."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
