"""A shared token-bucket bandwidth cap and a human size parser ('512K', '1.5G', '100MiB/s')."""

from __future__ import annotations

import re
import threading
import time

_UNITS = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([KMGT])(I)?)?\s*(B)?\s*(/S)?\s*", re.IGNORECASE)
_MIN_BURST = 1 << 20


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


class Throttle:
    """Thread-safe token bucket: all callers of consume() together stay under bytes_per_second."""

    def __init__(self, bytes_per_second: int | None) -> None:
        self._lock = threading.Lock()
        self._rate: int | None = None
        self._burst = 0.0
        self._tokens = 0.0
        self._stamp = time.monotonic()
        self.set_rate(bytes_per_second)

    @property
    def rate(self) -> int | None:
        """The cap in bytes per second (None: unlimited)."""
        return self._rate

    def set_rate(self, bytes_per_second: int | None) -> None:
        """Changes the cap; None or 0 means unlimited. The bucket starts full."""
        if bytes_per_second is not None and bytes_per_second < 0:
            raise ValueError(f"bandwidth cap must be positive, got {bytes_per_second}")
        with self._lock:
            self._rate = bytes_per_second or None
            self._burst = float(max(_MIN_BURST, (bytes_per_second or 0) // 10))
            self._tokens = self._burst
            self._stamp = time.monotonic()

    def consume(self, n: int) -> None:
        """Takes n bytes' worth of tokens, sleeping as long as the bucket is in debt."""
        if self._rate is None or n <= 0:
            return
        with self._lock:
            rate = self._rate
            if rate is None:
                return
            now = time.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._stamp) * rate)
            self._stamp = now
            self._tokens -= n
            wait = -self._tokens / rate
        if wait > 0:
            time.sleep(wait)
