"""One exception hierarchy for recserve.

Every error raised on a request path is a :class:`RecserveError` carrying an
:class:`ErrorKind`. The single mapping from kinds to gRPC status codes and HTTP
statuses lives in :mod:`recserve.rpc.status`; nothing else translates errors.
Messages carry the numbers: "table 'item' has 1,000 rows; id 1,417 is out of range".
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    UNAVAILABLE = "unavailable"
    FAILED_PRECONDITION = "failed_precondition"
    PERMISSION_DENIED = "permission_denied"
    INTERNAL = "internal"
    UNAUTHENTICATED = "unauthenticated"  # no or a wrong API key (HTTP 401)
    UNPROCESSABLE = "unprocessable"  # well-formed JSON whose values break the schema (HTTP 422)
    UNIMPLEMENTED = "unimplemented"  # a method this process does not serve (another kind of process does)


class RecserveError(Exception):
    """Base error. ``kind`` decides the wire status; ``retry_after_s`` is a hint
    for RESOURCE_EXHAUSTED / UNAVAILABLE rejections."""

    kind: ErrorKind = ErrorKind.INTERNAL

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class InvalidArgument(RecserveError):
    kind = ErrorKind.INVALID_ARGUMENT


class ConfigError(InvalidArgument):
    """A bad cluster spec / component config. The message names field, value and fix."""


class NotFound(RecserveError):
    kind = ErrorKind.NOT_FOUND


class ResourceExhausted(RecserveError):
    kind = ErrorKind.RESOURCE_EXHAUSTED


class DeadlineExceeded(RecserveError):
    kind = ErrorKind.DEADLINE_EXCEEDED


class Cancelled(RecserveError):
    kind = ErrorKind.CANCELLED


class Unavailable(RecserveError):
    kind = ErrorKind.UNAVAILABLE


class FailedPrecondition(RecserveError):
    kind = ErrorKind.FAILED_PRECONDITION


class PermissionDenied(RecserveError):
    kind = ErrorKind.PERMISSION_DENIED


class InternalError(RecserveError):
    kind = ErrorKind.INTERNAL


class Unauthenticated(RecserveError):
    """The caller did not prove who it is (a missing or wrong API key): HTTP 401. The
    message never quotes the key it was given."""

    kind = ErrorKind.UNAUTHENTICATED


class Unimplemented(RecserveError):
    """The method exists in the API but this process does not serve it (e.g. the
    ranker's Admin.RefreshIndex, which only the cascade has). The message says where to send it."""

    kind = ErrorKind.UNIMPLEMENTED


class InvalidField(InvalidArgument):
    """One request field is invalid; ``field`` is its JSON path (``"exclude_ids[3]"``,
    ``"body"`` for the body as a whole) and ``value`` the offending value, so an HTTP
    edge can name both in its error body. This kind (INVALID_ARGUMENT, HTTP 400) is for
    a request that cannot be read at all: malformed JSON, a body over the size cap."""

    def __init__(self, field: str, value: object, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.value = value


class UnprocessableField(InvalidField):
    """Well-formed JSON whose ``field`` breaks the schema (a wrong type, an unknown or
    missing field, a value out of range): HTTP 422, gRPC INVALID_ARGUMENT."""

    kind = ErrorKind.UNPROCESSABLE


def require(ok: bool, field: str, value: object, fix: str) -> None:
    """The one config check: raise ConfigError "<field> = <value> is invalid: <fix>"
    unless ``ok``. Every component config's ``__post_init__`` validates through it."""
    if not ok:
        raise ConfigError(f"{field} = {value!r} is invalid: {fix}")
