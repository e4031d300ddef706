"""A deep check's epoch sees a shard restart (issue 17): ``ShardInfo.upserts`` restarts
at 0 with the process while the rows it counted survive in RocksDB, so upserts followed
by a restart read the same count as before them. ``instance_id``, drawn at each start,
makes ``shard_upserts`` (the epoch part the ranker's and the cascade's deep checks use)
differ. Found by ``recserve bench faults``: after fault 5 (upserts, then SIGKILL of
their shards) both rankers' deep checks failed under an unchanged epoch and turned
NOT_SERVING, and every later answer was degraded."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from recserve.cluster import ShardCluster
from recserve.rpc.health import shard_upserts
from recserve.rpc.tensors import pack
from recserve.v1 import embedding_pb2
from recserve.v1.embedding_pb2_grpc import EmbeddingShardStub
from tests.integration.conftest import ADMIN_TOKEN, ShardWorld, channel

pytestmark = pytest.mark.integration


def test_upserts_then_a_restart_change_the_shards_epoch(shard_world: ShardWorld, shard_cluster: ShardCluster) -> None:
    before = asyncio.run(shard_upserts(shard_cluster.addresses))
    assert before is not None and all(len(iid) == 16 for iid, _ in before) and len({iid for iid, _ in before}) == len(before)
    table = shard_world.plan.table("category")
    ids = np.asarray(shard_world.plan.assignment(0, "category").cold_ids[:3], np.int64)  # rows shard 0 owns
    assert ids.size == 3
    req = embedding_pb2.UpsertRequest()
    req.tables.add(table="category", ids=pack(ids), rows=pack(np.ones((ids.size, table.dim), np.float32)))
    with channel(shard_cluster.address(0)) as ch:
        EmbeddingShardStub(ch).Upsert(req, timeout=30, metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),))
    after_upsert = asyncio.run(shard_upserts(shard_cluster.addresses))
    assert after_upsert is not None and after_upsert[0][1] > before[0][1]
    shard_cluster.restart(0)  # the count starts again at 0; the rows are still there
    after_restart = asyncio.run(shard_upserts(shard_cluster.addresses))
    assert after_restart is not None
    assert after_restart[0][1] == 0 and after_restart[1:] == before[1:]  # the count alone would read "unchanged" if before was 0
    assert after_restart[0][0] != before[0][0] and after_restart != before  # the instance id says it changed
