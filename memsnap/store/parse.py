"""Total, bounded parsing of what is read from a store: any bytes give a value or a clean BadObject.

A store is shared: other nodes, and anyone holding its credentials, write into it. So every object memsnap
reads back (a pack's index, a stored manifest, a sweep record) is parsed as restic parses its packs: the size
is bounded, the nesting depth is checked BEFORE json.loads (the C parser recurses: 200,000 nested brackets
raise RecursionError), the text must be UTF-8 without NaN/Infinity, and the top level must be an object. Any
other input is a BadObject that names the object (kind and key), which the caller skips and reports
(memsnap.store.bad_objects) instead of failing every drain or sweep that meets it. The caller then checks
the types of the fields it uses.
"""

from __future__ import annotations

import json
import re
from typing import Any, NoReturn, TypeGuard

from memsnap.store.errors import BadObject

MAX_DEPTH = 32  # memsnap's own objects nest at most 5 deep
MANIFEST_MAX = 256 << 20  # a manifest's bytes (~120 a chunk: 2M chunks, 2 TiB at 1 MiB); a drain never writes more
_STRING = re.compile(rb'"(?:[^"\\]++|\\.?)*+(?:"|\Z)', re.S)  # a JSON string, or the rest of the input
NOT_AN_OBJECT = "is not a JSON object"
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def clip(text: object, n: int = 200) -> str:
    """str(text) cut to n characters, printable in a log line or a gRPC message (no lone surrogates)."""
    s = str(text).encode("utf-8", "backslashreplace").decode("utf-8")
    return s if len(s) <= n else s[: n - 3] + "..."


def nesting_ok(data: bytes, max_depth: int = MAX_DEPTH) -> bool:
    """Whether JSON text nests at most about max_depth deep (up to 2x: a round may strip two kinds of pair);
    brackets inside strings do not count, and unbalanced brackets (not JSON) give False.

    Linear time whatever the input: one regex pass drops the strings (the pattern always matches from a quote
    to the next unescaped quote or the end, so it never rescans), then each of at most max_depth rounds
    removes the innermost pairs with bytes.replace.
    """
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return True
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKET)
    for _ in range(max_depth):
        if not brackets:
            return True
        fewer = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if len(fewer) == len(brackets):
            return False
        brackets = fewer
    return not brackets


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a number")


def load_json(data: bytes, kind: str, key: str, max_bytes: int, what: str = "") -> dict[str, Any]:
    """The JSON object in data, or BadObject(kind, key) saying why not. what: the object, as messages name it
    (default: '<kind> <key>')."""
    what = what or f"{kind} {clip(key)}"

    def bad(reason: str) -> BadObject:
        return BadObject(f"{what} {reason}", kind, key, reason)

    if len(data) > max_bytes:
        raise bad(f"has {len(data)} bytes, more than a {kind} may have ({max_bytes})")
    if not nesting_ok(data):
        raise bad(f"nests deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise bad(f"is not valid JSON ({clip(exc, 120)})") from None
    if not isinstance(value, dict):
        raise bad(NOT_AN_OBJECT)
    return value


def is_count(v: object) -> TypeGuard[int]:
    """Whether v is a non-negative int (not a bool) small enough for a file offset."""
    return type(v) is int and 0 <= v < 1 << 63
