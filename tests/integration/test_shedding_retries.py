"""Retries are bounded (issue 17): one of three replicas is slow for 10 s and the
retries and hedges it causes stay within the routing retry budget (10 % of primary
calls plus the burst); its breaker keeps it out for most of the 10 s; nobody's call
fails; it gets traffic again once it is fast. Real RankingClient, router and wire
(grpc.aio on loopback), fake Ranking servers, on a fake clock: the slow replica
"takes" its time by advancing the clock, so the 10 s cost no wall time."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import pytest

from recserve.client import RankingClient
from recserve.routing import RoutingConfig
from recserve.rpc.server import make_server
from recserve.v1 import ranking_pb2_grpc
from tests.unit.test_ranker_client import CANDIDATES, FakeClock, FakeRanker

pytestmark = pytest.mark.integration

RATE_PER_S = 50.0  # calls per fake second, one after another
RUN_S, SLOW_FROM_S, SLOW_FOR_S = 20.0, 5.0, 10.0
DEADLINE_S = 0.150  # each call's deadline
SLOW_TAKES_S = 0.050  # what a call to the slow replica costs its caller before DEADLINE_EXCEEDED


class SlowForAWhile(FakeRanker):
    """A fake ranker that, while ``slow`` is set, costs its caller SLOW_TAKES_S of the
    shared clock and answers DEADLINE_EXCEEDED, as a replica 200 ms behind would."""

    def __init__(self, name: str, clock: FakeClock) -> None:
        super().__init__(name, bias=0.0)
        self.clock = clock
        self.slow = False
        self.calls_while_slow = 0

    async def _enter(self, request: Any, context: grpc.aio.ServicerContext, cost: int) -> None:
        await super()._enter(request, context, cost)
        if self.slow:
            self.calls_while_slow += 1
            self.clock.advance(SLOW_TAKES_S)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.name}: 200 ms behind")


def test_a_replica_slow_for_10_s_causes_no_retry_storm() -> None:
    async def body() -> None:
        clock = FakeClock(0.0)
        config = RoutingConfig()  # the defaults: retry budget 10 % + burst 10, breaker 3 failures / 500 ms
        fakes = [SlowForAWhile(f"r{i}", clock) for i in range(3)]
        servers, addresses = [], []
        for fake in fakes:
            server = make_server(max_message_bytes=4 << 20)
            ranking_pb2_grpc.add_RankingServicer_to_server(fake, server)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            servers.append(server)
        slow = fakes[0]
        failed = served_after = 0
        calls = int(RUN_S * RATE_PER_S)
        try:
            async with RankingClient(addresses, config, rng=np.random.default_rng(1), clock=clock) as client:
                start = clock.now
                for i in range(calls):
                    clock.now = max(clock.now, start + i / RATE_PER_S)  # open loop: arrivals keep their schedule
                    t = clock.now - start
                    slow.slow = SLOW_FROM_S <= t < SLOW_FROM_S + SLOW_FOR_S
                    calls_before = slow.calls
                    try:
                        await client.rank(7, CANDIDATES, timeout_s=DEADLINE_S)
                    except Exception:  # noqa: BLE001  (any failure counts; none is expected)
                        failed += 1
                    if t >= SLOW_FROM_S + SLOW_FOR_S + 1.0:  # fast again (and its breaker's probe passed)
                        served_after += slow.calls - calls_before
                stats, router = client.stats, client.router.stats
            extra = stats.attempts - router.primaries
            assert router.primaries == calls
            assert extra == stats.retries
            assert extra <= config.retry_budget * calls + config.retry_burst  # no storm: the budget bounds it
            assert failed == 0  # every call found a healthy replica within its deadline
            # The breaker keeps the slow replica out: its first failures, then one half-open
            # probe per open period (500 ms) over the 10 s.
            probes_bound = config.breaker_failures + SLOW_FOR_S / (config.breaker_open_ms / 1e3) * config.half_open_probes + 2
            assert 0 < slow.calls_while_slow <= probes_bound
            assert served_after > 0.2 * (RUN_S - SLOW_FROM_S - SLOW_FOR_S - 1.0) * RATE_PER_S  # back in rotation once fast
        finally:
            await asyncio.gather(*(s.stop(None) for s in servers))

    asyncio.run(body())
