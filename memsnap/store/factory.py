"""open_store: picks the backend from a directory or a URL."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from memsnap.store.base import Store
from memsnap.store.posix import PosixStore


def open_store(
    store_dir: str | None = None, store_url: str | None = None, *, create: bool = False, **s3opts: Any
) -> Store:
    """A PosixStore for store_dir or a 'file://' URL, an S3Store for an 's3://' URL (s3opts: S3Store kwargs)."""
    if (store_dir is None) == (store_url is None):
        raise ValueError("give exactly one of a store directory or a store URL (s3://bucket/prefix)")
    if store_dir is not None:
        return PosixStore(store_dir, create=create)
    assert store_url is not None
    scheme = urlsplit(store_url).scheme
    if scheme == "s3":
        from memsnap.store.s3 import S3Store  # (boto3 only where a store is in S3)

        return S3Store.from_url(store_url, **{k: v for k, v in s3opts.items() if v is not None})
    if scheme == "file":
        return PosixStore(urlsplit(store_url).path, create=create)
    raise ValueError(f"unsupported store URL {store_url!r}: use s3://bucket/prefix or file:///path")
