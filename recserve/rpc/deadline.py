"""Deadline and header helpers used at every process edge (docs/architecture.md §3).

The effective deadline of a request is ``min(gRPC deadline, header.deadline_unix_ms)``,
converted once to ``time.monotonic()`` seconds; internals only ever see monotonic time.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

from recserve.errors import DeadlineExceeded, InvalidArgument
from recserve.logs import inherited_request_id
from recserve.v1 import common_pb2

PRIORITY_NAMES = {
    common_pb2.CRITICAL: "critical",
    common_pb2.STANDARD: "standard",
    common_pb2.BEST_EFFORT: "best_effort",
    common_pb2.PRIORITY_UNSPECIFIED: "standard",
}
PRIORITY_ENUMS = {"critical": common_pb2.CRITICAL, "standard": common_pb2.STANDARD, "best_effort": common_pb2.BEST_EFFORT}


@dataclasses.dataclass(frozen=True)
class RequestContext:
    """The parsed header: what internals see."""

    request_id: str
    tenant: str
    priority: str  # "critical" | "standard" | "best_effort"
    deadline: float  # monotonic seconds; math.inf when the caller set none


def monotonic_deadline(
    deadline_unix_ms: int,
    grpc_time_remaining_s: float | None,
    *,
    default_timeout_s: float | None = None,
    now_unix_s: float | None = None,
    now_monotonic_s: float | None = None,
) -> float:
    """Combine a wall-clock header deadline and a gRPC remaining time into one
    monotonic deadline. Returns ``math.inf`` when neither is set and no default."""
    wall = time.time() if now_unix_s is None else now_unix_s
    mono = time.monotonic() if now_monotonic_s is None else now_monotonic_s
    candidates: list[float] = []
    if deadline_unix_ms < 0:
        raise InvalidArgument(f"header.deadline_unix_ms is {deadline_unix_ms}; it must be >= 0 (0 = none)")
    if deadline_unix_ms > 0:
        candidates.append(mono + (deadline_unix_ms / 1000.0 - wall))
    if grpc_time_remaining_s is not None:
        candidates.append(mono + grpc_time_remaining_s)
    if not candidates:
        return mono + default_timeout_s if default_timeout_s is not None else float("inf")
    return min(candidates)


def context_from_header(
    header: common_pb2.RequestHeader,
    grpc_time_remaining_s: float | None = None,
    *,
    default_timeout_s: float | None = None,
) -> RequestContext:
    """Parse and validate a RequestHeader at the edge. Raises DeadlineExceeded if the
    deadline has already passed, InvalidArgument for an unknown priority."""
    if header.priority not in PRIORITY_NAMES:
        raise InvalidArgument(f"header.priority is {header.priority}; use CRITICAL (1), STANDARD (2) or BEST_EFFORT (3)")
    deadline = monotonic_deadline(header.deadline_unix_ms, grpc_time_remaining_s, default_timeout_s=default_timeout_s)
    if deadline <= time.monotonic():
        raise DeadlineExceeded(f"request {header.request_id or '?'} arrived after its deadline (deadline_unix_ms={header.deadline_unix_ms})")
    return RequestContext(
        request_id=header.request_id or uuid.uuid4().hex,
        tenant=header.tenant or "default",
        priority=PRIORITY_NAMES[header.priority],
        deadline=deadline,
    )


def make_header(
    *,
    timeout_s: float | None = None,
    tenant: str = "default",
    priority: str = "standard",
    request_id: str | None = None,
) -> common_pb2.RequestHeader:
    """Build a header for an outgoing request, with ``deadline_unix_ms`` from ``timeout_s``.
    ``request_id`` None / ``""``: the id of the request this call is made for (bound by
    the server edge, :mod:`recserve.logs`), so every hop's log lines carry one id; a
    fresh one outside any request."""
    if priority not in PRIORITY_ENUMS:
        raise InvalidArgument(f"priority {priority!r} is not one of {sorted(PRIORITY_ENUMS)}")
    deadline_ms = int((time.time() + timeout_s) * 1000) if timeout_s is not None else 0
    return common_pb2.RequestHeader(
        request_id=request_id or inherited_request_id() or uuid.uuid4().hex,
        tenant=tenant,
        priority=PRIORITY_ENUMS[priority],  # type: ignore[arg-type]
        deadline_unix_ms=deadline_ms,
    )
