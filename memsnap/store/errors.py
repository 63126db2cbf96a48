"""Store error types: every backend maps its OS/boto errors onto these."""

from __future__ import annotations


class StoreError(Exception):
    """A store operation failed."""


class StoreUnavailable(StoreError):
    """The store cannot be reached or used right now; retry later, data is not lost."""


class StoreFull(StoreError):
    """The store is out of space or quota."""


class StoreNotFound(StoreError):
    """The requested key does not exist."""


class StoreCorrupt(StoreError):
    """Stored bytes do not match what was written (size, checksum or stream format)."""


class BadObject(StoreCorrupt):
    """An object in the store is not one memsnap could have written (a pack's index, a manifest, a sweep record):
    kind and key name it, so that it can be skipped, reported and removed."""

    def __init__(self, message: str, kind: str = "", key: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.kind, self.key = kind, key
        self.reason = reason or message  # what is wrong with it, without naming it
