"""ServingLoop on a real asyncio loop: executor vs coroutine runners, failures, max_inflight,
cancellation, streaming, deadlines while busy, close. Synchronised with events and
futures, never sleeps; every test runs under a wall-clock guard so a bug fails, not hangs."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Any, Awaitable, Callable

import pytest

from recserve.config.spec import TenantConfig
from recserve.errors import DeadlineExceeded, FailedPrecondition, InternalError, ResourceExhausted, Unavailable
from recserve.scheduling import (
    AdmissionConfig,
    Batch,
    Done,
    DynamicBatchConfig,
    DynamicBatchPolicy,
    FeatureParallelConfig,
    FeatureParallelPolicy,
    Handle,
    Policy,
    PolicyKind,
    Scheduler,
    SchedulerView,
    ServingLoop,
)
from tests.utils import Prompt, ToyDecodePolicy, decode_step, expected_tokens


GUARD_S = 20.0


def run(test: Callable[[], Awaitable[None]]) -> None:
    """Run ``test`` on a fresh event loop; fail (not hang) if it takes over GUARD_S.
    Not wait_for: it cancels only the test task and then waits for it, which hangs when
    the test is stuck in aclose() behind a batch that never ends. Here asyncio.run's
    shutdown cancels every task (driver and batches too), so everything unwinds."""

    async def guarded() -> None:
        task = asyncio.ensure_future(test())
        done, _ = await asyncio.wait({task}, timeout=GUARD_S)
        if not done:
            raise AssertionError(f"the test did not finish within {GUARD_S:g} s")
        task.result()

    asyncio.run(guarded())


def window_scheduler(window_ms: float = 0.0, max_cost: float = 1e9, admission: AdmissionConfig = AdmissionConfig()) -> Scheduler:
    return Scheduler(FeatureParallelPolicy(FeatureParallelConfig(window_ms=window_ms, max_cost=max_cost)), admission)


def long_window_scheduler(admission: AdmissionConfig = AdmissionConfig()) -> Scheduler:
    """A 1 s window: a test that finishes in milliseconds did not wait for it."""
    return Scheduler(DynamicBatchPolicy(DynamicBatchConfig(max_batch_cost=1e9, max_wait_ms=1000.0, adaptive=False)), admission)


class BlockingRunner:
    """Async runner whose batches wait for ``release``; records what it saw."""

    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.started = asyncio.Queue[Batch]()
        self.gates: dict[int, asyncio.Event] = {}
        self.running = 0
        self.max_running = 0

    async def __call__(self, batch: Batch) -> list[Done]:
        self.seen += batch.payloads
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        gate = self.gates.setdefault(batch.batch_id, asyncio.Event())
        self.started.put_nowait(batch)
        await gate.wait()
        self.running -= 1
        return [Done(p * 10) for p in batch.payloads]

    def release(self, batch: Batch) -> None:
        self.gates.setdefault(batch.batch_id, asyncio.Event()).set()


def test_sync_runner_runs_on_the_executor_and_batches_concurrent_callers() -> None:
    async def test() -> None:
        threads: list[int] = []
        sizes: list[int] = []

        def runner(batch: Batch) -> list[Done]:
            threads.append(threading.get_ident())
            sizes.append(len(batch))
            return [Done(p * 2) for p in batch.payloads]

        loop = ServingLoop(window_scheduler(window_ms=5.0), runner, max_inflight=2)
        loop.start()
        results = await asyncio.gather(*(loop.submit(i) for i in range(20)))
        await loop.aclose()
        assert results == [2 * i for i in range(20)]
        assert threads and threading.get_ident() not in threads  # never on the event loop
        assert sum(sizes) == 20 and max(sizes) > 1  # callers were merged into batches

    run(test)


def test_coroutine_runner_is_awaited_on_the_loop() -> None:
    async def test() -> None:
        loop_thread = threading.get_ident()
        seen_threads: list[int] = []

        async def runner(batch: Batch) -> list[Done]:
            seen_threads.append(threading.get_ident())
            return [Done(f"r{p}") for p in batch.payloads]

        async with ServingLoop(window_scheduler(), runner) as loop:
            assert await loop.submit(7) == "r7"
        assert seen_threads == [loop_thread]

    run(test)


def test_runner_exception_fails_every_item_of_the_batch() -> None:
    async def test() -> None:
        boom = RuntimeError("oom")

        def runner(batch: Batch) -> list[Done]:
            raise boom

        async with ServingLoop(window_scheduler(window_ms=50.0), runner) as loop:
            futures = [loop.submit_nowait(i) for i in range(5)]
            results = await asyncio.gather(*futures, return_exceptions=True)
        assert all(isinstance(r, InternalError) and r.__cause__ is boom for r in results)
        assert loop.scheduler.stats().failed == 5

    run(test)


def test_wrong_outcome_count_fails_the_batch() -> None:
    async def test() -> None:
        async def runner(batch: Batch) -> list[Done]:
            return [Done(None)] * (len(batch) + 1)

        async with ServingLoop(window_scheduler(window_ms=50.0), runner) as loop:
            results = await asyncio.gather(*(loop.submit_nowait(i) for i in range(3)), return_exceptions=True)
        assert len(results) == 3 and all(isinstance(r, InternalError) for r in results)
        assert "4 outcomes for 3 items" in str(results[0])

    run(test)


def test_at_most_max_inflight_batches_run_at_once() -> None:
    async def test() -> None:
        runner = BlockingRunner()
        async with ServingLoop(window_scheduler(max_cost=1), runner, max_inflight=2) as loop:
            futures = [loop.submit_nowait(i) for i in range(3)]
            first = await runner.started.get()
            second = await runner.started.get()
            assert runner.started.empty() and runner.running == 2  # the third waits for a slot
            runner.release(first)
            third = await runner.started.get()
            assert third.payloads == [2]
            runner.release(second)
            runner.release(third)
            assert await asyncio.gather(*futures) == [0, 10, 20]
        assert runner.max_running == 2

    run(test)


def test_cancelling_the_awaiting_task_cancels_the_queued_item() -> None:
    async def test() -> None:
        runner = BlockingRunner()
        async with ServingLoop(window_scheduler(max_cost=1), runner, max_inflight=1) as loop:
            busy = asyncio.ensure_future(loop.submit("busy"))
            batch = await runner.started.get()
            entered = asyncio.Event()

            async def caller() -> Any:
                future = loop.submit_nowait("victim")
                entered.set()
                return await future  # no yield between set() and this await

            waiter = asyncio.ensure_future(caller())
            await entered.wait()
            assert loop.scheduler.queued_count == 1
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
            assert loop.scheduler.queued_count == 0
            runner.release(batch)
            assert await busy == "busy" * 10
        assert runner.seen == ["busy"]  # the cancelled item never ran
        assert loop.scheduler.stats().drops["cancelled"] == 1

    run(test)


def test_streaming_partial_outputs_through_the_loop() -> None:
    async def test() -> None:
        policy = ToyDecodePolicy(token_budget=1e9)
        async with ServingLoop(Scheduler(policy), decode_step, max_inflight=1) as loop:
            a = loop.submit_stream(Prompt(3, 5), request_id="a")
            b = loop.submit_stream(Prompt(3, 2), request_id="b")
            got_a = [tok async for tok in a]
            got_b = [tok async for tok in b]
            assert got_a == expected_tokens("a", 4) and got_b == expected_tokens("b", 1)
            assert await a.result() == expected_tokens("a", 5)
            assert await b.result() == expected_tokens("b", 2)

    run(test)


def test_stream_of_a_failed_item_raises_after_its_partials() -> None:
    async def test() -> None:
        async def runner(batch: Batch) -> list[Any]:
            raise Unavailable("model server gone")

        async with ServingLoop(window_scheduler(), runner) as loop:
            stream = loop.submit_stream(1)
            with pytest.raises(Unavailable):
                async for _ in stream:
                    pass
            with pytest.raises(Unavailable):
                await stream.result()

    run(test)


def test_deadline_drops_happen_on_time_even_while_every_slot_is_busy() -> None:
    async def test() -> None:
        runner = BlockingRunner()
        async with ServingLoop(window_scheduler(max_cost=1), runner, max_inflight=1) as loop:
            busy = loop.submit_nowait("busy")
            batch = await runner.started.get()
            start = time.monotonic()
            doomed = loop.submit_nowait("doomed", deadline=start + 0.02)
            with pytest.raises(DeadlineExceeded):
                await doomed  # resolves at its deadline, while "busy" still holds the slot
            assert time.monotonic() - start < 5.0
            assert runner.running == 1
            runner.release(batch)
            await busy
        assert runner.seen == ["busy"]

    run(test)


def test_aclose_drains_queued_work_without_waiting_for_the_window() -> None:
    async def test() -> None:
        async def runner(batch: Batch) -> list[Done]:
            return [Done(p) for p in batch.payloads]

        loop = ServingLoop(long_window_scheduler(), runner)
        loop.start()
        futures = [loop.submit_nowait(i) for i in range(4)]
        start = time.monotonic()
        await loop.aclose()
        assert time.monotonic() - start < 0.5
        assert [f.result() for f in futures] == [0, 1, 2, 3]
        with pytest.raises(Unavailable):
            loop.submit_nowait(5)

    run(test)


def test_aclose_without_drain_fails_queued_items_and_lets_running_ones_finish() -> None:
    async def test() -> None:
        runner = BlockingRunner()
        loop = ServingLoop(window_scheduler(max_cost=1), runner, max_inflight=1)
        loop.start()
        running = loop.submit_nowait(1)
        batch = await runner.started.get()
        queued = loop.submit_nowait(2)
        closing = asyncio.ensure_future(loop.aclose(drain=False))
        with pytest.raises(Unavailable):
            await queued
        assert not closing.done()  # still waiting for the running batch
        runner.release(batch)
        await closing
        assert running.result() == 10 and runner.seen == [1]

    run(test)


def test_admission_rejection_raises_at_submit_and_misuse_is_reported() -> None:
    async def test() -> None:
        async def runner(batch: Batch) -> list[Done]:
            return [Done(None)] * len(batch)

        loop = ServingLoop(long_window_scheduler(AdmissionConfig(max_queued_items=1)), runner)
        with pytest.raises(FailedPrecondition):
            loop.submit_nowait(0)  # not started
        loop.start()
        first = loop.submit_nowait(0)
        with pytest.raises(ResourceExhausted) as info:
            loop.submit_nowait(1)
        assert info.value.retry_after_s is not None
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        second = loop.submit_nowait(2, deadline=math.inf)  # the cancelled item freed the queue
        await loop.aclose()
        assert second.done() and loop.scheduler.stats().drops == {"deadline": 0, "cancelled": 1, "rejected": 1}

    run(test)


def test_closing_a_stream_cancels_its_item() -> None:
    async def test() -> None:
        runner = BlockingRunner()
        async with ServingLoop(window_scheduler(max_cost=1), runner, max_inflight=1) as loop:
            busy = loop.submit_nowait("busy")
            batch = await runner.started.get()
            stream = loop.submit_stream("victim")
            assert loop.scheduler.queued_count == 1
            await stream.aclose()
            with pytest.raises(asyncio.CancelledError):
                await stream.result()
            assert [x async for x in stream] == []  # the iterator ends
            assert loop.scheduler.queued_count == 0
            assert loop.scheduler.stats().drops["cancelled"] == 1
            runner.release(batch)
            await busy
        assert runner.seen == ["busy"]

    run(test)


def test_cancelling_an_item_in_flight_discards_its_result_and_frees_its_quota_when_the_batch_ends() -> None:
    async def test() -> None:
        runner = BlockingRunner()
        adm = AdmissionConfig(tenants=(TenantConfig("t", max_concurrent_cost=2.0),))
        async with ServingLoop(window_scheduler(admission=adm), runner, max_inflight=1) as loop:
            a = loop.submit_nowait(1, tenant="t")
            b = loop.submit_nowait(2, tenant="t")
            batch = await runner.started.get()
            assert len(batch) == 2
            a.cancel()
            with pytest.raises(asyncio.CancelledError):
                await a
            with pytest.raises(ResourceExhausted):  # the runner still holds a's cost
                loop.submit_nowait(3, tenant="t")
            runner.release(batch)
            assert await b == 20
            assert loop.scheduler.admission.tenant_inflight_cost("t") == 0.0  # released at complete
            c = loop.submit_nowait(4, tenant="t", cost=2.0)  # the whole quota is free again
            runner.release(await runner.started.get())
            assert await c == 40
        assert runner.seen == [1, 2, 4]
        assert loop.scheduler.stats().drops["cancelled"] == 1

    run(test)


def test_a_policy_hook_bug_while_completing_fails_the_rest_of_the_batch_not_hangs() -> None:
    class Bomb(FeatureParallelPolicy):
        def on_finish(self, handle: Handle, now: float) -> None:
            if handle.item.payload == 1:
                raise ValueError("policy bug")

    async def test() -> None:
        async def runner(batch: Batch) -> list[Done]:
            return [Done(p) for p in batch.payloads]

        policy = Bomb(FeatureParallelConfig(window_ms=0.0, max_cost=1e9))
        async with ServingLoop(Scheduler(policy), runner) as loop:
            results = await asyncio.gather(*(loop.submit_nowait(i) for i in range(3)), return_exceptions=True)
            assert results[:2] == [0, 1] and isinstance(results[2], InternalError)
            assert await loop.submit(5) == 5  # the loop keeps serving

    run(test)


def test_a_policy_bug_in_select_fails_queued_callers_and_aclose_still_waits_for_running_batches() -> None:
    class Flaky(Policy):
        kind = PolicyKind.FEATURE_PARALLEL

        def __init__(self) -> None:
            self.calls = 0

        def ready_at(self, view: SchedulerView, now: float) -> float | None:
            return now

        def select(self, view: SchedulerView, now: float) -> None:
            self.calls += 1
            if self.calls > 1:
                raise ValueError("policy bug")
            view.take()

    async def test() -> None:
        runner = BlockingRunner()
        loop = ServingLoop(Scheduler(Flaky()), runner, max_inflight=2)
        loop.start()
        first = loop.submit_nowait(1)
        batch = await runner.started.get()
        second = loop.submit_nowait(2)
        with pytest.raises(InternalError, match="policy bug"):
            await second
        with pytest.raises(Unavailable):
            loop.submit_nowait(3)
        closing = asyncio.ensure_future(loop.aclose())
        for _ in range(5):
            await asyncio.sleep(0)  # event-loop turns, not time: let aclose get as far as it can
        assert not closing.done() and not first.done()  # it waits for the batch still running
        runner.release(batch)
        await closing
        assert first.result() == 10

    run(test)


def test_batches_never_run_in_the_context_of_the_caller_that_started_the_loop() -> None:
    """A batch serves many callers: it must not see the context variables (an API key, a
    request id) of whichever caller happened to start the loop, or of any one caller."""
    import contextvars

    key: contextvars.ContextVar[str] = contextvars.ContextVar("key", default="")
    seen: list[str] = []

    async def runner(batch: Batch) -> list[Done]:
        seen.append(key.get())
        return [Done(None) for _ in batch.handles]

    async def test() -> None:
        loop = ServingLoop(Scheduler(DynamicBatchPolicy(DynamicBatchConfig(max_batch_cost=1.0, max_wait_ms=0.0, adaptive=False))), runner, 2)
        key.set("first caller's key")  # the caller that starts the loop (lazily, as the cascade's door did)
        loop.start()
        await loop.submit("a")
        key.set("second caller's key")
        await loop.submit("b")
        await loop.aclose()
        assert seen == ["", ""]

    run(test)
