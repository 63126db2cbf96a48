"""Who is asking: the identity every engine call is authorized against."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Caller:
    """Who is asking, from SO_PEERCRED on the Unix socket (uid 0 for authenticated TCP peers)."""

    uid: int
    gid: int = 0
    pid: int = 0

    @property
    def is_root(self) -> bool:
        """Root may act on anything."""
        return self.uid == 0


ROOT = Caller(0, 0, 0)
