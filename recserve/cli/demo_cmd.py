"""``recserve demo``: the main job on the embedded default cluster spec.

1. Generate a synthetic catalog sized from the spec's ``item`` table and print its
   summary (items, users, head/tail popularity share).
2. Plan the ``item`` table from the catalog's popularity, start real shard processes on
   loopback (RocksDB in a temp dir) loaded with the catalog's item vectors, and send
   many concurrent users' lookups (the spec's features that read ``item``: pooled
   histories and candidates) through the feature-parallel client. Print its windows,
   dedup ratio and RPC count, and check the pooled output against TorchRec's
   ``EmbeddingBagCollection`` on the same weights.

Later issues extend it until it serves the whole cascade.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="run the main job on the embedded default cluster spec")
    parser.add_argument("--config", type=Path, default=None, help="cluster spec TOML (default: the embedded spec)")
    parser.add_argument("--users", type=int, default=5_000, help="users in the demo catalog")
    parser.add_argument("--callers", type=_positive, default=64, help="concurrent lookup callers (one user batch each)")
    parser.add_argument("--users-per-caller", type=_positive, default=4, help="users (bags) per caller")
    parser.add_argument("--out", type=Path, default=None, help="keep the catalog here (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from recserve.catalog import CatalogConfig, format_summary, generate_catalog, summarize
    from recserve.config import load
    from recserve.errors import ConfigError

    cluster = load(args.config)
    item_tables = [t for t in cluster.tables if t.name == "item"]
    if not item_tables:
        raise ConfigError(f"demo needs a table named 'item' in the cluster spec; it declares {[t.name for t in cluster.tables]}")
    item_table = item_tables[0]
    with tempfile.TemporaryDirectory(prefix="recserve-demo-") as tmp:
        out = args.out if args.out is not None else Path(tmp) / "catalog"
        cfg = CatalogConfig(items=item_table.rows, users=args.users, dim=item_table.dim, seed=args.seed, impressions=20 * args.users)
        catalog = generate_catalog(cfg, out_dir=out, progress=True)
        print("== catalog ==")
        print(format_summary(summarize(catalog)))
        print("== feature-parallel lookups through real shard servers ==")
        report = _lookup_demo(cluster, catalog, Path(tmp), args)
        print(
            f"shards      {report['shards']} processes on loopback, plan v{report['plan_version']} "
            f"(hot {report['hot']:,}, warm {report['warm']:,}, cold {report['cold']:,} rows)\n"
            f"callers     {report['callers']} concurrent, {report['bags']:,} bags, {report['ids']:,} ids over features {report['features']}\n"
            f"windows     {report['windows']}, {report['unique_ids']:,} unique ids: dedup ratio {report['dedup_ratio']:.2f}\n"
            f"rpcs        {report['rpcs']} to the shards ({report['rpcs'] / max(1, report['windows']):.1f} per window; "
            f"{report['callers']} callers x {report['shards']} shards = {report['callers'] * report['shards']} without windows)\n"
            f"degraded    {report['degraded_callers']} callers\n"
            f"oracle      pooled output equals TorchRec EmbeddingBagCollection: {report['pooled_matches_torchrec']}"
        )
        return 0 if report["pooled_matches_torchrec"] and report["degraded_callers"] == 0 else 1


def _lookup_demo(cluster: Any, catalog: Any, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Serve ``catalog.item_vectors`` as the ``item`` table and look up user batches."""
    import dataclasses

    import numpy as np
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recserve.catalog import PopularitySampler
    from recserve.cluster.shards import ShardCluster
    from recserve.lookup.client import LookupClient
    from recserve.lookup.config import LookupClientConfig
    from recserve.sharding import plan_tables

    table = next(t for t in cluster.tables if t.name == "item")
    features = tuple(f for f in cluster.features if f.table == "item")
    weights = np.array(catalog.item_vectors, dtype=np.float32)  # writable copy: torch refuses read-only memmaps
    popularity = np.asarray(catalog.item_popularity, dtype=np.float64)
    plan = plan_tables([table], {"item": popularity}, cluster.sharding).plan
    tplan = plan.tables["item"]
    np.save(workdir / "item.npy", weights)
    plan.save(workdir / "plan.json")

    # Each caller: a batch of users; per user one bag per feature. History features get
    # the user's history; other features one popularity-sampled candidate.
    rng = np.random.default_rng(args.seed)
    sampler = PopularitySampler(popularity)
    hist = catalog.user_history
    kjts: list[KeyedJaggedTensor] = []
    for _ in range(args.callers):  # per caller (not per id): builds the callers' inputs
        users = rng.integers(0, catalog.num_users, size=args.users_per_caller)
        values: list[np.ndarray] = []
        lengths: list[np.ndarray] = []
        for f in features:
            if "history" in f.name:
                starts, ends = hist.offsets[users], hist.offsets[users + 1]
                lens = (ends - starts).astype(np.int64)
                idx = np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
                values.append(np.asarray(hist.values)[idx])
                lengths.append(lens)
            else:
                values.append(sampler.sample(len(users), rng))
                lengths.append(np.ones(len(users), dtype=np.int64))
        kjts.append(KeyedJaggedTensor(keys=[f.name for f in features], values=torch.from_numpy(np.concatenate(values).astype(np.int64)), lengths=torch.from_numpy(np.concatenate(lengths))))

    config = dataclasses.replace(LookupClientConfig.from_cluster(cluster), tables=(table,), features=features)
    with ShardCluster(workdir / "plan.json", workdir / "shards", load_from=workdir, server=cluster.shard_server) as shards:

        async def go() -> tuple[list[Any], Any]:
            client = LookupClient.connect(config, plan, shards.addresses)
            await client.start()
            try:
                results = await asyncio.gather(*(client.lookup(k, pooled=True, timeout_s=10.0) for k in kjts))
            finally:
                await client.aclose()
            return list(results), client.stats

        results, stats = asyncio.run(go())

    pooling = PoolingType.MEAN if table.pooling == "mean" else PoolingType.SUM
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="item", embedding_dim=table.dim, num_embeddings=table.rows, feature_names=[f.name for f in features], pooling=pooling)])
    with torch.no_grad():
        ebc.embedding_bags["item"].weight.copy_(torch.from_numpy(weights))
        exact = all(torch.allclose(r.pooled.values(), ebc(k).values(), rtol=0, atol=1e-5 if pooling == PoolingType.MEAN else 0) for r, k in zip(results, kjts))
    return {
        "shards": plan.num_shards,
        "plan_version": plan.version,
        "hot": len(tplan.hot_ids),
        "warm": len(tplan.warm_ids),
        "cold": tplan.num_cold,
        "callers": args.callers,
        "bags": sum(int(k.lengths().numel()) for k in kjts),
        "features": [f.name for f in features],
        "ids": stats.ids_requested,
        "unique_ids": stats.ids_unique,
        "dedup_ratio": stats.dedup_ratio,
        "windows": stats.windows,
        "rpcs": stats.rpcs_primary + stats.rpcs_hedge,
        "degraded_callers": stats.degraded_callers,
        "pooled_matches_torchrec": exact,
    }
