"""tests/gpu on a node without a usable GPU, with a fake nvidia-smi and a fake torch: a GPU that torch
cannot use FAILS the run (it must never pass as "skipped"), no GPU at all skips it, and either way
nothing is written into the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SMI = """#!/bin/sh
echo "0, GPU-00000000-1111-2222-3333-444444444444, NVIDIA H200, 580.65.06, 143771"
"""
CPU_ONLY_TORCH = """
__version__ = "2.9.0+cpu"
def zeros(*a, **kw):
    raise AssertionError("Torch not compiled with CUDA enabled")
"""


def _checkout_files() -> str:
    """Every untracked or changed path of the checkout, ignored ones included."""
    return subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all", "tests/gpu"],
                          cwd=REPO, capture_output=True, text=True, check=True).stdout


def _run_gpu_suite(tmp_path: Path, smi: bool) -> subprocess.CompletedProcess[str]:
    bin_dir, mods = tmp_path / "bin", tmp_path / "mods"
    bin_dir.mkdir()
    (mods / "torch").mkdir(parents=True)
    (mods / "torch" / "__init__.py").write_text(CPU_ONLY_TORCH)
    if smi:
        (bin_dir / "nvidia-smi").write_text(SMI)
        (bin_dir / "nvidia-smi").chmod(0o755)
    path = os.environ.get("PATH", "")
    if not smi:  # (none of the node's own either)
        path = os.pathsep.join(p for p in path.split(os.pathsep) if not (Path(p) / "nvidia-smi").exists())
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{path}",
           "PYTHONPATH": os.pathsep.join([str(mods), str(REPO)]), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("MEMSNAP_GPU_RESULTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider",
                           f"--basetemp={tmp_path / 'pt'}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_a_gpu_that_torch_cannot_use_fails_the_gpu_suite(tmp_path: Path) -> None:
    before = _checkout_files()
    r = _run_gpu_suite(tmp_path, smi=True)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "an NVIDIA GPU is present but torch cannot use it" in out and "Torch not compiled with CUDA" in out
    assert " skipped" not in out.splitlines()[-1], out[-2000:]
    assert _checkout_files() == before


def test_without_a_gpu_the_gpu_suite_skips(tmp_path: Path) -> None:
    before = _checkout_files()
    r = _run_gpu_suite(tmp_path, smi=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    last = out.strip().splitlines()[-1]
    assert " skipped" in last and "passed" not in last and "failed" not in last and "error" not in last, last
    assert "needs an NVIDIA GPU" in out
    assert _checkout_files() == before

