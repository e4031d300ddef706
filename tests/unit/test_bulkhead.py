"""DeviceBulkhead (fake clock) and DeviceExecutor (one worker thread, synchronised with
events): ranker batches first, decode's guaranteed minimum share, work conservation,
bounded bursts (issue 16, "Shared device")."""

from __future__ import annotations

import asyncio
import threading

import pytest

from recserve.errors import ConfigError, FailedPrecondition, Unavailable
from recserve.scheduling import Done, DynamicBatchConfig, DynamicBatchPolicy, Scheduler, ServingLoop
from recserve.scheduling.bulkhead import BulkheadConfig, DeviceBulkhead, Lane
from recserve.scheduling.device import DeviceExecutor

C, B = Lane.CRITICAL, Lane.BEST_EFFORT


def simulate(bulkhead: DeviceBulkhead[str], seconds: float, cost_s: dict[Lane, float], *, backlog: dict[Lane, int]) -> list[tuple[Lane, float, float]]:
    """Run the device for ``seconds`` of fake time with each lane kept at ``backlog[lane]``
    queued jobs of ``cost_s[lane]`` each (a lane with backlog 0 never has work). Returns
    (lane, start, end) per job run."""
    now = 0.0
    runs: list[tuple[Lane, float, float]] = []
    for lane, n in backlog.items():
        for _ in range(n):
            bulkhead.push(lane, lane.name, now)
    while now < seconds:
        job = bulkhead.pop(now)
        assert job is not None, "both backlogs are kept full: the device is never idle"
        end = now + cost_s[job.lane]
        bulkhead.done(job, end)
        runs.append((job.lane, now, end))
        now = end
        bulkhead.push(job.lane, job.lane.name, now)  # the closed loop keeps its backlog
    return runs


def share(runs: list[tuple[Lane, float, float]], lane: Lane) -> float:
    total = sum(e - s for _, s, e in runs)
    return sum(e - s for k, s, e in runs if k is lane) / total


def test_critical_goes_first_when_both_wait() -> None:
    b: DeviceBulkhead[str] = DeviceBulkhead()
    b.push(B, "step", 0.0)  # decode queued first ...
    b.push(C, "rank", 0.0)
    job = b.pop(0.0)
    assert job is not None and job.payload == "rank"  # ... the ranker batch still runs first


def test_device_runs_one_job_at_a_time_fifo_within_a_lane() -> None:
    b: DeviceBulkhead[str] = DeviceBulkhead()
    for name in ("r1", "r2"):
        b.push(C, name, 0.0)
    first = b.pop(0.0)
    assert first is not None and first.payload == "r1"
    assert b.busy and b.pop(0.0) is None  # busy: nothing else starts
    b.done(first, 0.001)
    second = b.pop(0.001)
    assert second is not None and second.payload == "r2"
    with pytest.raises(FailedPrecondition, match="not the running job"):
        b.done(first, 0.002)


@pytest.mark.parametrize("share_s", [0.2, 0.5])
@pytest.mark.parametrize(("crit_ms", "step_ms"), [(5.0, 2.0), (2.0, 6.0), (4.0, 4.0)])
def test_decode_keeps_its_minimum_share_under_sustained_contention(share_s: float, crit_ms: float, step_ms: float) -> None:
    b: DeviceBulkhead[str] = DeviceBulkhead(BulkheadConfig(min_device_share=share_s))
    runs = simulate(b, 20.0, {C: crit_ms / 1e3, B: step_ms / 1e3}, backlog={C: 2, B: 1})
    got = share(runs, B)
    # Non-preemptive jobs: the share is met to within one job's worth per credit cycle.
    assert share_s - 0.02 <= got <= share_s + 0.05, got
    stats = b.stats()
    assert stats.best_effort_contended_share == pytest.approx(got, abs=1e-6)  # every run here was contended
    assert stats.critical.jobs + stats.best_effort.jobs == len(runs)


def test_decode_never_starves_a_step_at_least_every_step_over_share() -> None:
    b: DeviceBulkhead[str] = DeviceBulkhead(BulkheadConfig(min_device_share=0.2))
    crit, step = 0.003, 0.002
    runs = simulate(b, 5.0, {C: crit, B: step}, backlog={C: 4, B: 1})
    starts = [s for k, s, _ in runs if k is B]
    gaps = [b2 - a for a, b2 in zip(starts, starts[1:])]
    assert len(starts) > 100
    assert max(gaps) <= step / 0.2 + crit  # the bound of the module doc, plus one non-preempted batch


def test_zero_share_is_strict_priority() -> None:
    b: DeviceBulkhead[str] = DeviceBulkhead(BulkheadConfig(min_device_share=0.0))
    runs = simulate(b, 1.0, {C: 0.004, B: 0.002}, backlog={C: 2, B: 1})
    assert not [r for r in runs if r[0] is B]


def test_work_conserving_decode_alone_is_free_and_rankers_still_go_first_after() -> None:
    b: DeviceBulkhead[str] = DeviceBulkhead(BulkheadConfig(min_device_share=0.2))
    runs = simulate(b, 1.0, {C: 0.004, B: 0.002}, backlog={B: 1})
    assert len(runs) == 500 and all(k is B for k, _, _ in runs)  # the device never idles for want of rankers
    assert b.credit_s == 0.0  # uncontended time moves no credit, either way
    now = runs[-1][2]
    b.push(C, "rank", now)  # decode has its next step queued already
    job = b.pop(now)
    assert job is not None and job.lane is C


def test_credit_is_bounded_so_a_long_ranker_burst_banks_no_long_decode_burst() -> None:
    cfg = BulkheadConfig(min_device_share=0.5, max_credit_ms=10.0)
    b: DeviceBulkhead[str] = DeviceBulkhead(cfg)
    b.push(B, "step", 0.0)
    b.push(C, "long-rank", 0.0)
    job = b.pop(0.0)
    assert job is not None and job.lane is C
    b.done(job, 1.0)  # one second contended at share 0.5 would earn half a second ...
    assert b.credit_s == pytest.approx(0.010)  # ... the bank holds 10 ms
    step = b.pop(1.0)
    assert step is not None and step.lane is B
    b.push(C, "rank", 1.0)
    b.done(step, 1.5)  # a 500 ms step while the rankers waited: the debt is bounded too
    assert b.credit_s == pytest.approx(-0.010)


def test_contended_time_counts_only_from_when_the_other_lane_arrived() -> None:
    b: DeviceBulkhead[str] = DeviceBulkhead(BulkheadConfig(min_device_share=0.2))
    b.push(C, "rank", 0.0)
    job = b.pop(0.0)
    assert job is not None
    b.push(B, "step", 0.004)  # decode arrives 4 ms into a 5 ms forward
    b.done(job, 0.005)
    assert b.credit_s == pytest.approx(0.001 * 0.2)  # earned at the share's rate for the 1 ms decode waited
    assert b.stats().critical.contended_s == pytest.approx(0.001)
    assert b.stats().critical.busy_s == pytest.approx(0.005)


def test_discard_drops_a_queued_job() -> None:
    b: DeviceBulkhead[str] = DeviceBulkhead()
    job = b.push(B, "step", 0.0)
    assert b.discard(job, 0.0) and not b.discard(job, 0.0)
    assert b.idle and b.pop(0.0) is None


@pytest.mark.parametrize("value", [-0.1, 0.95, float("nan")])
def test_share_out_of_range_names_the_field(value: float) -> None:
    with pytest.raises(ConfigError, match=r"generation\.min_device_share = "):
        BulkheadConfig(min_device_share=value)


def test_announced_ranker_work_paces_decode_to_its_share() -> None:
    """A ranker batch in flight (lookups out, no forward queued yet): decode runs at a
    duty cycle of the share, the device idling in between (next_wakeup), and runs freely
    again the moment the batch is withdrawn."""
    b: DeviceBulkhead[str] = DeviceBulkhead(BulkheadConfig(min_device_share=0.2))
    step = 0.002
    b.announce(0.0)
    now, ran = 0.0, 0.0
    b.push(B, "step", now)
    while now < 2.0:
        job = b.pop(now)
        if job is None:
            wake = b.next_wakeup(now)
            assert wake is not None and wake > now  # held back, with a time to come back
            now = wake
            continue
        b.done(job, now + step)
        now += step
        ran += step
        b.push(B, "step", now)
    assert ran / now == pytest.approx(0.2, abs=0.01)
    assert b.stats().paced_s == pytest.approx(now - ran, rel=0.02)
    job = b.pop(now)
    if job is None:
        wake = b.next_wakeup(now)
        assert wake is not None
        now = wake
        job = b.pop(now)
    assert job is not None
    b.done(job, now + step)
    now += step
    b.push(B, "step", now)
    assert b.pop(now) is None  # still announced, and the step just run is owed
    b.withdraw(now)
    assert b.next_wakeup(now) is None
    job = b.pop(now)  # no ranker work left: decode goes at once
    assert job is not None and job.lane is B


def test_without_yield_to_announced_decode_ignores_batches_in_flight() -> None:
    b: DeviceBulkhead[str] = DeviceBulkhead(BulkheadConfig(min_device_share=0.2, yield_to_announced=False))
    b.announce(0.0)
    runs = simulate(b, 0.5, {C: 0.004, B: 0.002}, backlog={B: 1})
    assert len(runs) == 250  # back to back: the device never idled


def test_withdraw_without_announce_is_refused() -> None:
    b: DeviceBulkhead[str] = DeviceBulkhead()
    with pytest.raises(FailedPrecondition, match="withdraw without a matching announce"):
        b.withdraw(0.0)


def test_generation_config_carries_co_locate_and_the_share() -> None:
    from recserve.config.spec import GenerationServiceConfig

    default = GenerationServiceConfig()
    assert default.co_locate is False and default.min_device_share == 0.2
    assert GenerationServiceConfig(co_locate=True, min_device_share=0.5).min_device_share == 0.5
    with pytest.raises(ConfigError, match=r"generation\.min_device_share = 1\.5 is invalid"):
        GenerationServiceConfig(min_device_share=1.5)
    with pytest.raises(ConfigError, match=r"generation\.co_locate = 'yes' is invalid"):
        GenerationServiceConfig(co_locate="yes")  # type: ignore[arg-type]


# ---- the executor (one real worker thread) ------------------------------------------


class FakeClock:
    """Advanced only by the jobs themselves: a job of cost c moves it by c."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_executor_orders_waiting_work_through_the_bulkhead() -> None:
    clock = FakeClock()
    device = DeviceExecutor(BulkheadConfig(min_device_share=0.2), clock=clock)
    gate, entered = threading.Event(), threading.Event()
    order: list[str] = []

    def work(name: str, cost_s: float) -> None:
        clock.now += cost_s
        order.append(name)

    def blocker(cost_s: float) -> None:
        entered.set()
        gate.wait(10.0)
        clock.now += cost_s

    try:
        # Round 1: the blocker took no device time while decode waited: no credit, a ranker
        # batch first; its 4 ms earn decode 1 ms, so one step, then the next batch.
        first = device.submit(C, blocker, 0.0)
        assert entered.wait(10.0)  # the device is busy; everything below queues behind it
        futures = [device.lane(B).submit(work, f"step{i}", 0.002) for i in range(2)]
        futures += [device.lane(C).submit(work, f"rank{i}", 0.004) for i in range(2)]
        gate.set()
        for f in [first, *futures]:
            f.result(10.0)
        assert order == ["rank0", "step0", "rank1", "step1"]
        # Round 2: a 10 ms forward while decode waited earns it 2.5 ms: one step goes ahead.
        order.clear()
        entered.clear()
        gate.clear()
        first = device.submit(C, blocker, 0.010)
        assert entered.wait(10.0)
        futures = [device.lane(B).submit(work, "step", 0.003), device.lane(C).submit(work, "rank", 0.004)]
        gate.set()
        for f in [first, *futures]:
            f.result(10.0)
        assert order == ["step", "rank"]
    finally:
        device.shutdown()
    stats = device.stats()
    assert (stats.critical.jobs, stats.best_effort.jobs) == (5, 3)
    assert stats.critical.busy_s == pytest.approx(0.010 + 3 * 0.004)


def test_executor_delivers_errors_skips_cancelled_and_refuses_after_shutdown() -> None:
    device = DeviceExecutor()
    gate, entered = threading.Event(), threading.Event()
    ran: list[str] = []

    def hold() -> None:
        entered.set()
        gate.wait(10.0)

    blocker = device.submit(C, hold)
    assert entered.wait(10.0)
    cancelled = device.submit(B, ran.append, "cancelled")
    assert cancelled.cancel()

    def boom() -> None:
        raise ValueError("forward failed")

    failing = device.submit(C, boom)
    gate.set()
    with pytest.raises(ValueError, match="forward failed"):
        failing.result(10.0)
    blocker.result(10.0)
    device.lane(C).shutdown()  # a lane's shutdown leaves the device running
    assert device.submit(C, ran.append, "after").result(10.0) is None
    device.shutdown()
    assert ran == ["after"]
    with pytest.raises(Unavailable, match="shut down"):
        device.submit(C, ran.append, "late")


def test_serving_loop_runs_its_batches_on_a_lane() -> None:
    """A ServingLoop handed a lane executor runs its (sync) runner on the device thread."""
    device = DeviceExecutor()
    threads: list[str] = []

    def runner(batch: object) -> list[Done]:
        threads.append(threading.current_thread().name)
        return [Done(p * 2) for p in batch.payloads]  # type: ignore[attr-defined]

    async def main() -> list[int]:
        loop = ServingLoop(Scheduler(DynamicBatchPolicy(DynamicBatchConfig(max_batch_cost=4, max_wait_ms=0.0))), runner, executor=device.lane(B), name="bulkhead-test")
        async with loop:
            return list(await asyncio.gather(*(loop.submit(i) for i in range(3))))

    try:
        assert asyncio.run(main()) == [0, 2, 4]
    finally:
        device.shutdown()
    assert threads and set(threads) == {"recserve-device"}
