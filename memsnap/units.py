"""The one human size parser ('512K', '1.5G', '100MiB/s'), for the config file and the CLI."""

from __future__ import annotations

import re

_UNITS = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([KMGT])(I)?)?\s*(B)?\s*(/S)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in text: a number with an optional K/M/G/T (or Ki/Mi/...) binary unit, 'B' and '/s'."""
    m = _SIZE_RE.fullmatch(text)
    if m is None:
        raise ValueError(
            f"invalid size {text!r}: use a number with an optional K, M, G or T suffix (binary), e.g. 512K or 1.5G"
        )
    number, unit = m.group(1), (m.group(2) or "").upper()
    if "." not in number:
        return int(number) << _UNITS[unit]
    if not unit and float(number) != int(float(number)):
        raise ValueError(f"invalid size {text!r}: a byte count without a unit must be whole")
    return round(float(number) * (1 << _UNITS[unit]))
