"""GenerationClient over fake streaming stubs and a fake clock: no sockets.

The fakes stand in for grpc.aio stubs (``stub.Generate(request, timeout=...)`` returns
an async-iterable call with ``cancel()``), scripted per replica with explicit setters
(``set_ok``, ``set_error(at=k)``: fail after k chunks, ``set_hold(after=k)``: park
after k chunks until cancelled or released); the client, its router, its retry budget
and its load tracking are real. The mixed-fleet integration test
(tests/integration/test_mixed_fleet.py) runs the same client against real replicas.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import numpy as np
import pytest

from recserve.client import GeneratedChunk, GenerationClient
from recserve.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from recserve.routing import BreakerState, DecodeLoad, RoutingConfig
from recserve.rpc.deadline import PRIORITY_ENUMS
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import common_pb2, generation_pb2

WAIT_S = 10.0  # guard on event waits only: a hang fails the test instead of stalling it
A, B = "gen-a:7400", "gen-b:7400"


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details, debug_error_string="")


class FakeStream:
    """One Generate RPC: iterating it plays the stub's script; ``cancel()`` is recorded."""

    def __init__(self, stub: FakeGenerator, request: generation_pb2.GenerateRequest) -> None:
        self.stub = stub
        self.request = request
        self.sent = 0
        self.cancelled = asyncio.Event()
        self._unpark = asyncio.Event()

    def cancel(self) -> bool:
        self.cancelled.set()
        self._unpark.set()
        return True

    async def initial_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata(*self.stub.metadata)

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> generation_pb2.GenerateChunk:
        stub = self.stub
        total = self.request.max_new_tokens
        if stub.on_chunk is not None:
            stub.on_chunk(self.sent)
        if stub.mode == "error" and self.sent == stub.error_at:
            assert stub.error is not None
            raise stub.error
        if stub.mode == "hold" and self.sent == stub.hold_after:
            stub.parked.set()
            await self._unpark.wait()
            if self.cancelled.is_set():
                raise asyncio.CancelledError  # what a cancelled grpc.aio call raises to its reader
        if self.sent >= total:
            raise StopAsyncIteration
        i = self.sent
        self.sent += 1
        last = self.sent == total
        return generation_pb2.GenerateChunk(
            index=i, tokens=pack(np.array([65 + i], dtype=np.int32)), text=chr(65 + i), finished=last,
            finish_reason="length" if last else "", emitted_unix_us=1_700_000_000_000_000 + i,
        )  # fmt: skip

    def release(self) -> None:
        self._unpark.set()


class FakeGenerator:
    """A Generation stub for one replica: each stream sends ``max_new_tokens`` chunks of
    one token (``A``, ``B``, ...), the last ``finished`` with reason ``length``. Modes:
    ``ok``; ``error`` (raise :attr:`error` before chunk ``error_at``); ``hold`` (park
    before chunk ``hold_after`` until cancelled). ``on_chunk(k)`` runs before chunk k."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"
        self.error: grpc.aio.AioRpcError | None = None
        self.error_at = 0
        self.hold_after = 0
        self.requests: list[generation_pb2.GenerateRequest] = []
        self.timeouts: list[float | None] = []
        self.streams: list[FakeStream] = []
        self.parked = asyncio.Event()
        self.on_chunk: Any = None
        self.metadata: list[tuple[str, str]] = []  # the initial metadata of every stream

    def set_load(self, active_tokens: str, kv_occupancy: str) -> None:
        self.metadata = [("recserve-active-tokens", active_tokens), ("recserve-kv-occupancy", kv_occupancy)]

    def set_ok(self) -> None:
        self.mode, self.error = "ok", None

    def set_error(self, code: grpc.StatusCode, *, at: int = 0, details: str = "") -> None:
        self.mode, self.error_at, self.error = "error", at, rpc_error(code, details or f"{self.name}: {code.name}")

    def set_hold(self, *, after: int = 0) -> None:
        self.mode, self.hold_after = "hold", after
        self.parked = asyncio.Event()

    def Generate(self, request: generation_pb2.GenerateRequest, timeout: float | None = None) -> FakeStream:
        self.requests.append(request)
        self.timeouts.append(timeout)
        stream = FakeStream(self, request)
        self.streams.append(stream)
        return stream


def make_client(stubs: dict[str, FakeGenerator], clock: FakeClock, config: RoutingConfig = RoutingConfig(), **kw: Any) -> GenerationClient:
    return GenerationClient(list(stubs), config, clock=clock, rng=np.random.default_rng(0), stub_factory=stubs.__getitem__, **kw)


async def collect(client: GenerationClient, prompt: str = "hi", **kw: Any) -> list[GeneratedChunk]:
    return [chunk async for chunk in client.generate(prompt, **kw)]


def test_generate_sends_every_field_and_unpacks_each_chunk() -> None:
    async def body() -> None:
        stub = FakeGenerator("a")
        before = time.time()
        async with make_client({A: stub}, FakeClock()) as client:
            chunks = await collect(client, "why?", max_new_tokens=3, temperature=0.7, seed=11, session_key="user-7", timeout_s=2.0,
                                   tenant="acme", priority="critical", request_id="req-1")  # fmt: skip
        after = time.time()
        (request,) = stub.requests
        assert (request.prompt, request.max_new_tokens, request.seed) == ("why?", 3, 11)
        assert request.temperature == pytest.approx(0.7)
        assert not request.HasField("prompt_tokens")
        h = request.header
        assert (h.request_id, h.tenant, h.priority, h.session_key) == ("req-1", "acme", PRIORITY_ENUMS["critical"], "user-7")
        assert stub.timeouts == [pytest.approx(2.0)]  # the fake clock does not move: exact
        assert int((before + 2.0) * 1000) <= h.deadline_unix_ms <= int((after + 2.0) * 1000)
        assert [c.index for c in chunks] == [0, 1, 2]
        assert "".join(c.text for c in chunks) == "ABC"
        assert [c.tokens.tolist() for c in chunks] == [[65], [66], [67]] and chunks[0].tokens.dtype == np.int32
        assert [c.finished for c in chunks] == [False, False, True] and chunks[-1].finish_reason == "length"
        assert [c.emitted_unix_us for c in chunks] == [1_700_000_000_000_000 + i for i in range(3)]
        assert {(c.replica, c.attempts) for c in chunks} == {(A, 1)}

    asyncio.run(body())


def test_prompt_tokens_go_as_int32_and_bad_ones_are_refused_before_any_rpc() -> None:
    async def body() -> None:
        stub = FakeGenerator("a")
        async with make_client({A: stub}, FakeClock()) as client:
            await collect(client, "", prompt_tokens=np.array([256, 104, 105], dtype=np.int64), max_new_tokens=1)
            sent = unpack(stub.requests[0].prompt_tokens, "p")
            assert sent.dtype == np.int32 and sent.tolist() == [256, 104, 105]
            assert stub.requests[0].header.session_key == ""  # no key: two choices, and the server is told none
            for bad, match in [(np.zeros((2, 2), np.int64), r"shape \[2, 2\]"), (np.array([1.5]), "dtype float64"),
                               (np.array([2**40]), "holds 1099511627776, outside int32")]:  # fmt: skip
                with pytest.raises(InvalidArgument, match=match):
                    await collect(client, "", prompt_tokens=bad)
        assert len(stub.requests) == 1

    asyncio.run(body())


def test_a_client_not_started_or_past_its_deadline_sends_nothing() -> None:
    async def body() -> None:
        stub, clock = FakeGenerator("a"), FakeClock()
        client = make_client({A: stub}, clock)
        with pytest.raises(FailedPrecondition, match="not started"):
            await collect(client)
        await client.start()
        with pytest.raises(DeadlineExceeded, match="before the first attempt"):
            await collect(client, deadline=clock.now - 0.001)
        with pytest.raises(InvalidArgument, match="timeout_s is 0"):
            await collect(client, timeout_s=0)
        await client.aclose()
        assert stub.requests == []

    asyncio.run(body())


def test_a_failure_before_the_first_chunk_is_retried_on_the_other_replica() -> None:
    async def body() -> None:
        down, up = FakeGenerator("a"), FakeGenerator("b")
        down.set_error(grpc.StatusCode.UNAVAILABLE)
        async with make_client({A: down, B: up}, FakeClock()) as client:
            for _ in range(4):  # two choices may pick either first; a pick of A must end on B
                chunks = await collect(client, max_new_tokens=2, request_id="r-9")
                assert [c.replica for c in chunks] == [B, B] and chunks[0].attempts in (1, 2)
            assert len(down.requests) >= 1, "two choices never picked the down replica: the test proves nothing"
            assert client.stats.retries == len(down.requests)
        assert {r.header.request_id for r in down.requests + up.requests} == {"r-9"}

    asyncio.run(body())


def test_a_failure_after_the_first_chunk_is_raised_not_retried_and_counts_against_the_replica() -> None:
    async def body() -> None:
        a, b = FakeGenerator("a"), FakeGenerator("b")
        a.set_error(grpc.StatusCode.UNAVAILABLE, at=2, details="a: the process went away")
        async with make_client({A: a}, FakeClock()) as client:
            got: list[GeneratedChunk] = []
            with pytest.raises(Unavailable, match=r"generator gen-a:7400: Generate: UNAVAILABLE: a: the process went away \(not retried: the stream had started\)"):
                async for chunk in client.generate(max_new_tokens=5):
                    got.append(chunk)
            assert [c.text for c in got] == ["A", "B"]  # what arrived was delivered
            assert client.stats.attempts == 1 and client.stats.retries == 0
            assert client.router.breakers._failures[0] == 1  # the mid-stream death is a failure
            assert client.router.inflight.tolist() == [0.0]
        del b

    asyncio.run(body())


def test_a_non_retryable_status_is_final_and_leaves_the_breaker_closed() -> None:
    async def body() -> None:
        a, b = FakeGenerator("a"), FakeGenerator("b")
        for stub in (a, b):
            stub.set_error(grpc.StatusCode.INVALID_ARGUMENT, details="temperature = nan: use a finite value >= 0")
        async with make_client({A: a, B: b}, FakeClock(), config=RoutingConfig(breaker_failures=1)) as client:
            with pytest.raises(InvalidArgument, match="temperature = nan"):
                await collect(client, temperature=float("nan"))
            assert client.stats.attempts == 1
            assert {client.router.state(r, 1000.0) for r in (A, B)} == {BreakerState.CLOSED}

    asyncio.run(body())


def test_a_deadline_mid_stream_raises_but_is_no_verdict_on_the_replica() -> None:
    async def body() -> None:
        a = FakeGenerator("a")
        a.set_error(grpc.StatusCode.DEADLINE_EXCEEDED, at=1)
        async with make_client({A: a}, FakeClock(), config=RoutingConfig(breaker_failures=1)) as client:
            with pytest.raises(DeadlineExceeded):
                await collect(client, max_new_tokens=4, timeout_s=1.0)
            assert client.router.state(A, 1000.0) is BreakerState.CLOSED
            assert client.stats.attempts == 1

    asyncio.run(body())


def test_closing_the_stream_cancels_the_rpc_and_frees_its_load() -> None:
    async def body() -> None:
        a = FakeGenerator("a")
        async with make_client({A: a}, FakeClock(), config=RoutingConfig(breaker_failures=1)) as client:
            stream = client.generate(max_new_tokens=8)
            first = await stream.__anext__()
            assert first.text == "A" and not a.streams[0].cancelled.is_set()
            await stream.aclose()
            assert a.streams[0].cancelled.is_set()
            assert a.streams[0].sent == 1  # nothing read after the close
            assert client.router.inflight.tolist() == [0.0]
            assert client.router.state(A, 1000.0) is BreakerState.CLOSED  # our cancel: no failure

    asyncio.run(body())


def test_breaking_out_of_the_loop_cancels_the_rpc() -> None:
    async def body() -> None:
        a = FakeGenerator("a")
        async with make_client({A: a}, FakeClock()) as client:
            async for chunk in client.generate(max_new_tokens=8):
                assert chunk.index == 0
                break
            # The dropped generator is closed by the event loop's finaliser hook.
            await asyncio.wait_for(a.streams[0].cancelled.wait(), WAIT_S)
            assert a.streams[0].sent == 1

    asyncio.run(body())


def test_cancelling_the_consumer_task_cancels_the_rpc() -> None:
    async def body() -> None:
        a = FakeGenerator("a")
        a.set_hold(after=1)
        async with make_client({A: a}, FakeClock()) as client:
            task = asyncio.create_task(collect(client, max_new_tokens=8))
            await asyncio.wait_for(a.parked.wait(), WAIT_S)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert a.streams[0].cancelled.is_set()
            assert client.router.inflight.tolist() == [0.0]

    asyncio.run(body())


def test_the_routers_work_follows_the_stream_active_tokens_then_kv_held() -> None:
    async def body() -> None:
        a = FakeGenerator("a")
        load = DecodeLoad(kv_weight=0.5)
        seen: list[float] = []
        async with make_client({A: a}, FakeClock(), load=load) as client:
            a.on_chunk = lambda k: seen.append(float(client.router.inflight[0]))
            # "hello!" is 6 UTF-8 bytes = 6 prompt tokens (the server adds no BOS); 4 new tokens.
            await collect(client, "hello!", max_new_tokens=4)
            assert client.router.inflight.tolist() == [0.0]
            assert client._own_active.tolist() == [0.0]
        # Before chunk 0: 6 + 4 active. Before chunk k>0 (k generated, prompt prefilled):
        # 4 - k active + 0.5 * (6 + k) held. After the finished chunk (the read that
        # ends the stream): nothing left.
        assert seen == [10.0] + [4 - k + 0.5 * (6 + k) for k in (1, 2, 3)] + [0.0]

    asyncio.run(body())


def test_two_choices_steers_new_streams_away_from_a_replica_holding_a_long_one() -> None:
    async def body() -> None:
        a, b = FakeGenerator("a"), FakeGenerator("b")
        for stub in (a, b):
            stub.set_hold(after=1)  # the long stream's replica parks it after its first chunk
        async with make_client({A: a, B: b}, FakeClock()) as client:
            long_task = asyncio.create_task(collect(client, "x" * 500, max_new_tokens=1000))
            await asyncio.wait_for(asyncio.wait([asyncio.ensure_future(a.parked.wait()), asyncio.ensure_future(b.parked.wait())],
                                                return_when=asyncio.FIRST_COMPLETED), WAIT_S)  # fmt: skip
            busy = A if a.parked.is_set() else B
            for stub in (a, b):
                stub.set_ok()
            picks = [(await collect(client, "q", max_new_tokens=1))[0].replica for _ in range(100)]
            # The busy replica wins a draw only against itself: ~1/4 of the picks, never most.
            assert picks.count(busy) < 0.4 * len(picks)
            assert 0 < picks.count(busy), "two choices never drew the busy replica twice: weak test"
            long_task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await long_task

    asyncio.run(body())


def test_capacity_weights_favour_the_bigger_replica() -> None:
    async def body() -> None:
        a, b = FakeGenerator("a"), FakeGenerator("b")
        async with make_client({A: a, B: b}, FakeClock(), weights=[3.0, 1.0]) as client:
            for _ in range(400):
                await collect(client, "q", max_new_tokens=1)
        # Idle replicas, one stream at a time: draws go 3:1 by weight and the stream's own
        # cost per weight is lower on A, so B takes a call only when drawn twice: 1/16.
        assert len(b.requests) / 400 == pytest.approx(1 / 16, abs=0.03)
        assert len(b.requests) > 0

    asyncio.run(body())


def test_a_session_sticks_to_its_replica_falls_back_when_it_is_down_and_returns() -> None:
    async def body() -> None:
        a, b = FakeGenerator("a"), FakeGenerator("b")
        stubs = {A: a, B: b}
        clock = FakeClock()
        cfg = RoutingConfig(breaker_failures=2, breaker_open_ms=1000.0)
        async with make_client(stubs, clock, config=cfg) as client:
            homes = {(await collect(client, session_key="user-7", max_new_tokens=1))[0].replica for _ in range(20)}
            assert len(homes) == 1
            (home,) = homes
            other = B if home == A else A
            # Two sessions with different keys do not all land on one replica.
            spread = {(await collect(client, session_key=f"user-{k}", max_new_tokens=1))[0].replica for k in range(40)}
            assert spread == {A, B}
            stubs[home].set_error(grpc.StatusCode.UNAVAILABLE)
            moved = [(await collect(client, session_key="user-7", max_new_tokens=1))[0] for _ in range(4)]
            assert {c.replica for c in moved} == {other}
            assert client.router.state(home, clock.now) is BreakerState.OPEN
            assert [c.attempts for c in moved[2:]] == [1, 1]  # once open, the session goes straight to the fallback
            stubs[home].set_ok()
            clock.advance(1.001)  # the open period ends: the session's next call is the probe
            back = await collect(client, session_key="user-7", max_new_tokens=1)
            assert back[0].replica == home and client.router.state(home, clock.now) is BreakerState.CLOSED

    asyncio.run(body())


def test_the_first_chunk_of_a_probe_closes_the_breaker_before_the_stream_ends() -> None:
    async def body() -> None:
        a = FakeGenerator("a")
        clock = FakeClock()
        async with make_client({A: a}, clock, config=RoutingConfig(breaker_failures=1, breaker_open_ms=500.0)) as client:
            a.set_error(grpc.StatusCode.UNAVAILABLE)
            with pytest.raises(Unavailable):
                await collect(client)
            assert client.router.state(A, clock.now) is BreakerState.OPEN
            clock.advance(0.6)
            a.set_hold(after=1)
            stream = client.generate(max_new_tokens=8)
            await stream.__anext__()  # the probe's first chunk
            assert client.router.state(A, clock.now) is BreakerState.CLOSED
            # Closed, not half-open with its probe out: a second stream is admitted now.
            second = client.generate(max_new_tokens=1)
            assert (await second.__anext__()).replica == A
            await second.aclose()
            await stream.aclose()

    asyncio.run(body())


def test_the_replicas_in_band_load_report_counts_other_clients_work_once() -> None:
    async def body() -> None:
        a, b = FakeGenerator("a"), FakeGenerator("b")
        load = DecodeLoad(kv_weight=0.5, kv_capacity_tokens=1000.0)
        async with make_client({A: a, B: b}, FakeClock(), config=RoutingConfig(policy="least_loaded"), load=load) as client:
            # An idle A reports nothing; B reports 300 active tokens and a 40 % full pool
            # from other clients: 300 + 0.5 * 0.4 * 1000 = 500 tokens of work.
            a.set_load("0", "0.0")
            b.set_load("300", "0.4")
            client.router.reported[:] = [0.0, 1e-9]  # least-loaded: the first stream goes to A
            await collect(client, "q", max_new_tokens=1)
            assert client.router.reported.tolist() == [0.0, 1e-9]  # only A started a stream
            client.router.reported[:] = [1.0, 0.0]  # now B
            await collect(client, "q", max_new_tokens=1)
            assert client.router.reported.tolist() == [1.0, 500.0]  # A's stays: no stream started there
            # A stream of ours is live on B (parked after its first chunk: 10 + 20 - 1 = 29
            # tokens to compute). B's next report counts it, and only the rest is others'.
            b.set_hold(after=1)
            client.router.reported[:] = [1e9, 0.0]
            held = asyncio.create_task(collect(client, "x" * 10, max_new_tokens=20))
            await asyncio.wait_for(b.parked.wait(), WAIT_S)
            assert client._own_active.tolist() == [0.0, 29.0]
            b.set_ok()
            b.set_load("329", "0.4")
            client.router.reported[:] = [1e9, 0.0]
            await collect(client, "q", max_new_tokens=1)
            assert client.router.reported[1] == 500.0
            # A malformed report is ignored, not trusted.
            b.set_load("lots", "0.9")
            client.router.reported[:] = [1e9, 7.0]
            await collect(client, "q", max_new_tokens=1)
            assert client.router.reported[1] == 7.0
            held.cancel()
            with pytest.raises(asyncio.CancelledError):
                await held
            assert client._own_active.tolist() == [0.0, 0.0]

    asyncio.run(body())
