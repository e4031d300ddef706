"""Adding / removing shards: versions, moved fractions, and that only the right ids move."""

from __future__ import annotations

import numpy as np
import pytest

from recserve.errors import ConfigError
from recserve.sharding.plan import ShardingPlan, Tier
from recserve.sharding.replan import moved_fraction, replan_add_shard, replan_remove_shard
from tests.unit.test_sharding_reference import make_plan

ROWS = 100_000


def cold_owner_keys(plan: ShardingPlan, ids: np.ndarray) -> np.ndarray:
    """Physical shard key of each id's cold owner."""
    return np.asarray(plan.keys)[plan.router("item").cold_owners_of(ids)[:, 0]]


def cold_ids(plan: ShardingPlan) -> np.ndarray:
    t = plan.table("item")
    return np.setdiff1d(np.arange(t.rows), np.concatenate([t.hot_ids, t.warm_ids]))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_adding_a_shard_moves_one_over_n_plus_one_of_cold_ids_to_it(n: int) -> None:
    plan = make_plan(rows=ROWS, hot=1_000, warm=10_000, hot_replicas=1, column_splits=1, num_shards=n, virtual_nodes=64)
    new, fraction = replan_add_shard(plan)
    assert new.version == plan.version + 1 and new.num_shards == n + 1
    ids = cold_ids(plan)
    before, after = cold_owner_keys(plan, ids), cold_owner_keys(new, ids)
    moved = before != after
    assert fraction == pytest.approx(moved.mean())  # the reported figure is the real one
    assert abs(fraction - 1 / (n + 1)) <= 0.02, (n, fraction)
    assert (after[moved] == new.keys[-1]).all()  # ids only move onto the new shard
    np.testing.assert_array_equal(new.tokens[:n], plan.tokens)


@pytest.mark.parametrize("victim", [0, 2, 4])
def test_removing_a_shard_moves_only_its_ids(victim: int) -> None:
    plan = make_plan(rows=ROWS, hot=1_000, warm=10_000, hot_replicas=2, column_splits=3, cold_replicas=2, num_shards=5, virtual_nodes=64)
    new, fraction = replan_remove_shard(plan, victim)
    assert new.version == 2 and new.num_shards == 4
    assert victim not in new.keys and len(new.keys) == 4
    ids = cold_ids(plan)
    before, after = cold_owner_keys(plan, ids), cold_owner_keys(new, ids)
    moved = before != after
    assert fraction == pytest.approx(moved.mean())
    assert (before[moved] == victim).all() and not (after == victim).any()
    assert abs(fraction - 1 / 5) <= 0.02


def test_remove_caps_fanout_and_refuses_the_last_shard() -> None:
    plan = make_plan(num_shards=3, hot_replicas=3, column_splits=3, cold_replicas=2)
    new, _ = replan_remove_shard(plan)
    t = new.table("item")
    assert (t.hot_replicas, t.column_splits, t.cold_replicas) == (2, 2, 2)
    assert new.keys == (0, 1)
    one = make_plan(num_shards=1, hot_replicas=1, column_splits=1)
    with pytest.raises(ConfigError, match="1-shard plan"):
        replan_remove_shard(one)
    with pytest.raises(ConfigError, match="shard 7"):
        replan_remove_shard(plan, 7)


def test_add_then_json_round_trip_keeps_keys_and_tokens() -> None:
    plan = make_plan(num_shards=3, virtual_nodes=8)
    removed, _ = replan_remove_shard(plan, 0)
    added, _ = replan_add_shard(removed)
    assert added.keys == (1, 2, 3)
    assert ShardingPlan.from_json(added.to_json()) == added


def test_hot_and_warm_moves_are_reported() -> None:
    plan = make_plan(rows=20_000, hot=2_000, warm=4_000, hot_replicas=2, column_splits=2, num_shards=4)
    new, _ = replan_add_shard(plan)
    same = moved_fraction(plan, plan, tier=Tier.HOT)
    hot = moved_fraction(plan, new, tier=Tier.HOT)
    warm = moved_fraction(plan, new, tier=Tier.WARM)
    assert same == 0.0
    # A hot set changes when the new shard becomes owner or first successor: ~2/5.
    assert 0.25 < hot < 0.55, hot
    assert 0.25 < warm < 0.55, warm
