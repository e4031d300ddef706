"""The lean window parts: dense dedup, the near cache over a table without hot ids, and
the transport settings the launcher passes to shard processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from recserve.config.spec import POLL_IO_EXPERIMENTS, LookupConfig
from recserve.errors import ConfigError
from recserve.lookup.client import LookupClient
from recserve.lookup.transport import channel_options, transport_env
from recserve.lookup.window import dedup
from tests.unit.test_lookup_client import item_kjt
from tests.unit.test_lookup_fakes import FakeShards, make_config, make_plan, make_weights


@pytest.mark.parametrize("rows, n", [(200_000, 4_096), (200_000, 64), (100_000, 3), (1_000, 10), (50, 5_000), (10**9, 100), (1, 7)])
def test_dedup_matches_np_unique_on_either_path(rows: int, n: int) -> None:
    rng = np.random.default_rng(rows + n)
    ids = (rng.zipf(1.2, n) % rows).astype(np.int64)
    want_u, want_inv = np.unique(ids, return_inverse=True)
    for _ in range(2):  # the reused scratch is clean after a window
        u, inv = dedup(ids, rows)
        assert u.dtype == np.int64 and inv.dtype == np.int64
        assert np.array_equal(u, want_u) and np.array_equal(inv, want_inv.reshape(-1))
        assert np.array_equal(u[inv], ids)
    other = (rng.zipf(1.1, n) % rows).astype(np.int64)  # a later window over the dirty scratch
    u, inv = dedup(other, rows)
    want_u, want_inv = np.unique(other, return_inverse=True)
    assert np.array_equal(u, want_u) and np.array_equal(inv, want_inv.reshape(-1))
    u, inv = dedup(np.zeros(0, dtype=np.int64), rows)
    assert u.size == 0 and inv.size == 0


def test_near_cache_over_a_plan_without_hot_ids_serves_every_window() -> None:
    # A cold-only plan (hot_fraction 0) leaves the near cache nothing to hold; with
    # near_cache_rows > 0 every window used to fail putting its (0, 0) "cached rows".
    plan, _ = make_plan(hot_fraction=0.0, warm_fraction=0.0, hot_replicas=1)
    weights = make_weights()
    fake = FakeShards(plan, weights)
    client = LookupClient(make_config(lookup=LookupConfig(near_cache_rows=16)), plan, fake)
    ids = np.array([3, 7, 7, 11])

    async def body() -> np.ndarray:
        await client.start()
        try:
            result = await client.lookup(item_kjt(ids), pooled=False, timeout_s=5.0)
        finally:
            await client.aclose()
        assert not result.degraded
        return result.rows["item_id"].numpy()

    assert np.array_equal(asyncio.run(body()), weights["item"][ids])


def test_transport_settings_become_process_env_and_channel_options() -> None:
    assert transport_env(LookupConfig(grpc_experiments="", shard_malloc_mmap_threshold_bytes=0)) == {}
    assert set(transport_env(LookupConfig())) == {"GRPC_EXPERIMENTS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}  # measured defaults
    env = transport_env(LookupConfig(grpc_experiments="-event_engine_client,-event_engine_listener", shard_malloc_mmap_threshold_bytes=1 << 22))
    assert env == {
        "GRPC_EXPERIMENTS": "-event_engine_client,-event_engine_listener",
        "MALLOC_MMAP_THRESHOLD_": str(1 << 22),
        "MALLOC_TRIM_THRESHOLD_": str(1 << 22),
    }
    assert ("grpc.http2.max_frame_size", 1 << 20) in channel_options(1 << 26, max_frame_bytes=1 << 20)
    assert not any(k == "grpc.http2.max_frame_size" for k, _ in channel_options(1 << 26))
    with pytest.raises(ConfigError, match="lookup.grpc_experiments"):
        LookupConfig(grpc_experiments="x;rm -rf")
    with pytest.raises(ConfigError, match="lookup.http2_max_frame_bytes = 100"):
        LookupConfig(http2_max_frame_bytes=100)


def test_launcher_default_transport_settings_do_not_inherit_the_parents_exports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The docs tell the client's process to export GRPC_EXPERIMENTS; shards launched from
    # it with grpc_experiments = "" and 0 must still get gRPC's and glibc's defaults.
    from recserve.cluster.shards import ShardCluster

    monkeypatch.setenv("GRPC_EXPERIMENTS", POLL_IO_EXPERIMENTS)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "123")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "123")
    defaults = transport_env(LookupConfig(grpc_experiments="", shard_malloc_mmap_threshold_bytes=0))
    env = ShardCluster(tmp_path / "plan.json", tmp_path / "data", num_shards=1, env=defaults)._env()  # builds, starts nothing
    assert not {"GRPC_EXPERIMENTS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(env)
    tuned = ShardCluster(tmp_path / "plan.json", tmp_path / "data", num_shards=1, env=transport_env(LookupConfig(shard_malloc_mmap_threshold_bytes=1 << 22)))._env()
    assert (tuned["GRPC_EXPERIMENTS"], tuned["MALLOC_MMAP_THRESHOLD_"]) == (POLL_IO_EXPERIMENTS, str(1 << 22))
    # Without transport settings the launcher leaves the inherited environment alone.
    assert ShardCluster(tmp_path / "plan.json", tmp_path / "data", num_shards=1)._env()["GRPC_EXPERIMENTS"] == POLL_IO_EXPERIMENTS


def test_the_equal_memory_budget_counts_the_near_caches_dense_id_map() -> None:
    """The near cache's id -> slot map (int16 over the table's ids) is client memory
    like its rows: the shards' budget shrinks by it, so recserve never holds more than
    Redis's used_memory."""
    from recserve.bench.lookup_capacity import NEAR_CACHE_ROW_OVERHEAD_BYTES, split_budget
    from recserve.lookup.near_cache import NearCache

    rows_only = split_budget(100 << 20, 2, near_cache_rows=2000, dim=64, block_cache_bytes=1 << 20)
    with_map = split_budget(100 << 20, 2, near_cache_rows=2000, dim=64, block_cache_bytes=1 << 20, id_space=200_000)
    assert rows_only.near_cache_bytes == 2000 * (64 * 4 + NEAR_CACHE_ROW_OVERHEAD_BYTES)
    assert with_map.near_cache_bytes == rows_only.near_cache_bytes + (200_000 + 3) * 2
    assert with_map.shard_memory_bytes < rows_only.shard_memory_bytes
    # The bound holds for the real cache: its map spans at most the table's ids.
    cache = NearCache({"item": (np.array([5, 199_999], dtype=np.int64), 64)}, staleness_s=1.0)
    held = cache._tables["item"].slot_of
    assert held is not None and held.nbytes <= (200_000 + 3) * 2
