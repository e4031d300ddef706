"""The Ranking client: ``Rank`` and ``EmbedUser`` over a replica set, routed by
:class:`recserve.routing.Router` (docs/architecture.md §9).

One grpc.aio channel per ranker replica; every call goes through the one router:

1. ``router.pick(now, cost=C)`` chooses a replica by power of two choices on in-flight
   candidates (``EmbedUser`` costs 1), skipping replicas whose breaker is open;
2. the RPC carries the remaining deadline twice: as the gRPC timeout and as
   ``header.deadline_unix_ms`` (:func:`recserve.rpc.deadline.make_header`), so the
   server sees it whichever way it reads it;
3. ``router.on_result`` reports the status (feeding the breaker and the work signal);
4. a retryable status (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) is retried on
   another replica while the deadline has time left and ``router.can_retry`` grants a
   token from the shared retry budget (retries stay within ``retry_budget`` x primary
   calls + ``retry_burst``, whatever fails). Any other status is final and raised at once.

Failures surface as the :class:`~recserve.errors.RecserveError` of the ranker's status
(:func:`recserve.rpc.status.error_from_code`: the status crosses the hop unchanged), the
message naming the replica and the method. When no replica can take the call the
router's :class:`~recserve.errors.Unavailable` (with ``retry_after_s``) propagates.
Cancelling the caller cancels the RPC and reports CANCELLED to the router (no verdict on
the replica's health).

No hedging yet: :meth:`Router.can_hedge` and :meth:`Router.hedge_delay` exist for a
later second call while the first is still out, spending the same budget.

Example::

    async with RankingClient(["127.0.0.1:7100", "127.0.0.1:7101"]) as client:
        result = await client.rank(42, np.array([7, 3, 9], dtype=np.int64), timeout_s=0.05)
        result.item_ids, result.scores      # int64 [3], float32 [3], best first
        vector = (await client.embed_user(42)).vector   # float32 [d]
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import grpc
import numpy as np

from recserve.errors import DeadlineExceeded, FailedPrecondition, InternalError, InvalidArgument, Unavailable
from recserve.lookup.transport import channel_options
from recserve.routing import Router, RoutingConfig, is_retryable
from recserve.rpc.deadline import make_header
from recserve.rpc.status import error_from_code
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import common_pb2, ranking_pb2, ranking_pb2_grpc

__all__ = ["EmbedResult", "RankResult", "RankingClient", "RankingClientStats"]

@dataclasses.dataclass(frozen=True)
class RankResult:
    """One ``Rank`` answer. The arrays are read-only views over the reply's bytes."""

    item_ids: np.ndarray  # int64 [C], sorted by score descending
    scores: np.ndarray  # float32 [C], logits (two_tower: inner products)
    degraded: bool
    degraded_reason: str  # "", "cold_start", "lookup_missing" or both, comma-separated
    missing_rows: int  # id lookups answered with default rows
    model_version: str
    model: str
    replica: str  # the address that answered
    attempts: int  # RPCs sent for this call (1 + retries)


@dataclasses.dataclass(frozen=True)
class EmbedResult:
    """One ``EmbedUser`` answer. ``vector`` is a read-only view over the reply's bytes."""

    vector: np.ndarray  # float32 [d], unit length
    model_version: str
    degraded: bool
    degraded_reason: str
    missing_rows: int
    replica: str
    attempts: int


@dataclasses.dataclass
class RankingClientStats:
    """Counters since the client was built (all calls, both methods)."""

    attempts: int = 0  # RPCs sent, retries included
    retries: int = 0  # attempts after the first, granted by the retry budget
    retries_refused_by_budget: int = 0  # retryable failures raised because no token was left


def _ids(array: np.ndarray | Sequence[int], field: str) -> np.ndarray:
    """int64 [N] from an integer array; a float or 2-D array is a caller bug, named here
    rather than truncated or flattened silently."""
    a = np.asarray(array)
    if a.ndim != 1:
        raise InvalidArgument(f"{field} has shape {list(a.shape)}; pass a 1-D int64 array [N]")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise InvalidArgument(f"{field} has dtype {a.dtype.name}; pass integer item ids (int64)")
    return np.ascontiguousarray(a, dtype=np.int64)


def _retry_after_s(error: grpc.aio.AioRpcError) -> float | None:
    """The server's ``retry-after-ms`` trailer (set by :func:`recserve.rpc.status.abort_with`)."""
    trailers = error.trailing_metadata()
    value = trailers.get("retry-after-ms") if isinstance(trailers, grpc.aio.Metadata) else None
    try:
        return float(value) / 1e3 if value is not None else None
    except (TypeError, ValueError):
        return None  # a malformed hint is no hint


class RankingClient:
    """Async client of a set of Ranking replicas (see the module docstring).

    Args:
        addresses: ``host:port`` of each replica (distinct).
        config: the routing section of the spec (two choices, breakers, retry budget).
        rng: random generator for two choices (inject a seeded one in tests).
        clock: monotonic seconds; the router's clock, and the timeline of ``deadline``
            arguments (tests pass a fake one to drive breaker timing). gRPC timeouts are
            the differences ``deadline - clock()``, so a fake clock must tick in seconds.
        max_message_bytes: send / receive limit per channel.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        config: RoutingConfig = RoutingConfig(),
        *,
        rng: np.random.Generator | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        self.router = Router(addresses, config, rng=rng)
        self.addresses = self.router.replicas
        self.stats = RankingClientStats()
        self.clock = clock  # public: callers put their deadlines on this timeline
        self._options = channel_options(max_message_bytes)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, ranking_pb2_grpc.RankingStub] = {}

    # ---- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Open one channel per replica (inside the running loop: grpc.aio binds a
        channel to the loop that made it). Connecting is lazy, so a replica that is down
        now costs nothing until it is picked."""
        if self._channels:
            return
        for address in self.addresses:
            channel = grpc.aio.insecure_channel(address, options=self._options)
            self._channels[address] = channel
            self._stubs[address] = ranking_pb2_grpc.RankingStub(channel)

    async def aclose(self) -> None:
        """Close every channel; RPCs still out end CANCELLED."""
        channels = list(self._channels.values())
        self._channels.clear()
        self._stubs.clear()
        await asyncio.gather(*(c.close(None) for c in channels))

    async def __aenter__(self) -> RankingClient:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    # ---- RPCs ---------------------------------------------------------------------

    async def rank(
        self,
        user_id: int,
        candidate_ids: np.ndarray | Sequence[int],
        *,
        model: str = "",
        history_item_ids: np.ndarray | Sequence[int] | None = None,
        timeout_s: float | None = None,
        deadline: float | None = None,
        tenant: str = "default",
        priority: str = "standard",
    ) -> RankResult:
        """Scores of ``candidate_ids`` (int64 [C]) for ``user_id``, best first.

        ``model``: ``""`` (the server's default, dlrm), ``"dlrm"``, ``"two_tower"``,
        ``"l3"``. ``history_item_ids`` (int64 [H]): recent items appended to the user's
        history for this call. ``timeout_s`` / ``deadline`` (on the client's clock): the
        earlier wins; neither means no deadline. Routing cost: C candidates.

        Example: ``await client.rank(7, np.array([5, 9]))`` -> RankResult with
        ``item_ids`` a permutation of ``[5, 9]`` and ``scores`` float32 [2].
        """
        candidates = _ids(candidate_ids, "candidate_ids")
        history = None if history_item_ids is None else _ids(history_item_ids, "history_item_ids")

        def build(header: common_pb2.RequestHeader) -> ranking_pb2.RankRequest:
            request = ranking_pb2.RankRequest(header=header, user_id=int(user_id), model=model)
            request.candidate_ids.CopyFrom(packed_candidates)
            if packed_history is not None:
                request.history_item_ids.CopyFrom(packed_history)
            return request

        # Packed once: a retry resends the same bytes with a fresh header.
        packed_candidates = pack(candidates)
        packed_history = None if history is None else pack(history)
        response, replica, attempts = await self._call(
            "Rank", build, cost=float(candidates.shape[0]), deadline=self._deadline(timeout_s, deadline), tenant=tenant, priority=priority
        )
        reply: ranking_pb2.RankResponse = response
        try:
            item_ids = unpack(reply.item_ids, "RankResponse.item_ids", expect_dtype=common_pb2.INT64, expect_ndim=1)
            scores = unpack(reply.scores, "RankResponse.scores", expect_dtype=common_pb2.FLOAT32, expect_ndim=1)
        except InvalidArgument as exc:
            raise InternalError(f"ranker {replica}: Rank: malformed reply: {exc.message}") from None
        # The answer must cover the request: one score per candidate, nothing dropped.
        if item_ids.shape[0] != candidates.shape[0] or scores.shape[0] != candidates.shape[0]:
            raise InternalError(
                f"ranker {replica}: Rank: {candidates.shape[0]} candidates sent, reply has "
                f"{item_ids.shape[0]} item_ids and {scores.shape[0]} scores"
            )
        return RankResult(
            item_ids=item_ids,
            scores=scores,
            degraded=reply.degraded,
            degraded_reason=reply.degraded_reason,
            missing_rows=int(reply.missing_rows),
            model_version=reply.model_version,
            model=reply.model,
            replica=replica,
            attempts=attempts,
        )

    async def embed_user(
        self,
        user_id: int,
        *,
        history_item_ids: np.ndarray | Sequence[int] | None = None,
        timeout_s: float | None = None,
        deadline: float | None = None,
        tenant: str = "default",
        priority: str = "standard",
    ) -> EmbedResult:
        """The user-tower vector (float32 [d]) of ``user_id``, with ``history_item_ids``
        (int64 [H]) appended to its history for this call. Routing cost: 1."""
        history = None if history_item_ids is None else _ids(history_item_ids, "history_item_ids")
        packed_history = None if history is None else pack(history)

        def build(header: common_pb2.RequestHeader) -> ranking_pb2.EmbedUserRequest:
            request = ranking_pb2.EmbedUserRequest(header=header, user_id=int(user_id))
            if packed_history is not None:
                request.history_item_ids.CopyFrom(packed_history)
            return request

        response, replica, attempts = await self._call(
            "EmbedUser", build, cost=1.0, deadline=self._deadline(timeout_s, deadline), tenant=tenant, priority=priority
        )
        reply: ranking_pb2.EmbedUserResponse = response
        try:
            vector = unpack(reply.vector, "EmbedUserResponse.vector", expect_dtype=common_pb2.FLOAT32, expect_ndim=1)
        except InvalidArgument as exc:
            raise InternalError(f"ranker {replica}: EmbedUser: malformed reply: {exc.message}") from None
        return EmbedResult(
            vector=vector,
            model_version=reply.model_version,
            degraded=reply.degraded,
            degraded_reason=reply.degraded_reason,
            missing_rows=int(reply.missing_rows),
            replica=replica,
            attempts=attempts,
        )

    # ---- the routed call ----------------------------------------------------------

    def _deadline(self, timeout_s: float | None, deadline: float | None) -> float:
        """The call's deadline on the client's clock (``math.inf``: none)."""
        if timeout_s is not None and not timeout_s > 0:
            raise InvalidArgument(f"timeout_s is {timeout_s}; use a positive number of seconds (or None for no deadline)")
        out = math.inf if deadline is None else deadline
        if timeout_s is not None:
            out = min(out, self.clock() + timeout_s)
        return out

    async def _call(
        self,
        method: str,
        build: Callable[[common_pb2.RequestHeader], Any],
        *,
        cost: float,
        deadline: float,
        tenant: str,
        priority: str,
    ) -> tuple[Any, str, int]:
        """Send ``method`` through the router until it answers, fails for good, the
        deadline passes or the retry budget refuses. Returns (reply, replica, attempts)."""
        if not self._stubs:
            raise FailedPrecondition(f"RankingClient.{method}: the client is not started; call await start() (or use async with)")
        router = self.router
        request_id = uuid.uuid4().hex  # one id across attempts: the servers' logs join them
        retry_of: str | None = None
        failure = ""  # the last failed attempt, for the message
        attempts = 0
        while True:
            now = self.clock()
            remaining = deadline - now
            if remaining <= 0:
                raise DeadlineExceeded(
                    f"ranker {method}: the deadline passed {-remaining * 1e3:.1f} ms ago"
                    + (f", after {attempts} attempts (last on {retry_of})" if attempts else ", before the first attempt")
                )
            try:
                replica = router.pick(now, cost=cost, retry_of=retry_of)
            except Unavailable as exc:  # every breaker open: fail fast, naming the first failure
                if retry_of is None:
                    raise
                raise Unavailable(f"{exc.message}; after {failure}", retry_after_s=exc.retry_after_s) from None
            attempts += 1
            self.stats.attempts += 1
            self.stats.retries += retry_of is not None
            timeout = None if math.isinf(remaining) else remaining
            request = build(make_header(timeout_s=timeout, tenant=tenant, priority=priority, request_id=request_id))
            call = getattr(self._stubs[replica], method)(request, timeout=timeout)
            # Anything escaping the await other than a status (the caller's cancellation,
            # the channel closed under us) is no verdict on the replica: CANCELLED.
            code = grpc.StatusCode.CANCELLED
            try:
                reply = await call
                code = grpc.StatusCode.OK
                return reply, replica, attempts
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                failure = f"ranker {replica}: {method}: {code.name}: {exc.details() or ''}"
                retry_after = _retry_after_s(exc)
            except asyncio.CancelledError:
                call.cancel()
                raise
            finally:
                end = self.clock()
                router.on_result(replica, _verdict(code, timeout, router.hedge_delay(replica)), end - now, end, cost=cost)
            refusal = self._why_not_retry(code, deadline)
            if refusal is not None:
                error = error_from_code(code, failure + refusal)
                error.retry_after_s = retry_after
                raise error
            retry_of = replica

    def _why_not_retry(self, code: grpc.StatusCode, deadline: float) -> str | None:
        """None when a failed attempt may be retried (a budget token is then spent),
        else what to add to its error message ("" when the status says it all)."""
        if not is_retryable(code):
            return ""  # the answer of a healthy replica: retrying cannot change it
        if deadline - self.clock() <= 0:
            return " (not retried: the deadline has passed)"
        if not self.router.can_retry(code):
            self.stats.retries_refused_by_budget += 1
            return " (not retried: the retry budget is spent)"
        return None


def _verdict(code: grpc.StatusCode, timeout_s: float | None, usual_s: float) -> grpc.StatusCode:
    """The status the router should judge the replica by. A DEADLINE_EXCEEDED on a call
    whose whole timeout was shorter than the replica's usual latency (its hedge-delay
    percentile) says the caller's budget was tight, not that the replica is sick: the
    cascade's stages set such deadlines on purpose, and three of them must not open a
    healthy ranker's breaker. It is reported as CANCELLED (no verdict; the time waited
    still feeds the latency estimate)."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout_s is not None and timeout_s < usual_s:
        return grpc.StatusCode.CANCELLED
    return code
