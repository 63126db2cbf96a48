"""Fallback GpuDriver that shells out to NVIDIA's cuda-checkpoint utility (the --action interface, r570+)."""

from __future__ import annotations

import shutil
from collections.abc import Callable

from memsnap.gpu.base import GpuPairs, ProcessState
from memsnap.gpu.errors import GpuError
from memsnap.gpu.runner import Runner, run_subprocess

_STATES = {s.name.lower(): s for s in ProcessState}
_QUERY_TIMEOUT_S = 30.0


class CudaCheckpointCli:
    """GpuDriver over `cuda-checkpoint --action lock|checkpoint|restore|unlock --pid N [--timeout MS]`."""

    name = "cuda-checkpoint"

    def __init__(
        self,
        binary: str = "cuda-checkpoint",
        runner: Runner = run_subprocess,
        op_timeout_s: float | None = None,
        lock_slack_s: float = 30.0,
    ) -> None:
        self.binary = binary
        self._run_argv = runner
        self._op_timeout_s = op_timeout_s
        self._lock_slack_s = lock_slack_s

    @classmethod
    def find(
        cls,
        binary: str = "cuda-checkpoint",
        runner: Runner | None = None,
        which: Callable[[str], str | None] = shutil.which,
    ) -> CudaCheckpointCli | None:
        """The binary on PATH if its --help offers --action (older ones only --toggle); else None."""
        run = runner or run_subprocess
        path = which(binary)
        if path is None:
            return None
        rc, out = run([path, "--help"], _QUERY_TIMEOUT_S)
        if rc != 0 or "--action" not in out:
            return None
        return cls(path, run)

    def _run(self, op: str, pid: int, args: list[str], timeout: float | None) -> str:
        """Run one cuda-checkpoint command; GpuError with its output when it fails."""
        rc, out = self._run_argv([self.binary, *args], timeout)
        if rc != 0:
            raise GpuError(f"cuda-checkpoint {op}", out or f"exit status {rc}", pid=pid, result=rc)
        return out

    def _action(self, action: str, pid: int, extra: list[str], timeout: float | None) -> None:
        """cuda-checkpoint --action ACTION --pid PID [extra]."""
        self._run(action, pid, ["--action", action, "--pid", str(pid), *extra], timeout)

    def lock(self, pid: int, timeout_ms: int) -> None:
        """--action lock, with --timeout when timeout_ms > 0."""
        if timeout_ms > 0:
            self._action("lock", pid, ["--timeout", str(timeout_ms)], timeout_ms / 1000 + self._lock_slack_s)
        else:
            self._action("lock", pid, [], self._op_timeout_s)

    def checkpoint(self, pid: int) -> None:
        """--action checkpoint."""
        self._action("checkpoint", pid, [], self._op_timeout_s)

    def restore(self, pid: int, gpu_pairs: GpuPairs = ()) -> None:
        """--action restore, with --device-map OLD=NEW,... (r580+) when GPUs are remapped.

        As with the driver API the map must list every checkpointed GPU (memsnap.gpu.remap fills it).
        """
        extra = ["--device-map", ",".join(f"{old}={new}" for old, new in gpu_pairs)] if gpu_pairs else []
        self._action("restore", pid, extra, self._op_timeout_s)

    def unlock(self, pid: int) -> None:
        """--action unlock."""
        self._action("unlock", pid, [], self._op_timeout_s)

    def get_state(self, pid: int) -> ProcessState:
        """--get-state: running, locked, checkpointed or failed (checkpointing, restoring from 13.4)."""
        out = self._run("get-state", pid, ["--get-state", "--pid", str(pid)], _QUERY_TIMEOUT_S)
        word = out.split()[0].lower() if out.split() else ""
        if word not in _STATES:
            raise GpuError("cuda-checkpoint get-state", f"unexpected output {out!r}", pid=pid)
        return _STATES[word]

    def restore_thread_id(self, pid: int) -> int:
        """--get-restore-tid."""
        out = self._run("get-restore-tid", pid, ["--get-restore-tid", "--pid", str(pid)], _QUERY_TIMEOUT_S)
        try:
            return int(out.split()[0])
        except (IndexError, ValueError):
            raise GpuError("cuda-checkpoint get-restore-tid", f"unexpected output {out!r}", pid=pid) from None

    def driver_version(self) -> int:
        """Unknown through the utility: 0 (use detect.gpu_info for the display driver version)."""
        return 0
