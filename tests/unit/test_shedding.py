"""Shedding at the door (issue 17): the scheduler refuses at ``add`` a request whose
deadline slack is below its estimated queue wait plus service time, with a retry hint,
instead of queueing it and running it into its deadline. Fake clock, no threads."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from recserve.errors import ResourceExhausted
from recserve.rpc.status import grpc_code, http_status
from recserve.scheduling import AdmissionConfig, Batch, Done, FeatureParallelConfig, FeatureParallelPolicy, Handle, ItemStatus, Priority, Scheduler, WorkItem
from recserve.scheduling.loop import ServingLoop
from tests.utils import Recorder

SERVICE_S = 0.010  # every batch of the fake runner takes 10 ms


def one_at_a_time(admission: AdmissionConfig = AdmissionConfig()) -> Scheduler:
    """Batches of one item (max_cost 1): the queue wait is queued items x service time."""
    return Scheduler(FeatureParallelPolicy(FeatureParallelConfig(window_ms=0.0, max_cost=1.0, dispatch_margin_ms=0.0)), admission)


def item(rid: str, deadline: float) -> WorkItem:
    return WorkItem(rid, "t", Priority.STANDARD, deadline, 1.0, payload=rid)


def warm(sched: Scheduler, now: float = 0.0, batches: int | None = None) -> float:
    """Run ``batches`` (default: the admission's ``shed_after_batches``, after which the
    slack check may shed) batches of SERVICE_S each, so the service-time estimate is known."""
    for k in range(sched.admission.config.shed_after_batches if batches is None else batches):
        sched.add(item(f"warm{k}", deadline=now + 10.0), now)
        batch = sched.schedule(now)
        assert batch is not None
        sched.complete(batch, [Done(None)], now + SERVICE_S)
        now += SERVICE_S
    return now


def test_a_request_whose_slack_is_below_queue_wait_plus_service_is_shed_with_a_retry_hint() -> None:
    sched = one_at_a_time()
    now = warm(sched)
    for i in range(10):  # 10 batches ahead: ~100 ms of queue wait, then 10 ms of service
        sched.add(item(f"q{i}", deadline=now + 10.0), now)
    wait_s, service_s = sched.estimated_wait_s()
    assert wait_s == pytest.approx(10 * SERVICE_S) and service_s == pytest.approx(SERVICE_S)
    with pytest.raises(ResourceExhausted) as caught:
        sched.add(item("tight", deadline=now + 0.05), now)  # 50 ms of slack < 110 ms
    err = caught.value
    assert grpc_code(err) is grpc.StatusCode.RESOURCE_EXHAUSTED and http_status(err) == 429
    assert err.retry_after_s == pytest.approx(10 * SERVICE_S)  # when the queue ahead has drained
    assert "tight" in err.message and "slack" in err.message and "10 items queued" in err.message
    assert sched.queued_count == 10 and sched.shed == 1 and sched.stats().drops["rejected"] == 1
    sched.add(item("roomy", deadline=now + 0.2), now)  # 200 ms > 110 ms: admitted
    assert sched.queued_count == 11


def test_no_estimate_yet_or_no_deadline_or_shedding_off_admits() -> None:
    cold = one_at_a_time()
    for i in range(10):
        cold.add(item(f"q{i}", deadline=1.0), 0.0)
    cold.add(item("tight", deadline=0.001), 0.0)  # no batch has run: nothing to estimate from
    off = one_at_a_time(AdmissionConfig(shed_by_slack=False))
    now = warm(off)
    for i in range(10):
        off.add(item(f"q{i}", deadline=now + 10.0), now)
    off.add(item("tight", deadline=now + 0.001), now)
    assert (cold.queued_count, off.queued_count, cold.shed, off.shed) == (11, 11, 0, 0)


def test_parallel_batches_shorten_the_estimated_wait() -> None:
    sched = one_at_a_time()
    now = warm(sched)
    for i in range(10):
        sched.add(item(f"q{i}", deadline=now + 10.0), now)
    sched.parallelism = 4  # what ServingLoop(max_inflight=4) sets
    # Its batch starts once 7 of the 10 ahead have finished, 4 at a time.
    assert sched.estimated_wait_s()[0] == pytest.approx(7 * SERVICE_S / 4)
    sched.add(item("fits", deadline=now + 0.03), now)  # 17.5 ms wait + 10 ms service < 30 ms
    assert sched.shed == 0
    with pytest.raises(ResourceExhausted):  # 11 ahead now: 20 ms + 10 ms > 25 ms
        sched.add(item("tight", deadline=now + 0.025), now)


def test_free_slots_mean_no_wait() -> None:
    sched = one_at_a_time()
    now = warm(sched)
    sched.parallelism = 4
    for i in range(3):  # 3 batches ahead, 4 slots: a fourth starts at once
        sched.add(item(f"q{i}", deadline=now + 10.0), now)
    assert sched.estimated_wait_s()[0] == 0.0
    sched.add(item("q3", deadline=now + 10.0), now)
    assert sched.estimated_wait_s()[0] == pytest.approx(SERVICE_S / 4)


def test_a_request_that_would_start_at_once_is_never_shed_so_a_stale_estimate_recovers() -> None:
    """An idle server whose service estimate is above every caller's slack (say, after a
    slow spell) must still run what arrives: shedding it would leave the estimate stale
    forever, since only runs refresh it."""
    sched = one_at_a_time()
    now = warm(sched)
    assert sched.estimated_wait_s() == (0.0, pytest.approx(SERVICE_S))
    sched.add(item("tight", deadline=now + SERVICE_S / 10), now)  # 1 ms of slack < 10 ms service: runs anyway
    assert sched.shed == 0 and sched.queued_count == 1
    with pytest.raises(ResourceExhausted):  # now one is ahead of it: the check applies
        sched.add(item("tight2", deadline=now + SERVICE_S / 10), now)
    assert sched.shed == 1


def test_serving_loop_tells_its_scheduler_how_many_batches_run_at_once() -> None:
    async def runner(batch: object) -> list[Done]:
        return []

    loop = ServingLoop(one_at_a_time(), runner, max_inflight=3)
    assert loop.scheduler.parallelism == 3


def simulate_overload(admission: AdmissionConfig) -> tuple[int, int, int, int]:
    """Arrivals at 2x capacity (one every 5 ms, 10 ms per item, one at a time), each
    with 50 ms of slack, for 2 s of fake time. Returns (on-time completions, late
    completions, dropped at the deadline, shed at add)."""
    sched = one_at_a_time(admission)
    rec = Recorder()
    warm(sched, -1.0)
    on_time = late = shed = 0
    handles: list[Handle] = []
    running: tuple[Batch, float] | None = None  # (batch, finish time)
    t = 0.0
    for step in range(400):
        t = step * 0.005
        if running is not None and running[1] <= t + 1e-9:  # float steps: 0.015 may be 0.0150000001
            batch, finished = running
            sched.complete(batch, [Done(None)], finished)
            for h in batch.handles:
                if finished <= h.deadline:
                    on_time += 1
                else:
                    late += 1
            running = None
        try:
            handles.append(sched.add(item(f"r{step}", deadline=t + 0.05), t, rec))
        except ResourceExhausted:
            shed += 1
        if running is None:
            formed = sched.schedule(t)
            if formed is not None:
                running = (formed, t + SERVICE_S)
    dropped = sum(h.status is ItemStatus.DROPPED for h in handles)
    return on_time, late, dropped, shed


def test_under_overload_shedding_keeps_goodput_where_edf_alone_runs_work_into_its_deadline() -> None:
    on_time, late, dropped, shed = simulate_overload(AdmissionConfig())
    # Capacity is 200 items in 2 s; arrivals 400. What is admitted finishes on time.
    assert on_time >= 190 and late <= 2 and dropped <= 2  # ~capacity, on time (late: float edges)
    assert shed >= 150
    # Without the slack check the queue fills and items wait until their deadline:
    # they are dropped there (never executed) or finish late, and the queue is never empty.
    off_on_time, off_late, off_dropped, off_shed = simulate_overload(AdmissionConfig(shed_by_slack=False))
    assert off_shed == 0 and off_dropped >= 150 and off_on_time <= 20


def test_shed_refusal_reaches_a_serving_loop_caller_synchronously() -> None:
    async def main() -> None:
        async def runner(batch: object) -> list[Done]:
            return [Done(None)]

        loop = ServingLoop(one_at_a_time(), runner, max_inflight=1, clock=lambda: 0.0)
        loop.start()
        try:
            sched = loop.scheduler
            for _ in range(sched.admission.config.shed_after_batches):  # a known (warm) 10 ms per batch
                sched.service.observe(1.0, SERVICE_S)
            for i in range(10):
                sched.add(item(f"q{i}", deadline=10.0), 0.0)  # straight into the core: nothing runs yet
            with pytest.raises(ResourceExhausted):
                loop.submit_nowait("x", deadline=0.02)
        finally:
            await loop.aclose(drain=False)

    asyncio.run(main())


def test_a_cold_scheduler_does_not_shed_on_its_first_batches() -> None:
    """The first batches of a fresh process pay lazy initialisation: one slow first batch
    must not make the slack check shed healthy traffic until shed_after_batches are seen."""
    sched = one_at_a_time(AdmissionConfig(shed_after_batches=3))
    now = warm(sched, batches=2)
    for i in range(10):
        sched.add(item(f"q{i}", deadline=now + 10.0), now)
    sched.add(item("tight", deadline=now + 0.05), now)  # would be shed with a warm estimate
    assert sched.shed == 0
    now = warm(sched, now, batches=1)  # the third measured batch: the estimate is warm
    with pytest.raises(ResourceExhausted):
        sched.add(item("tight2", deadline=now + 0.05), now)
    assert sched.shed == 1


def test_an_items_own_minimum_service_time_counts_when_above_the_estimate() -> None:
    """``WorkItem.min_service_s``: what the caller knows an item needs (the cascade: an
    undegraded call) when the measured estimate says less."""
    sched = one_at_a_time()
    now = warm(sched)
    sched.add(item("ahead", deadline=now + 10.0), now)  # one ahead: 10 ms wait + 10 ms service
    sched.add(item("fits", deadline=now + 0.05), now)  # 50 ms > 20 ms: admitted
    needy = WorkItem("needy", "t", Priority.STANDARD, now + 0.05, 1.0, payload="needy", min_service_s=0.045)
    with pytest.raises(ResourceExhausted):  # 20 ms wait + its own 45 ms > 50 ms
        sched.add(needy, now)
    assert sched.shed == 1 and sched.queued_count == 2



def test_a_window_policy_counts_the_queue_in_full_windows_not_in_past_batch_sizes() -> None:
    """At light load windows are small (here one item each) because little was waiting;
    ten callers queued behind one window in flight all join the next window (its cap is
    100), so their wait is about one window, not ten (issue 9: the lookup client shed
    callers at 1,500 req/s that the next window would have served in time)."""
    sched = Scheduler(FeatureParallelPolicy(FeatureParallelConfig(window_ms=0.0, max_cost=100.0, dispatch_margin_ms=0.0)), AdmissionConfig())
    now = warm(sched)  # mean batch size 1
    sched.add(item("running", deadline=now + 10.0), now)
    assert sched.schedule(now) is not None  # one window in flight
    for i in range(10):
        sched.add(item(f"q{i}", deadline=now + 10.0), now)
    wait_s, service_s = sched.estimated_wait_s()
    assert wait_s == pytest.approx(SERVICE_S * (1 + 10 / 100))  # the window in flight, plus a tenth of a window
    sched.add(item("tight", deadline=now + 0.03), now)  # 30 ms of slack > 11 + 10 ms: admitted
    assert sched.queued_count == 11 and sched.shed == 0
    with pytest.raises(ResourceExhausted):
        sched.add(item("tighter", deadline=now + 0.015), now)  # 15 ms < 11 + 10 ms: still shed


def test_the_estimate_follows_recent_batches_not_the_all_time_mean_cost() -> None:
    """After a burst of big batches (an overload, a knee search's top probe) the batches
    are small and fast again: the slack check must use what batches cost *now*. An
    all-time mean batch cost stayed high for the rest of the process's life, and the
    service fit evaluated there shed callers at a third of the knee (issue 9)."""
    sched = Scheduler(FeatureParallelPolicy(FeatureParallelConfig(window_ms=0.0, max_cost=500.0, dispatch_margin_ms=0.0)), AdmissionConfig())
    now = 0.0

    def run(cost: float, took_s: float, n: int) -> None:
        nonlocal now
        for k in range(n):
            sched.add(WorkItem(f"c{cost}-{k}", "t", Priority.STANDARD, now + 10.0, cost, payload=None), now)
            batch = sched.schedule(now)
            assert batch is not None
            now += took_s
            sched.complete(batch, [Done(None)], now)

    run(500.0, 0.050, 50)  # the burst: 50 ms batches of 500
    run(10.0, 0.005, 40)  # now: 5 ms batches of 10
    _, service_s = sched.estimated_wait_s()
    assert service_s < 0.008  # ≈ 5 ms (the fit keeps ~1.5 % of the burst's weight); the all-time mean cost gave ≈ 30 ms


def test_the_service_estimate_is_when_items_get_their_answers_not_when_the_batch_ends() -> None:
    """A lookup window answers each caller as its rows arrive (Scheduler.resolve); one
    caller waiting for a late shard keeps the window open until its deadline. Callers
    that would be answered in 5 ms must not be shed for the window's 20 ms (issue 9)."""
    sched = Scheduler(FeatureParallelPolicy(FeatureParallelConfig(window_ms=0.0, max_cost=100.0, dispatch_margin_ms=0.0)), AdmissionConfig())
    now = 0.0
    for b in range(20):
        handles = [sched.add(item(f"b{b}-{k}", deadline=now + 10.0), now) for k in range(10)]
        batch = sched.schedule(now)
        assert batch is not None and len(batch) == 10
        for h in handles[:9]:
            assert sched.resolve(h, Done(None), now + 0.005)  # nine answered after 5 ms
        now += 0.020  # the tenth at the batch's end, 20 ms
        sched.complete(batch, [Done(None)] * 10, now)
    wait_s, service_s = sched.estimated_wait_s()
    assert wait_s == 0.0 and service_s == pytest.approx(0.0065)  # (9 x 5 + 20) / 10 ms
    assert sched.service.mean_s() == pytest.approx(0.020)  # the batch itself still holds its slot 20 ms
