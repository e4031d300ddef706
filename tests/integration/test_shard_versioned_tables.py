"""Two model versions side by side on real shard processes (model rollout, issue 11).

Two fake exports (``embeddings/`` only, ``tests.unit.test_ranker_rollout.make_export``)
are staged into one load source (:func:`ranker.rollout.stage_exports`: version A under
plain names, version B prefixed), planned together and bulk-loaded by real shard servers
(RocksDB in a temp dir). Every shard reports each table's own ``model_version``; the
served names of each version follow from those reports; and a ``LookupClient`` reads
both versions' rows, through the renamed features of B, exactly as exported.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ranker.rollout import StagedSource, rename_features, served_table_names, stage_exports
from ranker.serving import versions_from_shard_info
from recserve.cluster import ShardCluster
from recserve.config.spec import ShardingConfig, ShardServerConfig
from recserve.lookup.client import LookupClient
from recserve.lookup.config import LookupClientConfig
from recserve.sharding import plan_tables
from recserve.sharding.plan import ShardingPlan
from recserve.v1 import embedding_pb2
from recserve.v1.embedding_pb2_grpc import EmbeddingShardStub
from tests.unit.test_ranker_rollout import FEATURES, PREFIX_B, SHAPES, VERSION_A, VERSION_B, make_export

pytestmark = pytest.mark.integration


class World:
    def __init__(self, staged: StagedSource, plan: ShardingPlan, shards: ShardCluster, arrays: dict[str, dict[str, np.ndarray]]) -> None:
        self.staged, self.plan, self.shards, self.arrays = staged, plan, shards, arrays


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("versioned-tables")
    arrays = {VERSION_A: make_export(root / "a", VERSION_A, seed=1), VERSION_B: make_export(root / "b", VERSION_B, seed=2)}
    staged = stage_exports([root / "a", root / "b"], root / "staged")
    # Hot, warm (column-split) and cold tiers on both shards, so every read path serves the prefixed tables.
    sharding = ShardingConfig(num_shards=2, hot_fraction=0.1, warm_fraction=0.3, hot_replicas=2, column_splits=2)
    plan = plan_tables(list(staged.tables), None, sharding).plan
    plan.save(root / "plan.json")
    with ShardCluster(root / "plan.json", root / "data", load_from=staged.path, server=ShardServerConfig(threads=1, row_cache_bytes=1 << 20)) as shards:
        yield World(staged, plan, shards, arrays)


def _shard_infos(world: World) -> list[Any]:
    out = []
    for address in world.shards.addresses:
        with grpc.insecure_channel(address) as ch:
            out.append(EmbeddingShardStub(ch).ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=10))
    return out


def test_every_shard_reports_each_tables_own_version(world: World) -> None:
    infos = _shard_infos(world)
    assert len(infos) == 2
    for info in infos:  # each shard, not only the merged view
        assert {t.table: t.model_version for t in info.tables} == world.staged.model_versions
    reported = versions_from_shard_info(infos)
    assert reported == {"dlrm_item": VERSION_A, "dlrm_user": VERSION_A, PREFIX_B + "dlrm_item": VERSION_B, PREFIX_B + "dlrm_user": VERSION_B}
    with grpc.insecure_channel(world.shards.address(1)) as ch:
        plan_reply = EmbeddingShardStub(ch).GetPlan(embedding_pb2.GetPlanRequest(), timeout=10)
    assert dict(plan_reply.table_model_versions) == reported
    assert served_table_names(SHAPES, VERSION_A, reported) == {"dlrm_item": "dlrm_item", "dlrm_user": "dlrm_user"}
    assert served_table_names(SHAPES, VERSION_B, reported) == {"dlrm_item": PREFIX_B + "dlrm_item", "dlrm_user": PREFIX_B + "dlrm_user"}


def test_lookup_reads_both_versions_rows_exactly(world: World) -> None:
    reported = versions_from_shard_info(_shard_infos(world))
    features_b = rename_features(FEATURES, served_table_names(SHAPES, VERSION_B, reported))
    config = LookupClientConfig(tables=world.staged.tables, features=FEATURES + features_b)
    # One bag per feature holding every id of its table, in a shuffled order.
    rng = np.random.default_rng(0)
    features = FEATURES + features_b
    ids = [rng.permutation(SHAPES[f.table.removeprefix(PREFIX_B)][0]) for f in features]
    kjt = KeyedJaggedTensor(
        keys=[f.name for f in features], values=torch.from_numpy(np.concatenate(ids)), lengths=torch.tensor([len(i) for i in ids], dtype=torch.int64)
    )

    async def go() -> Any:
        client = LookupClient.connect(config, world.plan, world.shards.addresses)
        await client.start()
        try:
            return await client.lookup(kjt, pooled=False, timeout_s=20.0)
        finally:
            await client.aclose()

    result = asyncio.run(go())
    assert result.missing == 0 and result.not_found == 0
    for f, f_ids in zip(features, ids):
        version = VERSION_B if f.name.startswith(PREFIX_B) else VERSION_A
        want = world.arrays[version][f.table.removeprefix(PREFIX_B)][f_ids]
        got = result.rows[f.name].numpy()
        assert got.shape == want.shape and np.array_equal(got, want), f.name
