"""Who is asking: the identity every engine call is authorized against."""

from __future__ import annotations

from dataclasses import dataclass

from memsnap.errors import PermissionDenied


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


def scoped_name(caller: Caller, key: str) -> tuple[int, str, bool]:
    """'NAME' -> (caller's uid, NAME, False); 'UID:NAME' -> (UID, NAME, True), which only root may use for
    another uid."""
    uid_s, sep, rest = key.partition(":")
    if sep and uid_s.isascii() and uid_s.isdigit() and len(uid_s) <= 10:
        uid = int(uid_s)
        if uid != caller.uid and not caller.is_root:
            raise PermissionDenied(f"uid {caller.uid} may not name uid {uid}'s jobs or checkpoints")
        return uid, rest, True
    return caller.uid, key, False
