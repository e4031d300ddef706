"""The planner: tier selection, column-split rule, memory budget, estimates, variants."""

from __future__ import annotations

import numpy as np
import pytest

from recserve.config.spec import ShardingConfig, TableConfig
from recserve.errors import ConfigError, ResourceExhausted
from recserve.sharding.estimates import estimate_plan, expected_owner_counts
from recserve.sharding.planner import plan_tables, plan_variants, resolve_column_splits
from tests.unit.test_sharding_reference import RefRouter


def zipf(rows: int, a: float = 1.05, seed: int = 0) -> np.ndarray:
    """Zipf popularity over a random permutation of ids (popular ids are not 0, 1, ...)."""
    f = np.empty(rows)
    f[np.random.default_rng(seed).permutation(rows)] = 1.0 / np.arange(1, rows + 1) ** a
    return f


def test_top_frequencies_become_hot_then_warm() -> None:
    rows = 2_000
    f = np.random.default_rng(1).random(rows)
    res = plan_tables([TableConfig("item", rows, 8)], {"item": f}, ShardingConfig(num_shards=3, hot_fraction=0.01, warm_fraction=0.1))
    t = res.plan.table("item")
    ranked = sorted(range(rows), key=lambda i: -f[i])
    assert t.hot_ids.tolist() == sorted(ranked[:20])
    assert t.warm_ids.tolist() == sorted(ranked[20:220])


def test_uniform_frequency_makes_the_lowest_ids_hot() -> None:
    res = plan_tables([TableConfig("item", 1_000, 8)], None, ShardingConfig(num_shards=2))
    assert res.plan.table("item").hot_ids.tolist() == list(range(10))
    assert res.plan.table("item").warm_ids.tolist() == list(range(10, 110))


@pytest.mark.parametrize(
    "dim, shards, configured, want",
    [(64, 4, 0, 1), (128, 4, 0, 1), (129, 4, 0, 2), (256, 4, 0, 2), (1000, 4, 0, 4), (64, 4, 3, 3), (2, 4, 4, 2)],
)
def test_column_split_rule(dim: int, shards: int, configured: int, want: int) -> None:
    assert resolve_column_splits(dim, ShardingConfig(num_shards=shards, column_splits=configured)) == want


def budget_config(budget: int) -> ShardingConfig:
    return ShardingConfig(num_shards=2, hot_fraction=0.01, warm_fraction=0.1, hot_replicas=2, column_splits=2, shard_memory_bytes=budget)


def test_memory_budget_is_enforced_with_table_and_byte_numbers() -> None:
    # Each of the 2 shards holds all 100 hot rows (R = 2) at 16*4 + 8 index bytes = 7,200,
    # and one 8-column slice of each of 1,000 warm rows at 8*4 + 8 = 40,000: 47,200 bytes.
    tables = [TableConfig("item", 10_000, 16)]
    res = plan_tables(tables, None, budget_config(47_200))
    assert res.bytes_per_shard["dram"].tolist() == [47_200, 47_200]
    assert res.bytes_per_shard["hot"].tolist() == [7_200, 7_200]
    with pytest.raises(ResourceExhausted) as e:
        plan_tables(tables, None, budget_config(47_199))
    msg = str(e.value)
    assert "table 'item'" in msg and "47,200 bytes" in msg and "47,199 bytes available" in msg


def test_memory_error_names_every_table_on_the_shard() -> None:
    tables = [TableConfig("item", 10_000, 16), TableConfig("user", 10_000, 16, dtype="float16")]
    with pytest.raises(ResourceExhausted) as e:
        plan_tables(tables, None, budget_config(50_000))
    msg = str(e.value)
    # float16 halves the row bytes: 100 * (32 + 8) + 1,000 * (16 + 8) = 28,000.
    assert "table 'item': 47,200 bytes" in msg and "table 'user': 28,000 bytes" in msg and "75,200 bytes of DRAM" in msg


def test_int8_rows_carry_scale_and_bias() -> None:
    res = plan_tables([TableConfig("item", 10_000, 16, dtype="int8")], None, budget_config(1 << 30))
    # hot: 100 rows * (16 + 8 scale/bias + 8 index); warm: 1,000 slices * (8 + 8 + 8).
    assert res.bytes_per_shard["hot"].tolist() == [3_200, 3_200]
    assert res.bytes_per_shard["warm"].tolist() == [24_000, 24_000]


def test_estimates_match_a_per_id_reference() -> None:
    rows, window = 3_000, 500
    f = zipf(rows)
    cfg = ShardingConfig(num_shards=4, hot_fraction=0.02, warm_fraction=0.1, hot_replicas=2, column_splits=2, cold_replicas=2)
    res = plan_tables([TableConfig("item", rows, 12)], {"item": f}, cfg, window_lookups=window)
    ref = RefRouter(res.plan, "item")
    p = f / f.sum()
    uniq = np.zeros(4)
    stored = {"hot": np.zeros(4), "warm": np.zeros(4), "cold": np.zeros(4)}
    for i in range(rows):
        q = 1.0 - (1.0 - p[i]) ** window
        tier = ref.tier(i)
        if tier == 0:
            for s in ref.hot_replicas(i):
                uniq[s] += q / 2
                stored["hot"][s] += 1
        elif tier == 1:
            for s in ref.warm_shards(i):
                uniq[s] += q
                stored["warm"][s] += 1
        else:
            owners = ref.cold_owners(i)
            uniq[owners[0]] += q
            for s in owners:
                stored["cold"][s] += 1
    np.testing.assert_allclose(res.unique_rows_per_shard, uniq, rtol=1e-9)
    assert res.imbalance == pytest.approx(uniq.max() / uniq.mean())
    e = res.estimate.tables["item"]
    for tier_name, want in stored.items():
        np.testing.assert_array_equal(e.rows_per_shard[tier_name], want)
    np.testing.assert_array_equal(res.bytes_per_shard["cold"], stored["cold"] * (12 * 4 + 24))
    # Every lookup lands once, a warm one on each of its C = 2 slice shards.
    warm_mass = p[res.plan.table("item").warm_ids].sum()
    assert res.estimate.lookups_per_shard.sum() == pytest.approx(window * (1 + warm_mass))


def test_replicating_hot_ids_cuts_lookup_imbalance_on_zipf() -> None:
    rows = 50_000
    res = plan_variants([TableConfig("item", rows, 256)], {"item": zipf(rows)}, ShardingConfig(num_shards=8))
    assert set(res) == {"row_only", "hybrid", "hybrid_no_colsplit"}
    row_only, hybrid, nocol = res["row_only"], res["hybrid"], res["hybrid_no_colsplit"]
    assert row_only.plan.table("item").hot_ids.size == 0 and row_only.plan.table("item").warm_ids.size == 0
    assert row_only.bytes_per_shard["dram"].sum() == 0
    assert hybrid.plan.table("item").column_splits == 2 and nocol.plan.table("item").column_splits == 1
    assert hybrid.estimate.lookup_imbalance < row_only.estimate.lookup_imbalance
    assert nocol.estimate.lookup_imbalance < row_only.estimate.lookup_imbalance


def test_expected_owner_counts_for_a_concrete_window() -> None:
    cfg = ShardingConfig(num_shards=3, hot_fraction=0.05, warm_fraction=0.2, hot_replicas=2, column_splits=2)
    plan = plan_tables([TableConfig("item", 400, 8)], None, cfg).plan
    ref = RefRouter(plan, "item")
    window = np.random.default_rng(2).integers(0, 400, 1_000)
    want = np.zeros(3)
    for i in set(window.tolist()):
        tier = ref.tier(i)
        for s in ref.hot_replicas(i) if tier == 0 else ref.warm_shards(i) if tier == 1 else ref.cold_owners(i)[:1]:
            want[s] += 0.5 if tier == 0 else 1.0
    np.testing.assert_allclose(expected_owner_counts(plan, "item", window), want)


def test_bad_access_frequencies_are_config_errors() -> None:
    tables = [TableConfig("item", 100, 8)]
    cfg = ShardingConfig(num_shards=2)
    with pytest.raises(ConfigError, match=r"shape \(99,\); expected \(100,\)"):
        plan_tables(tables, {"item": np.ones(99)}, cfg)
    with pytest.raises(ConfigError, match="non-negative"):
        plan_tables(tables, {"item": -np.ones(100)}, cfg)
    with pytest.raises(ConfigError, match="'user'"):
        plan_tables(tables, {"user": np.ones(100)}, cfg)
    with pytest.raises(ConfigError, match="window_lookups"):
        estimate_plan(plan_tables(tables, None, cfg).plan, None, window_lookups=0)


def test_planning_is_deterministic() -> None:
    tables = [TableConfig("item", 5_000, 8)]
    f = zipf(5_000)
    cfg = ShardingConfig(num_shards=3)
    assert plan_tables(tables, {"item": f}, cfg).plan == plan_tables(tables, {"item": f}, cfg).plan


def test_a_sample_of_lookups_plans_like_its_counts() -> None:
    """The planner's second frequency source: ids looked up, repeats counted."""
    from recserve.sharding.estimates import frequencies_from_lookups

    rows = 1_000
    sample = np.random.default_rng(4).choice(rows, size=20_000, p=zipf(rows) / zipf(rows).sum())
    freq = frequencies_from_lookups("item", rows, sample)
    assert freq.shape == (rows,) and freq.sum() == 20_000
    assert freq[int(sample[0])] == np.count_nonzero(sample == sample[0])
    assert frequencies_from_lookups("item", 4, np.array([2, 0, 2])).tolist() == [1.0, 0.0, 2.0, 0.0]
    res = plan_tables([TableConfig("item", rows, 8)], {"item": freq}, ShardingConfig(num_shards=2, hot_fraction=0.01))
    top = np.argsort(-freq, kind="stable")[:10]
    assert res.plan.table("item").hot_ids.tolist() == sorted(top.tolist())
    with pytest.raises(ConfigError, match=r"id 1,000 is out of range \[0, 1,000\)"):
        frequencies_from_lookups("item", rows, np.array([3, 1_000]))
    with pytest.raises(ConfigError, match="empty"):
        frequencies_from_lookups("item", rows, np.zeros(0, dtype=np.int64))
    with pytest.raises(ConfigError, match="integer"):
        frequencies_from_lookups("item", rows, np.array([0.5]))
