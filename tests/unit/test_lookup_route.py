"""Routing a window's unique ids (pure): owners, warm slices, hot spreading without
herding, two choices across windows, contacted-shard preference, dead and slow shards."""

from __future__ import annotations

import numpy as np

from recserve.lookup.route import FetchUnit, ShardState, chunk_units, route_window
from recserve.sharding.plan import ShardingPlan, Tier
from tests.unit.test_lookup_fakes import make_plan, tier_ids


def _route(plan: ShardingPlan, table: str, ids: np.ndarray, state: ShardState | None = None, **kw: object):  # type: ignore[no-untyped-def]
    uids = np.unique(ids)
    state = state or ShardState.healthy(plan.num_shards)
    return uids, route_window({table: uids}, {table: np.arange(uids.size)}, {table: plan.table(table)}, {table: plan.router(table)}, state, **kw)  # type: ignore[arg-type]


def test_every_fetch_goes_to_an_owner_and_warm_rows_to_every_slice() -> None:
    plan, _ = make_plan()
    ids = np.arange(plan.table("wide").rows)
    uids, routed = _route(plan, "wide", ids)
    router = plan.router("wide")
    pieces = np.zeros(uids.size, np.int64)
    for u in routed.units:
        k = plan.table("wide").slice_of(u.col_start, u.col_end)
        assert router.owns(u.shard, uids[u.positions], k).all()
        np.add.at(pieces, u.positions, 1)
    tiers = router.tier_of(uids)
    np.testing.assert_array_equal(pieces[tiers == Tier.WARM], 2)  # both slices
    np.testing.assert_array_equal(pieces[tiers != Tier.WARM], 1)
    assert all(v.size == 0 for v in routed.unroutable.values())


def test_hot_ids_are_spread_evenly_over_replicas_not_herded() -> None:
    plan, _ = make_plan(num_shards=4, hot_fraction=0.2, warm_fraction=0.0)
    hot = tier_ids(plan, "item", Tier.HOT)
    # A skewed load signal: shard 0 idle, the others with some work in flight (less than
    # this window brings). Per-id argmin would send every hot id with shard 0 among its
    # replicas to shard 0; levelling sends it just enough to even out the load.
    inflight = np.array([0, 40, 40, 40])
    state = ShardState(np.ones(4, bool), np.zeros(4, bool), inflight)
    uids, routed = _route(plan, "item", hot, state)
    cands = plan.router("item").hot_replicas_of(uids)
    chosen = np.full(uids.size, -1)
    for u in routed.units:
        chosen[u.positions] = u.shard
    with_zero = (cands == 0).any(axis=1)
    to_zero = (chosen[with_zero] == 0).mean()
    assert 0.5 < to_zero < 0.9  # steered towards the idle shard, but not all of them
    load = inflight + np.bincount(chosen, minlength=4)
    assert load.max() / load.min() < 1.3, load
    # Without a load signal the rotation gives each replica column an equal share.
    uids, routed = _route(plan, "item", hot)
    counts = np.bincount(np.concatenate([np.full(len(u), u.shard) for u in routed.units]), minlength=4)
    assert counts.max() / counts.mean() < 1.35, counts


def test_two_choices_move_load_across_windows() -> None:
    plan, _ = make_plan(num_shards=3, hot_fraction=0.3, warm_fraction=0.0)
    hot = tier_ids(plan, "item", Tier.HOT)
    idle = ShardState.healthy(3)
    busy = ShardState(np.ones(3, bool), np.zeros(3, bool), np.array([0, 0, 5000]))
    _, r_idle = _route(plan, "item", hot, idle)
    _, r_busy = _route(plan, "item", hot, busy)
    to2 = lambda r: sum(len(u) for u in r.units if u.shard == 2)  # noqa: E731
    assert to2(r_busy) < 0.2 * to2(r_idle)


def test_small_hot_groups_go_to_already_contacted_shards() -> None:
    plan, _ = make_plan(num_shards=4)
    router = plan.router("item")
    cold = tier_ids(plan, "item", Tier.COLD)
    hot = tier_ids(plan, "item", Tier.HOT)
    owner = router.cold_owners_of(cold)[:, 0]
    reps = router.hot_replicas_of(hot)
    # One cold id on shard s, one hot id replicated on s and another shard.
    pick = int(np.flatnonzero((reps == owner[0]).any(axis=1))[0])
    ids = np.array([cold[0], hot[pick]])
    for rotation in range(2):
        _, routed = _route(plan, "item", ids, rotation=rotation, min_ids_per_extra_rpc=64)
        assert {u.shard for u in routed.units} == {int(owner[0])}
        _, spread = _route(plan, "item", ids, rotation=rotation, min_ids_per_extra_rpc=0)
        assert {u.shard for u in spread.units} <= set(reps[pick].tolist()) | {int(owner[0])}


def test_dead_shard_replicated_ids_rerouted_rest_unroutable() -> None:
    plan, _ = make_plan(num_shards=3)
    dead = 1
    state = ShardState(np.array([True, False, True]), np.zeros(3, bool), np.zeros(3, np.int64))
    ids = np.arange(plan.table("wide").rows)
    uids, routed = _route(plan, "wide", ids, state)
    assert all(u.shard != dead for u in routed.units)
    router = plan.router("wide")
    tiers = router.tier_of(uids)
    cold_lost = (router.cold_owners_of(uids) == dead).any(axis=1) & (tiers == Tier.COLD)
    warm_lost = (router.warm_shards_of(uids) == dead).any(axis=1) & (tiers == Tier.WARM)
    hot_lost = (router.hot_replicas_of(uids) == dead).all(axis=1) & (tiers == Tier.HOT)
    expect = np.flatnonzero(cold_lost | warm_lost | hot_lost)
    np.testing.assert_array_equal(np.sort(routed.unroutable["wide"]), expect)
    assert cold_lost.any() and warm_lost.any() and not hot_lost.any()


def test_slow_shard_gets_no_hot_ids_while_a_fast_replica_exists() -> None:
    plan, _ = make_plan(num_shards=3)
    hot = tier_ids(plan, "item", Tier.HOT)
    slow = ShardState(np.ones(3, bool), np.array([False, True, False]), np.zeros(3, np.int64))
    uids, routed = _route(plan, "item", hot, slow)
    assert not any(u.shard == 1 for u in routed.units)
    # ... and its rows keep shard 1 as the hedge alternative (a copy still exists there).
    alts = np.concatenate([u.alternatives[:, 0] for u in routed.units])
    assert (alts == 1).any()


def test_chunks_cover_every_unit_in_order_and_fill_each_rpc() -> None:
    alts = np.arange(9, dtype=np.int32).reshape(9, 1)
    units = [
        FetchUnit(0, "a", np.arange(5), 0, 0, alts[:5]),
        FetchUnit(0, "b", np.arange(10, 14), 2, 4, alts[5:]),
    ]
    rpcs = chunk_units(units, 3)
    assert [sum(len(u) for u in rpc) for rpc in rpcs] == [3, 3, 3]
    assert [[(u.table, u.positions.tolist()) for u in rpc] for rpc in rpcs] == [
        [("a", [0, 1, 2])],
        [("a", [3, 4]), ("b", [10])],
        [("b", [11, 12, 13])],
    ]
    pieces = [u for rpc in rpcs for u in rpc]
    np.testing.assert_array_equal(np.concatenate([u.alternatives for u in pieces]), alts)  # alternatives follow their rows
    assert [(u.col_start, u.col_end) for u in pieces] == [(0, 0), (0, 0), (2, 4), (2, 4)]
    whole = chunk_units(units, 9)
    assert len(whole) == 1 and whole[0] is units  # within the limit: one RPC, units untouched
