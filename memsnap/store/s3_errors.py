"""Maps botocore exceptions onto the Store error types."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    FlexibleChecksumError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from urllib3.exceptions import HTTPError

from memsnap.store.errors import StoreCorrupt, StoreError, StoreFull, StoreNotFound, StoreUnavailable

NOT_FOUND = {"NoSuchKey", "NotFound", "404"}
FULL = {"QuotaExceeded", "XMinioStorageFull", "XMinioAdminBucketQuotaExceeded", "507"}
AUTH = {
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
    "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem", "403",
}  # fmt: skip
TRANSIENT = {"ServiceUnavailable", "SlowDown", "InternalError", "RequestTimeout", "500", "502", "503", "504"}


def error_code(e: ClientError) -> str:
    """The S3 error code ('NoSuchKey', '404', ...)."""
    return str(e.response.get("Error", {}).get("Code", ""))


def map_client_error(e: ClientError, what: str, where: str) -> StoreError:
    """The Store error for an S3 error response."""
    code = error_code(e)
    msg = f"{what} at {where}: {code} {e.response.get('Error', {}).get('Message', '')}".rstrip()
    if code in NOT_FOUND:
        return StoreNotFound(msg)
    if code == "NoSuchBucket":
        return StoreUnavailable(f"{msg}: create the bucket or fix the store URL")
    if code in AUTH:
        return StoreUnavailable(f"{msg}: check the S3 credentials and the bucket policy")
    if code in FULL:
        return StoreFull(f"{msg}: free space or raise the bucket quota")
    if code in TRANSIENT:
        return StoreUnavailable(f"{msg}: the S3 service is overloaded or down, retry later")
    return StoreError(msg)


def map_error(e: Exception, what: str, where: str) -> StoreError:
    """The Store error for any botocore exception (others are returned as StoreError)."""
    if isinstance(e, StoreError):
        return e
    if isinstance(e, ClientError):
        return map_client_error(e, what, where)
    if isinstance(e, FlexibleChecksumError):
        return StoreCorrupt(f"{what} at {where}: {e}")
    if isinstance(e, BotoConnectionError | HTTPClientError | IncompleteReadError | OSError | HTTPError):
        return StoreUnavailable(f"{what}: cannot reach S3 at {where} ({e}): check the endpoint and network")
    if isinstance(e, NoCredentialsError | PartialCredentialsError):
        return StoreUnavailable(
            f"{what}: {e}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or pass credentials"
        )
    return StoreError(f"{what} at {where}: {e}")


@contextlib.contextmanager
def translate(what: str, where: str) -> Iterator[None]:
    """Re-raises botocore exceptions as Store errors."""
    try:
        yield
    except (BotoCoreError, ClientError) as e:
        raise map_error(e, what, where) from e
