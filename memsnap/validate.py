"""Validation of every request field at the API edge: types, ranges, sizes, NUL bytes.

Everything here raises InvalidArgument with a one-line message that echoes at most CLIP characters of
the input, so that bad input never reaches the engine, the kernel or SQLite, and never comes back as
INTERNAL.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from memsnap.errors import InvalidArgument

CLIP = 200
MAX_ARGS = 4096            # argv entries
MAX_ENV = 4096             # environment variables
MAX_EXEC_BYTES = 1 << 20   # argv + environment together (the kernel allows about 2 MiB)
MAX_PATH = 4096            # PATH_MAX
MAX_KEY = 300              # targets, ids, names with a UID: prefix
MAX_ADDR = 512             # HOST:PORT, ADDR/PREFIX
MAX_TOKEN = 4096
MAX_GPUS = 256
MAX_BYTES = (1 << 63) - 1  # SQLite INTEGER

# Job and checkpoint names: also a store index key (memsnap.drain), so the same alphabet.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# Checkpoint and job ids (ck-..., job-..., or a store-adopted id): one path component.
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ENV_NAME_RE = re.compile(r"^[^=\x00]{1,1024}$")
IFNAME_RE = re.compile(r"^[A-Za-z0-9._@:-]{1,15}$")


def shorten(text: str, n: int = 200) -> str:
    """At most n characters of text, unquoted, for a message."""
    return text if len(text) <= n else text[:n] + "..."


def clip(text: str, n: int = CLIP) -> str:
    """At most n characters of caller input, quoted, for an error message."""
    return repr(text if len(text) <= n else text[:n] + "...")


def _plain(field: str, value: str, limit: int, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{field} must be a string")
    if not value and not allow_empty:
        raise InvalidArgument(f"{field} is empty")
    if len(value) > limit:
        raise InvalidArgument(f"{field} is longer than {limit} characters: {clip(value)}")
    if "\x00" in value:
        raise InvalidArgument(f"{field} contains a NUL byte: {clip(value)}")
    return value


def name(field: str, value: str) -> str:
    """An optional job/checkpoint name: letters, digits, '.', '_', '-' (not all digits: that is a pid)."""
    _plain(field, value, MAX_KEY)
    if value and (not NAME_RE.fullmatch(value) or value.isdigit()):
        raise InvalidArgument(f"{field} {clip(value)} is not a valid name: use up to 128 letters, digits, "
                              "'.', '_' or '-', starting with a letter or digit, not only digits")
    return value


def key(field: str, value: str, allow_empty: bool = False) -> str:
    """A pid, id or name, or 'UID:NAME' (what Checkpoint, Migrate and Restore take)."""
    _plain(field, value, MAX_KEY, allow_empty)
    if not value:
        return value
    if not value.isprintable() or value != value.strip():
        raise InvalidArgument(f"{field} {clip(value)} contains spaces or unprintable characters")
    if value.isdigit() and not value.isascii():
        raise InvalidArgument(f"{field} {clip(value)} is not a valid PID (ASCII digits only)")
    uid, sep, rest = value.partition(":")
    if sep and uid in CONTAINER_RUNTIMES:  # "podman:NAME": a container (memsnap.containers)
        container(field, value)
    elif sep:
        if not (uid.isascii() and uid.isdigit() and len(uid) <= 10 and int(uid) <= (1 << 32) - 2):
            raise InvalidArgument(f"{field} {clip(value)} is not UID:NAME")
        name(field, rest)
        if not rest:
            raise InvalidArgument(f"{field} {clip(value)} names no job")
    return value


CONTAINER_RUNTIMES = ("podman", "cri")  # (memsnap.containers.RUNTIMES; not imported: the CLI imports this module)


def container(field: str, value: str, allow_empty: bool = False) -> str:
    """A container, as RUNTIME:NAME (podman:web); "" where allow_empty."""
    _plain(field, value, MAX_KEY, allow_empty)
    if not value:
        return value
    runtime, sep, rest = value.partition(":")
    if not sep or runtime not in CONTAINER_RUNTIMES or not NAME_RE.fullmatch(rest):
        raise InvalidArgument(f"{field} {clip(value)} names no container: use podman:NAME or cri:NAME with the "
                              "container's name or id (letters, digits, '.', '_', '-')")
    return value


def ckpt_id(field: str, value: str) -> str:
    """A checkpoint id: one path component."""
    _plain(field, value, MAX_KEY, allow_empty=False)
    if not ID_RE.fullmatch(value):
        raise InvalidArgument(f"{field} {clip(value)} is not a checkpoint id")
    return value


def argv(values: Iterable[str]) -> list[str]:
    """A command line: at least the program, no NUL bytes, within the kernel's limits."""
    out = list(values)
    if not out or not out[0]:
        raise InvalidArgument("no command given; usage: memsnapctl run -- CMD ARGS...")
    if len(out) > MAX_ARGS:
        raise InvalidArgument(f"argv has {len(out)} entries; at most {MAX_ARGS}")
    for i, a in enumerate(out):
        _plain(f"argv[{i}]", a, MAX_EXEC_BYTES)
    return out


def env(values: Mapping[str, str]) -> dict[str, str]:
    """An environment: names without '=' or NUL, values without NUL."""
    out = dict(values)
    if len(out) > MAX_ENV:
        raise InvalidArgument(f"env has {len(out)} variables; at most {MAX_ENV}")
    for k, v in out.items():
        if not ENV_NAME_RE.fullmatch(k):
            raise InvalidArgument(f"env name {clip(k)} is empty, too long, or contains '=' or a NUL byte")
        _plain(f"env {clip(k, 40)}", v, MAX_EXEC_BYTES)
    return out


def exec_size(args: list[str], environ: Mapping[str, str]) -> None:
    """argv and environment together fit in what exec accepts."""
    total = sum(len(a.encode()) + 1 for a in args) + sum(len(k.encode()) + len(v.encode()) + 2
                                                          for k, v in environ.items())
    if total > MAX_EXEC_BYTES:
        raise InvalidArgument(f"argv and env take {total} bytes; at most {MAX_EXEC_BYTES}")


def cwd(value: str) -> str:
    """An absolute directory path, or empty (the job starts in /)."""
    _plain("cwd", value, MAX_PATH)
    if value and not value.startswith("/"):
        raise InvalidArgument(f"cwd {clip(value)} is not an absolute path")
    return value


def gpu_map(values: Mapping[str, str]) -> dict[str, str]:
    """Old GPU UUID -> new GPU UUID."""
    out = dict(values)
    if len(out) > MAX_GPUS:
        raise InvalidArgument(f"gpu_map has {len(out)} entries; at most {MAX_GPUS}")
    for k, v in out.items():
        _plain("gpu_map key", k, MAX_KEY, allow_empty=False)
        _plain("gpu_map value", v, MAX_KEY, allow_empty=False)
        if not (k.isprintable() and v.isprintable()):
            raise InvalidArgument(f"gpu_map entry {clip(k, 60)} contains unprintable characters")
    return out


def enum(field: str, value: int, allowed: Iterable[int]) -> int:
    """A proto enum value this daemon knows."""
    if value not in set(allowed):
        raise InvalidArgument(f"{field} {value} is not a known value")
    return value


def size(field: str, value: int) -> int:
    """A byte count or offset that SQLite and the tier can hold."""
    if not 0 <= value <= MAX_BYTES:
        raise InvalidArgument(f"{field} {value} is out of range 0..2^63-1")
    return value


def addr(field: str, value: str, allow_empty: bool = True) -> str:
    """HOST:PORT or ADDR/PREFIX text (parsed further where it is used)."""
    _plain(field, value, MAX_ADDR, allow_empty)
    if value and (not value.isprintable() or any(c.isspace() for c in value)):
        raise InvalidArgument(f"{field} {clip(value)} contains spaces or unprintable characters")
    return value


def ifname(field: str, value: str) -> str:
    """An optional network interface name."""
    _plain(field, value, 64)
    if value and not IFNAME_RE.fullmatch(value):
        raise InvalidArgument(f"{field} {clip(value)} is not an interface name")
    return value


def token(field: str, value: str) -> str:
    """An optional bearer token (never echoed)."""
    if len(value) > MAX_TOKEN or "\x00" in value or not value.isprintable():
        raise InvalidArgument(f"{field} is malformed (too long, or unprintable characters)")
    return value


def file_name(field: str, value: str) -> str:
    """A relative file name inside an image directory."""
    _plain(field, value, 255)
    if value and ("/" in value or value in (".", "..") or not value.isprintable()):
        raise InvalidArgument(f"{field} {clip(value)} is not a plain file name")
    return value
