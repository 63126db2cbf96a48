"""S3 writer: one put_object for small objects, else a parallel multipart upload with SHA256 part checksums."""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, Protocol, TypeVar

from memsnap.store.base import Bytes, StoredObject, StoreWriter
from memsnap.store.errors import StoreCorrupt, StoreError
from memsnap.store.s3_errors import map_error, translate

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")
MAX_PART = 5 << 30
PARTS_PER_TIER = 1000  # the part size doubles every 1000 parts, so 10000 parts reach ~8000x part_size


def b64(digest: bytes) -> str:
    """Base64 as S3 spells checksums."""
    return base64.b64encode(digest).decode()


class S3Target(Protocol):
    """What a writer uses of its store (S3Store is one): the client and bucket, key naming, part sizing,
    and the check and delete after the upload."""

    client: Any
    bucket: str
    part_size: int
    max_concurrency: int

    def object_key(self, key: str) -> str: ...

    def describe(self) -> str: ...

    def verify(self, key: str, size: int, checksum: str, sha256: str) -> None: ...

    def delete(self, key: str) -> None: ...


class S3Writer(StoreWriter):
    """Buffers part_size bytes at a time; at most max_concurrency parts are in flight."""

    def __init__(self, store: S3Target, key: str) -> None:
        self.key, self._store = key, store
        self._obj = store.object_key(key)
        self._buf = bytearray()
        self._sha = hashlib.sha256()
        self._size = 0
        self._upload_id: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._slots = threading.BoundedSemaphore(store.max_concurrency)
        self._parts: list[Future[tuple[int, str, bytes]]] = []
        self._open = True

    def _part_size(self, number: int) -> int:
        return min(MAX_PART, self._store.part_size << ((number - 1) // PARTS_PER_TIER))

    def write(self, data: Bytes) -> int:
        """Buffers data, starting a part upload each time a part is full."""
        if not self._open:
            raise StoreError(f"write to {self.key} after commit/abort")
        self._sha.update(data)
        self._size += len(data)
        self._buf += data
        while len(self._buf) >= (n := self._part_size(len(self._parts) + 1)):
            with memoryview(self._buf) as view:
                body = bytes(view[:n])
            del self._buf[:n]
            self._guard(self._submit, body)
        return len(data)

    def _guard(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Runs fn; on any error aborts the upload and raises it as a Store error."""
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            self.abort()
            if isinstance(e, Exception):
                raise map_error(e, f"upload {self._obj}", self._store.describe()) from e
            raise

    def _submit(self, body: bytes) -> None:
        if self._upload_id is None:
            with translate(f"start upload of {self._obj}", self._store.describe()):
                resp = self._store.client.create_multipart_upload(
                    Bucket=self._store.bucket, Key=self._obj, ChecksumAlgorithm="SHA256"
                )
            self._upload_id = str(resp["UploadId"])
            self._pool = ThreadPoolExecutor(self._store.max_concurrency, thread_name_prefix="s3-part")
        for f in self._parts:  # surface a failed part early
            if f.done() and f.exception() is not None:
                f.result()
        self._slots.acquire()
        assert self._pool is not None
        fut = self._pool.submit(self._upload_part, len(self._parts) + 1, body)
        fut.add_done_callback(lambda _: self._slots.release())
        self._parts.append(fut)

    def _upload_part(self, number: int, body: bytes) -> tuple[int, str, bytes]:
        digest = hashlib.sha256(body).digest()
        resp = self._store.client.upload_part(
            Bucket=self._store.bucket, Key=self._obj, UploadId=self._upload_id, PartNumber=number,
            Body=body, ChecksumAlgorithm="SHA256", ChecksumSHA256=b64(digest),
        )  # fmt: skip
        return number, str(resp["ETag"]), digest

    def commit(self) -> StoredObject:
        """Uploads what is left, completes the upload and verifies size and checksum."""
        if not self._open:
            raise StoreError(f"commit of {self.key} after commit/abort")
        sha = self._sha.hexdigest()
        checksum = self._guard(self._finish, sha)
        self._open = False
        try:
            self._store.verify(self.key, self._size, checksum, sha)
        except StoreCorrupt:
            self._store.delete(self.key)  # never leave a bad object (e.g. a manifest) published
            raise
        return StoredObject(self.key, self._size, sha)

    def _finish(self, sha: str) -> str:
        """Sends the last bytes; returns the checksum S3 should report (composite for multipart)."""
        where = self._store.describe()
        if self._upload_id is None:
            checksum = b64(bytes.fromhex(sha))
            with translate(f"put {self._obj}", where):
                self._store.client.put_object(
                    Bucket=self._store.bucket, Key=self._obj, Body=bytes(self._buf), Metadata={"sha256": sha},
                    ChecksumAlgorithm="SHA256", ChecksumSHA256=checksum,
                )  # fmt: skip
            self._buf = bytearray()
            return checksum
        if self._buf:
            self._submit(bytes(self._buf))
            self._buf = bytearray()
        parts = [f.result() for f in self._parts]
        with translate(f"complete upload of {self._obj}", where):
            self._store.client.complete_multipart_upload(
                Bucket=self._store.bucket, Key=self._obj, UploadId=self._upload_id,
                MultipartUpload={
                    "Parts": [{"PartNumber": n, "ETag": etag, "ChecksumSHA256": b64(d)} for n, etag, d in parts]
                },
            )  # fmt: skip
        self._close_pool()
        return f"{b64(hashlib.sha256(b''.join(d for _, _, d in parts)).digest())}-{len(parts)}"

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def abort(self) -> None:
        """Cancels queued parts, waits for running ones and aborts the multipart upload."""
        if not self._open:
            return
        self._open = False
        self._buf = bytearray()
        self._close_pool()
        if self._upload_id is not None:
            try:
                with translate(f"abort upload of {self._obj}", self._store.describe()):
                    self._store.client.abort_multipart_upload(
                        Bucket=self._store.bucket, Key=self._obj, UploadId=self._upload_id
                    )
            except StoreError as e:
                log.warning("could not abort multipart upload %s of %s: %s", self._upload_id, self._obj, e)
