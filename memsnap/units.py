"""The one parser of sizes and rates that people write, for the config file, memsnapd's flags and memsnapctl.

A size is a number of bytes, at least 1 and at most 2^63 - 1:

    SIZE   = NUMBER [UNIT] ["B"]           spaces allowed between the parts, any case
    NUMBER = DIGITS ["." [DIGITS]] | "." DIGITS
    UNIT   = ("K" | "M" | "G" | "T") ["i"]  always binary: 1K = 1Ki = 1KB = 1KiB = 1024

    4096, 100B, 512K, 512k, 1Ki, 1KiB, 10MB, 4mib, 1.5G, .5G

A fraction with a unit is rounded to the nearest byte (1.1G); without one it must come to a whole number of bytes
(1.5 is refused: either the unit was forgotten or it means nothing). 0 is refused: an unset size is spelled ""
in the config file and by leaving a flag out. A rate is a size per second, with or without "/s": 100M/s = 100M.
A size is never a rate: "64G/s" is refused where a size is wanted.
"""

from __future__ import annotations

import re

_SHIFT = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([KMGT])(I)?)?\s*(B)?\s*", re.IGNORECASE)
_RATE_RE = re.compile(r"(.*?)\s*/\s*s\s*", re.IGNORECASE)  # SIZE/s
MAX_SIZE = (1 << 63) - 1  # (an int64 on the wire and in the kernel's limits)
EXAMPLES = "such as 4096, 512K, 256M or 1.5G (K, M, G, T are binary: 1K = 1024)"


def parse_size(text: str) -> int:
    """The bytes text says (the grammar above); ValueError with one line saying what to write instead."""
    m = _SIZE_RE.fullmatch(text)
    if m is None:
        rate = _RATE_RE.fullmatch(text)
        if rate and _SIZE_RE.fullmatch(rate.group(1)):
            raise ValueError(f"{text!r} is a rate, not a size: drop the /s")
        raise ValueError(f"{text!r} is not a size: write a number of bytes or one with a unit, {EXAMPLES}")
    number, unit = m.group(1), (m.group(2) or "").upper()
    whole, _, fraction = number.partition(".")
    scaled = int(whole + fraction) << _SHIFT[unit]  # (exact: no float)
    tenths: int = 10 ** len(fraction)
    if not unit and scaled % tenths:
        raise ValueError(f"{text!r} is a fraction of a byte, not a size: add a unit (1.5K) or give whole bytes")
    size = (scaled * 2 + tenths) // (tenths * 2)  # (rounded half up)
    if size < 1:
        raise ValueError(f"{text!r} is not a size: give at least 1 byte, {EXAMPLES}")
    if size > MAX_SIZE:
        raise ValueError(f"{text!r} is too large a size: at most 8388607T (2^63 - 1 bytes)")
    return size


def parse_rate(text: str) -> int:
    """Bytes per second: a size, optionally followed by '/s' (100M/s = 100M)."""
    m = _RATE_RE.fullmatch(text)
    try:
        return parse_size(m.group(1) if m else text)
    except ValueError:
        raise ValueError(f"{text!r} is not a rate: write a size per second, such as 100M/s or 500K "
                         "(K, M, G, T are binary: 1K = 1024)") from None
