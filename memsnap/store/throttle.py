"""A shared token-bucket bandwidth cap."""

from __future__ import annotations

import threading
import time

_MIN_BURST = 1 << 20


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
