"""``recserve demo``: the main job on the embedded default cluster spec.

1. Generate a synthetic catalog sized from the spec's ``dlrm_item`` table and print its
   summary (items, users, head/tail popularity share).
2. Train a tiny model set (DLRM, two-tower, L3) on the catalog's scrubbed view, evaluate
   it against the ground truth and export it (``ranker.pipeline``); print the metrics
   table next to the ground-truth and popularity baselines.
3. Start real shard processes on loopback (RocksDB in a temp dir) loaded with the
   exported DLRM tables, and send many concurrent users' DLRM lookups (user id,
   candidate, pooled history, categories, tags) through the feature-parallel client.
   Print its windows, dedup ratio and RPC count; check the pooled output against
   TorchRec's ``EmbeddingBagCollection`` holding the trained weights, and the DLRM
   scores on remote embeddings against the in-process DLRM.
4. Start a real ranker process (``recserve ranker serve``) on those shards and rank a
   sample user's candidates over gRPC with each model; print the top items with their
   scores, and check the DLRM answer against the in-process model.
5. Start the cascade (``recserve cascade serve``) over the shards and the ranker and send
   a few ``Recommend`` calls; print each user's items, scores and stage reports.
6. Train the small explanation LM (:mod:`generation.train`) on the catalog's templated
   text, serve it (``recserve generate serve``), start the HTTP gateway (``recserve
   gateway serve``) on the cascade, the ranker and the generation replica, send one
   ``POST /v1/recommendations`` (printing the equivalent ``curl``), then stream an
   explanation for its top item from ``POST /v1/generate``, printing each token as its
   server-sent event arrives.

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
    parser.add_argument("--out", type=Path, default=None, help="keep the catalog and models here (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from recserve.catalog import CatalogConfig, format_summary, generate_catalog, summarize
    from recserve.config import load
    from recserve.errors import ConfigError

    cluster = load(args.config)
    item_tables = [t for t in cluster.tables if t.name == "dlrm_item"]
    if not item_tables:
        raise ConfigError(f"demo needs a table named 'dlrm_item' in the cluster spec; it declares {[t.name for t in cluster.tables]}")
    item_table = item_tables[0]
    with tempfile.TemporaryDirectory(prefix="recserve-demo-") as tmp:
        root = args.out if args.out is not None else Path(tmp)
        from ranker.export import NEW_ITEM_ROWS

        # The item tables hold the catalog plus the rows the export reserves for new items.
        cfg = CatalogConfig(items=item_table.rows - NEW_ITEM_ROWS, users=args.users, seed=args.seed, impressions=20 * args.users)
        catalog = generate_catalog(cfg, out_dir=root / "catalog", progress=True)
        print("== catalog ==")
        print(format_summary(summarize(catalog)))
        print("== models trained on the scrubbed catalog, judged against its ground truth ==")
        report = _train(root, args)
        print("== the explanation LM, trained on the catalog's templated text ==")
        print(_train_lm(root, catalog, args))
        # Runs every server; the explanation streams live while they are up, so this
        # section's heading is printed after it.
        lookups = _lookup_demo(cluster, report, Path(tmp), args)
        print("== feature-parallel DLRM lookups through real shard servers ==")
        print(
            f"shards      {lookups['shards']} processes on loopback, plan v{lookups['plan_version']}, model_version {lookups['model_version']} "
            f"(dlrm_item: hot {lookups['hot']:,}, warm {lookups['warm']:,}, cold {lookups['cold']:,} rows)\n"
            f"callers     {lookups['callers']} concurrent, {lookups['bags']:,} bags, {lookups['ids']:,} ids over features {lookups['features']}\n"
            f"windows     {lookups['windows']}, {lookups['unique_ids']:,} unique ids: dedup ratio {lookups['dedup_ratio']:.2f}\n"
            f"rpcs        {lookups['rpcs']} to the shards ({lookups['rpcs'] / max(1, lookups['windows']):.1f} per window; "
            f"{lookups['callers']} callers x {lookups['shards']} shards = {lookups['callers'] * lookups['shards']} without windows)\n"
            f"degraded    {lookups['degraded_callers']} callers\n"
            f"oracle      pooled output equals TorchRec EmbeddingBagCollection: {lookups['pooled_matches_torchrec']}\n"
            f"oracle      DLRM scores on remote embeddings equal in-process DLRM: {lookups['scores_match']}"
        )
        ranked = lookups["ranking"]
        print("== ranking a sample user's candidates over gRPC (recserve ranker serve) ==")
        print(ranked["table"])
        print(f"oracle      DLRM scores over gRPC equal the in-process DLRM: {ranked['matches']}")
        print("== Recommend through the L0-L3 cascade (recserve cascade serve), 200 ms deadlines ==")
        print(ranked["recommendations"])
        print("== one recommendation over HTTP (recserve gateway serve) ==")
        print(ranked["http"])
        ok = (lookups["pooled_matches_torchrec"] and lookups["scores_match"] and lookups["degraded_callers"] == 0 and ranked["matches"]
              and ranked["explained"])
        return 0 if ok else 1


def _train(root: Path, args: argparse.Namespace) -> Any:
    """Train and export the tiny model set; print its metrics table."""
    from ranker.config import TrainConfig
    from ranker.evaluate import format_metrics
    from ranker.pipeline import train_and_export

    # Tiny and quick: one pass each, 500 users for recall, one torch thread (two spin
    # against the shard processes and everything else on a 2-core box).
    config = TrainConfig(seed=args.seed, eval_users=500, threads=1)
    report = train_and_export(root / "catalog", root / "models", config)
    print(format_metrics(report.metrics, report.seconds))
    print(f"models      {root / 'models'} (model_version {report.manifest['model_version']}, trained on {report.device})")
    return report


# Small enough to train in ~10 s on one core; it learns the corpus's templates (not the
# catalog's facts), which is what an explanation streamed token by token needs to show.
LM_STEPS = 300
LM_WINDOW = 64  # tokens per training window


def _train_lm(root: Path, catalog: Any, args: argparse.Namespace) -> str:
    """Train the demo's explanation LM on templated lines about the catalog; save it to ``root/lm``."""
    import time

    import numpy as np
    import torch

    from generation.config import ModelConfig
    from generation.train import TrainConfig, catalog_corpus, save_checkpoint, train_lm

    shape = ModelConfig(n_layers=2, n_heads=4, dim=64, max_seq_len=256)
    corpus = catalog_corpus(catalog.item_category, catalog.item_tags, catalog.user_history, rng=np.random.default_rng(args.seed), items=2000, users=500)
    torch.set_num_threads(1)  # as the rankers' training: a second thread spins against everything else on a 2-core box
    started = time.perf_counter()
    model, losses = train_lm(corpus, shape, TrainConfig(steps=LM_STEPS, batch=16, seq_len=LM_WINDOW, seed=args.seed))
    seconds = time.perf_counter() - started
    version = save_checkpoint(root / "lm", model, {"train_seconds": round(seconds, 1), "final_loss": float(np.mean(losses[-20:]))})
    return (f"lm          {root / 'lm'} ({shape.n_layers} layers x {shape.dim}, {LM_STEPS} steps in {seconds:.0f} s; "
            f"loss {losses[0]:.2f} -> {float(np.mean(losses[-20:])):.2f} nats/byte; model_version {version})")  # fmt: skip


def _lookup_demo(cluster: Any, report: Any, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Serve the exported DLRM tables and look up user batches; score them remotely."""
    import dataclasses

    import numpy as np
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from ranker.features import dense_features, sparse_features
    from ranker.models.dlrm import DLRM_FEATURES, DlrmRanker
    from ranker.serving import check_table_versions, load_model, open_export
    from ranker.spec import access_frequencies, tables_and_features
    from recserve.cluster.shards import ShardCluster
    from recserve.lookup.client import LookupClient
    from recserve.lookup.config import LookupClientConfig
    from recserve.sharding import plan_tables

    export = open_export(report.out)
    tables, _ = tables_and_features(export.manifest)
    dlrm_tables = tuple(t for t in tables if t.name.startswith("dlrm_"))
    features = tuple(f for f in tables_and_features(export.manifest)[1] if f.table.startswith("dlrm_"))
    # Access frequency of the item table: its train-log impression counts (what a real
    # system knows), not the catalog's popularity.
    freq = access_frequencies(export.manifest, export.arrays.counts.item[:, 0])
    # Every exported table: the lookups below read DLRM's, the ranker all three models'.
    plan = plan_tables(list(tables), freq, cluster.sharding).plan
    tplan = plan.tables["dlrm_item"]
    plan.save(workdir / "plan.json")
    dlrm = load_model(export, "dlrm", device="cpu", with_tables=True)
    assert isinstance(dlrm, DlrmRanker)

    # Each caller: a batch of users, each with one candidate drawn from the log's items.
    rng = np.random.default_rng(args.seed)
    arrays = export.arrays
    shown = np.flatnonzero(arrays.counts.item[:, 0] > 0)
    pairs = [(rng.integers(0, arrays.num_users, args.users_per_caller), rng.choice(shown, args.users_per_caller)) for _ in range(args.callers)]
    kjts: list[KeyedJaggedTensor] = [sparse_features(arrays, DLRM_FEATURES, u, i).kjt() for u, i in pairs]

    config = dataclasses.replace(LookupClientConfig.from_cluster(cluster), tables=dlrm_tables, features=features)
    with ShardCluster(workdir / "plan.json", workdir / "shards", load_from=report.out, server=cluster.shard_server) as shards:
        versions = _table_versions(shards.addresses)
        check_table_versions(export.model_version, versions, [t.name for t in dlrm_tables])

        async def go() -> tuple[list[Any], Any]:
            client = LookupClient.connect(config, plan, shards.addresses)
            await client.start()
            try:
                results = await asyncio.gather(*(client.lookup(k, pooled=True, timeout_s=10.0) for k in kjts))
            finally:
                await client.aclose()
            return list(results), client.stats

        results, stats = asyncio.run(go())
        ranking = _rank_demo(report, shards.addresses, workdir, args)

    ebc = dlrm.dlrm.sparse_arch.embedding_bag_collection
    with torch.no_grad():
        # Mean pooling divides on both sides in a different order: equal within fp32 rounding.
        exact = all(torch.allclose(r.pooled.values(), ebc(k).values(), rtol=0, atol=1e-5) for r, k in zip(results, kjts))
        scores_match = True
        for r, k, (u, i) in zip(results, kjts, pairs):  # per caller (a batch each), not per candidate
            dense = torch.from_numpy(dense_features(arrays, u, i))
            scores_match &= bool(torch.allclose(dlrm.score_pooled(dense, r.pooled.to_dict()), dlrm(dense, k), rtol=1e-5, atol=1e-5))
    return {
        "shards": plan.num_shards,
        "plan_version": plan.version,
        "model_version": export.model_version,
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
        "scores_match": scores_match,
        "ranking": ranking,
    }


def _rank_demo(report: Any, shard_addresses: list[str], workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Start one ranker on the shards; rank a sample user's candidates with each model."""
    import numpy as np
    import torch

    from recserve.client import RankingClient
    from ranker.scoring import score_pairs
    from ranker.serving import load_model, open_export
    from recserve.cluster.cascade import CascadeCluster
    from recserve.cluster.gateway import GatewayCluster
    from recserve.cluster.generation import GenerationCluster
    from recserve.cluster.rankers import RankerCluster

    export = open_export(report.out)
    arrays = export.arrays
    rng = np.random.default_rng(args.seed + 1)
    user = int(rng.integers(0, arrays.num_users))
    shown = np.flatnonzero(arrays.counts.item[:, 0] > 0)
    candidates = rng.choice(shown, min(200, shown.size), replace=False).astype(np.int64)

    async def go() -> dict[str, Any]:
        async with RankingClient(rankers.addresses) as client:
            return {m: await client.rank(user, candidates, model=m, timeout_s=10.0) for m in ("dlrm", "l3", "two_tower")}

    spec = report.out / "cluster.toml"
    with RankerCluster(spec, report.out, shard_addresses, num_rankers=1, data_root=workdir / "rankers") as rankers:
        answers = asyncio.run(go())
        # The cascade over the same shards and ranker: Recommend end to end.
        with CascadeCluster(spec, report.out, rankers.addresses, shard_addresses, data_root=workdir / "cascade") as cascade:
            recommendations = _recommend_demo(cascade.address, [user] + rng.integers(0, arrays.num_users, 2).tolist())
            lm = Path(report.out).parent / "lm"  # written by _train_lm
            with GenerationCluster(spec, checkpoint=lm, data_root=workdir / "generation") as generation, \
                    GatewayCluster(spec, [cascade.address], rankers.addresses, generators=generation.addresses, data_root=workdir / "gateway") as gateway:
                http_answer, top = _http_demo(gateway.url, user)
                explained = _explain_demo(gateway.url, user, top, int(arrays.item_category[top]))
    dlrm = load_model(export, "dlrm", device="cpu", with_tables=True)
    with torch.no_grad():
        want = dict(zip(candidates.tolist(), score_pairs(dlrm, arrays, np.full(candidates.shape, user), candidates).tolist()))  # type: ignore[arg-type]
    d = answers["dlrm"]
    matches = bool(np.allclose(d.scores, [want[i] for i in d.item_ids.tolist()], rtol=1e-5, atol=1e-5))
    lines = [f"user {user:,} (history {int(arrays.user_history.lengths()[user])} items), {candidates.size} candidates, model_version {d.model_version}"]
    lines.append(f"{'rank':>4}  " + "  ".join(f"{m + ' item':>14} {'score':>8}" for m in answers))
    for k in range(10):
        lines.append(f"{k + 1:>4}  " + "  ".join(f"{int(a.item_ids[k]):>14,} {float(a.scores[k]):>8.3f}" for a in answers.values()))
    degraded = [m for m, a in answers.items() if a.degraded]
    lines.append(f"degraded    {degraded or 'none'}")
    return {"table": "\n".join(lines), "matches": matches, "recommendations": recommendations, "http": http_answer, "explained": explained}


def _explain_demo(url: str, user: int, item: int, category: int) -> bool:
    """Stream an explanation of ``item`` from ``POST /v1/generate`` and print each token's
    text the moment its server-sent event arrives; True when the stream finished."""
    import http.client
    import json
    import sys
    import time

    # Short: the LM learned positions up to its training windows (LM_WINDOW tokens) only.
    prompt = f"item {item} is in category"
    body = json.dumps({"prompt": prompt, "max_new_tokens": LM_WINDOW - len(prompt), "session_key": f"user-{user}"})
    print(f"== an explanation of user {user:,}'s top recommended item {item:,} (category {category}), streamed token by token "
          f"(POST /v1/generate: server-sent events from recserve generate serve) ==")
    print(f"$ curl -sN -X POST {url}/v1/generate -H 'Content-Type: application/json' -d '{body}'")
    host, _, port = url.removeprefix("http://").rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    started = time.perf_counter()
    first_ms, tokens, reason, text = 0.0, 0, "", prompt
    try:
        conn.request("POST", "/v1/generate", body=body, headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        if reply.status != 200:
            print(f"POST /v1/generate -> {reply.status}: {reply.read().decode()[:300]}")
            return False
        sys.stdout.write(prompt)
        for line in iter(reply.readline, b""):  # one line at a time, as the events arrive
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                print(f"\nstream error: {event['error']['message']}")
                return False
            if not tokens:
                first_ms = (time.perf_counter() - started) * 1e3
            tokens += len(event["tokens"])
            text += event["text"]
            sys.stdout.write(event["text"])
            sys.stdout.flush()
            if event["finished"]:
                reason = event["finish_reason"]
                break
    finally:
        conn.close()
    total_ms = (time.perf_counter() - started) * 1e3
    newline = "" if text.endswith("\n") else "\n"  # the stop token is a newline
    print(f"{newline}{tokens} tokens, first after {first_ms:.0f} ms, all in {total_ms:.0f} ms; finish_reason {reason}")
    return bool(reason)


def _http_demo(url: str, user: int) -> tuple[str, int]:
    """One recommendation over HTTP through the gateway, shown as the curl a user types;
    also its top item."""
    import json
    import urllib.request

    body = json.dumps({"user_id": user, "k": 5, "deadline_ms": 500})
    request = urllib.request.Request(url + "/v1/recommendations", data=body.encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        answer = json.loads(reply.read())
        request_id = reply.headers["X-Request-Id"]
    return (f"$ curl -s -X POST {url}/v1/recommendations -H 'Content-Type: application/json' -d '{body}'\n"
            f"items {answer['item_ids']}, degraded {answer['degraded_reason'] or 'no'}, request id {request_id}"), int(answer["item_ids"][0])  # fmt: skip


def _recommend_demo(address: str, users: list[int]) -> str:
    """A few Recommend calls over gRPC: each user's items, scores and stage reports."""
    import grpc
    import numpy as np

    from recserve.rpc.deadline import make_header
    from recserve.rpc.tensors import unpack
    from recserve.v1 import recommender_pb2
    from recserve.v1.recommender_pb2_grpc import RecommenderStub

    lines = []
    with grpc.insecure_channel(address) as channel:
        stub = RecommenderStub(channel)
        stub.Recommend(recommender_pb2.RecommendRequest(header=make_header(timeout_s=5.0), user_id=users[0], k=10), timeout=10)  # warm-up
        for user in users:
            resp = stub.Recommend(recommender_pb2.RecommendRequest(header=make_header(timeout_s=0.2), user_id=int(user), k=10), timeout=5)
            items, scores = unpack(resp.item_ids, "item_ids"), unpack(resp.scores, "scores")
            lines.append(f"user {int(user):,}: coverage {resp.coverage:.2f}, degraded {resp.degraded_reason or 'no'}, index {resp.index_version}")
            lines.append("  items   " + " ".join(f"{int(i):>7,}" for i in items))
            lines.append("  scores  " + " ".join(f"{float(x):>7.3f}" for x in np.asarray(scores)))
            lines.append(f"  {'stage':<6}{'budget ms':>10}{'elapsed ms':>11}{'in':>7}{'out':>6}{'coverage':>9}  degraded")
            for st in resp.stages:
                lines.append(f"  {st.stage:<6}{st.budget_ms:>10.1f}{st.elapsed_ms:>11.1f}{st.in_count:>7,}{st.out_count:>6,}{st.coverage:>9.2f}  {st.degraded_reason or '-'}")
    return "\n".join(lines)


def _table_versions(addresses: list[str]) -> dict[str, str]:
    """table -> model_version, from every shard's ShardInfo."""
    import grpc

    from ranker.serving import versions_from_shard_info
    from recserve.v1 import embedding_pb2
    from recserve.v1.embedding_pb2_grpc import EmbeddingShardStub

    infos = []
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            infos.append(EmbeddingShardStub(channel).ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=10.0))
    return versions_from_shard_info(infos)
