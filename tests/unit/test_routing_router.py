"""The Router facade: choice + breakers + retry budget + affinity (pure, fake clock)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from recserve.errors import NotFound, Unavailable
from recserve.routing import BreakerState, RetryBudget, Router, RoutingConfig

OK, UNAVAILABLE = grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE
NAMES = ["r0:7000", "r1:7000", "r2:7000"]


def make_router(**overrides: object) -> Router:
    cfg = RoutingConfig(**{"breaker_failures": 2, "breaker_open_ms": 1000.0, **overrides})  # type: ignore[arg-type]
    return Router(NAMES, cfg, rng=np.random.default_rng(0))


def fail_until_open(router: Router, replica: str, now: float) -> None:
    for _ in range(router.config.breaker_failures):
        router.on_result(replica, UNAVAILABLE, 0.001, now, cost=0.0)


def test_the_docstring_example_runs() -> None:
    router = Router(["r0:7000", "r1:7000"], RoutingConfig(), rng=np.random.default_rng(0))
    now = 0.0
    replica = router.pick(now, cost=500)
    router.on_result(replica, UNAVAILABLE, 0.004, now, cost=500)
    assert router.can_retry(UNAVAILABLE)
    retry = router.pick(now, cost=500, retry_of=replica)
    assert retry != replica  # the other replica takes the retry
    router.on_result(retry, OK, 0.003, now, cost=500)
    np.testing.assert_array_equal(router.inflight, [0.0, 0.0])
    assert router.stats.primaries == 1 and router.stats.retries_picked == 1


def test_in_flight_cost_steers_new_calls_away_from_a_busy_replica() -> None:
    router = make_router()
    busy = router.pick(0.0, cost=1000.0)  # one big call still out
    picks = [router.pick(0.0, cost=1.0) for _ in range(300)]
    # busy wins a draw only against itself: at most ~1/9 of the picks, never most.
    assert picks.count(busy) < 0.2 * len(picks)
    router.on_result(busy, OK, 0.01, 0.0, cost=1000.0)
    assert router.work[router.index(busy)] == picks.count(busy)


def test_an_open_replica_gets_no_calls_then_exactly_one_probe() -> None:
    router = make_router()
    fail_until_open(router, "r1:7000", 5.0)
    assert router.state("r1:7000", 5.0) is BreakerState.OPEN
    picks = {router.pick(5.5, cost=0.0) for _ in range(200)}
    assert picks == {"r0:7000", "r2:7000"}
    # After the open period: one probe, then none until it answers.
    router.reported[:] = [1e9, 0.0, 1e9]  # make r1 the lightest so it is drawn first
    picks6 = [router.pick(6.0, cost=0.0) for _ in range(50)]
    assert picks6.count("r1:7000") == 1
    router.on_result("r1:7000", OK, 0.002, 6.01, cost=0.0)
    assert router.state("r1:7000", 6.01) is BreakerState.CLOSED
    closed = [router.pick(6.02, cost=0.0) for _ in range(300)]
    assert closed.count("r1:7000") / 300 == pytest.approx(5 / 9, abs=0.08)  # drawn at least once in 2


def test_when_every_replica_is_open_pick_fails_fast_naming_them() -> None:
    router = make_router()
    for i, name in enumerate(NAMES):
        fail_until_open(router, name, 1.0 + 0.1 * i)
    with pytest.raises(Unavailable, match=r"no replica of 3 can take the call: r0:7000 open for 800 ms, r1:7000 open for 900 ms") as e:
        router.pick(1.2)
    assert e.value.retry_after_s == pytest.approx(0.8)
    assert router.stats.unavailable == 1
    assert router.pick(2.0) == "r0:7000"  # the first to half-open takes the probe
    with pytest.raises(Unavailable, match=r"r0:7000 half_open with its probes out, r1:7000 open for 50 ms") as e:
        router.pick(2.05)
    assert e.value.retry_after_s == pytest.approx(0.05)  # r1 half-opens first


def test_a_non_retryable_answer_is_not_a_breaker_failure_and_not_retried() -> None:
    router = make_router()
    for _ in range(5):
        router.on_result("r0:7000", grpc.StatusCode.INVALID_ARGUMENT, 0.001, 0.0, cost=0.0)
    assert router.state("r0:7000", 0.0) is BreakerState.CLOSED
    assert not router.can_retry(grpc.StatusCode.INVALID_ARGUMENT)
    assert router.budget.tokens == router.config.retry_burst


def test_a_cancelled_call_is_no_verdict_but_frees_the_probe() -> None:
    router = make_router()
    fail_until_open(router, "r1:7000", 0.0)
    router.reported[:] = [1e9, 0.0, 1e9]
    assert [router.pick(1.0, cost=0.0) for _ in range(30)].count("r1:7000") == 1  # the probe
    router.on_result("r1:7000", grpc.StatusCode.CANCELLED, 0.001, 1.0, cost=0.0)
    assert router.state("r1:7000", 1.0) is BreakerState.HALF_OPEN  # not closed by it
    assert [router.pick(1.0, cost=0.0) for _ in range(30)].count("r1:7000") == 1  # a new probe


def test_a_retry_storm_through_the_router_stays_within_the_budget() -> None:
    router = make_router(retry_budget=0.1, retry_burst=3.0, breaker_failures=10_000)
    extra = 0
    for _ in range(1000):
        replica = router.pick(0.0)
        while True:
            router.on_result(replica, UNAVAILABLE, 0.001, 0.0)
            if not router.can_retry(UNAVAILABLE):
                break
            extra += 1
            replica = router.pick(0.0, retry_of=replica)
    assert extra <= 0.1 * 1000 + 3 and extra >= 0.1 * 1000 - 1
    assert router.stats.primaries == 1000 and router.stats.retries_picked == extra


def test_shared_budget_and_weights() -> None:
    shared = RetryBudget(0.1, burst=1.0)
    a = Router(NAMES, RoutingConfig(), budget=shared)
    b = Router(NAMES, RoutingConfig(), budget=shared)
    assert a.can_hedge() and not b.can_hedge()  # one bucket for both
    weighted = Router(NAMES, RoutingConfig(), weights=[1.0, 1.0, 6.0], rng=np.random.default_rng(1))
    picks = [weighted.pick(0.0, cost=0.0) for _ in range(4000)]
    assert picks.count("r2:7000") / len(picks) == pytest.approx(0.75, abs=0.03)
    with pytest.raises(Exception, match=r"routing.weights = \[1.0, 0.0, 1.0\]"):
        Router(NAMES, weights=[1.0, 0.0, 1.0])
    with pytest.raises(NotFound, match="'r9:7000' is not in"):
        a.on_result("r9:7000", OK, 0.0, 0.0)


def test_session_key_sticks_to_its_replica_and_falls_back_on_the_ring() -> None:
    router = make_router()
    home = router.pick(0.0, key=42, cost=0.0)
    assert all(router.pick(0.0, key=42, cost=0.0) == home for _ in range(20))
    others = [router.pick(0.0, key=k, cost=0.0) for k in range(200)]
    assert len(set(others)) == 3  # keys spread over the set
    fail_until_open(router, home, 1.0)
    fallback = router.pick(1.0, key=42, cost=0.0)
    expected = router.replicas[int(router.affinity.preference(42)[0, 1])]
    assert fallback == expected != home
    assert router.pick(1.0, key=42, cost=0.0, retry_of=fallback) not in (home, fallback)
    assert router.pick(2.0, key=42, cost=0.0) == home  # probe: the key returns home
    router.on_result(home, OK, 0.001, 2.0, cost=0.0)
    assert router.pick(2.1, key=42, cost=0.0) == home


def test_hedge_delay_follows_answers_not_fast_refusals() -> None:
    router = make_router(hedge_min_ms=1.0, breaker_failures=1000)
    for _ in range(20):
        router.on_result("r0:7000", OK, 0.030, 0.0, cost=0.0)
        router.on_result("r1:7000", UNAVAILABLE, 0.0001, 0.0, cost=0.0)
    assert router.hedge_delay("r0:7000") == pytest.approx(0.030)
    assert router.hedge_delay("r1:7000") == router.latency.default_delay_s  # no answers yet


def test_cancelling_a_call_sent_before_the_outage_does_not_free_the_probe_permit() -> None:
    # A hedge sent to r1 while it was healthy loses its race after r1 broke and its
    # one probe went out: that cancellation held no probe permit, so it must not let a
    # second probe through while the first is still out.
    router = make_router(policy="least_loaded")
    router.reported[:] = [1e9, 0.0, 1e9]  # r1 is the lightest: chosen whenever it may be
    assert [router.pick(0.0, cost=0.0) for _ in range(3)] == ["r1:7000"] * 3
    fail_until_open(router, "r1:7000", 0.0)  # two of them fail; the first is still out
    assert [router.pick(1.0, cost=0.0) for _ in range(30)].count("r1:7000") == 1  # the probe
    router.on_result("r1:7000", grpc.StatusCode.CANCELLED, 0.5, 1.0, cost=0.0)  # the old call
    assert [router.pick(1.0, cost=0.0) for _ in range(30)].count("r1:7000") == 0  # probe still out
    router.on_result("r1:7000", OK, 0.002, 1.01, cost=0.0)  # the probe answers
    assert router.state("r1:7000", 1.01) is BreakerState.CLOSED
