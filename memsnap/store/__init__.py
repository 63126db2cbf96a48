"""Durable storage for checkpoint images: a posix directory tree or an S3 bucket."""

from typing import TYPE_CHECKING

from memsnap.store.base import MANIFEST_NAME, Store, StoredObject, StoreWriter
from memsnap.store.codec import (
    Codec,
    DecodeResult,
    DecodingReader,
    EncodeResult,
    EncodingWriter,
    copy_decode,
    copy_encode,
)
from memsnap.store.errors import StoreCorrupt, StoreError, StoreFull, StoreNotFound, StoreUnavailable
from memsnap.store.factory import open_store
from memsnap.store.posix import PosixStore
from memsnap.store.throttle import Throttle
from memsnap.units import parse_size

if TYPE_CHECKING:
    from memsnap.store.s3 import S3Store

__all__ = [
    "MANIFEST_NAME",
    "Codec",
    "DecodeResult",
    "DecodingReader",
    "EncodeResult",
    "EncodingWriter",
    "PosixStore",
    "S3Store",
    "Store",
    "StoreCorrupt",
    "StoreError",
    "StoreFull",
    "StoreNotFound",
    "StoreUnavailable",
    "StoreWriter",
    "StoredObject",
    "Throttle",
    "copy_decode",
    "copy_encode",
    "open_store",
    "parse_size",
]


def __getattr__(name: str) -> object:
    """S3Store on first use: boto3 is a fifth of memsnapd's start, and a node with a POSIX store never needs it."""
    if name == "S3Store":
        from memsnap.store.s3 import S3Store

        return S3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
