"""The one place that maps recserve errors to gRPC and HTTP statuses."""

from __future__ import annotations

import grpc

from recserve.errors import ErrorKind, InternalError, RecserveError

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
}

# Codes a client may retry or hedge on another replica; everything else is final.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED})

KIND_OF_CODE: dict[grpc.StatusCode, ErrorKind] = {code: kind for kind, code in GRPC_CODE.items()}


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
