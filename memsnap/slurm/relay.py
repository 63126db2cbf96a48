"""Relays a memsnap job's log file to the launcher's stdout (so it lands in the Slurm output file),
and picks up the exit-status line that the launcher's shell wrapper appends when the workload ends."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import BinaryIO

# The wrapper prints this (then the status and a newline) when the workload exits by itself.
EXIT_MARKER = b"\x1ememsnap-slurm-exit="
WRAPPER = "\"$@\"; s=$?; printf '\\036memsnap-slurm-exit=%d\\n' \"$s\"; exit \"$s\""
_CHUNK = 1 << 20


def wrap(argv: list[str]) -> list[str]:
    """argv run under /bin/sh, which reports the exit status into the log when argv ends."""
    return ["/bin/sh", "-c", WRAPPER, "memsnap-slurm", *argv]


def unwrap(argv: list[str]) -> list[str]:
    """The workload's own argv from a wrapped one (argv unchanged if it is not wrapped)."""
    if len(argv) >= 4 and argv[0] == "/bin/sh" and argv[1] == "-c" and argv[2] == WRAPPER:
        return argv[4:]
    return argv


def output_is_empty_file(fd: int) -> bool:
    """Whether fd is a regular file with nothing in it yet (Slurm truncates the output on a restart)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == 0


class LogRelay:
    """Copies what a log file gains to out, from a given offset; strips and records the exit marker."""

    def __init__(self, path: str, offset: int, out: BinaryIO, warn: Callable[[str], None]) -> None:
        self.path = path
        self.offset = offset
        self.out = out
        self.warn = warn
        self.exit_status: int | None = None
        self._pending = b""  # a possible start of the marker, held back until we know
        self._in_marker = False
        self._marker_digits = b""
        self._warned = False

    def pump(self) -> int:
        """Relays everything new; returns the number of bytes read."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                total = 0
                while True:
                    data = f.read(_CHUNK)
                    if not data:
                        break
                    self.offset += len(data)
                    total += len(data)
                    self._feed(data)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                self.warn(f"cannot read the job log {self.path} ({exc.strerror}); the workload's output "
                          "stays in that file")
            return 0
        if total:
            self.out.flush()
        return total

    def finish(self) -> None:
        """Relays the rest and releases any held-back bytes (the workload has ended)."""
        self.pump()
        if self._pending:
            self.out.write(self._pending)
            self._pending = b""
        self.out.flush()

    def _feed(self, data: bytes) -> None:
        buf = self._pending + data
        self._pending = b""
        while buf:
            if self._in_marker:
                nl = buf.find(b"\n")
                self._marker_digits += buf if nl < 0 else buf[:nl]
                if nl < 0:
                    return
                digits = self._marker_digits.strip()
                self.exit_status = int(digits) if digits.isdigit() else None
                self._in_marker, self._marker_digits = False, b""
                buf = buf[nl + 1:]
                continue
            i = buf.find(EXIT_MARKER)
            if i >= 0:
                self.out.write(buf[:i])
                self._in_marker = True
                buf = buf[i + len(EXIT_MARKER):]
                continue
            # Hold back a tail that could be the start of a marker split across reads.
            keep = 0
            for n in range(min(len(EXIT_MARKER) - 1, len(buf)), 0, -1):
                if EXIT_MARKER.startswith(buf[-n:]):
                    keep = n
                    break
            self.out.write(buf[:len(buf) - keep])
            self._pending = buf[len(buf) - keep:]
            return


def empty_output(stream: BinaryIO) -> bool:
    """Whether stream is an empty regular file (Slurm truncated the output file for a requeued run)."""
    try:
        return output_is_empty_file(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False


def file_size(path: str) -> int:
    """The size of path, 0 if it is "" or gone."""
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def log_chain(last: str, current: str) -> list[str]:
    """The logs of a job's earlier runs, oldest first, ending with last: a restored copy's log starts with
    '# memsnap: restored from CK; earlier output: PARENT', or '# memsnap: moved here from HOST/JOB (CK); ...'
    (memsnap.engine.Engine.restore_own_log)."""
    chain: list[str] = []
    path = last
    while path and path != current and path not in chain and len(chain) < 1000:
        chain.append(path)
        try:
            with open(path, "rb") as f:
                first = f.readline(4096).decode(errors="replace")
        except OSError:
            break
        path = first.split("; earlier output: ", 1)[1].strip() if first.startswith("# memsnap: ") \
            and "; earlier output: " in first else ""
    return chain[::-1]
