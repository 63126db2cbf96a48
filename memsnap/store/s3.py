"""S3Store: objects in an S3 (or S3-compatible) bucket under a key prefix."""

from __future__ import annotations

import builtins
import io
import logging
import time
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from urllib3.exceptions import HTTPError

from memsnap.store.base import MiB, StoreWriter, is_manifest, validate_key, validate_prefix
from memsnap.store.errors import StoreCorrupt, StoreError, StoreNotFound, StoreUnavailable
from memsnap.store.s3_errors import error_code, map_error, translate
from memsnap.store.s3_writer import S3Writer

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger(__name__)
MIN_PART = 5 * MiB


class S3Store:
    """Keys map to '<prefix>/<key>' objects; commit() verifies size and SHA256 checksum with head_object."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        part_size: int = 8 * MiB,
        max_concurrency: int = 4,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        max_attempts: int = 5,
        addressing_style: str | None = None,
    ) -> None:
        if part_size < MIN_PART:
            raise ValueError(f"S3 part size must be at least 5 MiB, got {part_size}")
        if max_concurrency < 1:
            raise ValueError(f"S3 max concurrency must be at least 1, got {max_concurrency}")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.part_size, self.max_concurrency = part_size, max_concurrency
        config = Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"max_attempts": max_attempts, "mode": "standard"},
            max_pool_connections=max(32, 2 * max_concurrency),
            s3={"addressing_style": addressing_style} if addressing_style else None,
        )
        session = boto3.session.Session(
            aws_access_key_id=access_key, aws_secret_access_key=secret_key, aws_session_token=session_token
        )
        self.client: Any = session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> S3Store:
        """An S3Store for 's3://bucket[/prefix]'; kwargs go to the constructor."""
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError(f"invalid S3 URL {url!r}: expected s3://bucket/prefix")
        return cls(parts.netloc, parts.path, **kwargs)

    def describe(self) -> str:
        """'s3://bucket/prefix', plus the endpoint when one is set."""
        url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return f"{url} ({self.endpoint_url})" if self.endpoint_url else url

    def object_key(self, key: str) -> str:
        """The bucket key for a store key."""
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _full_prefix(self, prefix: str) -> str:
        validate_prefix(prefix)
        return f"{self.prefix}/{prefix}" if self.prefix else prefix

    def _store_key(self, obj: str) -> str:
        return obj[len(self.prefix) + 1 :] if self.prefix else obj

    def open_writer(self, key: str) -> StoreWriter:
        """A writer that uploads on commit() (multipart above part_size)."""
        self.object_key(key)
        return S3Writer(self, key)

    def open_reader(self, key: str) -> BinaryIO:
        """A streaming reader; raises StoreNotFound if absent."""
        with translate(f"get {key}", self.describe()):
            resp = self.client.get_object(Bucket=self.bucket, Key=self.object_key(key))
        return io.BufferedReader(_Body(resp["Body"], f"read {key}", self.describe()), buffer_size=MiB)

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of key (shorter at its end): one ranged GET."""
        if length <= 0:
            return b""
        return self._ranged(key, f"bytes={offset}-{offset + length - 1}", length)[0]

    def read_tail(self, key: str, length: int) -> tuple[bytes, int]:
        """(the last `length` bytes of key or all of it, its size): one GET of a suffix range."""
        data, resp = self._ranged(key, f"bytes=-{max(1, length)}", max(1, length))
        total = str(resp.get("ContentRange", "")).rpartition("/")[2]
        return data, int(total) if total.isascii() and total.isdigit() else len(data)

    def _ranged(self, key: str, rng: str, limit: int) -> tuple[bytes, dict[str, Any]]:
        """One ranged GET; at most limit bytes are read (a server that ignores Range costs no more memory)."""
        with translate(f"get {key}", self.describe()):
            resp = self.client.get_object(Bucket=self.bucket, Key=self.object_key(key), Range=rng)
        with io.BufferedReader(_Body(resp["Body"], f"read {key}", self.describe()), buffer_size=MiB) as body:
            return body.read(limit), dict(resp)

    def _head(self, key: str, **kwargs: Any) -> dict[str, Any]:
        try:
            with translate(f"head {key}", self.describe()):
                return dict(self.client.head_object(Bucket=self.bucket, Key=self.object_key(key), **kwargs))
        except StoreNotFound:
            raise StoreNotFound(f"{key} not found in {self.describe()}") from None

    def exists(self, key: str) -> bool:
        """Whether the object exists."""
        try:
            self._head(key)
        except StoreNotFound:
            return False
        return True

    def stat(self, key: str) -> int:
        """Object size in bytes."""
        return int(self._head(key)["ContentLength"])

    def list(self, prefix: str) -> list[str]:
        """Sorted keys starting with prefix."""
        full = self._full_prefix(prefix)
        out: list[str] = []
        with translate(f"list {prefix!r}", self.describe()):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full
            ):
                out.extend(self._store_key(str(o["Key"])) for o in page.get("Contents", []))
        return sorted(out)

    def list_with_mtime(self, prefix: str) -> builtins.list[tuple[str, int, float]]:
        """(key, size, LastModified as unix time) of every key starting with prefix, sorted."""
        full = self._full_prefix(prefix)
        out: builtins.list[tuple[str, int, float]] = []
        with translate(f"list {prefix!r}", self.describe()):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                out.extend((self._store_key(str(o["Key"])), int(o["Size"]), o["LastModified"].timestamp())
                           for o in page.get("Contents", []))
        return sorted(out)

    def touch(self, key: str) -> bool:
        """Refreshes key's LastModified (an in-place copy); False if absent."""
        obj = self.object_key(key)
        try:
            with translate(f"touch {key}", self.describe()):
                self.client.copy_object(Bucket=self.bucket, Key=obj, CopySource={"Bucket": self.bucket, "Key": obj},
                                        MetadataDirective="REPLACE", Metadata={"touched": str(int(time.time()))})
        except StoreNotFound:
            return False
        return True

    def delete_keys(self, keys: builtins.list[str], not_after: float | None = None) -> int:
        """Deletes these objects in batches of 1000 (not_after is not checked again here: S3 has no
        conditional delete on LastModified). Returns how many were asked to be deleted."""
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            with translate("delete chunks", self.describe()):
                resp = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": self.object_key(k)} for k in batch], "Quiet": True}
                )
            if resp.get("Errors"):
                raise StoreError(f"delete in {self.describe()}: {resp['Errors'][:3]}")
        return len(keys)

    def delete(self, key: str) -> None:
        """Deletes one object (no error if absent)."""
        with translate(f"delete {key}", self.describe()):
            self.client.delete_object(Bucket=self.bucket, Key=self.object_key(key))

    def delete_prefix(self, prefix: str) -> None:
        """Deletes manifests first, then the other objects, then aborts uploads left under prefix."""
        if not validate_prefix(prefix):
            raise ValueError("refusing to delete the whole store: give a non-empty prefix")
        keys = self.list(prefix)
        manifests = [k for k in keys if is_manifest(k)]
        rest = [k for k in keys if not is_manifest(k)]
        for batch in [manifests] + [rest[i : i + 1000] for i in range(0, len(rest), 1000)]:
            if not batch:
                continue
            with translate(f"delete {prefix!r}", self.describe()):
                resp = self.client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": self.object_key(k)} for k in batch], "Quiet": True},
                )
            if resp.get("Errors"):
                raise StoreError(f"delete {prefix!r} in {self.describe()}: {resp['Errors'][:3]}")
        self._abort_uploads(self._full_prefix(prefix), None)

    def _abort_uploads(self, full_prefix: str, cutoff: float | None) -> int:
        aborted = 0
        with translate("clean up multipart uploads", self.describe()):
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=full_prefix
            )
            for page in pages:
                for up in page.get("Uploads", []):
                    if cutoff is None or up["Initiated"].timestamp() < cutoff:
                        self.client.abort_multipart_upload(
                            Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"]
                        )
                        aborted += 1
        return aborted

    def cleanup_temps(self, older_than_s: float = 0.0) -> int:
        """Aborts multipart uploads under the prefix initiated more than older_than_s ago."""
        return self._abort_uploads(
            self._full_prefix(""), time.time() - older_than_s if older_than_s > 0 else None
        )

    def check(self) -> None:
        """head_bucket: raises StoreUnavailable when the endpoint, bucket or credentials are wrong."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if error_code(e) in ("404", "NoSuchBucket", "NotFound"):
                raise StoreUnavailable(
                    f"bucket {self.bucket!r} does not exist at {self.describe()}: create it or fix the store URL"
                ) from e
            err = map_error(e, "health check", self.describe())
            raise (err if isinstance(err, StoreUnavailable) else StoreUnavailable(str(err))) from e
        except BotoCoreError as e:
            raise StoreUnavailable(str(map_error(e, "health check", self.describe()))) from e

    def verify(self, key: str, size: int, checksum: str, sha256: str) -> None:
        """Compares head_object's size, SHA256 checksum and x-amz-meta-sha256 with what was sent."""
        head = self._head(key, ChecksumMode="ENABLED")
        where = f"{key} in {self.describe()}"
        if int(head["ContentLength"]) != size:
            raise StoreCorrupt(f"{where} has {head['ContentLength']} bytes, {size} were written")
        got = head.get("ChecksumSHA256")
        meta = head.get("Metadata", {}).get("sha256")
        if got is None and meta is None:
            log.warning("%s: the server returned no checksum; only the size was verified", where)
        if got is not None and not _same_checksum(str(got), checksum):
            raise StoreCorrupt(f"{where} has SHA256 checksum {got}, expected {checksum}")
        if meta is not None and meta != sha256:
            raise StoreCorrupt(f"{where} has x-amz-meta-sha256 {meta}, expected {sha256}")


def _same_checksum(got: str, want: str) -> bool:
    """Compares S3 checksums; the '-<parts>' suffix of composite checksums is optional (moto omits it)."""
    g, _, g_parts = got.partition("-")
    w, _, w_parts = want.partition("-")
    return g == w and (not g_parts or not w_parts or g_parts == w_parts)


class _Body(io.RawIOBase):
    """A raw reader over a botocore StreamingBody that raises Store errors."""

    def __init__(self, body: Any, what: str, where: str) -> None:
        super().__init__()
        self._body, self._what, self._where = body, what, where

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        try:
            data: bytes = self._body.read(len(view))
        except (BotoCoreError, ClientError, HTTPError, OSError) as e:
            raise map_error(e, self._what, self._where) from e
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()
