"""The Python client of recserve: ``Recommend`` on the cascade and ``Rank`` on the
rankers, over gRPC, async (:class:`RecClient`) and blocking (:class:`SyncRecClient`).

This is what a feed service (``examples/feed_service.py``) and the HTTP gateway use.
Each call takes its deadline as an argument (``timeout_s`` and / or ``deadline`` on the
client's clock) and sends it both in ``RequestHeader.deadline_unix_ms`` and as the gRPC
deadline. Both methods are reads, so both are retried on a retryable status
(UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) on another replica, within the
router's retry budget (at most ``retry_budget`` extra calls per call, 10% by default):
:class:`recserve.client.routed.RoutedCalls` for the recommenders, a
:class:`~recserve.client.RankingClient` for the rankers. Failures raise the
:class:`~recserve.errors.RecserveError` of the downstream status
(:func:`recserve.rpc.status.error_from_code`), with ``retry_after_s`` when the server
gave one.

Async example::

    async with RecClient(["127.0.0.1:7300"], rankers=["127.0.0.1:7100"]) as client:
        rec = await client.recommend(42, k=20, timeout_s=0.1)
        rec.item_ids, rec.scores          # int64 [20], float32 [20], best first
        ranked = await client.rank(42, [7, 3, 9], timeout_s=0.05)

Blocking example (a private event loop in a daemon thread)::

    with SyncRecClient(["127.0.0.1:7300"]) as client:
        rec = client.recommend(42, k=20, timeout_s=0.1)
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from recserve.client.ranking import RankingClient, RankResult
from recserve.client.routed import CallStats, RoutedCalls, StubFactory, ids_arg
from recserve.config.spec import TlsConfig
from recserve.errors import FailedPrecondition, InternalError, InvalidArgument
from recserve.routing import RoutingConfig
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import common_pb2, recommender_pb2, recommender_pb2_grpc

__all__ = ["RECOMMENDER_SERVICE", "RecClient", "Recommendation", "StageReport", "SyncRecClient"]

RECOMMENDER_SERVICE = recommender_pb2.DESCRIPTOR.services_by_name["Recommender"].full_name

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class StageReport:
    """What one cascade stage did for a request (``recserve.v1.StageReport``)."""

    stage: str  # "L0".."L3"
    budget_ms: float
    elapsed_ms: float
    in_count: int  # candidates entering the stage
    out_count: int  # candidates leaving it
    degraded: bool
    degraded_reason: str  # "", "skipped_budget", "shrunk_input", "lookup_missing", "timeout", "cold_start"
    coverage: float  # fraction of the intended candidates the stage scored, 0..1


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """One ``Recommend`` answer. The arrays are read-only views over the reply's bytes."""

    item_ids: np.ndarray  # int64 [k], best first
    scores: np.ndarray  # float32 [k], the last stage's scores (only the order compares across items)
    stages: tuple[StageReport, ...]
    coverage: float
    degraded: bool
    degraded_reason: str  # "", "cold_start", or the first degraded stage's reason
    index_version: str  # the L0 index that retrieved the candidates
    model_version: str  # the export whose models scored them
    replica: str  # the recommender that answered
    attempts: int  # RPCs sent for this call (1 + retries)


class RecClient:
    """Async client of recserve's recommenders (and, optionally, its rankers).

    Args:
        recommenders: ``host:port`` of each cascade (Recommender) replica.
        rankers: ``host:port`` of each ranker replica; empty: :meth:`rank` is refused.
        config: the routing section of the spec (two choices, breakers, retry budget),
            one router per replica set.
        clock: monotonic seconds; the timeline of ``deadline`` arguments and of the
            routers (a fake clock must tick in seconds: gRPC timeouts are differences).
        rng: random generator for two choices (seed it in tests).
        stub_factory / ranking_stub_factory: address -> stub, replacing the channels
            (unit tests' fakes).
        tls: the spec's ``[tls]`` (channels over TLS when it is enabled).
        api_key: this client's tenant API key, sent as ``x-api-key`` call metadata on
            both replica sets (``""`` = none: the key-less tenant).
    """

    def __init__(
        self,
        recommenders: Sequence[str],
        rankers: Sequence[str] = (),
        config: RoutingConfig = RoutingConfig(),
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: np.random.Generator | None = None,
        max_message_bytes: int = 64 << 20,
        stub_factory: StubFactory | None = None,
        ranking_stub_factory: StubFactory | None = None,
        tls: TlsConfig | None = None,
        api_key: str = "",
    ) -> None:
        self._calls = RoutedCalls(
            recommenders, recommender_pb2_grpc.RecommenderStub, service=RECOMMENDER_SERVICE, what="recommender", config=config, rng=rng,
            clock=clock, max_message_bytes=max_message_bytes, stub_factory=stub_factory, tls=tls, api_key=api_key,
        )  # fmt: skip
        self.router = self._calls.router
        self.stats: CallStats = self._calls.stats  # Recommend calls; rank's are self.ranking.stats
        self.clock = clock  # public: callers put their deadlines on this timeline
        self.ranking: RankingClient | None = None
        if rankers:
            self.ranking = RankingClient(rankers, config, rng=rng, clock=clock, max_message_bytes=max_message_bytes, stub_factory=ranking_stub_factory, tls=tls, api_key=api_key)

    @property
    def recommenders(self) -> tuple[str, ...]:
        """The recommender replicas now: a name among the addresses stands for the pods it
        resolves to, re-resolved every ``[routing] dns_refresh_ms`` (:mod:`recserve.routing.resolve`)."""
        return self._calls.addresses

    # ---- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Open the channels (inside the running loop; connecting is lazy)."""
        await self._calls.start()
        if self.ranking is not None:
            await self.ranking.start()

    async def aclose(self) -> None:
        """Close every channel; RPCs still out end CANCELLED."""
        await self._calls.aclose()
        if self.ranking is not None:
            await self.ranking.aclose()

    async def __aenter__(self) -> RecClient:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def check_ready(self, timeout_s: float = 1.0) -> dict[str, bool]:
        """address -> whether it reports its service SERVING on gRPC health (every
        recommender, then every ranker; checked concurrently)."""
        ready = await self._calls.check_ready(timeout_s)
        if self.ranking is not None:
            ready.update(await self.ranking.check_ready(timeout_s))
        return ready

    # ---- RPCs ---------------------------------------------------------------------

    async def recommend(
        self,
        user_id: int,
        k: int = 0,
        *,
        timeout_s: float | None = None,
        deadline: float | None = None,
        exclude_ids: np.ndarray | Sequence[int] | None = None,
        recent_item_ids: np.ndarray | Sequence[int] | None = None,
        tenant: str = "default",
        priority: str = "standard",
        request_id: str = "",
    ) -> Recommendation:
        """The top ``k`` items for ``user_id`` through the L0-L3 cascade.

        ``k``: 0 = the server's default. ``exclude_ids`` (int64 [E]): items never to
        return; ``recent_item_ids`` (int64 [R]): items interacted with since the last
        log, added to the history for this request and excluded. ``timeout_s`` /
        ``deadline`` (on :attr:`clock`): the earlier wins; neither means the server's
        default deadline. ``request_id``: in the header of every attempt, and in
        the log lines of every process the call reaches (``""``: the id of the request
        this call serves, else a fresh one). Routing cost: 1.

        Example: ``await client.recommend(7, k=3, timeout_s=0.1)`` -> Recommendation
        with ``item_ids`` int64 [3] and ``scores`` float32 [3].
        """
        if k < 0:
            raise InvalidArgument(f"k = {k} is negative; pass 0 (the server's default) or the number of items wanted")
        packed_exclude = None if exclude_ids is None else pack(ids_arg(exclude_ids, "exclude_ids"))
        packed_recent = None if recent_item_ids is None else pack(ids_arg(recent_item_ids, "recent_item_ids"))

        def build(header: common_pb2.RequestHeader) -> recommender_pb2.RecommendRequest:
            request = recommender_pb2.RecommendRequest(header=header, user_id=int(user_id), k=int(k))
            if packed_exclude is not None:
                request.exclude_ids.CopyFrom(packed_exclude)
            if packed_recent is not None:
                request.recent_item_ids.CopyFrom(packed_recent)
            return request

        response, replica, attempts = await self._calls.call(
            "Recommend", build, cost=1.0, deadline=self._calls.deadline(timeout_s, deadline), tenant=tenant, priority=priority,
            request_id=request_id, client="RecClient",
        )  # fmt: skip
        reply: recommender_pb2.RecommendResponse = response
        try:
            item_ids = unpack(reply.item_ids, "RecommendResponse.item_ids", expect_dtype=common_pb2.INT64, expect_ndim=1)
            scores = unpack(reply.scores, "RecommendResponse.scores", expect_dtype=common_pb2.FLOAT32, expect_ndim=1)
        except InvalidArgument as exc:
            raise InternalError(f"recommender {replica}: Recommend: malformed reply: {exc.message}") from None
        if item_ids.shape[0] != scores.shape[0]:
            raise InternalError(f"recommender {replica}: Recommend: reply has {item_ids.shape[0]} item_ids and {scores.shape[0]} scores")
        stages = tuple(  # one per stage (at most four): not a per-item loop
            StageReport(s.stage, s.budget_ms, s.elapsed_ms, int(s.in_count), int(s.out_count), s.degraded, s.degraded_reason, s.coverage)
            for s in reply.stages
        )
        return Recommendation(
            item_ids=item_ids, scores=scores, stages=stages, coverage=reply.coverage, degraded=reply.degraded,
            degraded_reason=reply.degraded_reason, index_version=reply.index_version, model_version=reply.model_version,
            replica=replica, attempts=attempts,
        )  # fmt: skip

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
        """Scores of ``candidate_ids`` (int64 [C]) for ``user_id``, best first, from the
        rankers (:meth:`RankingClient.rank`; ``model`` ``""`` = dlrm)."""
        if self.ranking is None:
            raise FailedPrecondition("RecClient.rank: the client has no rankers; pass rankers=['host:port', ...]")
        return await self.ranking.rank(
            user_id, candidate_ids, model=model, history_item_ids=history_item_ids, timeout_s=timeout_s, deadline=deadline, tenant=tenant,
            priority=priority, request_id=request_id,
        )  # fmt: skip


class SyncRecClient:
    """:class:`RecClient` with blocking methods of the same signatures, for code that
    has no event loop (a Flask / Django view, a notebook, a batch job).

    It owns one private event loop running in a daemon thread; each call is submitted
    to it with :func:`asyncio.run_coroutine_threadsafe` and waited for, so calls from
    several threads share one set of channels and one router (its retry budget and
    breakers see all of them). Interrupting the wait (KeyboardInterrupt) cancels the
    RPC. Call :meth:`close` (or use ``with``) to close the channels and stop the thread.
    Arguments: those of :class:`RecClient`.
    """

    def __init__(
        self,
        recommenders: Sequence[str],
        rankers: Sequence[str] = (),
        config: RoutingConfig = RoutingConfig(),
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: np.random.Generator | None = None,
        max_message_bytes: int = 64 << 20,
        stub_factory: StubFactory | None = None,
        ranking_stub_factory: StubFactory | None = None,
        tls: TlsConfig | None = None,
        api_key: str = "",
    ) -> None:
        self._client = RecClient(recommenders, rankers, config, clock=clock, rng=rng, max_message_bytes=max_message_bytes,
                                 stub_factory=stub_factory, ranking_stub_factory=ranking_stub_factory, tls=tls, api_key=api_key)  # fmt: skip
        self.clock = self._client.clock
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="recserve-client", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._run(self._client.start())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def client(self) -> RecClient:
        """The async client behind this one (its ``stats``, ``router``)."""
        return self._client

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise FailedPrecondition("SyncRecClient: the client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt in the caller: cancel the RPC (a no-op once done)
            raise

    def recommend(
        self,
        user_id: int,
        k: int = 0,
        *,
        timeout_s: float | None = None,
        deadline: float | None = None,
        exclude_ids: np.ndarray | Sequence[int] | None = None,
        recent_item_ids: np.ndarray | Sequence[int] | None = None,
        tenant: str = "default",
        priority: str = "standard",
        request_id: str = "",
    ) -> Recommendation:
        """Blocking :meth:`RecClient.recommend`."""
        return self._run(self._client.recommend(
            user_id, k, timeout_s=timeout_s, deadline=deadline, exclude_ids=exclude_ids, recent_item_ids=recent_item_ids, tenant=tenant,
            priority=priority, request_id=request_id,
        ))  # fmt: skip

    def rank(
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
        """Blocking :meth:`RecClient.rank`."""
        return self._run(self._client.rank(
            user_id, candidate_ids, model=model, history_item_ids=history_item_ids, timeout_s=timeout_s, deadline=deadline, tenant=tenant,
            priority=priority, request_id=request_id,
        ))  # fmt: skip

    def check_ready(self, timeout_s: float = 1.0) -> dict[str, bool]:
        """Blocking :meth:`RecClient.check_ready`."""
        return self._run(self._client.check_ready(timeout_s))

    def close(self) -> None:
        """Close the channels and stop the loop's thread (idempotent)."""
        if self._closed:
            return
        try:
            self._run(self._client.aclose())
        finally:
            self._closed = True
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncRecClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
