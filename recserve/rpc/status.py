"""The one place that maps recserve errors to gRPC and HTTP statuses."""

from __future__ import annotations

import math
import re
from typing import Any

import grpc

from recserve.errors import ErrorKind, InternalError, InvalidField, RecserveError

GRPC_CODE: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    # A schema failure the HTTP gateway found: to gRPC it is an invalid argument.
    ErrorKind.UNPROCESSABLE: grpc.StatusCode.INVALID_ARGUMENT,
}

HTTP_STATUS: dict[ErrorKind, int] = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.RESOURCE_EXHAUSTED: 429,
    ErrorKind.DEADLINE_EXCEEDED: 504,
    ErrorKind.CANCELLED: 499,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.FAILED_PRECONDITION: 412,
    ErrorKind.PERMISSION_DENIED: 403,
    ErrorKind.INTERNAL: 500,
    ErrorKind.UNAUTHENTICATED: 401,
    ErrorKind.UNIMPLEMENTED: 501,
    ErrorKind.UNPROCESSABLE: 422,
}

# Codes a client may retry or hedge on another replica; everything else is final.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED})

# Kinds only the HTTP gateway raises, sharing their gRPC code with another kind: a peer's
# status maps back to that other kind (INVALID_ARGUMENT from a peer is INVALID_ARGUMENT).
GATEWAY_ONLY_KINDS = frozenset({ErrorKind.UNPROCESSABLE})
KIND_OF_CODE: dict[grpc.StatusCode, ErrorKind] = {code: kind for kind, code in GRPC_CODE.items() if kind not in GATEWAY_ONLY_KINDS}


_ERROR_CLASS: dict[ErrorKind, type[RecserveError]] = {cls.kind: cls for cls in RecserveError.__subclasses__()}


def error_from_code(code: grpc.StatusCode | None, message: str) -> RecserveError:
    """The RecserveError for a status received from a peer (unknown codes: INTERNAL),
    so a status crosses a process hop unchanged."""
    kind = KIND_OF_CODE.get(code, ErrorKind.INTERNAL) if code is not None else ErrorKind.INTERNAL
    return _ERROR_CLASS.get(kind, InternalError)(message)


def grpc_code(error: BaseException) -> grpc.StatusCode:
    """gRPC status for any exception (unknown exceptions are INTERNAL)."""
    if isinstance(error, RecserveError):
        return GRPC_CODE[error.kind]
    return grpc.StatusCode.INTERNAL


def http_status(error: BaseException) -> int:
    if isinstance(error, RecserveError):
        return HTTP_STATUS[error.kind]
    return 500


def grpc_details(error: BaseException) -> str:
    """Status details: the message, plus a retry-after hint where there is one."""
    if isinstance(error, RecserveError):
        if error.retry_after_s is not None:
            return f"{error.message} (retry after {error.retry_after_s * 1000:.0f} ms)"
        return error.message
    return f"internal error: {type(error).__name__}: {error}"


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """Abort an aio RPC with the status mapped from ``error`` (raises AbortError)."""
    if isinstance(error, RecserveError) and error.retry_after_s is not None:
        context.set_trailing_metadata((("retry-after-ms", str(int(error.retry_after_s * 1000))),))
    await context.abort(grpc_code(error), grpc_details(error))


def abort_with_sync(context: grpc.ServicerContext, error: BaseException) -> None:
    """:func:`abort_with` for a sync servicer's context (grpc runs sync handlers in its
    thread pool, with a context whose ``abort`` blocks and raises AbortError)."""
    if isinstance(error, RecserveError) and error.retry_after_s is not None:
        context.set_trailing_metadata((("retry-after-ms", str(int(error.retry_after_s * 1000))),))
    context.abort(grpc_code(error), grpc_details(error))


def is_retryable(code: grpc.StatusCode | None) -> bool:
    return code in RETRYABLE_CODES


# A message that names its field the way every recserve check does: "k = 5,000 is
# invalid: ...", "exclude_ids[3] = 9,999 is out of range: ...", at its start or after a
# client's "recommender HOST:PORT: Recommend: INVALID_ARGUMENT: " prefix.
_FIELD_MESSAGE = re.compile(r"(?:^|: )(?P<field>[A-Za-z_][\w.]*(?:\[\d+\])?) = (?P<value>[^ ]+?):? is ")


def http_error_body(error: BaseException, request_id: str) -> tuple[int, dict[str, Any]]:
    """The HTTP status and JSON error body for any exception: the one shape every
    gateway error has (docs/architecture.md §3, "The HTTP gateway")::

        {"error": {"status": 422, "kind": "unprocessable", "field": "k", "value": 0,
                   "message": "k = 0 is out of range: use 1..1000"}, "request_id": "..."}

    ``field`` / ``value`` come from an :class:`~recserve.errors.InvalidField`, or, for a
    downstream status, from a message that starts ``FIELD = VALUE is ...``; otherwise
    None. Unknown exceptions are a 500 that names only their type (their text may hold
    anything)."""
    status = http_status(error)
    field: str | None = None
    value: object = None
    if isinstance(error, RecserveError):
        kind = error.kind.value
        message = error.message
        if isinstance(error, InvalidField):
            field, value = error.field, error.value
        else:
            match = _FIELD_MESSAGE.search(message)
            if match is not None:
                field, text = match["field"], match["value"]
                digits = text.replace(",", "")
                value = int(digits) if digits.lstrip("-").isdigit() else text
    else:
        kind = ErrorKind.INTERNAL.value
        message = f"internal error: {type(error).__name__}"
    body = {"error": {"status": status, "kind": kind, "field": field, "value": value, "message": message}, "request_id": request_id}
    return status, body


def retry_after_header(error: BaseException) -> str | None:
    """The HTTP ``Retry-After`` value (whole seconds, at least 1) for an error that
    carries a retry hint; None otherwise. 429 and 503 answers always carry one: a
    rejection without a hint says 1 s."""
    hint = error.retry_after_s if isinstance(error, RecserveError) else None
    if hint is None and http_status(error) not in (429, 503):
        return None
    return str(max(1, math.ceil(hint or 1.0)))
