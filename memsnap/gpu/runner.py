"""Running helper binaries (cuda-checkpoint, nvidia-smi) behind an injectable function."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence

# argv, timeout in seconds (None = no limit) -> (exit status, stdout followed by stderr).
Runner = Callable[[Sequence[str], float | None], tuple[int, str]]

EXIT_NOT_FOUND = 127
EXIT_TIMEOUT = 124


def run_subprocess(argv: Sequence[str], timeout: float | None) -> tuple[int, str]:
    """Run argv without a shell; a missing binary is 127 and a timeout 124, never an exception."""
    try:
        proc = subprocess.run(
            list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError as exc:
        return EXIT_NOT_FOUND, str(exc)
    except subprocess.TimeoutExpired:
        return EXIT_TIMEOUT, f"{argv[0]} timed out after {timeout}s"
    return proc.returncode, (proc.stdout + proc.stderr).strip()
