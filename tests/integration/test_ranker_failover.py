"""Two real rankers behind the router: killing one loses no call that had retry budget
left; its breaker opens, and closes again after a restart."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from recserve.client import RankingClient
from recserve.cluster import ShardCluster
from recserve.cluster.rankers import RankerCluster
from recserve.routing import BreakerState, RoutingConfig
from tests.integration.ranker_world import RankerWorld, make_ranker_world

CALLERS = 4


@pytest.fixture(scope="module")
def two_rankers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RankerWorld, ShardCluster, RankerCluster]]:
    world = make_ranker_world(tmp_path_factory.mktemp("failover"))
    with ShardCluster(world.plan_path, world.root / "shards", load_from=world.models) as shards:
        with RankerCluster(world.spec_path, world.models, shards.addresses, num_rankers=2, data_root=world.root / "rankers") as rankers:
            yield world, shards, rankers


def test_killing_a_ranker_loses_no_call_and_its_breaker_opens_then_closes(two_rankers: tuple[RankerWorld, ShardCluster, RankerCluster]) -> None:
    world, _, rankers = two_rankers
    rng = np.random.default_rng(4)
    n_items = world.export.arrays.num_items
    cfg = RoutingConfig(breaker_failures=1, breaker_open_ms=300.0)
    victim = rankers.addresses[1]

    async def go() -> None:
        async with RankingClient(rankers.addresses, cfg, rng=np.random.default_rng(0)) as client:
            answered: list[str] = []
            killed = asyncio.Event()

            async def caller(seed: int) -> None:
                r = np.random.default_rng(seed)
                # Run until the kill has happened and a few calls have gone through after it.
                after = 0
                while after < 8:
                    res = await client.rank(int(r.integers(0, 300)), r.choice(n_items, 64, replace=False), timeout_s=20.0)
                    answered.append(res.replica)
                    after += int(killed.is_set())

            tasks = [asyncio.ensure_future(caller(int(rng.integers(1 << 30)))) for _ in range(CALLERS)]
            while len(set(answered)) < 2:  # both replicas have answered before the kill
                await asyncio.sleep(0.01)
            await asyncio.to_thread(rankers.kill, 1)
            killed.set()
            await asyncio.gather(*tasks)  # every call answered: none lost
            n_after_kill = len(answered)
            assert client.router.state(victim, client.clock()) is not BreakerState.CLOSED
            assert client.stats.retries >= 1 and client.stats.retries_refused_by_budget == 0

            await asyncio.to_thread(rankers.restart, 1)
            await asyncio.sleep(cfg.breaker_open_ms / 1e3)
            for _ in range(200):  # two choices sends the half-open probe within a few calls
                res = await client.rank(1, np.arange(32), timeout_s=20.0)
                if client.router.state(victim, client.clock()) is BreakerState.CLOSED and res.replica == victim:
                    break
            assert client.router.state(victim, client.clock()) is BreakerState.CLOSED
            assert n_after_kill > CALLERS * 8

    asyncio.run(go())
