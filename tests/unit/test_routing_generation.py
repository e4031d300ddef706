"""Router support for generation streams (pure, fake clock): the decode work signal,
costs that move while a stream runs, the first message closing a breaker, and
session-key affinity over generation replicas."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from recserve.errors import ConfigError
from recserve.routing import BreakerState, DecodeLoad, Router, RoutingConfig

OK, UNAVAILABLE, CANCELLED = grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED
NAMES = ["gen-0:7400", "gen-1:7400", "gen-2:7400"]


def make_router(**overrides: object) -> Router:
    cfg = RoutingConfig(**{"breaker_failures": 2, "breaker_open_ms": 1000.0, **overrides})  # type: ignore[arg-type]
    return Router(NAMES, cfg, rng=np.random.default_rng(0))


def test_decode_load_moves_tokens_from_active_to_held() -> None:
    load = DecodeLoad(kv_weight=0.5)
    assert load.cost(40, 32) == 72.0  # nothing prefilled: prompt and budget still to compute
    assert load.cost(40, 32, 0, prefilled=True) == 32 + 0.5 * 40
    assert load.cost(40, 32, 8, prefilled=True) == 24 + 0.5 * 48
    assert load.cost(40, 32, 32, prefilled=True) == 0.5 * 72  # budget spent: only the K/V held
    assert load.cost(40, 32, 99, prefilled=True) == 0.5 * 72  # a count past the budget is clipped
    # kv_weight 1: the KV reservation, constant over the stream's life.
    flat = DecodeLoad(kv_weight=1.0)
    assert {flat.cost(40, 32), flat.cost(40, 32, 10, prefilled=True)} == {72.0}


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_decode_load_refuses_a_weight_outside_0_1(bad: float) -> None:
    with pytest.raises(ConfigError, match="decode_load.kv_weight"):
        DecodeLoad(kv_weight=bad)


def test_add_inflight_moves_a_running_calls_cost_and_on_result_clears_it() -> None:
    router = make_router()
    r = router.pick(0.0, cost=72.0)
    i = router.index(r)
    router.add_inflight(r, -20.0)  # the stream's first chunks arrived
    assert router.inflight[i] == 52.0
    router.on_result(r, OK, None, 1.0, cost=52.0)
    assert router.inflight.tolist() == [0.0, 0.0, 0.0]
    router.add_inflight(r, -5.0)  # a late report never drives the signal negative
    assert router.inflight[i] == 0.0


def test_on_answer_closes_a_half_open_breaker_while_the_stream_still_runs() -> None:
    router = make_router()
    for _ in range(2):
        router.on_result("gen-1:7400", UNAVAILABLE, 0.001, 5.0, cost=0.0)
    router.reported[:] = [1e9, 0.0, 1e9]  # gen-1 is the lightest: the probe goes there
    probe = router.pick(6.5, cost=10.0)
    assert probe == "gen-1:7400" and router.state(probe, 6.5) is BreakerState.HALF_OPEN
    assert "gen-1:7400" not in {router.pick(6.5, cost=0.0) for _ in range(30)}  # its one probe is out
    router.on_answer(probe, 0.004, 6.6)
    assert router.state(probe, 6.6) is BreakerState.CLOSED
    assert "gen-1:7400" in {router.pick(6.6, cost=0.0) for _ in range(30)}
    # The time to the first message is the latency recorded; ending the stream with
    # latency None records nothing more (a 30 s stream is no 30 s latency).
    count = int(router.latency._count[1])
    router.on_result(probe, OK, None, 36.6, cost=10.0)
    assert int(router.latency._count[1]) == count
    assert router.state(probe, 36.6) is BreakerState.CLOSED


def test_a_cancelled_stream_with_latency_none_changes_no_state() -> None:
    router = make_router()
    r = router.pick(0.0, key="conv-1", cost=5.0)
    router.on_result(r, CANCELLED, None, 1.0, cost=5.0)
    i = router.index(r)
    assert router.state(r, 1.0) is BreakerState.CLOSED and int(router.latency._count[i]) == 0 and router.inflight[i] == 0.0


def test_session_keys_stick_ignore_load_and_fall_back_clockwise_only_for_the_down_owner() -> None:
    router = make_router()
    keys = [f"user-{k}" for k in range(60)]
    owners = {k: router.pick(0.0, key=k, cost=0.0) for k in keys}
    assert set(owners.values()) == set(NAMES)  # 60 sessions spread over the 3 replicas
    router.reported[:] = [1e9, 1e9, 1e9]
    router.reported[router.index(owners["user-0"])] = 1e12  # affinity beats load: prefix reuse
    assert {router.pick(0.0, key=k, cost=0.0) for k in ["user-0"] * 5} == {owners["user-0"]}
    down = owners["user-0"]
    for _ in range(2):
        router.on_result(down, UNAVAILABLE, 0.001, 1.0, cost=0.0)
    moved = {k: router.pick(1.5, key=k, cost=0.0) for k in keys}
    for k in keys:
        if owners[k] == down:
            assert moved[k] != down
            # The fallback is the key's next replica on the ring, the same every time.
            assert moved[k] == router.replicas[int(router.affinity.preference(k)[0, 1])]
        else:
            assert moved[k] == owners[k], f"{k} moved though its owner is healthy"
    # After the open period the owner takes one probe; once it answers its keys return.
    first = router.pick(2.01, key="user-0", cost=0.0)
    assert first == down
    router.on_answer(first, 0.003, 2.02)
    assert {k: router.pick(2.03, key=k, cost=0.0) for k in keys} == owners


def test_a_shedding_replica_is_no_breaker_verdict() -> None:
    """RESOURCE_EXHAUSTED (admission shedding) from a live replica never opens its
    breaker, however many in a row; UNAVAILABLE does (the control)."""
    router = Router(["a:1", "b:1"], RoutingConfig(breaker_failures=3), rng=np.random.default_rng(0))
    for k in range(10):
        router.pick(float(k), cost=1.0)
        router.on_result("a:1", grpc.StatusCode.RESOURCE_EXHAUSTED, 0.001, float(k))
    assert router.state("a:1", 10.0) is BreakerState.CLOSED
    for k in range(3):
        router.on_result("a:1", grpc.StatusCode.UNAVAILABLE, 0.001, 11.0 + k)
    assert router.state("a:1", 13.2) is BreakerState.OPEN  # opened at 13.0 for breaker_open_ms (500 ms)
