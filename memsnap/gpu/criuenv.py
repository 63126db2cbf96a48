"""Keeping CRIU's own CUDA plugin out of the dumps and restores whose CUDA state memsnap handles."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

LIBS_DIR_ENV = "CRIU_LIBS_DIR"


def plugin_free_libdir(path: Path) -> Path:
    """Create path (0700) as CRIU's plugin dir; it must hold no .so, so CRIU loads no plugin at all."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    plugins = sorted(p.name for p in path.iterdir() if p.name.endswith(".so"))
    if plugins:
        raise RuntimeError(f"{path} is meant to be CRIU's empty plugin dir but holds {', '.join(plugins)}")
    return path


def criu_env(libdir: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for `criu swrk` with CRIU_LIBS_DIR pointing at an empty plugin dir."""
    env = dict(os.environ if base is None else base)
    env[LIBS_DIR_ENV] = str(plugin_free_libdir(libdir))
    return env
