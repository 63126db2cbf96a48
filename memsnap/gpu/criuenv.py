"""Keeping CRIU's own CUDA plugin out of the dumps and restores whose CUDA state memsnap handles.

memsnap.criu.Criu runs every `criu swrk` with CRIU_LIBS_DIR set to a plugin dir made and checked here.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

LIBS_DIR_ENV = "CRIU_LIBS_DIR"


def plugin_free_libdir(path: Path) -> Path:
    """Create path (0700) as CRIU's plugin dir, and check it can make CRIU load no plugin at all.

    CRIU dlopens every *.so in it, as root: it must be a real directory (not a symlink), owned by us,
    writable by nobody else, and hold no .so. RuntimeError says which of these fails.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"{path} is meant to be CRIU's empty plugin dir but is not a directory")
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(
            f"{path} is meant to be CRIU's empty plugin dir but is owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):04o}: it must be ours and writable by nobody else"
        )
    plugins = sorted(p.name for p in path.iterdir() if p.name.endswith(".so"))
    if plugins:
        raise RuntimeError(f"{path} is meant to be CRIU's empty plugin dir but holds {', '.join(plugins)}")
    return path


def criu_env(libdir: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for `criu swrk` with CRIU_LIBS_DIR pointing at an empty, checked plugin dir."""
    env = dict(os.environ if base is None else base)
    env[LIBS_DIR_ENV] = str(plugin_free_libdir(libdir))
    return env
