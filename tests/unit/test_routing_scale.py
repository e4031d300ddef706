"""The routing scale limit: beyond ``dense_route_max_rows`` routing keeps nothing per
row of the table (ring arithmetic + the plan's sorted hot / warm sets), a shard's index
is sized to the rows it owns, and the closed-form sizes the simulator prints equal what
the built structures hold."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from embedding_server.layout import TableLayout, WarmSlice
from embedding_server.quant import RowDType
from embedding_server.store import RowStore
from embedding_server.table import Residence, TableTiers
from recserve.config.spec import ShardingConfig
from recserve.errors import ConfigError
from recserve.sharding.plan import ShardingPlan, TablePlan, Tier
from recserve.sharding.router import DENSE_MAP_MAX_ROWS, routing_memory_bytes
from recserve.sharding.simulate import SimulationInput, index_bytes, simulate

BIG = 10**8


def big_plan(rows: int = BIG, dense_route_max_rows: int = DENSE_MAP_MAX_ROWS) -> ShardingPlan:
    """A 10**8-row table with small tiers: only the plan's own id arrays are per-id."""
    hot = np.arange(0, min(rows, 3000), 3, dtype=np.int64)
    warm = np.arange(1, min(rows, 30_000), 3, dtype=np.int64)
    table = TablePlan(name="item", rows=rows, dim=16, hot_ids=hot, warm_ids=warm, hot_replicas=2, column_splits=2, cold_replicas=2)
    return ShardingPlan(version=1, num_shards=8, tables={"item": table}, virtual_nodes=16, dense_route_max_rows=dense_route_max_rows)


def test_a_1e8_row_router_allocates_nothing_per_row() -> None:
    plan = big_plan()
    ids = np.random.default_rng(1).integers(0, BIG, 4096)
    ids[:50] = plan.table("item").hot_ids[:50]
    ids[50:100] = plan.table("item").warm_ids[:50]
    tracemalloc.start()
    try:
        router = plan.router("item")
        router.prepare()
        routes = router.route(ids)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # The dense map would be 200 MB, the former 2-bit tier map 25 MB.
    assert not router.dense and peak < 4 << 20
    assert (routes.tier[:50] == Tier.HOT).all() and (routes.tier[50:100] == Tier.WARM).all()
    assert router.tier_of(np.array([2, 3, 29_999, BIG - 1])).tolist() == [Tier.COLD, Tier.HOT, Tier.COLD, Tier.COLD]


def test_compact_and_dense_routing_agree_on_every_id() -> None:
    rows = 20_000
    dense = big_plan(rows)
    compact = ShardingPlan.from_json(big_plan(rows, dense_route_max_rows=0).to_json())  # the setting travels in the JSON
    assert dense.router("item").dense and not compact.router("item").dense
    assert dense == compact  # a routing-structure choice, not a different plan
    ids = np.arange(rows)
    a, b = dense.router("item").route(ids), compact.router("item").route(ids)
    for field in ("tier", "hot_index", "hot_shards", "warm_index", "warm_shards", "cold_index", "cold_shards"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    for shard in range(dense.num_shards):
        assert np.array_equal(dense.router("item").owned_cold_ids(shard), compact.router("item").owned_cold_ids(shard))
        assert np.array_equal(dense.router("item").owns(shard, ids, 1), compact.router("item").owns(shard, ids, 1))


def test_dense_route_max_rows_is_validated_and_defaults_from_the_spec() -> None:
    assert ShardingConfig().dense_route_max_rows == DENSE_MAP_MAX_ROWS
    with pytest.raises(ConfigError, match="sharding.dense_route_max_rows"):
        ShardingConfig(dense_route_max_rows=-1)
    with pytest.raises(ConfigError, match="dense_route_max_rows = -5"):
        big_plan(100, dense_route_max_rows=-5)


@pytest.mark.parametrize("max_rows", [0, DENSE_MAP_MAX_ROWS])
def test_closed_form_routing_memory_equals_the_built_router(max_rows: int) -> None:
    plan = big_plan(30_000, dense_route_max_rows=max_rows)
    router = plan.router("item")
    router.prepare()
    built = router.memory_bytes()
    t = plan.table("item")
    closed = routing_memory_bytes(
        rows=t.rows, hot_ids=t.hot_ids.size, warm_ids=t.warm_ids.size, num_shards=plan.num_shards, virtual_nodes=plan.virtual_nodes,
        hot_replicas=t.hot_replicas, column_splits=t.column_splits, cold_replicas=t.cold_replicas, dense_max_rows=max_rows,
    )  # fmt: skip
    assert closed.pop("total") == sum(built.values())
    assert closed == built


def test_1e8_row_routing_memory_from_closed_form_sizes_and_in_the_simulator() -> None:
    """1 % hot, 10 % warm on 64 shards: 88 MB of tier sets (the plan's own arrays) +
    the ring, against 200 MB for a dense map; nothing grows with the table beyond them."""
    knobs = dict(hot_ids=10**6, warm_ids=10**7, num_shards=64, virtual_nodes=64, hot_replicas=2, column_splits=1, cold_replicas=1)
    mem = routing_memory_bytes(rows=BIG, **knobs)
    assert mem["tier_sets"] == 88_000_000 and "dense_codes" not in mem
    assert mem["total"] - mem["tier_sets"] < 2 << 20  # ring + position tables
    assert routing_memory_bytes(rows=10 * BIG, **knobs) == mem  # no per-row term
    assert routing_memory_bytes(rows=BIG, **knobs, dense_max_rows=BIG)["dense_codes"] == 2 * BIG
    cfg = ShardingConfig(num_shards=64, hot_replicas=2, column_splits=1)
    r = simulate(SimulationInput(rows=BIG, dim=64, zipf=1.05, qps=1000, ids_per_request=100, sharding=cfg))
    assert r["routing_memory_bytes"] == mem
    # The shard side: 13 B per owned row + 4 B per owned cold row, not 9 B per table row.
    owned = r["owned_rows_per_shard"]
    assert owned == pytest.approx((10**6 * 2 + 10**7 + 89 * 10**6) / 64)
    assert r["shard_index_bytes_per_shard"]["total"] < r["landed_per_row_bytes"]["shard_index_per_shard"] / 20


def test_a_shard_index_is_sized_to_the_rows_it_owns(tmp_path: Path) -> None:
    rows, dim = 2 * 10**7, 8
    layout = TableLayout(
        name="item", rows=rows, dim=dim,
        hot_ids=np.arange(0, 1000, 10, dtype=np.int64),
        warm=(WarmSlice(index=1, col_start=4, col_end=8, ids=np.arange(5, 3000, 10, dtype=np.int64)),),
        cold_ids=np.arange(7, rows, 4999, dtype=np.int64)[:4000],
    )  # fmt: skip
    store = RowStore(tmp_path / "db", {"item": dim})
    try:
        tracemalloc.start()
        try:
            tiers = TableTiers(layout, store, dtype=RowDType.FLOAT32, cache_bytes=1 << 16)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        # A map over the id space (code u8 + slot i32 + cache i32) would be 180 MB.
        assert peak < 2 << 20
        assert tiers.index_bytes == index_bytes(100 + 300, len(layout.cold_ids))["total"]
        ids = np.array([10, 15, int(layout.cold_ids[5]), 11, rows - 1])
        codes, _ = tiers.residence(ids)
        assert codes.tolist() == [Residence.HOT, Residence.WARM0, Residence.COLD, Residence.NOT_OWNED, Residence.NOT_OWNED]
        result = tiers.lookup(ids, 0, dim, RowDType.FLOAT32)  # nothing loaded: owned -> default rows
        assert result.not_owned.tolist() == [0, 1, 0, 1, 1]  # warm slice 1 cannot serve the full row
    finally:
        store.close()
