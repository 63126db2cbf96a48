"""Engine errors; each carries the gRPC status it maps to and a one-line message that says what to do."""

from __future__ import annotations


class MemsnapError(Exception):
    """Base class; `code` names a grpc.StatusCode member."""

    code = "INTERNAL"


class NotFound(MemsnapError):
    """Unknown process, job or checkpoint."""

    code = "NOT_FOUND"


class InvalidArgument(MemsnapError):
    """Malformed input."""

    code = "INVALID_ARGUMENT"


class TierExhausted(MemsnapError):
    """The memory tier cannot hold the image."""

    code = "RESOURCE_EXHAUSTED"


class QuotaExceeded(MemsnapError):
    """The caller's uid is at a limit of [quota] (memsnap.quota); nothing was started."""

    code = "RESOURCE_EXHAUSTED"


class FailedPrecondition(MemsnapError):
    """CRIU, the kernel or the checkpoint's state does not allow the operation."""

    code = "FAILED_PRECONDITION"


class PermissionDenied(MemsnapError):
    """The caller may not act on that target."""

    code = "PERMISSION_DENIED"


class Unauthenticated(MemsnapError):
    """The caller did not prove who it is."""

    code = "UNAUTHENTICATED"


class Unavailable(MemsnapError):
    """Storage or a peer is down; retrying later may work."""

    code = "UNAVAILABLE"


class IntegrityFailure(MemsnapError):
    """An image failed its integrity check; nothing was restored."""

    code = "DATA_LOSS"


class Aborted(MemsnapError):
    """A concurrent operation holds the target."""

    code = "ABORTED"
