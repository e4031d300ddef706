"""A re-plan that keeps upserts: load, upsert through real shards, re-plan to one more
shard, ``recserve shard migrate`` offline, start the new shards without ``--load-from``
and read every upserted row back through the real ``LookupClient``. (Re-runs, overwrite
refusals and re-cut warm slices are covered in tests/unit/test_embedding_migrate.py.)

The oracle is the source arrays with the upserted rows written over them.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recserve.cluster.shards import REPO_ROOT, ShardCluster
from recserve.config.spec import ShardServerConfig
from recserve.lookup.client import LookupClient
from recserve.lookup.types import LookupResult
from recserve.sharding.plan import ShardingPlan, Tier
from recserve.sharding.replan import replan_add_shard
from tests.unit.test_lookup_fakes import FEATURES, make_config, make_plan, make_weights, tier_ids

pytestmark = pytest.mark.integration

FEATURE_OF = {"item": "item_id", "wide": "wide_tag", "user": "user_id"}  # one feature per table
SERVER = ShardServerConfig(threads=1, row_cache_bytes=1 << 20)


def moved(old: ShardingPlan, new: ShardingPlan, table: str, ids: np.ndarray, tier: Tier) -> np.ndarray:
    """bool [N]: the id's owners differ between the plans."""
    ro, rn = old.router(table), new.router(table)
    if tier is Tier.HOT:
        return (np.sort(ro.hot_replicas_of(ids), axis=1) != np.sort(rn.hot_replicas_of(ids), axis=1)).any(axis=1)  # type: ignore[no-any-return]
    if tier is Tier.WARM:
        return (ro.warm_shards_of(ids) != rn.warm_shards_of(ids)).any(axis=1)  # type: ignore[no-any-return]
    return ro.cold_owners_of(ids)[:, 0] != rn.cold_owners_of(ids)[:, 0]  # type: ignore[no-any-return]


def upsert_ids(old: ShardingPlan, new: ShardingPlan) -> dict[str, np.ndarray]:
    """Per table: hot, warm and cold ids, mostly ones the re-plan moves."""
    out = {}
    for table in FEATURE_OF:
        picks = []
        for tier in (Tier.HOT, Tier.WARM, Tier.COLD):
            ids = tier_ids(old, table, tier)
            m = moved(old, new, table, ids, tier)
            picks += [ids[m][:3], ids[~m][:1]]
        out[table] = np.sort(np.concatenate(picks))
    return out


def kjt(ids: dict[str, np.ndarray]) -> KeyedJaggedTensor:
    """One example, one bag per table's feature."""
    keys = [FEATURE_OF[t] for t in ids]
    return KeyedJaggedTensor(
        keys=keys, values=torch.from_numpy(np.concatenate(list(ids.values()))), lengths=torch.tensor([len(v) for v in ids.values()])
    )


async def read(plan: ShardingPlan, addresses: list[str], ids: dict[str, np.ndarray]) -> LookupResult:
    async with LookupClient.connect(make_config(), plan, addresses) as client:
        return await client.lookup(kjt(ids), pooled=False, timeout_s=30)


def migrate_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "recserve", "shard", "migrate", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_migrate_to_one_more_shard_keeps_every_upsert(tmp_path: Path) -> None:
    assert {f.table for f in FEATURES} == set(FEATURE_OF)
    old, _ = make_plan()
    new, _ = replan_add_shard(old)
    old.save(tmp_path / "plan-v1.json")
    new.save(tmp_path / "plan-v2.json")
    weights = make_weights()
    np.savez(tmp_path / "weights.npz", **weights)  # type: ignore[arg-type]
    ids = upsert_ids(old, new)
    rng = np.random.default_rng(5)
    rows = {t: rng.standard_normal((len(v), weights[t].shape[1])).astype(np.float32) + 20 for t, v in ids.items()}
    args = ["--from-plan", str(tmp_path / "plan-v1.json"), "--to-plan", str(tmp_path / "plan-v2.json"), "--from-data", str(tmp_path / "old"), "--to-data", str(tmp_path / "new"), "--json"]

    with ShardCluster(tmp_path / "plan-v1.json", tmp_path / "old", load_from=tmp_path / "weights.npz", server=SERVER, insecure_admin=True) as cluster:

        async def upsert_all() -> None:
            async with LookupClient.connect(make_config(), old, cluster.addresses) as client:
                for table in ids:  # to every owner: hot replicas, warm slices, cold owner
                    await client.upsert(table, ids[table], rows[table], timeout_s=10)

        asyncio.run(upsert_all())
        busy = migrate_cli(*args)  # the shards still run: refused, clearly
        assert busy.returncode == 2 and "is already open (a running shard?)" in busy.stderr, busy.stderr[-2000:]

    first = migrate_cli(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout)
    assert summary["from_plan_version"] == 1 and summary["to_plan_version"] == 2 and len(summary["rows_written"]) == 4
    assert summary["carried_upserts"] >= 3 and summary["ids_incomplete"] == {t: 0 for t in ids}

    untouched = {t: np.setdiff1d(rng.choice(weights[t].shape[0], 200, replace=False), ids[t]) for t in ids}
    with ShardCluster(tmp_path / "plan-v2.json", tmp_path / "new", server=SERVER) as cluster:  # no --load-from
        assert cluster.num_shards == 4
        got = asyncio.run(read(new, cluster.addresses, ids))
        base = asyncio.run(read(new, cluster.addresses, untouched))
    assert (got.missing, got.not_found, base.missing, base.not_found) == (0, 0, 0, 0)  # every row stored, every owner up
    for table, feature in FEATURE_OF.items():
        assert torch.equal(got.rows[feature], torch.from_numpy(rows[table])), table
        assert torch.equal(base.rows[feature], torch.from_numpy(weights[table][untouched[table]])), table
