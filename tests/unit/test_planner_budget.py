"""The memory-budgeted planner (``sharding.placement = "budget"``) and per-table overrides."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from recserve.config.load import loads
from recserve.config.spec import ShardingConfig, TableConfig
from recserve.errors import ConfigError, ResourceExhausted
from recserve.sharding.planner import plan_tables, whole_copy_bytes


def budget(bytes_per_shard: int, **kw: object) -> ShardingConfig:
    return ShardingConfig(num_shards=2, placement="budget", shard_memory_bytes=bytes_per_shard, **kw)  # type: ignore[arg-type]


def zipf(rows: int) -> np.ndarray:
    f = np.empty(rows)
    f[np.random.default_rng(0).permutation(rows)] = 1.0 / np.arange(1, rows + 1) ** 1.05
    return f


def test_a_small_table_is_replicated_whole_on_every_shard() -> None:
    # Today's rule gives a 300-row table 3 hot ids, 30 warm and 267 cold; a whole copy is
    # 300 * (64 * 4 + 8) = 79,200 bytes, which fits every shard's budget.
    small = TableConfig("category", 300, 64)
    assert whole_copy_bytes(small) == 79_200
    fractions = plan_tables([small], None, ShardingConfig(num_shards=2)).plan.table("category")
    assert (fractions.hot_ids.size, fractions.warm_ids.size, fractions.num_cold) == (3, 30, 267)
    res = plan_tables([small, TableConfig("item", 20_000, 16)], None, budget(1 << 20))
    t = res.plan.table("category")
    assert t.hot_ids.tolist() == list(range(300)) and t.hot_replicas == 2 and t.num_cold == 0
    for shard in range(2):  # every shard answers every id from DRAM
        assert res.plan.assignment(shard, "category").hot_ids.size == 300
    row = {r["table"]: r for r in res.tier_rows()}
    assert row["category"]["replicated_whole"] and not row["item"]["replicated_whole"]


def test_budget_fills_hot_then_warm_by_popularity_and_leaves_the_rest_to_rocksdb_and_row_cache() -> None:
    rows, dim = 20_000, 16
    f = zipf(rows)
    # A whole copy (20,000 * 72 = 1.44 MB) does not fit 400 kB; hot (1%) does, warm gets the rest.
    res = plan_tables([TableConfig("item", rows, dim)], {"item": f}, budget(400_000, hot_fraction=0.01, warm_fraction=0.99))
    t = res.plan.table("item")
    ranked = np.argsort(-f, kind="stable")
    assert t.hot_ids.tolist() == sorted(ranked[:200].tolist())
    assert 0 < t.warm_ids.size < rows - 200 and t.num_cold > 0
    assert t.warm_ids.tolist() == sorted(ranked[200 : 200 + t.warm_ids.size].tolist())  # next most popular
    dram = res.bytes_per_shard["dram"]
    assert int(dram.max()) <= 400_000
    # Filled: the fullest shard uses the budget to within 1% (the fit shrinks by the
    # measured overflow plus 5%, so it may stop a few rows short of the exact maximum).
    assert int(dram.max()) > 0.99 * 400_000
    assert res.row_cache_bytes.tolist() == (400_000 - dram).tolist()


def test_budget_honours_hot_fraction_cap_and_reports_row_cache() -> None:
    res = plan_tables([TableConfig("item", 10_000, 16)], None, budget(10 << 20, hot_fraction=0.02, warm_fraction=0.0))
    t = res.plan.table("item")
    # A whole copy is 10,000 * 72 = 720 kB: it fits 10 MiB, so it is replicated whole
    # and the hot_fraction cap does not apply.
    assert t.hot_ids.size == 10_000
    big = TableConfig("item", 200_000, 16)  # 14.4 MB whole copy > 10 MiB
    res = plan_tables([big], None, budget(10 << 20, hot_fraction=0.02, warm_fraction=0.0))
    t = res.plan.table("item")
    assert (t.hot_ids.size, t.warm_ids.size) == (4_000, 0)
    assert res.row_cache_bytes.min() > 0


SPEC = """
[[tables]]
name = "item"
rows = 100000
dim = 64

[[tables]]
name = "category"
rows = 1000
dim = 64
hot_fraction = 0.5
warm_fraction = 0.25
column_splits = 2
hot_replicas = 1
cold_replicas = 2

[[features]]
name = "history_items"
table = "item"

[sharding]
num_shards = 2
hot_fraction = 0.01
warm_fraction = 0.10
hot_replicas = 2
"""


def test_per_table_overrides_are_honoured_from_toml() -> None:
    cfg = loads(SPEC)  # `hot_fraction` under [[tables]] is no longer an unknown key
    cat = cfg.table("category")
    assert (cat.hot_fraction, cat.warm_fraction, cat.column_splits, cat.hot_replicas, cat.cold_replicas) == (0.5, 0.25, 2, 1, 2)
    for placement in ("fractions", "budget"):
        sharding = dataclasses.replace(cfg.sharding, placement=placement)
        plan = plan_tables(cfg.tables, None, sharding).plan
        t = plan.table("category")
        assert (t.hot_ids.size, t.warm_ids.size, t.num_cold) == (500, 250, 250), placement
        assert (t.column_splits, t.hot_replicas, t.cold_replicas) == (2, 1, 2)
    item = plan_tables(cfg.tables, None, cfg.sharding).plan.table("item")  # no overrides: [sharding]'s values
    assert (item.hot_ids.size, item.hot_replicas, item.column_splits) == (1_000, 2, 1)
    with pytest.raises(ConfigError, match=r"tables\[1\]\.hot_fraction = 'half'"):
        loads(SPEC.replace("hot_fraction = 0.5", 'hot_fraction = "half"'))


def test_explicit_per_table_fractions_that_do_not_fit_are_resource_exhausted() -> None:
    t = TableConfig("item", 10_000, 16, hot_fraction=0.5)  # 5,000 rows * 72 bytes on both shards
    with pytest.raises(ResourceExhausted) as e:
        plan_tables([t], None, budget(100_000))
    assert "table 'item'" in str(e.value) and "100,000 bytes available" in str(e.value)


def test_bad_overrides_name_the_table_and_field() -> None:
    with pytest.raises(ConfigError, match=r"tables\.item\.hot_fraction = 1\.5"):
        TableConfig("item", 10, 4, hot_fraction=1.5)
    with pytest.raises(ConfigError, match=r"tables\.item: its overrides \{'hot_replicas': 3\}"):
        plan_tables([TableConfig("item", 10, 4, hot_replicas=3)], None, ShardingConfig(num_shards=2))
    with pytest.raises(ConfigError, match="sharding.placement"):
        ShardingConfig(placement="greedy")


def test_explicit_fractions_are_served_before_optional_whole_copies() -> None:
    # 500 hot ids * 72 bytes on both shards = 36,000 of 100,000 bytes: the demand fits.
    # The 1,000-row table's whole copy (72,000) is optional; it fits only without that
    # demand, so it must not be placed first and leave the demand ResourceExhausted.
    demand = TableConfig("item", 10_000, 16, hot_fraction=0.05, warm_fraction=0.0)
    small = TableConfig("category", 1_000, 16)
    res = plan_tables([demand, small], None, budget(100_000))
    item, cat = res.plan.table("item"), res.plan.table("category")
    assert (item.hot_ids.size, item.warm_ids.size) == (500, 0)
    assert cat.num_cold > 0  # not replicated whole: no room left for a whole copy
    assert int(res.bytes_per_shard["dram"].max()) <= 100_000
