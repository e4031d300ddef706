"""Issue 9's lean scheduler path, decision side: the fast paths decide what the per-item
paths they replaced decided.

- the slack check folded into ``Scheduler.add`` (its inputs derived once per batch
  event, the fit's estimate once per cost) sheds exactly the requests, with exactly the
  message and retry-after hint, that the per-add derivation shed — through random
  adds, batches, early answers, cancels, parallelism changes, direct fit samples and a
  cap that moves at any time;
- ``resolve_done`` (``_answer`` inlined, latencies recorded once) and ``complete``
  (``_release`` inlined) leave what ``resolve`` per item leaves, quotas and policy
  hooks included;
- the ServingLoop's submit path: default request ids, one driver wake-up per burst and
  never a lost one, an item future that was already done.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

import pytest

from recserve.config.spec import TenantConfig
from recserve.errors import InternalError, ResourceExhausted
from recserve.scheduling import Done, FeatureParallelConfig, FeatureParallelPolicy, Priority, Scheduler, WorkItem
from recserve.scheduling.admission import Admission, AdmissionConfig
from recserve.scheduling.loop import ServingLoop
from recserve.scheduling.metrics import DropReason
from recserve.scheduling.policy_base import Policy, SchedulerView
from recserve.scheduling.types import Batch, Handle, ItemStatus

# -- the slack check ------------------------------------------------------------------


def reference_wait(s: Scheduler) -> tuple[float, float]:
    """``estimated_wait_s`` as it was derived on every add before issue 9's fold."""
    service = s.service
    mean_s = service.mean_s()
    queued = s._queue.count / max(1.0, s._mean_size)  # noqa: SLF001
    cap = s._batch_cap  # noqa: SLF001
    if cap is not None:
        queued = min(queued, s._queue.cost / max(cap(), 1e-9))  # noqa: SLF001
    ahead = queued + len(s._inflight)  # noqa: SLF001
    wait_s = mean_s * max(0.0, ahead - (s.parallelism - 1)) / s.parallelism
    return wait_s, (s._item_s if service.count else mean_s)  # noqa: SLF001


def reference_shed(s: Scheduler, item: WorkItem, now: float) -> ResourceExhausted | None:
    """The error the per-add ``_shed_check`` raised for ``item``, or None to admit."""
    if not (item.deadline < math.inf and s.service.count >= s.admission.config.shed_after_batches):
        return None
    wait_s, service_s = reference_wait(s)
    if wait_s <= 0.0:
        return None
    need_s = max(service_s, s.service.estimate_s(item.cost), item.min_service_s)
    try:
        Admission(s.admission.config).shed(item.request_id, item.deadline - now, wait_s, need_s, s.queued_count)
    except ResourceExhausted as err:
        return err
    return None


class MovingCap(FeatureParallelPolicy):
    """A window policy whose cap the test moves between any two calls (an SLO
    controller's moves in ``on_finish``, e.g. at a cancel, between batch events)."""

    def __init__(self) -> None:
        super().__init__(FeatureParallelConfig(window_ms=0.5, max_cost=1e9))
        self.cap_now = 8.0

    def cap(self) -> float:
        return self.cap_now


class TakeSome(Policy):
    """No window, no cap: up to 5 items whenever any is queued."""

    def ready_at(self, view: SchedulerView, now: float) -> float | None:
        return now if view.queued_count else None

    def select(self, view: SchedulerView, now: float) -> None:
        while view.queued_count and view.batch_size < 5:
            view.take()


def drive(policy: Policy, seed: int) -> tuple[int, int]:
    """Random traffic against one scheduler; at every add, the folded check must decide
    (and word) what the reference decides. Returns (admitted, shed) with a deadline."""
    rng = random.Random(seed)
    sched = Scheduler(policy, AdmissionConfig(shed_after_batches=2))
    now = 0.0
    queued: list[Handle] = []
    running: list[Batch] = []
    admitted = shed = 0
    for step in range(600):
        now += rng.choice([0.0, 0.0, 1e-4, 1e-3, 4e-3])
        op = rng.random()
        if op < 0.5:
            cost = rng.choice([1.0, 1.0, 2.0, 4.0, 3.5])  # repeats and changes: the estimate cache
            deadline = now + rng.choice([math.inf, 0.0005, 0.002, 0.006, 0.02, 0.1])
            item = WorkItem(f"r{step}", "default", Priority.STANDARD, deadline, cost, min_service_s=rng.choice([0.0, 0.0, 0.004]))
            assert sched.estimated_wait_s() == reference_wait(sched)  # bit for bit
            want = reference_shed(sched, item, now)
            before = (sched.shed, sched.metrics.drops[DropReason.REJECTED])
            if want is None:
                queued.append(sched.add(item, now))
                admitted += deadline < math.inf
            else:
                with pytest.raises(ResourceExhausted) as got:
                    sched.add(item, now)
                assert (str(got.value), got.value.retry_after_s) == (str(want), want.retry_after_s)
                assert (sched.shed, sched.metrics.drops[DropReason.REJECTED]) == (before[0] + 1, before[1] + 1)
                shed += 1
        elif op < 0.65:
            batch = sched.schedule(now, flush=rng.random() < 0.3)
            if batch is not None:
                running.append(batch)
        elif op < 0.8 and running:
            batch = running.pop(rng.randrange(len(running)))
            live = [h for h in batch.handles if not h.done]
            early = live[: rng.randrange(len(live) + 1)]
            sched.resolve_done(early, [None] * len(early), now)
            now += rng.choice([0.001, 0.003, 0.008])
            if rng.random() < 0.2:
                sched.fail(batch, RuntimeError("runner down"), now)  # ends it without a fit sample
            else:
                sched.complete(batch, [Done(None)] * len(batch), now)
        elif op < 0.86:
            waiting = [h for h in queued if h.status is ItemStatus.QUEUED]
            if waiting:
                sched.cancel(rng.choice(waiting), now)
        elif op < 0.9:
            sched.parallelism = rng.choice([1, 2, 3])
        elif op < 0.94:
            sched.service.observe(rng.choice([1.0, 6.0]), rng.choice([0.001, 0.004]))  # straight into the fit
        elif isinstance(policy, MovingCap):
            policy.cap_now = rng.choice([0.5, 2.0, 8.0, 64.0])
        sched.expire(now)
    return admitted, shed


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("make", [MovingCap, TakeSome], ids=["window-policy", "no-cap"])
def test_the_folded_slack_check_sheds_what_the_per_add_derivation_shed(make: type[Policy], seed: int) -> None:
    admitted, shed = drive(make(), seed)
    assert admitted > 20 and shed > 5  # both outcomes were exercised


def test_a_moving_cap_is_asked_at_every_add_not_cached() -> None:
    policy = MovingCap()
    sched = Scheduler(policy, AdmissionConfig(shed_after_batches=1))
    sched.service.observe(1.0, 0.010)
    for i in range(8):
        sched.add(WorkItem(f"q{i}", "t", Priority.STANDARD, math.inf, 1.0), 0.0)
    sched.parallelism = 1
    policy.cap_now = 8.0  # 8 queued, 1 per batch (mean size 1): min(8, 8 / 8) = 1 batch ahead
    assert sched.estimated_wait_s()[0] == pytest.approx(0.010)
    policy.cap_now = 2.0  # no batch event in between: 4 batches ahead now
    assert sched.estimated_wait_s()[0] == pytest.approx(0.040)
    item = WorkItem("tight", "t", Priority.STANDARD, 0.045, 1.0)  # 45 ms < 40 ms + 10 ms
    with pytest.raises(ResourceExhausted):
        sched.add(item, 0.0)
    policy.cap_now = 8.0
    sched.add(item, 0.0)  # 45 ms >= 10 + 10 ms


# -- resolve_done / complete ---------------------------------------------------------


class Recorder:
    def __init__(self, *, fail_on: str | None = None) -> None:
        self.seen: list[tuple[str, Any]] = []
        self.fail_on = fail_on

    def on_done(self, handle: Handle, output: Any) -> None:
        self.seen.append((handle.request_id, output))
        if handle.request_id == self.fail_on:
            raise RuntimeError("listener bug")

    def on_error(self, handle: Handle, error: Exception) -> None:
        self.seen.append((handle.request_id, repr(error)))

    def on_partial(self, handle: Handle, output: Any) -> None:
        pass


class Finishes(FeatureParallelPolicy):
    """Counts on_finish per request (the core calls it from complete's inlined release)."""

    def __init__(self) -> None:
        super().__init__(FeatureParallelConfig(window_ms=0.0, max_cost=1e9))
        self.finished: list[tuple[str, ItemStatus, float]] = []

    def on_finish(self, handle: Handle, now: float) -> None:
        self.finished.append((handle.request_id, handle.status, now))


def running(listener: Recorder) -> tuple[Scheduler, Finishes, Batch]:
    policy = Finishes()
    sched = Scheduler(policy, AdmissionConfig(tenants=(TenantConfig(name="t", max_concurrent_cost=100.0),)))
    for i in range(6):
        sched.add(WorkItem(f"r{i}", "t", Priority.STANDARD, 100.0, 2.0 + i, payload=i), 1.0 + 0.5 * i, listener)
    batch = sched.schedule(5.0, flush=True)
    assert batch is not None and len(batch) == 6
    return sched, policy, batch


def fields(h: Handle) -> tuple[Any, ...]:
    return (h.request_id, h.status, h.output, h.answered_at, h.listener is None, h.quota is None, repr(h.error), h.steps)


def test_resolve_done_and_complete_leave_what_resolve_of_each_leaves() -> None:
    bulk_seen, each_seen = Recorder(fail_on="r1"), Recorder(fail_on="r1")  # a listener bug is logged, not fatal
    bulk, bulk_policy, bulk_batch = running(bulk_seen)
    each, each_policy, each_batch = running(each_seen)
    bulk.cancel(bulk_batch.handles[4], 5.5)
    each.cancel(each_batch.handles[4], 5.5)
    assert bulk.resolve_done(bulk_batch.handles[:5], ["a", "b", "c", "d", "e"], 6.0) == 4  # r4 cancelled: skipped
    for h, out in zip(each_batch.handles[:5], "abcde"):
        each.resolve(h, Done(out), 6.0)
    assert [fields(h) for h in bulk_batch.handles] == [fields(h) for h in each_batch.handles]
    assert bulk_seen.seen == each_seen.seen and len(bulk_seen.seen) == 5  # r0..r3 done, r4 cancelled
    assert bulk.metrics.latency_s.recent() == each.metrics.latency_s.recent() == [5.0, 4.5, 4.0, 3.5]  # in order
    assert bulk.admission.tenant_inflight_cost("t") == each.admission.tenant_inflight_cost("t") == sum(2.0 + i for i in range(6))
    # complete: the early-answered and cancelled items release their quota and reach
    # on_finish only now; r5 finishes with its outcome.
    for sched, batch in ((bulk, bulk_batch), (each, each_batch)):
        sched.complete(batch, [Done("late")] * 6, 7.0)
    assert [fields(h) for h in bulk_batch.handles] == [fields(h) for h in each_batch.handles]
    assert bulk_batch.handles[0].output == "a" and bulk_batch.handles[5].output == "late"
    assert bulk.admission.tenant_inflight_cost("t") == each.admission.tenant_inflight_cost("t") == 0.0
    assert bulk_policy.finished == each_policy.finished and len(bulk_policy.finished) == 6
    assert all(h.quota is None for h in bulk_batch.handles)
    assert bulk.stats() == each.stats() and bulk.metrics.completed == 5


def test_resolve_done_keeps_the_answers_and_latencies_before_an_item_it_refuses() -> None:
    sched, _, batch = running(Recorder())
    queued = sched.add(WorkItem("queued", "t", Priority.STANDARD, 100.0, 1.0), 5.5)
    with pytest.raises(InternalError, match="queued.*needs a running item"):
        sched.resolve_done([*batch.handles[:2], queued, batch.handles[2]], ["a", "b", "x", "c"], 6.0)
    assert [h.output for h in batch.handles[:3]] == ["a", "b", None]
    assert sched.metrics.completed == 2 and sched.metrics.latency_s.recent() == [5.0, 4.5]


# -- the serving loop's submit path ------------------------------------------------------


class TakeAll(Policy):
    def ready_at(self, view: SchedulerView, now: float) -> float | None:
        return now if view.queued_count else None

    def select(self, view: SchedulerView, now: float) -> None:
        view.take_while(math.inf)


def test_submit_names_items_wakes_the_driver_once_per_burst_and_never_misses_a_wake_up() -> None:
    sizes: list[int] = []
    ids: list[str] = []

    async def runner(batch: Batch) -> list[Done]:
        sizes.append(len(batch))
        ids.extend(h.request_id for h in batch.handles)
        return [Done(h.item.payload * 2) for h in batch.handles]

    async def go() -> int:
        loop = ServingLoop(Scheduler(TakeAll()), runner, name="lean-submit")
        loop.start()
        await asyncio.sleep(0)  # the driver is asleep on its event
        wake = loop._wake  # noqa: SLF001
        assert wake is not None
        sets = 0
        real_set = wake.set

        def counting_set() -> None:
            nonlocal sets
            sets += 1
            real_set()

        wake.set = counting_set  # type: ignore[method-assign]
        burst = [loop.submit_nowait(i) for i in range(10)]
        assert sets == 1  # one wake-up for the whole burst
        assert await asyncio.gather(*burst) == [2 * i for i in range(10)]
        # The driver went back to sleep (it cleared the event): the next submit wakes it
        # (wait_for only turns a lost wake-up into a failure instead of a hang).
        for round_ in range(3):
            assert await asyncio.wait_for(loop.submit_nowait(100 + round_), 10.0) == 2 * (100 + round_)
        assert await asyncio.wait_for(loop.submit(7, request_id="mine"), 10.0) == 14
        await loop.aclose()
        return sets

    sets = asyncio.run(go())
    assert sizes == [10, 1, 1, 1, 1] and sets >= 5
    assert ids == [f"lean-submit-{n}" for n in range(1, 14)] + ["mine"]


def test_an_item_future_already_done_is_left_alone_and_the_rest_are_answered(caplog: pytest.LogCaptureFixture) -> None:
    loops: list[ServingLoop] = []

    async def runner(batch: Batch) -> list[Any]:
        first = batch.handles[0].listener
        assert isinstance(first, asyncio.Future)
        asyncio.Future.cancel(first)  # done behind the scheduler's back: the item still runs
        loops[0].resolve_done(batch.handles, ["x", "y"])
        return [Done(None)] * len(batch)

    async def go() -> list[Any]:
        loop = ServingLoop(Scheduler(TakeAll()), runner, name="lean-done")
        loops.append(loop)
        loop.start()
        futures = [loop.submit_nowait("a"), loop.submit_nowait("b")]
        got = await asyncio.gather(*futures, return_exceptions=True)
        await loop.aclose()
        return got

    got = asyncio.run(go())
    assert isinstance(got[0], asyncio.CancelledError) and got[1] == "y"
    assert loops[0].scheduler.metrics.completed == 2
    assert not [r for r in caplog.records if "failed on done" in r.getMessage()]  # not a listener failure
