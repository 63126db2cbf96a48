"""The Store protocol, the writer base class and key validation shared by backends."""

from __future__ import annotations

import abc
import posixpath
from dataclasses import dataclass
from types import TracebackType
from typing import BinaryIO, Protocol, Self

MANIFEST_NAME = "manifest.json"
TEMP_PREFIX = ".tmp-"
MiB = 1 << 20

Bytes = bytes | bytearray | memoryview


@dataclass(frozen=True)
class StoredObject:
    """What commit() returns: the key, its stored size and (S3 only) its sha256 hex."""

    key: str
    size_bytes: int
    sha256: str | None = None


class StoreWriter(abc.ABC):
    """A sink for one key; nothing is visible until commit(); leaving a with-block uncommitted aborts."""

    key: str

    @abc.abstractmethod
    def write(self, data: Bytes) -> int:
        """Appends data; returns len(data)."""

    @abc.abstractmethod
    def commit(self) -> StoredObject:
        """Makes the object durable and visible under its key."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discards everything written; a no-op after commit() or a previous abort()."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()


class Store(Protocol):
    """A flat key space of immutable objects (keys look like '<checkpoint_id>/<file>')."""

    def open_writer(self, key: str) -> StoreWriter:
        """A writer whose object appears under key only on commit()."""
        ...

    def open_reader(self, key: str) -> BinaryIO:
        """A reader for key; raises StoreNotFound if absent."""
        ...

    def exists(self, key: str) -> bool:
        """Whether key is published."""
        ...

    def list(self, prefix: str) -> list[str]:
        """Sorted keys that start with prefix (temporaries excluded)."""
        ...

    def delete_prefix(self, prefix: str) -> None:
        """Deletes every key under prefix, manifests first so a half-deleted checkpoint is unpublished."""
        ...

    def stat(self, key: str) -> int:
        """Size of key in bytes; raises StoreNotFound if absent."""
        ...

    def check(self) -> None:
        """Cheap health probe; raises StoreUnavailable (or StoreFull) saying what to do."""
        ...

    def cleanup_temps(self, older_than_s: float = 0.0) -> int:
        """Removes leftovers of interrupted writes older than older_than_s; returns how many."""
        ...

    def describe(self) -> str:
        """A one-line location, e.g. 'posix:/var/lib/memsnap/store' or 's3://bucket/prefix'."""
        ...


def validate_key(key: str) -> str:
    """Returns key if it is a clean relative path, else raises ValueError."""
    parts = key.split("/")
    if not key or key.startswith("/") or "\0" in key or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid store key {key!r}: use a relative path like '<checkpoint_id>/<file>'")
    if any(p.startswith(TEMP_PREFIX) for p in parts):
        raise ValueError(f"invalid store key {key!r}: names starting with {TEMP_PREFIX!r} are reserved")
    return key


def validate_prefix(prefix: str) -> str:
    """Returns prefix if it is '' or a clean relative path (a trailing '/' allowed)."""
    if prefix:
        validate_key(prefix.removesuffix("/"))
    return prefix


def is_manifest(key: str) -> bool:
    """Whether key names a checkpoint manifest."""
    return posixpath.basename(key) == MANIFEST_NAME
