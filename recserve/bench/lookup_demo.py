"""A small end-to-end lookup through the feature-parallel client, for ``make demo``.

Starts a few real shard processes on loopback, sends many concurrent callers' lookups
(two features sharing one table, Zipf ids) through :class:`LookupClient`, checks the
pooled output against TorchRec's ``EmbeddingBagCollection`` on the same weights and
returns (and prints) one summary line with the dedup ratio. Call it from the demo
command: ``from recserve.bench.lookup_demo import demo_lookup; demo_lookup()``.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def demo_lookup(*, items: int = 20_000, dim: int = 32, shards: int = 3, callers: int = 48, ids_per_feature: int = 16, zipf: float = 1.05, seed: int = 0, quiet: bool = False) -> dict[str, Any]:
    """Run the demo; returns its figures (``dedup_ratio``, ``windows``, ``rpcs``, ...)."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recserve.catalog.items import make_popularity
    from recserve.catalog.zipf import PopularitySampler
    from recserve.cluster.shards import ShardCluster
    from recserve.config.spec import FeatureConfig, ShardingConfig, ShardServerConfig, TableConfig
    from recserve.lookup.client import LookupClient
    from recserve.lookup.config import LookupClientConfig
    from recserve.sharding.planner import plan_tables

    rng = np.random.default_rng(seed)
    popularity, order = make_popularity(rng, items, zipf)
    weights = rng.standard_normal((items, dim), dtype=np.float32)
    table = TableConfig("item", rows=items, dim=dim)
    features = (FeatureConfig("item_id", "item"), FeatureConfig("history", "item"))
    plan = plan_tables([table], {"item": popularity}, ShardingConfig(num_shards=shards, hot_replicas=min(2, shards)), seed=seed).plan
    sampler = PopularitySampler(popularity, order)
    lengths = np.full(2, ids_per_feature // 2, dtype=np.int64)  # 2 examples per feature
    kjts = [
        KeyedJaggedTensor(
            keys=["item_id", "history"],
            values=torch.from_numpy(sampler.sample(2 * int(lengths.sum()), rng)),
            lengths=torch.from_numpy(np.tile(lengths, 2)),
        )
        for _ in range(callers)
    ]
    workdir = Path(tempfile.mkdtemp(prefix="recserve-demo-lookup-"))
    try:
        np.save(workdir / "item.npy", weights)
        plan.save(workdir / "plan.json")
        with ShardCluster(workdir / "plan.json", workdir / "data", load_from=workdir, server=ShardServerConfig(threads=1)) as cluster:

            async def go() -> tuple[list[Any], Any]:
                client = LookupClient.connect(LookupClientConfig(tables=(table,), features=features), plan, cluster.addresses)
                await client.start()
                try:
                    results = await asyncio.gather(*(client.lookup(k, pooled=True, timeout_s=5.0) for k in kjts))
                finally:
                    await client.aclose()
                return list(results), client.stats

            results, stats = asyncio.run(go())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="item", embedding_dim=dim, num_embeddings=items, feature_names=["item_id", "history"])])
    with torch.no_grad():
        ebc.embedding_bags["item"].weight.copy_(torch.from_numpy(weights))
        exact = all(torch.equal(r.pooled.values(), ebc(k).values()) for r, k in zip(results, kjts))
    out = {
        "callers": callers,
        "ids": stats.ids_requested,
        "unique_ids": stats.ids_unique,
        "dedup_ratio": stats.dedup_ratio,
        "windows": stats.windows,
        "rpcs": stats.rpcs_primary + stats.rpcs_hedge,
        "shards": shards,
        "degraded_callers": stats.degraded_callers,
        "pooled_matches_torchrec": exact,
    }
    if not quiet:
        print(
            f"lookup client: {callers} concurrent callers, {out['ids']:,} ids (2 features on one table) -> "
            f"{out['windows']} window(s), {out['unique_ids']:,} unique ids (dedup ratio {out['dedup_ratio']:.2f}), "
            f"{out['rpcs']} RPCs to {shards} shards; pooled output equals TorchRec EBC: {exact}"
        )
    return out
