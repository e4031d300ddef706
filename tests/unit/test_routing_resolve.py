"""DNS re-resolution of replica sets (recserve.routing.resolve + Router.set_replicas +
RoutedCalls.refresh), with a fake resolver and a fake clock: no DNS, no sockets."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import grpc
import numpy as np
import pytest

from recserve.client.routed import RoutedCalls
from recserve.config.spec import RoutingConfig
from recserve.errors import ConfigError
from recserve.routing import BreakerState, Router
from recserve.routing.resolve import (
    RESOLVE_ENV,
    Membership,
    OverrideResolver,
    ReplicaResolver,
    default_resolver,
    is_literal,
    parse_overrides,
)

NAME = "recserve-ranker.feed.svc.cluster.local:7200"


class FakeResolver(ReplicaResolver):
    """Answers set by the test (``set_answer``, ``set_failing``); counts lookups."""

    def __init__(self, answers: dict[str, tuple[str, ...]]) -> None:
        self.answers = dict(answers)
        self.failing = False
        self.lookups: Counter[str] = Counter()

    def set_answer(self, name: str, *replicas: str) -> None:
        self.answers[name] = replicas

    def set_failing(self, failing: bool) -> None:
        self.failing = failing

    def resolve(self, target: str) -> tuple[str, ...]:
        self.lookups[target] += 1
        if self.failing:
            raise OSError(f"lookup of {target} timed out")
        return self.answers[target]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_literals_are_never_looked_up_and_names_are_refreshed_on_schedule() -> None:
    resolver = FakeResolver({NAME: ("10.0.0.1:7200", "10.0.0.2:7200")})
    literal = Membership(["127.0.0.1:7001", "[::1]:7002", "unix:/run/shard.sock"], resolver, refresh_s=30.0)
    assert not literal.dynamic and not literal.due(1e9)
    assert literal.replicas == ("127.0.0.1:7001", "[::1]:7002", "unix:/run/shard.sock")
    m = Membership([NAME, "127.0.0.1:7001"], resolver, refresh_s=30.0, now=0.0)
    assert m.replicas == (NAME, "127.0.0.1:7001")  # unresolved: the name itself, as gRPC would dial it
    assert m.due(0.0)
    change = m.refresh(0.0)
    assert change is not None and change.replicas == ("10.0.0.1:7200", "10.0.0.2:7200", "127.0.0.1:7001")
    assert change.removed == (NAME,)
    assert not m.due(29.9) and m.due(30.0)
    resolver.set_answer(NAME, "10.0.0.2:7200", "10.0.0.3:7200")  # a scale event: one pod replaced
    change = m.refresh(30.0)
    assert change is not None
    assert (change.added, change.removed) == (("10.0.0.3:7200",), ("10.0.0.1:7200",))
    assert m.refresh(60.0) is None  # same answer: no change
    assert resolver.lookups == Counter({NAME: 3})


def test_a_failed_or_empty_answer_keeps_the_replicas() -> None:
    resolver = FakeResolver({NAME: ("10.0.0.1:7200",)})
    m = Membership([NAME], resolver, refresh_s=1.0)
    m.refresh(0.0)
    resolver.set_failing(True)
    assert m.refresh(1.0) is None
    resolver.set_failing(False)
    resolver.set_answer(NAME)
    assert m.refresh(2.0) is None
    assert m.replicas == ("10.0.0.1:7200",) and m.failures == 2


def test_overrides_map_rendered_names_to_loopback() -> None:
    overrides = parse_overrides(f"{NAME}=127.0.0.1:7001|127.0.0.1:7002, shard-0.svc:7100=127.0.0.1:7003")
    resolver = OverrideResolver(overrides, fallback=FakeResolver({"other.svc:1": ("10.1.1.1:1",)}))
    assert resolver.resolve(NAME) == ("127.0.0.1:7001", "127.0.0.1:7002")
    assert resolver.map("shard-0.svc:7100") == "127.0.0.1:7003"
    assert resolver.resolve("other.svc:1") == ("10.1.1.1:1",)
    env = default_resolver({RESOLVE_ENV: f"{NAME}=127.0.0.1:9"})
    assert env.resolve(NAME) == ("127.0.0.1:9",)
    with pytest.raises(ConfigError, match=RESOLVE_ENV):
        parse_overrides("no-equals-sign")
    assert is_literal("10.0.0.1:1") and is_literal("dns:///x.svc:1") and not is_literal(NAME)


def test_set_replicas_keeps_the_state_of_replicas_that_stay() -> None:
    config = RoutingConfig(breaker_failures=1, breaker_open_ms=1000.0)
    router = Router(["a:1", "b:1", "c:1"], config, rng=np.random.default_rng(0))
    router.on_result(router.pick(0.0, cost=5.0), grpc.StatusCode.OK, 0.01, 0.0, cost=5.0)
    picked = router.pick(0.0, cost=7.0)  # in flight across the change
    router.on_result("b:1", grpc.StatusCode.UNAVAILABLE, 0.001, 0.0)  # b's breaker opens
    router.set_replicas(["b:1", "c:1", "d:1"])
    assert router.replicas == ("b:1", "c:1", "d:1")
    assert router.state("b:1", 0.1) is BreakerState.OPEN  # kept
    assert router.state("d:1", 0.1) is BreakerState.CLOSED  # new: fresh
    before = router.inflight.copy()
    router.on_result(picked, grpc.StatusCode.OK, 0.01, 0.2, cost=7.0)  # a late result, maybe of removed a:1
    if picked == "a:1":
        assert np.array_equal(router.inflight, before)  # dropped, not an error
    else:
        assert router.inflight[router.index(picked)] == before[router.index(picked)] - 7.0
    picks = {router.pick(0.2) for _ in range(50)}
    assert picks <= {"c:1", "d:1"} and "d:1" in picks  # never the removed one, nor the open one


def _no_stub(channel: grpc.aio.Channel) -> Any:
    raise AssertionError("no channel is opened: the tests pass stub_factory")


class FakeStub:
    """One replica: ``Ping`` answers its own name."""

    def __init__(self, address: str, calls: Counter[str]) -> None:
        self.address = address
        self.calls = calls

    def Ping(self, request: Any, timeout: float | None = None, **_: Any) -> Any:
        self.calls[self.address] += 1

        async def answer() -> str:
            return self.address

        return answer()


def test_routed_calls_follow_the_resolved_pods() -> None:
    """The client is given one headless name: at start it routes over the pods it
    resolves to; after a scale-down and up, once ``dns_refresh_ms`` has passed, calls
    reach the new pod and never the removed one."""
    resolver = FakeResolver({NAME: ("10.0.0.1:7200", "10.0.0.2:7200")})
    clock = FakeClock()
    calls: Counter[str] = Counter()
    routed = RoutedCalls([NAME], _no_stub, service="recserve.v1.Ranking", what="ranker", config=RoutingConfig(dns_refresh_ms=5000.0),
                         rng=np.random.default_rng(0), clock=clock, stub_factory=lambda a: FakeStub(a, calls), resolver=resolver)  # fmt: skip

    async def ping(n: int) -> set[str]:
        out = set()
        for _ in range(n):
            reply, _, _ = await routed.call("Ping", lambda h: h, cost=1.0, deadline=clock() + 1.0, tenant="t", priority="standard")
            out.add(reply)
        return out

    async def scenario() -> None:
        await routed.start()
        assert routed.addresses == ("10.0.0.1:7200", "10.0.0.2:7200")
        assert await ping(40) == {"10.0.0.1:7200", "10.0.0.2:7200"}
        resolver.set_answer(NAME, "10.0.0.2:7200", "10.0.0.3:7200")
        assert await ping(10) <= {"10.0.0.1:7200", "10.0.0.2:7200"}  # not due yet: the old set
        clock.now += 5.0
        await ping(1)  # due: the call starts a background refresh
        assert routed._refreshing is not None
        await routed._refreshing
        calls.clear()
        assert await ping(40) == {"10.0.0.2:7200", "10.0.0.3:7200"}
        assert calls["10.0.0.1:7200"] == 0
        await routed.aclose()

    asyncio.run(scenario())
    assert resolver.lookups[NAME] == 2


def test_fake_stubs_without_a_resolver_never_look_names_up() -> None:
    routed = RoutedCalls(["r0:7000", "r1:7000"], _no_stub, service="s", what="ranker", stub_factory=lambda a: FakeStub(a, Counter()))
    assert routed.membership is None
