"""LookupClient behaviour over the in-process fake fleet: windows, per-caller failure,
dead / late / erroring shards, hedging within budget, deadlines, plan refresh, near cache."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recserve.config.spec import LookupConfig
from recserve.errors import DeadlineExceeded, InvalidArgument
from recserve.lookup.client import LookupClient
from recserve.lookup.types import LookupResult
from recserve.sharding.plan import ShardingPlan, Tier
from tests.unit.test_lookup_fakes import FakeShards, make_config, make_plan, make_weights, tier_ids

T = TypeVar("T")


def run(client: LookupClient, body: Callable[[], Awaitable[T]]) -> T:
    async def go() -> T:
        await client.start()
        try:
            return await body()
        finally:
            await client.aclose()

    return asyncio.run(go())


def item_kjt(ids: np.ndarray, feature: str = "item_id") -> KeyedJaggedTensor:
    """One example whose single bag holds ``ids``."""
    return KeyedJaggedTensor(keys=[feature], values=torch.from_numpy(np.array(ids, np.int64)), lengths=torch.tensor([len(ids)]))


def lost_mask(plan: ShardingPlan, table: str, ids: np.ndarray, dead: set[int]) -> np.ndarray:
    """bool [len(ids)]: ids with no live owner under ``plan`` when ``dead`` are down
    (hot: every replica; warm: any column slice; cold: every ring owner)."""
    r = plan.router(table)
    d = np.array(sorted(dead))
    tiers = r.tier_of(ids)
    hot = np.isin(r.hot_replicas_of(ids), d).all(axis=1) & (tiers == Tier.HOT)
    warm = np.isin(r.warm_shards_of(ids), d).any(axis=1) & (tiers == Tier.WARM)
    cold = np.isin(r.cold_owners_of(ids), d).all(axis=1) & (tiers == Tier.COLD)
    return np.asarray(hot | warm | cold)


def lost_count(plan: ShardingPlan, table: str, ids: np.ndarray, dead: set[int]) -> int:
    """How many of ``ids`` (with repeats) have no live owner under ``plan``."""
    return int(lost_mask(plan, table, ids, dead).sum())


def test_concurrent_callers_share_one_window_and_one_rpc_per_shard() -> None:
    plan, _ = make_plan()
    fake = FakeShards(plan, make_weights())
    client = LookupClient(make_config(), plan, fake)
    rng = np.random.default_rng(0)
    kjts = [item_kjt(rng.integers(0, 2000, 20)) for _ in range(30)]
    results = run(client, lambda: asyncio.gather(*(client.lookup(k, pooled=True, timeout_s=5) for k in kjts)))
    assert len(results) == 30 and not any(r.degraded for r in results)
    assert client.stats.windows == 1
    shards = [c.shard for c in fake.calls]
    assert len(shards) == len(set(shards)) >= 2  # one RPC per contacted shard


def test_a_bad_caller_fails_alone() -> None:
    plan, _ = make_plan()
    weights = make_weights()
    client = LookupClient(make_config(), plan, FakeShards(plan, weights))
    good = [item_kjt(np.array([1, 2, 3])), item_kjt(np.array([4, 4]))]
    bad = item_kjt(np.array([5, 2000]))  # table 'item' has 2,000 rows

    async def body() -> list[object]:
        return list(await asyncio.gather(*(client.lookup(k, pooled=True, timeout_s=5) for k in (good[0], bad, good[1])), return_exceptions=True))

    out = run(client, body)
    assert isinstance(out[1], InvalidArgument) and "2,000" in str(out[1])
    for res, k in zip((out[0], out[2]), good):
        assert isinstance(res, LookupResult)
        assert res.pooled is not None
        want = torch.from_numpy(weights["item"][k.values().numpy()].sum(axis=0, keepdims=True))
        assert torch.equal(res.pooled["item_id"], want)
    assert client.stats.callers_rejected == 1


def test_dead_shard_serves_replicas_and_counts_the_rest_as_missing() -> None:
    plan, _ = make_plan()
    weights = make_weights()
    fake = FakeShards(plan, weights)
    fake.set_down(1)
    client = LookupClient(make_config(), plan, fake)
    rng = np.random.default_rng(1)
    hot, cold = tier_ids(plan, "wide", Tier.HOT), tier_ids(plan, "wide", Tier.COLD)
    warm = tier_ids(plan, "wide", Tier.WARM)
    batches = [np.concatenate((rng.choice(hot, 5), rng.choice(warm, 5), rng.choice(cold, 5))) for _ in range(12)]

    async def body() -> list[LookupResult]:
        out = []
        for _ in range(3):  # several windows: failover first, then an open breaker
            out += await asyncio.gather(*(client.lookup(item_kjt(b, "wide_tag"), pooled=False, timeout_s=5) for b in batches))
        return out

    results = run(client, body)
    for i, res in enumerate(results):
        ids = batches[i % len(batches)]
        expect = lost_count(plan, "wide", ids, {1})
        assert res.missing == expect, (i, res.missing, expect)
        rows = res.rows["wide_tag"].numpy()
        lost = np.zeros(ids.size, bool)
        r = plan.router("wide")
        lost |= (r.cold_owners_of(ids) == 1).all(axis=1) & (r.tier_of(ids) == Tier.COLD)
        lost |= (r.warm_shards_of(ids) == 1).any(axis=1) & (r.tier_of(ids) == Tier.WARM)
        np.testing.assert_array_equal(rows[~lost], weights["wide"][ids[~lost]])
        assert (rows[lost] == 0).all()
    assert sum(r.missing for r in results) > 0
    assert client.runtime.breakers.opened >= 1
    assert client.stats.rpcs_hedge >= 1  # hot rows of the first windows failed over


def test_late_shard_is_hedged_within_budget_and_callers_meet_deadlines() -> None:
    plan, _ = make_plan()
    weights = make_weights()
    fake = FakeShards(plan, weights)
    cfg = make_config(hedge_min_ms=2.0, hedge_burst=2.0, lookup=LookupConfig(hedge_budget=0.05))
    client = LookupClient(cfg, plan, fake)
    hot = tier_ids(plan, "item", Tier.HOT)
    late = 0
    cands = plan.router("item").hot_replicas_of(hot)
    hot_on_late = hot[(cands == late).any(axis=1)]

    async def body() -> list[LookupResult]:
        fake.set_blocked(late)
        out = []
        for i in range(6):
            t0 = time.monotonic()
            # A generous deadline: the blocked replica never answers, so only a hedge can
            # deliver these rows, however late a loaded machine wakes the event loop.
            res = await client.lookup(item_kjt(hot_on_late[i * 5 : i * 5 + 5]), pooled=False, timeout_s=2.0)
            assert time.monotonic() - t0 < 2.0 + 0.5
            out.append(res)
        fake.release(late)
        return out

    results = run(client, body)
    assert all(not r.degraded for r in results)  # every hot row came from a replica
    stats = client.stats
    assert stats.rpcs_hedge >= 1
    assert stats.rpcs_hedge <= 0.05 * stats.rpcs_primary + 2.0  # budget: ratio + burst


def test_non_retryable_errors_are_never_hedged() -> None:
    plan, _ = make_plan()
    fake = FakeShards(plan, make_weights())
    fake.set_error(0, grpc.StatusCode.INVALID_ARGUMENT)
    client = LookupClient(make_config(), plan, fake)
    hot = tier_ids(plan, "item", Tier.HOT)
    ids = hot[(plan.router("item").hot_replicas_of(hot) == 0).any(axis=1)][:20]
    res = run(client, lambda: client.lookup(item_kjt(ids), pooled=False, timeout_s=1))
    assert client.stats.rpcs_hedge == 0
    sent_to_0 = sum(c.ids("item").size for c in fake.calls if c.shard == 0)
    assert sent_to_0 > 0 and res.missing == sent_to_0


def test_each_caller_resolves_at_its_own_deadline() -> None:
    plan, _ = make_plan()
    weights = make_weights()
    fake = FakeShards(plan, weights)
    client = LookupClient(make_config(), plan, fake)
    cold = tier_ids(plan, "item", Tier.COLD)
    owner = plan.router("item").cold_owners_of(cold)[:, 0]
    on2, elsewhere = cold[owner == 2][:4], cold[owner != 2][:4]
    ids = np.concatenate((on2, elsewhere))

    async def body() -> tuple[LookupResult, LookupResult, float]:
        fake.set_blocked(2)
        t0 = time.monotonic()
        short = asyncio.ensure_future(client.lookup(item_kjt(ids), pooled=False, timeout_s=0.3))
        long = asyncio.ensure_future(client.lookup(item_kjt(ids), pooled=False, timeout_s=30.0))
        first = await short
        waited = time.monotonic() - t0
        fake.release(2)
        return first, await long, waited

    short, long, waited = run(client, body)
    assert client.stats.windows == 1  # both callers were in one window
    assert 0.29 <= waited < 1.5  # at its own deadline: not earlier, and nowhere near the long caller's 30 s
    assert short.missing == 4 and short.missing_by_feature == {"item_id": 4}
    assert (short.rows["item_id"][:4] == 0).all()
    assert not long.degraded
    assert torch.equal(long.rows["item_id"], torch.from_numpy(weights["item"][ids]))
    # The shard RPC carried the latest of the two deadlines, so it was still open for `long`.


def test_newer_plan_version_in_a_reply_triggers_get_plan() -> None:
    plan, _ = make_plan()
    fake = FakeShards(plan, make_weights())
    client = LookupClient(make_config(), plan, fake)
    v2 = dataclasses.replace(plan, version=2)

    async def body() -> None:
        await client.lookup(item_kjt(np.array([1, 2])), pooled=True, timeout_s=1)
        fake.set_plan(v2)
        await client.lookup(item_kjt(np.array([3])), pooled=True, timeout_s=1)
        assert client._refresh is not None
        await client._refresh

    run(client, body)
    assert fake.plan_gets == 1 and client.plan.version == 2 and client.stats.plan_refreshes == 1


def test_near_cache_serves_hot_rows_and_upsert_invalidates_them() -> None:
    plan, _ = make_plan()
    weights = make_weights()
    fake = FakeShards(plan, weights)
    cfg = make_config(lookup=LookupConfig(near_cache_rows=1000, near_cache_staleness_ms=10_000))
    client = LookupClient(cfg, plan, fake)
    hot = tier_ids(plan, "item", Tier.HOT)[:10]
    new_row = np.full((1, 16), 7.0, np.float32)

    async def body() -> tuple[LookupResult, LookupResult, int, int]:
        await client.lookup(item_kjt(hot), pooled=False, timeout_s=1)
        before = fake.rpcs()
        cached = await client.lookup(item_kjt(hot), pooled=False, timeout_s=1)
        rpcs_for_cached = fake.rpcs() - before
        await client.upsert("item", hot[:1], new_row)
        after = await client.lookup(item_kjt(hot), pooled=False, timeout_s=1)
        return cached, after, rpcs_for_cached, fake.rpcs()

    cached, after, rpcs_for_cached, _ = run(client, body)
    assert rpcs_for_cached == 0  # all ten rows from the near cache
    assert torch.equal(cached.rows["item_id"], torch.from_numpy(weights["item"][hot]))
    assert torch.equal(after.rows["item_id"][0], torch.from_numpy(new_row[0]))  # not the stale cached row
    assert torch.equal(after.rows["item_id"][1:], torch.from_numpy(weights["item"][hot[1:]]))
    assert client.near_cache_hit_rate == pytest.approx(19 / 30)  # each id once per lookup: same either way
    # The upsert reached every owner: both hot replicas.
    owners = set(plan.router("item").hot_replicas_of(hot[:1])[0].tolist())
    assert {s for s, _ in fake.upserts} == owners


def test_a_tight_deadline_closes_a_long_window_early() -> None:
    plan, _ = make_plan()
    weights = make_weights()
    # A 100 ms window, but the caller only has 60 ms: the window must close early enough
    # for the caller to get its rows (not a queue drop), and long before 100 ms. The 30 ms
    # dispatch margin absorbs a late event-loop wake-up on a loaded machine.
    cfg = make_config(dispatch_margin_ms=30.0, lookup=LookupConfig(window_ms=100.0, max_window_ms=100.0))
    client = LookupClient(cfg, plan, FakeShards(plan, weights))
    ids = np.array([1, 2, 3])

    async def body() -> tuple[LookupResult, float]:
        t0 = time.monotonic()
        res = await client.lookup(item_kjt(ids), pooled=False, timeout_s=0.06)
        return res, time.monotonic() - t0

    res, took = run(client, body)
    assert took < 0.1  # resolved before the 100 ms window would have closed
    assert client.stats.windows == 1  # a window took it before its deadline
    assert not res.degraded


def test_a_caller_whose_deadline_passes_in_the_queue_fails_with_deadline_exceeded() -> None:
    plan, _ = make_plan()
    fake = FakeShards(plan, make_weights())
    # One window slot, held by a caller blocked on shard 2; the next caller waits in the
    # queue past its deadline: the scheduler drops it with DEADLINE_EXCEEDED (no window
    # ever takes it), and the window slot's caller is unaffected.
    cfg = make_config(lookup=LookupConfig(max_inflight_batches=1))
    client = LookupClient(cfg, plan, fake)
    cold = tier_ids(plan, "item", Tier.COLD)
    on2 = cold[plan.router("item").cold_owners_of(cold)[:, 0] == 2][:3]

    async def body() -> tuple[LookupResult, BaseException | None]:
        fake.set_blocked(2)
        first = asyncio.ensure_future(client.lookup(item_kjt(on2), pooled=True, timeout_s=5.0))
        while client.stats.windows < 1:
            await asyncio.sleep(0)
        error: BaseException | None = None
        try:
            await client.lookup(item_kjt(np.array([1, 2, 2])), pooled=True, timeout_s=0.05)
        except DeadlineExceeded as e:
            error = e
        fake.release(2)
        return await first, error

    first, error = run(client, body)
    assert not first.degraded
    assert isinstance(error, DeadlineExceeded)
    assert client.stats.windows == 1  # the late caller never reached a window
    assert client.scheduler.stats().drops["deadline"] == 1  # dropped in the queue, by the scheduler


def test_windows_run_concurrently_and_rpcs_carry_their_callers_latest_deadline() -> None:
    plan, _ = make_plan()
    weights = make_weights()
    fake = FakeShards(plan, weights)
    client = LookupClient(make_config(), plan, fake)
    cold = tier_ids(plan, "item", Tier.COLD)
    owner = plan.router("item").cold_owners_of(cold)[:, 0]

    async def body() -> tuple[LookupResult, LookupResult, bool]:
        fake.set_blocked(2)
        first = asyncio.ensure_future(client.lookup(item_kjt(cold[owner == 2][:3]), pooled=False, timeout_s=5.0))
        while client.stats.windows < 1:  # until the first window is running
            await asyncio.sleep(0)
        second = await client.lookup(item_kjt(cold[owner == 0][:3]), pooled=False, timeout_s=5.0)
        pending = not first.done()  # the second window finished while the first waited
        fake.release(2)
        return await first, second, pending

    first, second, pending = run(client, body)
    assert pending and client.stats.windows == 2
    assert not first.degraded and not second.degraded
    header = fake.calls[0].request.header
    assert abs(header.deadline_unix_ms / 1000.0 - (time.time() + 5.0)) < 5.0  # about now + 5 s, not 0
    assert header.deadline_unix_ms > 0


def test_upsert_fails_unless_every_owner_acknowledges() -> None:
    from recserve.errors import Unavailable

    plan, _ = make_plan()
    fake = FakeShards(plan, make_weights())
    client = LookupClient(make_config(), plan, fake)
    hot = tier_ids(plan, "item", Tier.HOT)[:1]
    owners = plan.router("item").hot_replicas_of(hot)[0]
    fake.set_down(int(owners[1]))

    async def body() -> None:
        await client.upsert("item", hot, np.ones((1, 16), np.float32))

    with pytest.raises(Unavailable, match=f"shard {int(owners[1])}"):
        run(client, body)
    # The live owner applied it; the dead one did not acknowledge, so the caller knows.
    assert {s for s, _ in fake.upserts} == set(owners.tolist())


def test_big_windows_prepare_and_resolve_on_the_executor() -> None:
    plan, _ = make_plan()
    weights = make_weights()
    client = LookupClient(make_config(offload_ids=0), plan, FakeShards(plan, weights))
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, 2000, 30) for _ in range(8)]
    results = run(client, lambda: asyncio.gather(*(client.lookup(item_kjt(b), pooled=True, timeout_s=5) for b in batches)))
    for b, res in zip(batches, results):
        assert res.pooled is not None
        assert torch.equal(res.pooled["item_id"], torch.from_numpy(weights["item"][b].sum(axis=0, keepdims=True)))


def test_a_window_in_flight_across_a_plan_refresh_fills_only_its_own_near_cache() -> None:
    # A plan refresh builds a new near cache with other slots; a window sent before it
    # must not store its replies by its old slot numbers into the new cache (that would
    # serve one id's row for another).
    plan, _ = make_plan()
    v2, _ = make_plan(seed=5, version=2)
    weights = make_weights()
    fake = FakeShards(plan, weights)
    cfg = make_config(lookup=LookupConfig(near_cache_rows=1000, near_cache_staleness_ms=60_000))
    client = LookupClient(cfg, plan, fake)
    hot1, hot2 = tier_ids(plan, "item", Tier.HOT), tier_ids(v2, "item", Tier.HOT)
    assert not np.array_equal(hot1, hot2)  # the two caches differ slot by slot

    async def body() -> tuple[LookupResult, LookupResult]:
        for s in range(plan.num_shards):
            fake.set_blocked(s)
        first = asyncio.ensure_future(client.lookup(item_kjt(hot1), pooled=False, timeout_s=5.0))
        while fake.rpcs() == 0:  # until the first window has sent its RPCs
            await asyncio.sleep(0)
        fake.set_plan(v2)
        assert await client.refresh_plan(0)
        fake.set_plan(plan)  # the in-flight RPCs are answered under the plan they were sent on
        for s in range(plan.num_shards):
            fake.release(s)
        old = await first
        fake.set_plan(v2)
        return old, await client.lookup(item_kjt(hot2), pooled=False, timeout_s=5.0)

    old, new = run(client, body)
    assert torch.equal(old.rows["item_id"], torch.from_numpy(weights["item"][hot1]))
    assert torch.equal(new.rows["item_id"], torch.from_numpy(weights["item"][hot2]))


def test_a_window_in_flight_when_the_fleet_shrinks_still_resolves_its_callers() -> None:
    # Scale-down: a refresh switches to a plan with fewer shards while a window still
    # waits on a shard the new plan no longer has; its reply must still be taken.
    plan, _ = make_plan(num_shards=4)
    smaller, _ = make_plan(num_shards=3, version=2)
    weights = make_weights()
    fake = FakeShards(plan, weights)
    client = LookupClient(make_config(), plan, fake)
    cold = tier_ids(plan, "item", Tier.COLD)
    on_last = cold[plan.router("item").cold_owners_of(cold)[:, 0] == 3][:5]
    assert on_last.size == 5

    async def body() -> LookupResult:
        fake.set_blocked(3)
        first = asyncio.ensure_future(client.lookup(item_kjt(on_last), pooled=False, timeout_s=5.0))
        while fake.rpcs(3) == 0:  # until the window waits on shard 3
            await asyncio.sleep(0)
        fake.set_plan(smaller)
        assert await client.refresh_plan(0)
        fake.set_plan(plan)  # shard 3 answers under the plan the window was sent on
        fake.release(3)
        return await first

    result = run(client, body)
    assert not result.degraded
    assert torch.equal(result.rows["item_id"], torch.from_numpy(weights["item"][on_last]))


def test_upsert_with_non_integer_ids_is_refused_not_truncated() -> None:
    plan, _ = make_plan()
    fake = FakeShards(plan, make_weights())
    client = LookupClient(make_config(), plan, fake)

    async def body() -> None:
        await client.upsert("item", [1.5], np.ones((1, 16), np.float32))

    with pytest.raises(InvalidArgument, match="dtype float64"):
        run(client, body)
    assert fake.upserts == []  # nothing written (a cast would have written id 1)


@pytest.mark.parametrize("pooled", [True, False])
def test_missing_rows_are_attributed_to_their_bags(pooled: bool) -> None:
    """A caller batching several requests into one lookup (the Ranking service) needs each
    bag's missing count, not only the caller's total."""
    plan, _ = make_plan()
    fake = FakeShards(plan, make_weights())
    client = LookupClient(make_config(), plan, fake)
    cold = tier_ids(plan, "item", Tier.COLD)
    owner = plan.router("item").cold_owners_of(cold)[:, 0]
    on2, elsewhere = cold[owner == 2][:3], cold[owner != 2][:3]
    # bags: [2 dead, 0] [0 dead] [1 dead + 1 live]; a second caller in the window has its own bags.
    values = np.concatenate((on2[:2], elsewhere[:1], on2[2:3], elsewhere[1:2]))
    kjt = KeyedJaggedTensor(keys=["item_id"], values=torch.from_numpy(values), lengths=torch.tensor([2, 1, 2]))

    async def body() -> tuple[LookupResult, LookupResult]:
        fake.set_blocked(2)
        other = asyncio.ensure_future(client.lookup(item_kjt(np.concatenate((elsewhere[2:], on2[:1]))), pooled=pooled, timeout_s=0.3))
        mine = await client.lookup(kjt, pooled=pooled, timeout_s=0.3)
        fake.release(2)
        return mine, await other

    mine, other = run(client, body)
    assert mine.missing == 3 and mine.missing_bags["item_id"].tolist() == [2, 0, 1]
    assert other.missing == 1 and other.missing_bags["item_id"].tolist() == [1]
