"""Issue 9's lean scheduler path, metrics side: the bulk recorders equal the per-item ones.

- ``Summary.record_many`` leaves the ring, count and total that ``record`` of each value
  in turn leaves (bit for bit, wrap-around included);
- ``BatchHistogram.observe_many`` leaves every sample (buckets, count, sum) that
  prometheus_client's own ``Histogram.observe`` of each value leaves;
- a policy's ``take_while`` records the queue waits that ``take`` one by one records, in
  the scheduler's ring and in the loop's histogram, and a real ServingLoop's scraped
  queue-wait histogram holds exactly the scheduler's samples.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.registry import REGISTRY

from recserve.metrics.catalog import LATENCY_BUCKETS_S
from recserve.metrics.histogram import BatchHistogram
from recserve.scheduling import Priority, Scheduler, WorkItem
from recserve.scheduling.core import Scheduler as CoreScheduler
from recserve.scheduling.loop import ServingLoop
from recserve.scheduling.metrics import Summary
from recserve.scheduling.policy_base import Policy, SchedulerView
from recserve.scheduling.types import Batch, Done

# -- Summary.record_many ----------------------------------------------------------------


def _state(summary: Summary) -> tuple[list[float], int, float]:
    return list(summary._buf), summary.count, summary.total  # noqa: SLF001  (the ring itself)


@pytest.mark.parametrize("window", [1, 4, 8])
def test_record_many_leaves_the_ring_count_and_total_that_record_of_each_leaves(window: int) -> None:
    rng = random.Random(window)
    bulk, each = Summary(window), Summary(window)
    # Chunks shorter than, equal to and longer than the ring, from every start offset.
    for size in [0, 1, 3, window - 1, window, window + 1, 2 * window + 3, 1, 5]:
        values = [rng.random() * 10 ** rng.randint(-6, 3) for _ in range(max(size, 0))]
        bulk.record_many(values)
        for v in values:
            each.record(v)
        assert _state(bulk) == _state(each)  # exact: the same floats, summed in the same order
    assert bulk.summary() == each.summary()


def test_record_many_takes_a_tuple_and_sums_left_to_right() -> None:
    bulk, each = Summary(4), Summary(4)
    values = (1e16, 1.0, -1e16, 1.0)  # compensated summation would give 2.0; record gives 1.0
    bulk.record_many(values)
    for v in values:
        each.record(v)
    assert bulk.total == each.total == 1.0 and bulk.recent() == each.recent() == list(values)


# -- BatchHistogram.observe_many ---------------------------------------------------------


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample but ``_created`` (a timestamp), keyed by its name and labels."""
    out = {}
    for family in registry.collect():
        for s in family.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _pair() -> tuple[CollectorRegistry, Histogram, CollectorRegistry, BatchHistogram]:
    ref_registry, bulk_registry = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("lean_wait_seconds", "queue wait", ["loop"], buckets=LATENCY_BUCKETS_S, registry=ref_registry)
    bulk = BatchHistogram("lean_wait_seconds", "queue wait", ["loop"], buckets=LATENCY_BUCKETS_S, registry=bulk_registry)
    return ref_registry, ref, bulk_registry, bulk


def test_observe_many_leaves_every_sample_that_observe_of_each_leaves() -> None:
    ref_registry, ref, bulk_registry, bulk = _pair()
    rng = random.Random(7)
    # Bounds themselves (``a <= bound`` files a value equal to a bound in that bound's
    # bucket), values between them, beyond the last, zero, negative, +inf.
    edge = [*LATENCY_BUCKETS_S, 0.0, -0.5, 11.0, math.inf, 0.00025 * (1 + 1e-15)]
    batches = [edge, [rng.random() * 0.01 for _ in range(64)], [], [0.003], [rng.expovariate(50.0) for _ in range(200)]]
    for i, batch in enumerate(batches):
        label = f"l{i % 2}"
        bulk.labels(label).observe_many(batch)
        for v in batch:
            ref.labels(label).observe(v)
        assert _samples(bulk_registry) == _samples(ref_registry)
    # Mixed with single observations, which it keeps too.
    bulk.labels("l0").observe(0.002)
    ref.labels("l0").observe(0.002)
    assert _samples(bulk_registry) == _samples(ref_registry)
    # l0 got batches 0, 2 and 4, then the single observation.
    assert _samples(bulk_registry)[("lean_wait_seconds_count", (("loop", "l0"),))] == len(edge) + 0 + 200 + 1


def test_observe_many_counts_and_sums_as_observe_does() -> None:
    ref_registry, ref, bulk_registry, bulk = _pair()
    values = [0.0001, 0.0005, 0.0005, 0.002, 7.0, 20.0]
    bulk.labels("x").observe_many(values)
    for v in values:
        ref.labels("x").observe(v)
    got = _samples(bulk_registry)
    assert got == _samples(ref_registry)
    labels = (("loop", "x"),)
    assert got[("lean_wait_seconds_count", labels)] == 6.0
    assert got[("lean_wait_seconds_sum", labels)] == sum(values)
    assert got[("lean_wait_seconds_bucket", (("le", "0.0005"), ("loop", "x")))] == 3.0  # 0.0001 and both 0.0005
    assert got[("lean_wait_seconds_bucket", (("le", "10.0"), ("loop", "x")))] == 5.0
    assert got[("lean_wait_seconds_bucket", (("le", "+Inf"), ("loop", "x")))] == 6.0


def test_observe_many_files_nan_in_no_bucket_like_observe() -> None:
    ref_registry, ref, bulk_registry, bulk = _pair()
    bulk.labels("n").observe_many([math.nan, 0.001])
    ref.labels("n").observe(math.nan)
    ref.labels("n").observe(0.001)
    got, want = _samples(bulk_registry), _samples(ref_registry)
    labels = (("loop", "n"),)
    assert got[("lean_wait_seconds_count", labels)] == want[("lean_wait_seconds_count", labels)] == 1.0
    assert math.isnan(got.pop(("lean_wait_seconds_sum", labels))) and math.isnan(want.pop(("lean_wait_seconds_sum", labels)))
    assert got == want


def test_observe_many_on_a_labelled_parent_raises_as_observe_does() -> None:
    _, ref, _, bulk = _pair()
    with pytest.raises(ValueError) as want:
        ref.observe(1.0)
    with pytest.raises(ValueError) as got_many:
        bulk.observe_many([1.0])
    with pytest.raises(ValueError) as got_one:
        bulk.observe(1.0)
    assert str(got_many.value) == str(got_one.value) == str(want.value)


# -- the scheduler's queue waits ---------------------------------------------------------


class _TakeEach(Policy):
    """Takes up to ``limit`` queued items one ``take()`` at a time (a non-window policy)."""

    def __init__(self, limit: int, *, bulk: bool) -> None:
        self.limit = limit
        self.bulk = bulk

    def ready_at(self, view: SchedulerView, now: float) -> float | None:
        return now if view.queued_count else None

    def select(self, view: SchedulerView, now: float) -> None:
        if self.bulk:
            view.take_while(float(self.limit))  # cost 1 each: ``limit`` items
            return
        while view.queued_count and view.batch_size < self.limit:
            view.take()


def _fed(policy: Policy, hist: BatchHistogram) -> tuple[Scheduler, list[list[str]]]:
    sched = CoreScheduler(policy)
    sched.observe_queue_waits(hist.labels("q").observe_many)
    rng = random.Random(3)
    now, order = 0.0, []
    for i in range(40):
        now += rng.choice([0.0, 1e-4, 7e-4, 3e-3])
        deadline = math.inf if i % 3 else now + rng.choice([0.5, 0.2])  # EDF moves some ahead
        sched.add(WorkItem(f"r{i}", "default", Priority.STANDARD if i % 5 else Priority.CRITICAL, deadline, 1.0), now)
        if i % 4 == 3:
            batch = sched.schedule(now + 0.001)
            assert batch is not None
            order.append([h.request_id for h in batch.handles])
            sched.complete(batch, [Done(None)] * len(batch), now + 0.002)
    return sched, order


def test_take_while_records_the_queue_waits_that_take_one_by_one_records() -> None:
    bulk_registry, each_registry = CollectorRegistry(), CollectorRegistry()
    bulk_hist = BatchHistogram("lean_q_seconds", "q", ["loop"], buckets=LATENCY_BUCKETS_S, registry=bulk_registry)
    each_hist = BatchHistogram("lean_q_seconds", "q", ["loop"], buckets=LATENCY_BUCKETS_S, registry=each_registry)
    bulk, bulk_order = _fed(_TakeEach(3, bulk=True), bulk_hist)
    each, each_order = _fed(_TakeEach(3, bulk=False), each_hist)
    assert bulk_order == each_order and len(bulk_order) == 10  # same batches, same EDF order
    assert _state(bulk.metrics.queue_wait_s) == _state(each.metrics.queue_wait_s)
    assert bulk.metrics.queue_wait_s.count == 30
    assert _samples(bulk_registry) == _samples(each_registry)
    assert bulk.stats() == each.stats()


class _TakeAll(Policy):
    def ready_at(self, view: SchedulerView, now: float) -> float | None:
        return now if view.queued_count else None

    def select(self, view: SchedulerView, now: float) -> None:
        view.take_while(math.inf)


def test_a_serving_loop_scrapes_exactly_the_scheduler_queue_waits() -> None:
    """End to end: the loop's ``recserve_scheduler_queue_wait_seconds{loop=...}`` holds
    what a prometheus_client Histogram fed the scheduler's own samples one by one holds."""
    name = "test-lean-queue-wait"
    clock = [100.0]
    gate: asyncio.Event | None = None

    async def runner(batch: Batch) -> list[Any]:
        assert gate is not None
        await gate.wait()
        return [Done(h.item.payload) for h in batch.handles]

    async def go() -> Scheduler:
        nonlocal gate
        gate = asyncio.Event()
        loop = ServingLoop(Scheduler(_TakeAll()), runner, max_inflight=1, name=name, clock=lambda: clock[0])
        loop.start()
        first = loop.submit_nowait("a")
        await asyncio.sleep(0)  # batch 1 runs [a] and holds the slot
        rest = []
        for i, wait_s in enumerate([0.0001, 0.0004, 0.0009, 0.003, 0.02]):
            clock[0] += wait_s
            rest.append(loop.submit_nowait(f"b{i}"))
        clock[0] += 0.0005
        gate.set()
        assert await first == "a" and await asyncio.gather(*rest) == [f"b{i}" for i in range(5)]
        await loop.aclose()
        return loop.scheduler

    sched = asyncio.run(go())
    waits = sched.metrics.queue_wait_s.recent()
    assert len(waits) == 6 and waits[0] == 0.0
    ref_registry = CollectorRegistry()
    ref = Histogram("recserve_scheduler_queue_wait_seconds", "ref", ["loop"], buckets=LATENCY_BUCKETS_S, registry=ref_registry)
    for w in waits:
        ref.labels(name).observe(w)
    want = {k: v for k, v in _samples(ref_registry).items() if ("loop", name) in k[1]}
    got = {k: v for k, v in _samples(REGISTRY).items() if k[0].startswith("recserve_scheduler_queue_wait_seconds") and ("loop", name) in k[1]}
    assert got == want and got[("recserve_scheduler_queue_wait_seconds_count", (("loop", name),))] == 6.0
