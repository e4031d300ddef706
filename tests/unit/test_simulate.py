"""The capacity simulator's closed forms against the dense estimators on small tables:
``estimate_plan`` (a real plan's router swept over every id), dense numpy sums,
``moved_fraction`` of a real re-plan. Then the 10**9-row case, run with bounded memory."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from recserve.catalog import zipf_weights
from recserve.cli.main import main
from recserve.config.spec import ShardingConfig, TableConfig
from recserve.errors import ConfigError
from recserve.sharding.plan import Tier
from recserve.sharding.planner import plan_tables
from recserve.sharding.replan import moved_fraction, replan_add_shard
from recserve.sharding import simulate as simulate_module
from recserve.sharding.simulate import SimulationInput, expected_max, rank_sum, simulate

ROWS, DIM, ZIPF, SHARDS = 40_000, 64, 1.05, 4


def sim_input(lookups: int, sharding: ShardingConfig, rows: int = ROWS) -> SimulationInput:
    return SimulationInput(rows=rows, dim=DIM, zipf=ZIPF, qps=30.0, ids_per_request=lookups, sharding=sharding)


def dense_plan(sharding: ShardingConfig, lookups: int, seed: int = 0):  # type: ignore[no-untyped-def]
    # Rank == id: the catalog convention (item 0 is the most popular).
    table = TableConfig(name="item", rows=ROWS, dim=DIM)
    return plan_tables([table], {"item": zipf_weights(ROWS, ZIPF)}, sharding, window_lookups=lookups, seed=seed)


@pytest.mark.parametrize("alpha", [0.0, 0.8, 1.05, 1.4])
def test_rank_sums_match_dense_sums_with_the_tail_integrated(alpha: float) -> None:
    rows, lookups = 300_000, 4096
    p = zipf_weights(rows, alpha)
    q = -np.expm1(lookups * np.log1p(-p))
    r = np.arange(1, rows + 1, dtype=np.float64)
    norm = rank_sum(lambda x: x**-alpha, 1, rows, head_ranks=500)  # almost all integrated
    assert norm == pytest.approx(float(np.sum(r**-alpha)), rel=1e-6)

    def q_of(x: np.ndarray) -> np.ndarray:
        return -np.expm1(lookups * np.log1p(-(x**-alpha) / norm))

    for lo, hi in [(1, rows), (3001, 33_000), (33_001, rows)]:
        dense = q[lo - 1 : hi]
        assert rank_sum(q_of, lo, hi, head_ranks=500) == pytest.approx(float(dense.sum()), rel=1e-5)
        assert rank_sum(lambda x: q_of(x) ** 2, lo, hi, head_ranks=500) == pytest.approx(float((dense**2).sum()), rel=1e-5)
    assert rank_sum(q_of, 10, 9) == 0.0


@pytest.mark.parametrize("variant", ["hybrid", "row_only"])
def test_simulator_matches_the_dense_estimator_on_a_small_plan(variant: str) -> None:
    knobs = dict(hot_fraction=0.0, warm_fraction=0.0) if variant == "row_only" else dict(column_splits=2)
    cfg = ShardingConfig(num_shards=SHARDS, hot_replicas=2, **knobs)  # type: ignore[arg-type]
    lookups = 4096
    sim = simulate(sim_input(lookups, cfg))
    est = dense_plan(cfg, lookups).estimate
    # Means over shards are exact sums in both models.
    assert sim["unique_rows_per_shard_per_window"] == pytest.approx(float(est.unique_rows_per_shard.mean()), rel=1e-6)
    q = -np.expm1(lookups * np.log1p(-zipf_weights(ROWS, ZIPF)))
    assert sim["unique_ids_per_window"] == pytest.approx(float(q.sum()), rel=1e-6)
    for tier in ("hot", "warm", "cold", "dram", "rocksdb"):
        assert sim["bytes_per_shard"][tier] == pytest.approx(float(est.bytes_per_shard[tier].mean()), rel=1e-9, abs=1e-6)
    assert sum(sim["traffic_share"].values()) == pytest.approx(1.0, rel=1e-9)
    # Imbalance: the simulator's expectation over hash placements vs this plan's one
    # placement; both are close to 1, so compare the excess over 1.
    assert sim["imbalance"] > 1.0
    assert abs(sim["imbalance"] - est.imbalance) < 0.02


def test_rpc_probability_matches_the_dense_product() -> None:
    """P[a shard gets an RPC in a window] = 1 - (1 - X_s)**L, X_s the chance one draw
    lands on shard s under this plan's real routing (hot: 1/R per replica)."""
    cfg = ShardingConfig(num_shards=SHARDS, hot_replicas=2, column_splits=2)
    lookups = 4  # small windows: many shards get nothing
    sim = simulate(sim_input(lookups, cfg))
    plan = dense_plan(cfg, lookups).plan
    t = plan.table("item")
    p = zipf_weights(ROWS, ZIPF)
    rt = plan.router("item").route(np.arange(ROWS))
    land = np.zeros((ROWS, SHARDS))
    for r in range(t.hot_replicas):
        np.add.at(land, (rt.hot_index, rt.hot_shards[:, r]), 1.0 / t.hot_replicas)
    for k in range(t.column_splits):
        np.add.at(land, (rt.warm_index, rt.warm_shards[:, k]), 1.0)
    np.add.at(land, (rt.cold_index, rt.cold_shards[:, 0]), 1.0)
    dense = 1.0 - (1.0 - p @ land) ** lookups  # [S]
    assert 0.2 < sim["rpc_probability_per_shard_per_window"] < 0.99
    assert sim["rpc_probability_per_shard_per_window"] == pytest.approx(float(dense.mean()), abs=0.01)
    assert sim["rpcs_per_s_per_shard"] == pytest.approx(30.0 * sim["rpc_probability_per_shard_per_window"])


def test_remap_fractions_match_a_real_replan() -> None:
    cfg = ShardingConfig(num_shards=SHARDS, hot_replicas=2, column_splits=2, hot_fraction=0.1, warm_fraction=0.3)
    sim = simulate(sim_input(4096, cfg))["remap_fraction_add_shard"]
    old = dense_plan(cfg, 4096).plan
    new, cold = replan_add_shard(old)
    assert sim["cold"] == pytest.approx(cold, abs=0.01)
    assert sim["hot"] == pytest.approx(moved_fraction(old, new, tier=Tier.HOT), abs=0.03)
    assert sim["warm"] == pytest.approx(moved_fraction(old, new, tier=Tier.WARM), abs=0.03)


def test_expected_max_matches_order_statistics() -> None:
    assert expected_max(np.zeros(2), np.ones(2)) == pytest.approx(1 / np.sqrt(np.pi), abs=1e-4)
    assert expected_max(np.zeros(1), np.ones(1)) == pytest.approx(0.0, abs=1e-4)
    assert expected_max(np.array([1.0, 5.0]), np.zeros(2)) == 5.0
    assert expected_max(np.array([0.0, 100.0]), np.ones(2)) == pytest.approx(100.0, abs=1e-3)


def test_a_billion_rows_on_256_shards_with_bounded_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # Building the 256-shard balanced ring (S * V tokens, no per-row term) is pure-Python
    # heap work that tracemalloc slows 20x; uniform shares keep this test fast.
    monkeypatch.setattr(simulate_module, "RING_SHARES_MAX_TOKENS", 0)
    cfg = ShardingConfig(num_shards=256)
    inp = SimulationInput(rows=10**9, dim=64, zipf=1.05, qps=20_000, ids_per_request=200, window_ms=1.0, sharding=cfg)
    tracemalloc.start()
    try:
        r = simulate(inp)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20  # a dense probs[rows] alone would be 8 GB
    assert 0 < r["unique_ids_per_window"] <= r["lookups_per_window"] == 4000
    assert r["unique_rows_per_shard_per_window"] * 256 == pytest.approx(sum(r["unique_ids_per_window_by_tier"][k] * m for k, m in (("hot", 1), ("warm", 1), ("cold", 1))))
    assert r["imbalance"] > 1.0 and r["remap_fraction_add_shard"]["cold"] == pytest.approx(1 / 257)
    assert r["bytes_per_shard"]["hot"] == pytest.approx(10**7 * 2 / 256 * (64 * 4 + 8))
    assert "tier_sets" in r["routing_memory_bytes"] and "dense_codes" not in r["routing_memory_bytes"]
    json.dumps(r)  # JSON-ready


def test_bad_inputs_name_the_field() -> None:
    with pytest.raises(ConfigError, match="qps = 0"):
        SimulationInput(rows=10, dim=4, zipf=1.0, qps=0, ids_per_request=1, sharding=ShardingConfig())
    with pytest.raises(ConfigError, match="dtype = 'bf16'"):
        SimulationInput(rows=10, dim=4, zipf=1.0, qps=1, ids_per_request=1, sharding=ShardingConfig(), dtype="bf16")


def test_cli_prints_json_and_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "simulate", "--rows", "1e8", "--dim", "64", "--zipf", "1.05", "--shards", "64", "--qps", "1000", "--ids-per-request", "100"]
    assert main(argv + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["inputs"]["rows"] == 10**8 and r["inputs"]["shards"] == 64
    assert r["routing_memory_bytes"]["tier_sets"] == 8 * (10**6 + 10**7)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "routing structures (ring + hot/warm sets)" in out and "RPCs per shard" in out
