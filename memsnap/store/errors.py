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
