"""The Ranking client: ``Rank`` and ``EmbedUser`` over a replica set, routed by
:class:`recserve.routing.Router` (docs/architecture.md §9).

One grpc.aio channel per ranker replica; every call goes through the one router and
retry loop of :class:`recserve.client.routed.RoutedCalls` (two choices on in-flight
candidates, ``EmbedUser`` costing 1; the deadline as the gRPC timeout and in the header;
retryable statuses retried on another replica within the shared retry budget; any other
status final). Failures surface as the :class:`~recserve.errors.RecserveError` of the
ranker's status, the message naming the replica and the method; when no replica can take
the call the router's :class:`~recserve.errors.Unavailable` (with ``retry_after_s``)
propagates. Cancelling the caller cancels the RPC and reports CANCELLED to the router.

No hedging yet: :meth:`Router.can_hedge` and :meth:`Router.hedge_delay` exist for a
later second call while the first is still out, spending the same budget.

Example::

    async with RankingClient(["127.0.0.1:7100", "127.0.0.1:7101"]) as client:
        result = await client.rank(42, np.array([7, 3, 9], dtype=np.int64), timeout_s=0.05)
        result.item_ids, result.scores      # int64 [3], float32 [3], best first
        vector = (await client.embed_user(42)).vector   # float32 [d]
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from types import TracebackType

import numpy as np

from recserve.client.routed import CallStats, RoutedCalls, StubFactory, ids_arg
from recserve.config.spec import TlsConfig
from recserve.errors import InternalError, InvalidArgument
from recserve.routing import RoutingConfig
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import common_pb2, ranking_pb2, ranking_pb2_grpc

__all__ = ["EmbedResult", "RankResult", "RankingClient", "RankingClientStats"]

RANKING_SERVICE = ranking_pb2.DESCRIPTOR.services_by_name["Ranking"].full_name


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


# The counters of :class:`RoutedCalls` (attempts, retries, retries refused by the budget).
RankingClientStats = CallStats


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
        stub_factory: address -> stub, replacing the channels (unit tests' fakes).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        config: RoutingConfig = RoutingConfig(),
        *,
        rng: np.random.Generator | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_message_bytes: int = 64 << 20,
        stub_factory: StubFactory | None = None,
        tls: TlsConfig | None = None,  # the spec's [tls]: channels over TLS when enabled
        api_key: str = "",  # this client's tenant API key (x-api-key metadata); "" = none
    ) -> None:
        self._calls = RoutedCalls(
            addresses, ranking_pb2_grpc.RankingStub, service=RANKING_SERVICE, what="ranker", config=config, rng=rng, clock=clock,
            max_message_bytes=max_message_bytes, stub_factory=stub_factory, tls=tls, api_key=api_key,
        )  # fmt: skip
        self.router = self._calls.router
        self.stats: RankingClientStats = self._calls.stats
        self.clock = clock  # public: callers put their deadlines on this timeline

    @property
    def addresses(self) -> tuple[str, ...]:
        """The ranker replicas now: a name among the addresses stands for the pods it
        resolves to, re-resolved every ``[routing] dns_refresh_ms`` (:mod:`recserve.routing.resolve`)."""
        return self._calls.addresses

    # ---- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Open one channel per replica (inside the running loop: grpc.aio binds a
        channel to the loop that made it). Connecting is lazy, so a replica that is down
        now costs nothing until it is picked."""
        await self._calls.start()

    async def aclose(self) -> None:
        """Close every channel; RPCs still out end CANCELLED."""
        await self._calls.aclose()

    async def check_ready(self, timeout_s: float = 1.0) -> dict[str, bool]:
        """address -> whether the replica reports ``recserve.v1.Ranking`` SERVING."""
        return await self._calls.check_ready(timeout_s)

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
        request_id: str = "",
    ) -> RankResult:
        """Scores of ``candidate_ids`` (int64 [C]) for ``user_id``, best first.

        ``model``: ``""`` (the server's default, dlrm), ``"dlrm"``, ``"two_tower"``,
        ``"l3"``. ``history_item_ids`` (int64 [H]): recent items appended to the user's
        history for this call. ``timeout_s`` / ``deadline`` (on the client's clock): the
        earlier wins; neither means no deadline. ``request_id``: sent in the header of
        every attempt (``""``: the id of the request this call serves, else a fresh
        one). Routing cost: C candidates.

        Example: ``await client.rank(7, np.array([5, 9]))`` -> RankResult with
        ``item_ids`` a permutation of ``[5, 9]`` and ``scores`` float32 [2].
        """
        candidates = ids_arg(candidate_ids, "candidate_ids")
        history = None if history_item_ids is None else ids_arg(history_item_ids, "history_item_ids")

        def build(header: common_pb2.RequestHeader) -> ranking_pb2.RankRequest:
            request = ranking_pb2.RankRequest(header=header, user_id=int(user_id), model=model)
            request.candidate_ids.CopyFrom(packed_candidates)
            if packed_history is not None:
                request.history_item_ids.CopyFrom(packed_history)
            return request

        # Packed once: a retry resends the same bytes with a fresh header.
        packed_candidates = pack(candidates)
        packed_history = None if history is None else pack(history)
        response, replica, attempts = await self._calls.call(
            "Rank", build, cost=float(candidates.shape[0]), deadline=self._calls.deadline(timeout_s, deadline), tenant=tenant,
            priority=priority, request_id=request_id, client="RankingClient",
        )  # fmt: skip
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
        request_id: str = "",
    ) -> EmbedResult:
        """The user-tower vector (float32 [d]) of ``user_id``, with ``history_item_ids``
        (int64 [H]) appended to its history for this call. Routing cost: 1."""
        history = None if history_item_ids is None else ids_arg(history_item_ids, "history_item_ids")
        packed_history = None if history is None else pack(history)

        def build(header: common_pb2.RequestHeader) -> ranking_pb2.EmbedUserRequest:
            request = ranking_pb2.EmbedUserRequest(header=header, user_id=int(user_id))
            if packed_history is not None:
                request.history_item_ids.CopyFrom(packed_history)
            return request

        response, replica, attempts = await self._calls.call(
            "EmbedUser", build, cost=1.0, deadline=self._calls.deadline(timeout_s, deadline), tenant=tenant, priority=priority,
            request_id=request_id, client="RankingClient",
        )  # fmt: skip
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
