"""Trained tables served by real shard processes: remote scoring equals in-process.

A tiny model set is trained on a 5k-item catalog and exported; the export's
``embeddings/`` are bulk-loaded into real shard servers (RocksDB in a temp dir) and read
back through the feature-parallel ``LookupClient``. Oracles: DLRM on pooled remote
embeddings vs torchrec's ``EmbeddingBagCollection`` in process with the same weights;
L3 on unpooled remote history rows vs its in-process lookups; the two-tower user tower
on pooled remote rows. Every shard table reports the export's ``model_version``, and
dense weights of another export are refused naming both versions.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from ranker.export import export_models
from ranker.features import dense_features, sparse_features, user_dense_features
from ranker.models.common import to_tensor
from ranker.models.dlrm import DLRM_FEATURES, DlrmRanker
from ranker.models.l3 import L3Reranker
from ranker.models.two_tower import USER_TOWER_FEATURES, TwoTower
from ranker.scoring import jagged_tensors, user_vectors
from ranker.scrubbed import open_scrubbed
from ranker.serving import Export, check_table_versions, load_model, open_export, versions_from_shard_info
from ranker.spec import tables_and_features
from ranker.train import train_all
from recserve.cluster import ShardCluster
from recserve.config.spec import ShardingConfig
from recserve.errors import FailedPrecondition
from recserve.lookup.client import LookupClient
from recserve.lookup.config import LookupClientConfig
from recserve.sharding import plan_tables
from recserve.v1 import embedding_pb2
from recserve.v1.embedding_pb2_grpc import EmbeddingShardStub
from tests.integration.ranker_world import TINY
from tests.utils_catalog import make_catalog

PAIRS = 96


@dataclasses.dataclass(frozen=True)
class World:
    export: Export
    other_version: str
    config: LookupClientConfig
    plan: Any
    shards: ShardCluster


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("ranker-remote")
    make_catalog(root / "catalog", items=5_000, users=400, impressions=8_000, categories=16, tags=64, history_len=12, candidates=128)
    view = open_scrubbed(root / "catalog")
    manifest = export_models(train_all(view, TINY), view, root / "models")
    # A second run with another seed: the "other training run" whose dense weights must be refused.
    other = export_models(train_all(view, dataclasses.replace(TINY, seed=7)), view, root / "other")
    tables, features = tables_and_features(manifest)
    plan = plan_tables(list(tables), None, ShardingConfig(num_shards=2, hot_fraction=0.01, warm_fraction=0.1, hot_replicas=2, column_splits=2)).plan
    plan.save(root / "plan.json")
    with ShardCluster(root / "plan.json", root / "shards", load_from=root / "models") as shards:
        yield World(open_export(root / "models"), other["model_version"], LookupClientConfig(tables=tables, features=features), plan, shards)


def _pairs(export: Export) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return rng.integers(0, export.arrays.num_users, PAIRS), rng.integers(0, export.arrays.num_items, PAIRS)


def _lookups(world: World, calls: list[tuple[Any, bool]]) -> list[Any]:
    async def go() -> list[Any]:
        client = LookupClient.connect(world.config, world.plan, world.shards.addresses)
        await client.start()
        try:
            return list(await asyncio.gather(*(client.lookup(kjt, pooled=pooled, timeout_s=20.0) for kjt, pooled in calls)))
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_remote_pooled_dlrm_and_unpooled_l3_equal_in_process(world: World) -> None:
    export = world.export
    arrays = export.arrays
    users, items = _pairs(export)
    dense = to_tensor(dense_features(arrays, users, items), torch.device("cpu"))
    dlrm = load_model(export, "dlrm", device="cpu", with_tables=True)
    l3 = load_model(export, "l3", device="cpu", with_tables=True)
    tt = load_model(export, "two_tower", device="cpu", with_tables=True)
    assert isinstance(dlrm, DlrmRanker) and isinstance(l3, L3Reranker) and isinstance(tt, TwoTower)
    dlrm_kjt = sparse_features(arrays, DLRM_FEATURES, users, items).kjt()
    l3_pooled = sparse_features(arrays, l3.pooled_features, users, items)
    l3_rows = sparse_features(arrays, l3.unpooled_features, users, items)
    tt_kjt = sparse_features(arrays, USER_TOWER_FEATURES, users, users).kjt()
    r_dlrm, r_l3p, r_l3u, r_tt = _lookups(world, [(dlrm_kjt, True), (l3_pooled.kjt(), True), (l3_rows.kjt(), False), (tt_kjt, True)])
    assert not any(r.degraded for r in (r_dlrm, r_l3p, r_l3u, r_tt))
    with torch.no_grad():
        # DLRM: torchrec's EBC in process vs the pooled remote lookup, same weights.
        local = dlrm(dense, dlrm_kjt)
        remote = dlrm.score_pooled(dense, r_dlrm.pooled.to_dict())
        assert local.shape == (PAIRS,) and local.std() > 0
        torch.testing.assert_close(remote, local, rtol=1e-5, atol=1e-5)
        # L3: pooled candidate rows plus *unpooled* history rows from the shards.
        local3 = l3(jagged_tensors(sparse_features(arrays, l3.pooled_features + l3.unpooled_features, users, items), torch.device("cpu")), dense)
        remote3 = l3.score_looked_up(r_l3p.pooled.to_dict(), r_l3u.rows, r_l3u.lengths["l3_history_items"], dense)
        assert int(r_l3u.lengths["l3_history_items"].max()) == 6
        torch.testing.assert_close(remote3, local3, rtol=1e-5, atol=1e-5)
        # Two-tower user tower on pooled remote history rows.
        remote_u = tt.user_from_pooled(r_tt.pooled.to_dict(), to_tensor(user_dense_features(arrays, users), torch.device("cpu")))
        torch.testing.assert_close(remote_u, user_vectors(tt, arrays, users), rtol=1e-5, atol=1e-5)
        # The remote path really used the shards' rows: zeroed local tables score differently.
        blank = load_model(export, "dlrm", device="cpu")
        assert not torch.allclose(blank(dense, dlrm_kjt), remote, atol=1e-4)


def _shard_infos(world: World) -> list[Any]:
    out = []
    for address in world.shards.addresses:
        with grpc.insecure_channel(address) as ch:
            out.append(EmbeddingShardStub(ch).ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=10))
    return out


def test_shards_report_the_export_version_and_mismatch_is_refused(world: World) -> None:
    infos = _shard_infos(world)
    versions = versions_from_shard_info(infos)
    assert set(versions) == set(world.export.table_names())
    assert set(versions.values()) == {world.export.model_version}
    with grpc.insecure_channel(world.shards.address(0)) as ch:
        plan_reply = EmbeddingShardStub(ch).GetPlan(embedding_pb2.GetPlanRequest(), timeout=10)
    assert dict(plan_reply.table_model_versions) == {t: world.export.model_version for t in world.plan.tables}
    check_table_versions(world.export.model_version, versions, world.export.table_names())
    assert world.other_version != world.export.model_version
    with pytest.raises(FailedPrecondition) as err:
        check_table_versions(world.other_version, versions, world.export.table_names())
    assert world.other_version in str(err.value) and world.export.model_version in str(err.value)
