"""RankingClient over in-process fake Ranking servers (grpc.aio on loopback).

The servers are fakes with explicit state setters (``set_mode``, a shared :class:`Hold`
that parks calls until released); the client, its router and the wire are real. The
router runs on a fake clock wherever timing matters (breakers), so nothing waits on wall
time; the only real-clock test checks that the deadline reaches the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import numpy as np
import pytest

from recserve.client import RankingClient
from recserve.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, RecserveError, Unavailable
from recserve.routing import BreakerState, RoutingConfig
from recserve.rpc.server import make_server
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import common_pb2, ranking_pb2, ranking_pb2_grpc

WAIT_S = 10.0  # guard on event waits only: a hang fails the test instead of stalling it


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Hold:
    """Parks calls at the fake servers until :meth:`release`; counts arrivals so a test
    waits for "n calls are at the servers" with an event, not a sleep."""

    def __init__(self) -> None:
        self.released = asyncio.Event()
        self.arrived = 0
        self._want = 0
        self._reached = asyncio.Event()

    def arrive(self) -> None:
        self.arrived += 1
        if self.arrived >= self._want:
            self._reached.set()

    async def until(self, n: int) -> None:
        self._want = n
        if self.arrived < n:
            self._reached.clear()
            await asyncio.wait_for(self._reached.wait(), WAIT_S)

    def release(self) -> None:
        self.released.set()


class FakeRanker(ranking_pb2_grpc.RankingServicer):
    """Scores candidate ``i`` as ``0.5 * i + bias``; EmbedUser returns
    ``[user_id, H, bias, 0]`` (H = history length). Modes: ``ok``, ``unavailable``,
    ``invalid``, ``precondition``, ``hold`` (park at :attr:`hold`)."""

    def __init__(self, name: str, bias: float) -> None:
        self.name = name
        self.bias = bias
        self.mode = "ok"
        self.hold: Hold | None = None
        self.calls = 0
        self.requests: list[Any] = []
        self.time_remaining: list[float | None] = []
        self.candidates_held = 0  # candidates of the calls parked here now
        self.cancelled = asyncio.Event()

    def set_mode(self, mode: str, hold: Hold | None = None) -> None:
        assert mode in ("ok", "unavailable", "invalid", "precondition", "hold")
        self.mode, self.hold = mode, hold

    async def _enter(self, request: Any, context: grpc.aio.ServicerContext, cost: int) -> None:
        self.calls += 1
        self.requests.append(request)
        self.time_remaining.append(context.time_remaining())
        if self.mode == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is draining")
        if self.mode == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.name}: candidate_ids[0] = -1 is out of range")
        if self.mode == "precondition":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.name}: model 'l3' is not loaded")
        if self.mode == "hold":
            assert self.hold is not None
            self.candidates_held += cost
            self.hold.arrive()
            try:
                await self.hold.released.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            finally:
                self.candidates_held -= cost

    async def Rank(self, request: ranking_pb2.RankRequest, context: grpc.aio.ServicerContext) -> ranking_pb2.RankResponse:
        ids = unpack(request.candidate_ids, "candidate_ids", expect_dtype=common_pb2.INT64, expect_ndim=1)
        await self._enter(request, context, int(ids.shape[0]))
        scores = (ids * 0.5 + self.bias).astype(np.float32)
        order = np.argsort(-scores, kind="stable")
        return ranking_pb2.RankResponse(
            item_ids=pack(np.take(ids, order)), scores=pack(np.take(scores, order)), model_version=f"v-{self.name}", model=request.model or "dlrm"
        )

    async def EmbedUser(self, request: ranking_pb2.EmbedUserRequest, context: grpc.aio.ServicerContext) -> ranking_pb2.EmbedUserResponse:
        await self._enter(request, context, 1)
        history = unpack(request.history_item_ids, "history_item_ids").shape[0] if request.HasField("history_item_ids") else 0
        vector = np.array([request.user_id, history, self.bias, 0.0], dtype=np.float32)
        return ranking_pb2.EmbedUserResponse(vector=pack(vector), model_version=f"v-{self.name}", degraded=True, degraded_reason="cold_start")


@contextlib.asynccontextmanager
async def cluster(
    n: int, config: RoutingConfig | None = None, *, clock: Callable[[], float] | None = None, seed: int = 0
) -> AsyncIterator[tuple[RankingClient, list[FakeRanker]]]:
    """``n`` fake rankers on free loopback ports and a started client over them."""
    fakes = [FakeRanker(f"r{i}", bias=float(i)) for i in range(n)]
    servers = []
    addresses = []
    try:
        for fake in fakes:
            server = make_server(max_message_bytes=4 << 20)
            ranking_pb2_grpc.add_RankingServicer_to_server(fake, server)
            port = server.add_insecure_port("127.0.0.1:0")
            servers.append(server)
            await server.start()
            addresses.append(f"127.0.0.1:{port}")
        client = RankingClient(
            addresses, config or RoutingConfig(), rng=np.random.default_rng(seed), clock=clock or FakeClock()
        )
        async with client:
            yield client, fakes
    finally:
        for fake in fakes:
            if fake.hold is not None:
                fake.hold.release()
        await asyncio.gather(*(s.stop(None) for s in servers))


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())  # type: ignore[arg-type]


def by_address(client: RankingClient, fakes: list[FakeRanker]) -> dict[str, FakeRanker]:
    return dict(zip(client.addresses, fakes))


CANDIDATES = np.array([4, 9, 1, 7], dtype=np.int64)


# ---- answers ----------------------------------------------------------------------


def test_rank_and_embed_user_carry_every_field_and_unpack_the_reply() -> None:
    async def body() -> None:
        async with cluster(1) as (client, [fake]):
            result = await client.rank(
                42, CANDIDATES, model="l3", history_item_ids=[3, 5], tenant="t1", priority="critical"
            )
            assert result.item_ids.tolist() == [9, 7, 4, 1]
            assert np.array_equal(result.scores, np.array([4.5, 3.5, 2.0, 0.5], dtype=np.float32))
            assert result.scores.dtype == np.float32 and result.item_ids.dtype == np.int64
            assert (result.model, result.model_version, result.replica, result.attempts) == ("l3", "v-r0", client.addresses[0], 1)
            request = fake.requests[-1]
            assert request.user_id == 42 and request.model == "l3"
            assert unpack(request.history_item_ids, "h").tolist() == [3, 5]
            assert (request.header.tenant, request.header.priority) == ("t1", common_pb2.CRITICAL)

            embedded = await client.embed_user(42, history_item_ids=np.array([1, 2, 3]))
            assert embedded.vector.tolist() == [42.0, 3.0, 0.0, 0.0]
            assert (embedded.degraded, embedded.degraded_reason, embedded.model_version) == (True, "cold_start", "v-r0")
            assert fake.requests[-1].header.tenant == "default" and fake.requests[-1].user_id == 42
            # No history given: the field stays unset (the server tells "none" from "[]").
            await client.rank(42, CANDIDATES)
            assert not fake.requests[-1].HasField("history_item_ids")
            assert client.stats.attempts == 3 and client.router.inflight.tolist() == [0.0]

    run(body)


def test_bad_candidate_arrays_are_named_before_any_rpc() -> None:
    async def body() -> None:
        async with cluster(1) as (client, [fake]):
            with pytest.raises(InvalidArgument, match=r"candidate_ids has shape \[2, 2\]"):
                await client.rank(1, np.zeros((2, 2), dtype=np.int64))
            with pytest.raises(InvalidArgument, match="candidate_ids has dtype float64"):
                await client.rank(1, np.array([1.5, 2.0]))
            assert fake.calls == 0
        with pytest.raises(FailedPrecondition, match="not started"):
            await RankingClient(["127.0.0.1:1"]).rank(1, CANDIDATES)

    run(body)


# ---- retries ----------------------------------------------------------------------


def test_retryable_failure_is_retried_on_the_other_replica_and_succeeds() -> None:
    async def body() -> None:
        async with cluster(2) as (client, fakes):
            down, up = fakes
            down.set_mode("unavailable")
            # Route until a call's first pick lands on the failing replica (seeded: the
            # second call here); every call must still succeed, from the healthy one.
            for _ in range(20):
                result = await client.rank(7, CANDIDATES)
                assert result.replica == client.addresses[1]
                if result.attempts == 2:
                    break
            assert result.attempts == 2
            assert result.model_version == "v-r1" and result.scores.tolist() == [5.5, 4.5, 3.0, 1.5]
            assert down.calls == 1 and client.stats.retries == 1
            # One request id across the attempts, so the two servers' logs join.
            assert down.requests[0].header.request_id == up.requests[-1].header.request_id

    run(body)


@pytest.mark.parametrize(("mode", "error"), [("invalid", InvalidArgument), ("precondition", FailedPrecondition)])
def test_non_retryable_status_is_raised_at_once_with_the_replica_named(mode: str, error: type[RecserveError]) -> None:
    async def body() -> None:
        async with cluster(2) as (client, fakes):
            for fake in fakes:
                fake.set_mode(mode)
            with pytest.raises(error) as raised:
                await client.rank(7, CANDIDATES)
            answered = [a for a, f in by_address(client, fakes).items() if f.calls]
            assert len(answered) == 1 and sum(f.calls for f in fakes) == 1
            assert raised.value.message.startswith(f"ranker {answered[0]}: Rank: {mode == 'invalid' and 'INVALID_ARGUMENT' or 'FAILED_PRECONDITION'}: ")
            assert client.stats.retries == client.stats.retries_refused_by_budget == client.router.budget.spent == 0
            assert "not retried" not in raised.value.message
            # An answer from a healthy replica: its breaker does not count it.
            assert client.router.state(answered[0], client.clock()) is BreakerState.CLOSED
            assert client.router.stats.failures == 0

    run(body)


def test_retries_over_many_calls_stay_within_the_budget() -> None:
    config = RoutingConfig(retry_budget=0.1, retry_burst=3.0, breaker_failures=1_000_000)  # breaker never opens
    calls = 150

    async def body() -> None:
        async with cluster(2, config) as (client, fakes):
            down, up = fakes
            down.set_mode("unavailable")
            refused = 0
            for _ in range(calls):
                try:
                    result = await client.rank(7, CANDIDATES)
                    assert result.replica == client.addresses[1]
                except Unavailable as exc:
                    assert client.addresses[0] in exc.message and "retry budget is spent" in exc.message
                    refused += 1
            stats = client.stats
            assert client.router.stats.primaries == calls
            assert stats.retries <= config.retry_budget * calls + config.retry_burst
            # The budget did bind (else this test shows nothing), and every retryable
            # failure either got a token or was refused by the budget.
            assert refused == stats.retries_refused_by_budget > 0
            assert stats.retries >= config.retry_burst
            assert down.calls == stats.retries + refused
            assert stats.attempts == calls + stats.retries == down.calls + up.calls

    run(body)


# ---- breakers ---------------------------------------------------------------------


def test_dead_replica_breaker_opens_then_closes_after_the_open_period_and_a_probe() -> None:
    config = RoutingConfig(breaker_failures=2, breaker_open_ms=500.0, retry_burst=100.0)
    clock = FakeClock()

    async def body() -> None:
        async with cluster(2, config, clock=clock) as (client, fakes):
            dead, live = fakes
            a = client.addresses[0]
            dead.set_mode("unavailable")
            for _ in range(40):
                await client.rank(7, CANDIDATES)  # retried onto the live one
                if client.router.state(a, clock()) is BreakerState.OPEN:
                    break
            assert client.router.state(a, clock()) is BreakerState.OPEN
            assert dead.calls == config.breaker_failures
            for _ in range(10):
                assert (await client.rank(7, CANDIDATES)).attempts == 1  # no traffic to the open one
            assert dead.calls == config.breaker_failures

            dead.set_mode("ok")  # restarted, but the breaker still waits out its period
            clock.advance(0.499)
            assert client.router.state(a, clock()) is BreakerState.OPEN
            clock.advance(0.001)
            assert client.router.state(a, clock()) is BreakerState.HALF_OPEN
            for _ in range(40):
                result = await client.rank(7, CANDIDATES)
                if result.replica == a:
                    break
            assert result.replica == a and result.attempts == 1  # the probe answered
            assert client.router.state(a, clock()) is BreakerState.CLOSED

    run(body)


def test_all_breakers_open_fails_fast_with_the_router_unavailable() -> None:
    config = RoutingConfig(breaker_failures=1, breaker_open_ms=500.0)
    clock = FakeClock()

    async def body() -> None:
        async with cluster(1, config, clock=clock) as (client, [fake]):
            fake.set_mode("unavailable")
            with pytest.raises(Unavailable) as first:
                await client.rank(7, CANDIDATES)
            # Its failure opened the only breaker, so the retry found no replica: the
            # router's error, naming the failure that led to it.
            assert first.value.message.startswith("no replica of 1 can take the call")
            assert first.value.message.endswith(f"; after ranker {client.addresses[0]}: Rank: UNAVAILABLE: r0 is draining")
            clock.advance(0.2)
            with pytest.raises(Unavailable, match="no replica of 1 can take the call") as raised:
                await client.rank(7, CANDIDATES)
            assert raised.value.retry_after_s == pytest.approx(0.3)
            assert fake.calls == 1  # the second call sent nothing

    run(body)


# ---- deadlines and cancellation ---------------------------------------------------


def test_the_deadline_reaches_the_server_in_the_header_and_as_the_grpc_timeout() -> None:
    async def body() -> None:
        # Real clock: gRPC's timeout is real time. ``deadline`` is on the client's clock;
        # the earlier of it and ``timeout_s`` wins.
        async with cluster(1, clock=time.monotonic) as (client, [fake]):
            wall_before = time.time()
            await client.rank(7, CANDIDATES, timeout_s=30.0, deadline=time.monotonic() + 3.0)
            wall_after = time.time()
            header = fake.requests[-1].header
            assert (wall_before + 3.0) * 1e3 - 1 <= header.deadline_unix_ms <= (wall_after + 3.0) * 1e3
            remaining = fake.time_remaining[-1]
            # gRPC rounds the wire timeout up to its unit, so a few ms over 3 s is fine;
            # the point is 3 s (the deadline), not 30 s (timeout_s).
            assert remaining is not None and 1.0 < remaining <= 3.5

            await client.embed_user(7)  # no deadline: none on the wire either
            assert fake.requests[-1].header.deadline_unix_ms == 0 and fake.time_remaining[-1] is None

            with pytest.raises(DeadlineExceeded, match="before the first attempt"):
                await client.rank(7, CANDIDATES, deadline=time.monotonic() - 0.001)
            assert fake.calls == 2

    run(body)


def test_cancelling_the_caller_cancels_the_rpc_and_reports_cancelled() -> None:
    async def body() -> None:
        async with cluster(1) as (client, [fake]):
            hold = Hold()
            fake.set_mode("hold", hold)
            task = asyncio.create_task(client.rank(7, CANDIDATES))
            await hold.until(1)
            assert client.router.inflight.tolist() == [4.0]
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(fake.cancelled.wait(), WAIT_S)  # the server saw it
            router = client.router
            assert router.inflight.tolist() == [0.0] and router.stats.failures == 0
            assert router.state(client.addresses[0], client.clock()) is BreakerState.CLOSED

    run(body)


# ---- two choices ------------------------------------------------------------------


def test_two_choices_spreads_load_by_in_flight_candidates() -> None:
    small, n_small = 10, 40

    async def body() -> None:
        async with cluster(2, seed=3) as (client, fakes):
            hold = Hold()
            for fake in fakes:
                fake.set_mode("hold", hold)
            big = asyncio.create_task(client.rank(7, np.arange(1000, dtype=np.int64)))
            await hold.until(1)
            heavy = next(i for i, f in enumerate(fakes) if f.candidates_held == 1000)
            light = 1 - heavy
            tasks = [asyncio.create_task(client.rank(7, np.arange(small, dtype=np.int64))) for _ in range(n_small)]
            await hold.until(1 + n_small)
            # The router's work signal is the candidates in flight, as the servers see them.
            assert client.router.inflight.tolist() == [float(f.candidates_held) for f in fakes]
            # The heavy replica gets a small call only when both draws land on it (1 in 4);
            # cost-blind random choice would split the small calls evenly.
            to_light = (fakes[light].candidates_held) // small
            assert to_light + (fakes[heavy].candidates_held - 1000) // small == n_small
            assert to_light >= 0.65 * n_small
            hold.release()
            results = await asyncio.gather(big, *tasks)
            assert all(r.attempts == 1 for r in results)
            assert client.router.inflight.tolist() == [0.0, 0.0]

    run(body)


def test_deadlines_shorter_than_a_replicas_usual_latency_do_not_open_its_breaker() -> None:
    """The cascade sets tight stage deadlines on purpose: a call that times out within less
    than the replica's usual latency is no verdict on it; one with room to spare is."""

    async def body() -> None:
        cfg = RoutingConfig(breaker_failures=2, retry_budget=0.0, retry_burst=0.0)
        async with cluster(1, cfg) as (client, [fake]):
            fake.set_mode("hold", Hold())
            usual = client.router.hedge_delay(client.addresses[0])  # 10 ms before any sample
            for _ in range(4):
                with pytest.raises(DeadlineExceeded):
                    await client.rank(7, CANDIDATES, timeout_s=usual / 10)
            assert client.router.stats.failures == 0
            assert client.router.state(client.addresses[0], client.clock()) is BreakerState.CLOSED
            for _ in range(2):
                with pytest.raises(DeadlineExceeded):
                    await client.rank(7, CANDIDATES, timeout_s=usual * 3)
            assert client.router.stats.failures == 2
            assert client.router.state(client.addresses[0], client.clock()) is BreakerState.OPEN

    run(body)
