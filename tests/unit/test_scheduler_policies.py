"""Dynamic and feature-parallel policies, and the policy factory. Fake clock, no sleeps."""

from __future__ import annotations

from typing import Any

import pytest

from recserve.errors import ConfigError
from recserve.scheduling import (
    Done,
    DynamicBatchConfig,
    DynamicBatchPolicy,
    FeatureParallelConfig,
    FeatureParallelPolicy,
    Policy,
    PolicyKind,
    Priority,
    Scheduler,
    SchedulerView,
    SloControlConfig,
    WorkItem,
    make_policy,
    register_policy,
)

_n = 0


def item(*, cost: float = 1.0, deadline: float = 1e6, priority: Priority = Priority.STANDARD) -> WorkItem:
    global _n
    _n += 1
    return WorkItem(f"r{_n}", "t", priority, deadline, cost, None)


def dynamic(**overrides: Any) -> Scheduler:
    cfg: dict[str, Any] = dict(max_batch_cost=4, max_wait_ms=5.0, adaptive=False, dispatch_margin_ms=0.0)
    cfg.update(overrides)
    return Scheduler(DynamicBatchPolicy(DynamicBatchConfig(**cfg)))


def run_all(sched: Scheduler, now: float, service_s: float = 0.0) -> list[float]:
    """Schedule and complete every batch ready at ``now``; returns their costs."""
    costs = []
    while (batch := sched.schedule(now)) is not None:
        sched.complete(batch, [Done(None)] * len(batch), now + service_s)
        costs.append(batch.cost)
    return costs


def drive(sched: Scheduler, arrivals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Event-driven like the serving loop: wake at ``next_wakeup`` or the next arrival,
    whichever comes first; instant service. Returns (dispatch time, cost) per batch."""
    batches: list[tuple[float, float]] = []
    pending = list(arrivals)  # (time, cost), sorted
    now = 0.0
    while pending or not sched.idle:
        wake = sched.next_wakeup(now)
        if wake is not None and (not pending or wake < pending[0][0]):
            now = max(now, wake)
            batch = sched.schedule(now)
            assert batch is not None, "next_wakeup promised a batch"
            sched.complete(batch, [Done(None)] * len(batch), now)
            batches.append((now, batch.cost))
        else:
            now, cost = pending.pop(0)
            sched.add(item(cost=cost), now)
    return batches


def test_dynamic_fixed_window_waits_max_wait_from_the_first_arrival() -> None:
    sched = dynamic()
    sched.add(item(), 1.000)
    sched.add(item(), 1.003)
    assert sched.next_wakeup(1.003) == pytest.approx(1.005)
    assert sched.schedule(1.0049) is None
    batch = sched.schedule(1.005)
    assert batch is not None and len(batch) == 2


def test_dynamic_full_batch_goes_at_once_and_leftovers_keep_their_window() -> None:
    sched = dynamic()
    for _ in range(6):
        sched.add(item(), 0.0)
    batch = sched.schedule(0.0)  # 6 >= max_batch_cost 4: no waiting
    assert batch is not None and batch.cost == 4
    # The 2 leftovers arrived at 0.0: their window ends at 0.005, not 5 ms after now.
    assert sched.schedule(0.001) is None
    assert sched.next_wakeup(0.001) == pytest.approx(0.005)
    batch = sched.schedule(0.005)
    assert batch is not None and batch.cost == 2


def test_an_item_larger_than_the_cap_runs_alone() -> None:
    sched = dynamic()
    sched.add(item(cost=10), 0.0)
    sched.add(item(cost=1), 0.0)
    batch = sched.schedule(0.0)
    assert batch is not None and [h.cost for h in batch.handles] == [10]


def test_lower_classes_do_not_jump_a_head_that_does_not_fit() -> None:
    sched = dynamic()
    sched.add(item(cost=3, priority=Priority.CRITICAL), 0.0)
    sched.add(item(cost=3, priority=Priority.STANDARD), 0.0)
    sched.add(item(cost=1, priority=Priority.BEST_EFFORT), 0.0)
    batch = sched.schedule(0.0)  # 7 >= 4: dispatch; 3 fits, then the standard 3 does not
    assert batch is not None and [h.priority for h in batch.handles] == [Priority.CRITICAL]


def test_adaptive_window_is_short_at_high_rate_and_capped_at_low_rate() -> None:
    target, cap, max_wait = 300.0, 512.0, 0.010
    sched = dynamic(max_batch_cost=cap, target_batch_cost=target, max_wait_ms=max_wait * 1e3, adaptive=True, rate_tau_s=0.1)
    policy = sched.policy
    assert isinstance(policy, DynamicBatchPolicy)
    # 64-unit items every 0.5 ms: 128,000 units/s for 1 s (10 tau).
    batches = drive(sched, [(0.0005 * (i + 1), 64.0) for i in range(2000)])
    now = 1.0
    rate = 64 / 0.0005
    assert policy.window_s() == pytest.approx(target / rate, rel=0.03)  # 2.34 ms
    # The window, not the size cap, closes the batches: 5 items arrive in 2.34 ms.
    assert {cost for _, cost in batches[len(batches) // 2:-1]} == {320.0}  # [-1]: arrivals stopped
    # Then one item every 100 ms (640 units/s) for 5 s: 300 / 640 s = 0.47 s, capped.
    batches = drive(sched, [(now + 0.1 * (i + 1), 64.0) for i in range(50)])
    assert policy.window_s() == pytest.approx(max_wait)
    dispatch_delays = [t - (now + 0.1 * (i + 1)) for i, (t, _) in enumerate(batches)]
    assert dispatch_delays[-10:] == pytest.approx([max_wait] * 10)


def test_slack_trigger_dispatches_before_the_window_when_the_deadline_needs_it() -> None:
    sched = dynamic(max_wait_ms=10.0)
    sched.add(item(), 0.0)
    assert run_all(sched, 0.010, service_s=0.003)  # one measured batch: 3 ms of service
    sched.add(item(deadline=1.008), 1.0)  # 8 ms of slack, 10 ms window
    wake = sched.next_wakeup(1.0)
    assert wake is not None and wake == pytest.approx(1.005)  # deadline - 3 ms of service, not the 1.010 window end
    assert sched.schedule(wake - 1e-6) is None
    assert sched.schedule(wake) is not None


def test_slo_controller_shrinks_window_and_cap_when_p99_nears_the_slo() -> None:
    slo = SloControlConfig(period_s=1.0, min_samples=5)
    sched = dynamic(max_batch_cost=100, max_wait_ms=10.0, slo_ms=50.0, slo_control=slo)
    policy = sched.policy
    assert isinstance(policy, DynamicBatchPolicy)
    now = 0.0
    for _ in range(300):  # every item takes 80 ms end to end: p99 far above 0.9 x 50 ms
        sched.add(item(cost=1), now)
        batch = sched.schedule(now + 0.010)
        assert batch is not None
        sched.complete(batch, [Done(None)], now + 0.080)
        now += 0.010
    assert policy.controller is not None and policy.scale < 1.0
    assert policy.cap() == pytest.approx(100 * policy.scale)
    assert policy.window_s() == pytest.approx(0.010 * policy.scale)
    assert policy.gauges()["scale"] == policy.scale


def test_feature_parallel_window_merges_many_callers_into_one_batch() -> None:
    sched = Scheduler(FeatureParallelPolicy(FeatureParallelConfig(window_ms=1.0, max_cost=100_000)))
    callers = [sched.add(item(cost=10 + i), 0.00002 * i) for i in range(50)]  # all within 1 ms
    assert sched.schedule(0.00099) is None
    batch = sched.schedule(0.001)
    assert batch is not None
    assert set(batch.handles) == set(callers) and batch.cost == sum(10 + i for i in range(50))
    late = sched.add(item(cost=7), 0.0012)
    assert sched.schedule(0.0012) is None  # the late caller opened a new window
    batch = sched.schedule(0.0022)
    assert batch is not None and batch.handles == (late,)


def test_feature_parallel_window_closes_early_at_max_cost() -> None:
    sched = Scheduler(FeatureParallelPolicy(FeatureParallelConfig(window_ms=1.0, max_cost=100)))
    for i in range(3):
        sched.add(item(cost=30), 0.0001 * i)
        assert sched.schedule(0.0001 * i) is None
    sched.add(item(cost=30), 0.0003)
    batch = sched.schedule(0.0003)
    assert batch is not None and batch.cost == 90 and sched.queued_count == 1


def test_feature_parallel_adaptive_window() -> None:
    cfg = FeatureParallelConfig(window_ms=1.0, max_window_ms=2.0, target_cost=1000, max_cost=8192, adaptive=True, rate_tau_s=0.05)
    policy = FeatureParallelPolicy(cfg)
    sched = Scheduler(policy)
    # 100 ids every 0.1 ms = 1e6 ids/s for 0.3 s (6 tau): the window is 1000 / 1e6 s = 1 ms.
    drive(sched, [(0.0001 * (i + 1), 100.0) for i in range(3000)])
    assert policy.window_s() == pytest.approx(1000 / 1e6, rel=0.05)
    # Then 100 ids every 50 ms = 2,000 ids/s: 0.5 s, capped at max_window_ms.
    batches = drive(sched, [(0.3 + 0.05 * (i + 1), 100.0) for i in range(20)])
    assert policy.window_s() == pytest.approx(0.002)
    assert batches[-1][0] == pytest.approx(0.3 + 0.05 * 20 + 0.002)


def test_factory_is_keyed_by_the_enum_and_open_to_new_policies() -> None:
    assert isinstance(make_policy(PolicyKind.DYNAMIC, DynamicBatchConfig(max_batch_cost=8, max_wait_ms=1)), DynamicBatchPolicy)
    assert isinstance(make_policy(PolicyKind.FEATURE_PARALLEL, FeatureParallelConfig()), FeatureParallelPolicy)
    with pytest.raises(ConfigError, match="CONTINUOUS"):
        make_policy(PolicyKind.CONTINUOUS, None)

    class Eager(Policy):
        kind = PolicyKind.CONTINUOUS

        def ready_at(self, view: SchedulerView, now: float) -> float | None:
            return now

        def select(self, view: SchedulerView, now: float) -> None:
            view.take_while(float("inf"))

    register_policy(PolicyKind.CONTINUOUS, lambda cfg: Eager())
    try:
        assert isinstance(make_policy(PolicyKind.CONTINUOUS, None), Eager)
        with pytest.raises(ConfigError, match="already registered"):
            register_policy(PolicyKind.CONTINUOUS, lambda cfg: Eager())
    finally:
        from recserve.scheduling import policy_base

        policy_base._REGISTRY.pop(PolicyKind.CONTINUOUS, None)


def test_policy_configs_are_validated_with_the_bad_value_in_the_message() -> None:
    with pytest.raises(ConfigError, match="max_batch_cost = 0"):
        DynamicBatchConfig(max_batch_cost=0, max_wait_ms=1)
    with pytest.raises(ConfigError, match="target_batch_cost"):
        DynamicBatchConfig(max_batch_cost=8, max_wait_ms=1, target_batch_cost=9)
    with pytest.raises(ConfigError, match="window_ms"):
        FeatureParallelConfig(window_ms=-1)


def test_the_slo_controller_never_shrinks_the_cap_below_min_batch_cost() -> None:
    """A cap under one request would leave every batch one oversized item (unbatched)."""
    slo = SloControlConfig(period_s=1.0, min_samples=5)
    sched = dynamic(max_batch_cost=100, max_wait_ms=10.0, slo_ms=50.0, slo_control=slo, min_batch_cost=40)
    policy = sched.policy
    assert isinstance(policy, DynamicBatchPolicy)
    now = 0.0
    for _ in range(2000):  # p99 far above the SLO for 20 periods: the scale falls to its floor
        sched.add(item(cost=1), now)
        batch = sched.schedule(now + 0.010)
        assert batch is not None
        sched.complete(batch, [Done(None)], now + 0.080)
        now += 0.010
    assert policy.scale * 100 < 40 and policy.cap() == 40
