"""Vectorised routing against the pure-Python reference, on both lookup paths."""

from __future__ import annotations

import numpy as np
import pytest

from recserve.errors import InvalidArgument, NotFound
from recserve.sharding.plan import ShardingPlan, Tier
from recserve.sharding.router import TableRouter
from tests.unit.test_sharding_reference import RefRouter, make_plan

CONFIGS = [
    dict(hot_replicas=2, column_splits=3, cold_replicas=1, num_shards=5),
    dict(hot_replicas=3, column_splits=1, cold_replicas=2, num_shards=4, virtual_nodes=8),
    dict(hot_replicas=1, column_splits=4, cold_replicas=3, num_shards=4, seed=7),
    dict(hot_replicas=1, column_splits=1, cold_replicas=1, num_shards=1),
]


def routers(plan: ShardingPlan) -> list[TableRouter]:
    """The plan's own (dense-map) router and a ring-arithmetic router of the same table."""
    dense = plan.router("item")
    ring = TableRouter(plan.table("item"), plan.ring, seed=plan.seed, dense_max_rows=0)
    ring.prepare()
    assert dense.dense and not ring.dense
    return [dense, ring]


def sample_ids(plan: ShardingPlan, n: int = 600) -> np.ndarray:
    t = plan.table("item")
    rng = np.random.default_rng(3)
    # Random ids plus every tier's members and the table's edges, shuffled.
    ids = np.concatenate([rng.integers(0, t.rows, n), t.hot_ids[:40], t.warm_ids[:40], [0, t.rows - 1]])
    return rng.permutation(ids).astype(np.int64)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_routing_matches_reference(cfg: dict) -> None:
    plan = make_plan(**cfg)
    ref = RefRouter(plan, "item")
    ids = sample_ids(plan)
    want_tier = np.array([ref.tier(int(i)) for i in ids])
    want_hot = np.array([ref.hot_replicas(int(i)) for i in ids])
    want_warm = np.array([ref.warm_shards(int(i)) for i in ids])
    want_cold = np.array([ref.cold_owners(int(i)) for i in ids])
    for r in routers(plan):
        np.testing.assert_array_equal(r.tier_of(ids), want_tier)
        np.testing.assert_array_equal(r.hot_replicas_of(ids), want_hot)
        np.testing.assert_array_equal(r.warm_shards_of(ids), want_warm)
        np.testing.assert_array_equal(r.cold_owners_of(ids), want_cold)
        rt = r.route(ids)
        np.testing.assert_array_equal(rt.tier, want_tier)
        np.testing.assert_array_equal(rt.hot_index, np.flatnonzero(want_tier == Tier.HOT))
        np.testing.assert_array_equal(rt.hot_shards, want_hot[rt.hot_index])
        np.testing.assert_array_equal(rt.warm_shards, want_warm[rt.warm_index])
        np.testing.assert_array_equal(rt.cold_index, np.flatnonzero(want_tier == Tier.COLD))
        np.testing.assert_array_equal(rt.cold_shards, want_cold[rt.cold_index])


@pytest.mark.parametrize("cfg", CONFIGS[:3])
def test_owns_matches_reference(cfg: dict) -> None:
    plan = make_plan(**cfg)
    ref = RefRouter(plan, "item")
    ids = sample_ids(plan, 300)
    c = plan.table("item").column_splits
    for r in routers(plan):
        for shard in range(plan.num_shards):
            for k in [None, *range(c)]:
                want = [ref.owns(shard, int(i), k) for i in ids]
                np.testing.assert_array_equal(r.owns(shard, ids, k), want, err_msg=f"shard {shard} slice {k}")


def test_hot_ids_have_distinct_replicas_spread_over_all_shards() -> None:
    plan = make_plan(rows=20_000, hot=2_000, warm=0, hot_replicas=3, column_splits=1, num_shards=6)
    reps = plan.router("item").hot_replicas_of(plan.table("item").hot_ids)
    assert reps.shape == (2_000, 3)
    assert (np.sort(reps, axis=1)[:, 1:] != np.sort(reps, axis=1)[:, :-1]).all()  # distinct per id
    assert ((reps >= 0) & (reps < 6)).all()
    # Every shard holds about H * R / S = 1000 hot rows, not just the first R shards.
    per_shard = np.bincount(reps.ravel(), minlength=6)
    assert per_shard.min() > 700 and per_shard.max() < 1300, per_shard


def test_out_of_range_and_malformed_ids_are_rejected_with_numbers() -> None:
    plan = make_plan(rows=1_000)
    for r in routers(plan):
        with pytest.raises(InvalidArgument, match=r"1,000 rows; id 1,000 is out of range \[0, 1,000\)"):
            r.tier_of(np.array([3, 1_000, 5]))
        with pytest.raises(InvalidArgument, match="id -2 is out of range"):
            r.route(np.array([4, -2]))
        with pytest.raises(InvalidArgument, match="integers"):
            r.owns(0, np.array([1.5]))
        with pytest.raises(InvalidArgument, match="1-D"):
            r.hot_replicas_of(np.zeros((2, 2), dtype=np.int64))


def test_empty_ids_route_to_empty_arrays() -> None:
    plan = make_plan()
    for r in routers(plan):
        assert r.tier_of(np.zeros(0, dtype=np.int64)).shape == (0,)
        assert r.hot_replicas_of([]).shape == (0, 2)
        assert r.warm_shards_of([]).shape == (0, 3)
        assert r.route([]).cold_shards.shape == (0, 1)


def test_owns_rejects_unknown_shard_and_slice() -> None:
    r = make_plan(num_shards=5, column_splits=3).router("item")
    with pytest.raises(NotFound, match="shard 5"):
        r.owns(5, [1])
    with pytest.raises(InvalidArgument, match=r"slice index 3 is out of range \[0, 3\)"):
        r.owns(0, [1], slice_index=3)


def test_router_is_cached_and_unknown_table_is_not_found() -> None:
    plan = make_plan()
    assert plan.router("item") is plan.router("item")
    with pytest.raises(NotFound, match="'user' is not in sharding plan"):
        plan.router("user")


def test_tables_are_salted_differently() -> None:
    """Two tables with the same ids must not share one placement (id 0 of every
    catalog table is the most popular one)."""
    from recserve.sharding.plan import TablePlan

    a = make_plan(rows=10_000, hot=0, warm=0, column_splits=1).table("item")
    none = np.zeros(0, dtype=np.int64)
    b = TablePlan(name="user", rows=10_000, dim=10, hot_ids=none, warm_ids=none, hot_replicas=2, column_splits=1, cold_replicas=1)
    plan = ShardingPlan(version=1, num_shards=5, tables={"item": a, "user": b}, virtual_nodes=16)
    ids = np.arange(10_000)
    same = plan.router("item").cold_owners_of(ids)[:, 0] == plan.router("user").cold_owners_of(ids)[:, 0]
    assert 0.1 < same.mean() < 0.3  # ~1/5 agree by chance, not all
