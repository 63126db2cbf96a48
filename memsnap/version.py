"""`--version` of memsnapd and memsnapctl: memsnap's, CRIU's and the kernel's versions."""

from __future__ import annotations

import argparse
import platform
import subprocess
from typing import Any

from memsnap import __version__


def version_text() -> str:
    """memsnap, CRIU (and which binary) and kernel versions, one per line."""
    try:
        from memsnap.criu import find_binary

        binary = find_binary()
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
        first = next((ln for ln in out.splitlines() if ln.startswith("Version:")), out.strip())
        criu = f"{first.removeprefix('Version:').strip()} ({binary})"
    except Exception as exc:  # a client-only machine has no CRIU: say so, do not fail
        criu = f"not found ({exc})"
    return (f"memsnap {__version__}\nCRIU {criu}\nkernel {platform.release()}\n"
            f"python {platform.python_version()}")


class VersionAction(argparse.Action):
    """argparse action: print version_text() and exit (CRIU is asked only when --version is given)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        super().__init__(option_strings, dest=dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the memsnap, CRIU and kernel versions and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(version_text())
        parser.exit()
