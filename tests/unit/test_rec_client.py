"""RecClient and SyncRecClient over fake stubs and a fake clock: no sockets.

The fakes stand in for grpc.aio stubs (``stub.Recommend(request, timeout=...)`` returns
an awaitable call with ``cancel()``), scripted per replica with explicit setters; the
client, its router and retry budget are real. The integration test
(tests/integration/test_rec_client.py) runs the same client against a real cluster.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import numpy as np
import pytest

from recserve.client import RecClient, Recommendation, SyncRecClient
from recserve.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from recserve.routing import RoutingConfig
from recserve.rpc.deadline import PRIORITY_ENUMS
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import common_pb2, ranking_pb2, recommender_pb2

WAIT_S = 10.0  # guard on event waits only: a hang fails the test instead of stalling it
A, B = "rec-a:7300", "rec-b:7300"


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def rpc_error(code: grpc.StatusCode, details: str, retry_after_ms: int | None = None) -> grpc.aio.AioRpcError:
    trailers = grpc.aio.Metadata() if retry_after_ms is None else grpc.aio.Metadata(("retry-after-ms", str(retry_after_ms)))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, details=details, debug_error_string="")


class FakeCall:
    """One RPC in flight: awaiting it runs the stub's script; ``cancel()`` is recorded."""

    def __init__(self, stub: FakeStub, request: Any) -> None:
        self.stub = stub
        self.request = request
        self.cancelled = False

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def __await__(self) -> Any:
        return self.stub.answer(self.request).__await__()


class FakeStub:
    """A Recommender (or Ranking) stub for one replica. Modes: ``ok``; ``error`` (raise
    :attr:`error`); ``hold`` (park until cancelled, setting :attr:`arrived`).
    ``on_call`` runs before answering (e.g. to advance the fake clock)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"
        self.error: grpc.aio.AioRpcError | None = None
        self.requests: list[Any] = []
        self.timeouts: list[float | None] = []
        self.calls: list[FakeCall] = []
        self.arrived = asyncio.Event()
        self.on_call: Any = None

    def set_error(self, code: grpc.StatusCode, details: str = "", retry_after_ms: int | None = None) -> None:
        self.mode, self.error = "error", rpc_error(code, details or f"{self.name}: {code.name}", retry_after_ms)

    def set_ok(self) -> None:
        self.mode, self.error = "ok", None

    def set_hold(self) -> None:
        self.mode = "hold"

    def _call(self, request: Any, timeout: float | None = None) -> FakeCall:
        self.requests.append(request)
        self.timeouts.append(timeout)
        call = FakeCall(self, request)
        self.calls.append(call)
        return call

    Recommend = _call
    Rank = _call

    async def answer(self, request: Any) -> Any:
        if self.on_call is not None:
            self.on_call()
        if self.mode == "error":
            assert self.error is not None
            raise self.error
        if self.mode == "hold":
            self.arrived.set()
            await asyncio.Event().wait()  # until cancelled
        if isinstance(request, ranking_pb2.RankRequest):
            ids = unpack(request.candidate_ids, "candidate_ids")
            return ranking_pb2.RankResponse(item_ids=pack(ids[::-1].copy()), scores=pack(np.arange(ids.shape[0], 0, -1, dtype=np.float32)),
                                            model_version="m1", model=request.model or "dlrm")  # fmt: skip
        k = request.k or 3
        ids = np.arange(100, 100 + k, dtype=np.int64)
        return recommender_pb2.RecommendResponse(
            item_ids=pack(ids), scores=pack(np.linspace(1.0, 0.0, k, dtype=np.float32)), coverage=0.75, degraded=True,
            degraded_reason="shrunk_input", index_version="ix-7", model_version=f"m-{self.name}",
            stages=[recommender_pb2.StageReport(stage="L0", budget_ms=10.0, elapsed_ms=4.5, in_count=0, out_count=50, coverage=1.0),
                    recommender_pb2.StageReport(stage="L2", budget_ms=20.0, elapsed_ms=19.0, in_count=50, out_count=50, degraded=True,
                                                degraded_reason="shrunk_input", coverage=0.5)],
        )  # fmt: skip


def make_client(
    stubs: dict[str, FakeStub], clock: FakeClock, config: RoutingConfig = RoutingConfig(), rankers: dict[str, FakeStub] | None = None
) -> RecClient:
    return RecClient(
        list(stubs), list(rankers or {}), config, clock=clock, rng=np.random.default_rng(0), stub_factory=stubs.__getitem__,
        ranking_stub_factory=(rankers or {}).__getitem__,
    )  # fmt: skip


def test_recommend_sends_every_field_and_unpacks_the_reply() -> None:
    async def body() -> None:
        stub, clock = FakeStub("a"), FakeClock()
        client = make_client({A: stub}, clock)
        await client.start()
        before = time.time()
        rec = await client.recommend(7, 4, timeout_s=0.25, exclude_ids=[1, 2], recent_item_ids=np.array([9], dtype=np.int32),
                                     tenant="acme", priority="critical", request_id="req-1")  # fmt: skip
        after = time.time()
        (request,) = stub.requests
        assert (request.user_id, request.k) == (7, 4)
        assert unpack(request.exclude_ids, "e").tolist() == [1, 2] and unpack(request.recent_item_ids, "r").tolist() == [9]
        assert unpack(request.recent_item_ids, "r").dtype == np.int64
        header = request.header
        assert (header.request_id, header.tenant, header.priority) == ("req-1", "acme", PRIORITY_ENUMS["critical"])
        # The deadline goes down twice: as the gRPC timeout (exact on the fake clock) and
        # as an absolute wall-clock header deadline.
        assert stub.timeouts == [pytest.approx(0.25)]
        assert int((before + 0.25) * 1000) <= header.deadline_unix_ms <= int((after + 0.25) * 1000)
        assert isinstance(rec, Recommendation)
        assert rec.item_ids.tolist() == [100, 101, 102, 103] and rec.item_ids.dtype == np.int64
        assert rec.scores.dtype == np.float32 and rec.scores.shape == (4,)
        assert [s.stage for s in rec.stages] == ["L0", "L2"]
        assert rec.stages[1].degraded and rec.stages[1].degraded_reason == "shrunk_input" and rec.stages[1].coverage == 0.5
        assert rec.stages[0].out_count == 50 and rec.stages[0].elapsed_ms == 4.5
        assert (rec.coverage, rec.degraded, rec.index_version, rec.model_version) == (0.75, True, "ix-7", "m-a")
        assert (rec.replica, rec.attempts) == (A, 1)
        await client.aclose()

    asyncio.run(body())


def test_no_deadline_sends_no_timeout_and_a_fresh_request_id_per_call() -> None:
    async def body() -> None:
        stub = FakeStub("a")
        async with make_client({A: stub}, FakeClock()) as client:
            await client.recommend(1)
            await client.recommend(1)
        assert stub.timeouts == [None, None]
        assert [r.header.deadline_unix_ms for r in stub.requests] == [0, 0]
        ids = [r.header.request_id for r in stub.requests]
        assert all(ids) and ids[0] != ids[1]

    asyncio.run(body())


def test_retryable_status_is_retried_on_the_other_replica_with_the_same_request_id() -> None:
    async def body() -> None:
        down, up = FakeStub("a"), FakeStub("b")
        down.set_error(grpc.StatusCode.UNAVAILABLE)
        async with make_client({A: down, B: up}, FakeClock()) as client:
            for _ in range(4):  # two choices may pick either first; a pick of A must be retried on B
                rec = await client.recommend(3, timeout_s=1.0, request_id="r-9")
                assert rec.replica == B and rec.attempts in (1, 2)
            assert len(down.requests) >= 1, "two choices never picked the down replica: the test proves nothing"
            assert client.stats.retries == len(down.requests) and client.stats.attempts == 4 + len(down.requests)
        assert {r.header.request_id for r in down.requests + up.requests} == {"r-9"}

    asyncio.run(body())


@pytest.mark.parametrize(
    ("code", "error"), [(grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument), (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition)]
)
def test_non_retryable_status_is_final_and_raised_with_the_replica_named(code: grpc.StatusCode, error: type[Exception]) -> None:
    async def body() -> None:
        a, b = FakeStub("a"), FakeStub("b")
        a.set_error(code, "k = 5000 is out of range: use 1..1000")
        b.set_error(code, "k = 5000 is out of range: use 1..1000")
        async with make_client({A: a, B: b}, FakeClock()) as client:
            with pytest.raises(error) as caught:
                await client.recommend(3, 5000)
            assert len(a.requests) + len(b.requests) == 1 and client.stats.retries == 0
            assert "k = 5000" in str(caught.value) and ("rec-a" in str(caught.value) or "rec-b" in str(caught.value))
            assert client.router.stats.failures == 0  # an answer, not a sick replica

    asyncio.run(body())


def test_retries_stay_within_the_budget_and_the_last_error_carries_retry_after() -> None:
    async def body() -> None:
        a, b = FakeStub("a"), FakeStub("b")
        for stub in (a, b):
            stub.set_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", retry_after_ms=250)
        # Breakers never open here (high failure count), so only the budget limits retries.
        config = RoutingConfig(retry_budget=0.1, retry_burst=3.0, breaker_failures=10_000)
        calls = 50
        async with make_client({A: a, B: b}, FakeClock(), config) as client:
            errors = []
            for _ in range(calls):
                with pytest.raises(ResourceExhausted) as caught:
                    await client.recommend(3, timeout_s=1.0)
                errors.append(caught.value)
            stats = client.stats
            assert client.router.stats.primaries == calls
            assert stats.retries <= config.retry_budget * calls + config.retry_burst
            assert stats.retries >= config.retry_burst  # the burst was spent, then the budget refused
            assert stats.retries_refused_by_budget > 0
            assert stats.attempts == calls + stats.retries == len(a.requests) + len(b.requests)
        assert errors[-1].retry_after_s == pytest.approx(0.25)
        assert "retry budget is spent" in str(errors[-1])

    asyncio.run(body())


def test_a_deadline_passed_during_an_attempt_is_not_retried() -> None:
    async def body() -> None:
        a, b = FakeStub("a"), FakeStub("b")
        clock = FakeClock()
        for stub in (a, b):
            stub.set_error(grpc.StatusCode.UNAVAILABLE)
            stub.on_call = lambda: clock.advance(0.2)  # each attempt eats 200 ms
        async with make_client({A: a, B: b}, clock) as client:
            with pytest.raises(Unavailable) as caught:
                await client.recommend(3, timeout_s=0.15)
            assert len(a.requests) + len(b.requests) == 1
            assert "deadline has passed" in str(caught.value)
            # An absolute deadline already behind the clock: nothing is sent.
            with pytest.raises(DeadlineExceeded, match="before the first attempt"):
                await client.recommend(3, deadline=clock() - 0.01)
            assert len(a.requests) + len(b.requests) == 1

    asyncio.run(body())


def test_cancelling_the_caller_cancels_the_rpc_and_reports_cancelled() -> None:
    async def body() -> None:
        stub = FakeStub("a")
        stub.set_hold()
        async with make_client({A: stub}, FakeClock()) as client:
            task = asyncio.ensure_future(client.recommend(3, timeout_s=5.0))
            await asyncio.wait_for(stub.arrived.wait(), WAIT_S)
            assert client.router.inflight.tolist() == [1.0]
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert stub.calls[0].cancelled
            assert client.router.inflight.tolist() == [0.0] and client.router.stats.failures == 0
            assert client.stats.retries == 0

    asyncio.run(body())


def test_bad_arguments_are_named_before_any_rpc() -> None:
    async def body() -> None:
        stub = FakeStub("a")
        async with make_client({A: stub}, FakeClock()) as client:
            with pytest.raises(InvalidArgument, match="k = -1"):
                await client.recommend(3, -1)
            with pytest.raises(InvalidArgument, match="exclude_ids has dtype float64"):
                await client.recommend(3, exclude_ids=np.array([1.5]))
            with pytest.raises(InvalidArgument, match="timeout_s is 0"):
                await client.recommend(3, timeout_s=0)
        assert stub.requests == []
        with pytest.raises(FailedPrecondition, match="RecClient.Recommend: the client is not started"):
            await make_client({A: stub}, FakeClock()).recommend(3)

    asyncio.run(body())


def test_rank_goes_to_the_rankers_with_the_callers_request_id() -> None:
    async def body() -> None:
        rec, ranker = FakeStub("a"), FakeStub("r")
        async with make_client({A: rec}, FakeClock(), rankers={"ranker:7100": ranker}) as client:
            result = await client.rank(5, [10, 20, 30], model="l3", timeout_s=0.5, request_id="rid-2")
            assert result.item_ids.tolist() == [30, 20, 10] and result.model == "l3" and result.replica == "ranker:7100"
            (request,) = ranker.requests
            assert request.header.request_id == "rid-2" and ranker.timeouts == [pytest.approx(0.5)]
        assert rec.requests == []
        async with make_client({A: rec}, FakeClock()) as client:
            with pytest.raises(FailedPrecondition, match="no rankers"):
                await client.rank(5, [10])

    asyncio.run(body())


def test_sync_client_blocks_on_its_own_loop_and_closes() -> None:
    stub, ranker = FakeStub("a"), FakeStub("r")
    client = SyncRecClient([A], ["ranker:7100"], clock=FakeClock(), stub_factory={A: stub}.__getitem__,
                           ranking_stub_factory={"ranker:7100": ranker}.__getitem__)  # fmt: skip
    with client:
        rec = client.recommend(4, 2, timeout_s=0.5, request_id="s-1")
        assert rec.item_ids.tolist() == [100, 101] and rec.replica == A
        assert stub.requests[0].header.request_id == "s-1" and stub.timeouts == [pytest.approx(0.5)]
        assert client.rank(4, np.array([1, 2], dtype=np.int64)).item_ids.tolist() == [2, 1]
        # A downstream error crosses the thread as the same RecserveError.
        stub.set_error(grpc.StatusCode.INVALID_ARGUMENT, "user_id = -4 is out of range")
        with pytest.raises(InvalidArgument, match="user_id = -4"):
            client.recommend(-4)
        thread = client._thread
        assert thread.is_alive()
    assert not thread.is_alive()
    client.close()  # idempotent
    with pytest.raises(FailedPrecondition, match="closed"):
        client.recommend(4)
