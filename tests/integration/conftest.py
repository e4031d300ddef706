"""Fixtures for integration tests on real shard processes over loopback.

``shard_world`` builds a small two-table world once per module: a plan from the real
planner (``item`` 4000 × 32 with Zipf access, 2-way column split; ``category`` 600 × 16,
no split), the source arrays (the test oracle), saved as ``<table>.npy``.
``shard_cluster`` runs all 3 shards of it with the fault hook on and an admin token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from recserve.cluster import ShardCluster
from recserve.config.spec import ShardingConfig, ShardServerConfig, TableConfig
from recserve.sharding.plan import ShardingPlan
from recserve.sharding.planner import plan_table
from recserve.v1.embedding_pb2_grpc import EmbeddingShardStub

NUM_SHARDS = 3
ADMIN_TOKEN = "test-admin-token"
MAX_IDS_PER_RPC = 8192
MAX_MESSAGE_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class ShardWorld:
    root: Path
    plan: ShardingPlan
    plan_path: Path
    source_dir: Path
    sources: dict[str, np.ndarray]  # table -> fp32 [rows, dim]: the oracle


def make_world(root: Path, seed: int = 0) -> ShardWorld:
    rng = np.random.default_rng(seed)
    item, category = TableConfig(name="item", rows=4000, dim=32), TableConfig(name="category", rows=600, dim=16, pooling="mean")
    zipf = 1.0 / np.arange(1, item.rows + 1) ** 1.05
    freq = zipf[rng.permutation(item.rows)]  # popular ids scattered over the id space
    base = ShardingConfig(num_shards=NUM_SHARDS, hot_fraction=0.01, warm_fraction=0.10, hot_replicas=2)
    tables = {
        "item": plan_table(item, freq / freq.sum(), dataclasses.replace(base, column_splits=2)),
        "category": plan_table(category, None, dataclasses.replace(base, column_splits=1)),
    }
    plan = ShardingPlan(version=1, num_shards=NUM_SHARDS, tables=tables)
    root.mkdir(parents=True, exist_ok=True)
    plan_path = root / "plan.json"
    plan.save(plan_path)
    source_dir = root / "source"
    source_dir.mkdir(exist_ok=True)
    sources = {t.name: rng.standard_normal((t.rows, t.dim)).astype(np.float32) for t in (item, category)}
    for name, array in sources.items():
        np.save(source_dir / f"{name}.npy", array)
    return ShardWorld(root=root, plan=plan, plan_path=plan_path, source_dir=source_dir, sources=sources)


def server_config(**overrides: int) -> ShardServerConfig:
    base = ShardServerConfig(max_ids_per_rpc=MAX_IDS_PER_RPC, row_cache_bytes=256 << 10, max_message_bytes=MAX_MESSAGE_BYTES, threads=1)
    return dataclasses.replace(base, **overrides)


def channel(address: str) -> grpc.Channel:
    """A client channel with the raised message limits (both directions)."""
    return grpc.insecure_channel(
        address, options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    )


@pytest.fixture(scope="module")
def shard_world(tmp_path_factory: pytest.TempPathFactory) -> ShardWorld:
    return make_world(tmp_path_factory.mktemp("shard-world"))


@pytest.fixture(scope="module")
def shard_cluster(shard_world: ShardWorld) -> Iterator[ShardCluster]:
    cluster = ShardCluster(
        shard_world.plan_path, shard_world.root / "data", server=server_config(), load_from=shard_world.source_dir, fault_hook=True, admin_token=ADMIN_TOKEN
    )
    with cluster:
        yield cluster


@pytest.fixture(scope="module")
def shard_stubs(shard_cluster: ShardCluster) -> Iterator[list[EmbeddingShardStub]]:
    channels = [channel(a) for a in shard_cluster.addresses]
    yield [EmbeddingShardStub(c) for c in channels]
    for c in channels:
        c.close()
