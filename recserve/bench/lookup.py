"""``recserve bench lookup``: the feature-parallel lookup client against its alternatives.

Starts real shard processes (row cache capped at ``--row-cache-fraction`` of each
shard's cold bytes, so the cold path really reads RocksDB), a ``redis-server`` when the
binary exists, and drives every mode of :mod:`recserve.bench.lookup_modes` with the same
Zipf request stream at the same concurrency, side by side in one run. Then a separate
open-loop run (Poisson arrivals at a stated rate) measures the client's latency, and
the pooled outputs of requests the client actually served are checked against an
in-process TorchRec ``EmbeddingBagCollection`` on the same weights. With
``--sweep-rates`` the open-loop run is repeated for the client and naive at each offered
rate (JSON key ``sweep``, see :mod:`recserve.bench.sweep`); ``--plot PATH`` draws it.

Example::

    recserve bench lookup --items 200000 --dim 64 --shards 4 --concurrency 64 \\
        --ids-per-request 64 --zipf 1.05 --json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from recserve.bench.sweep import format_sweep, parse_rates, plot_sweep

MODES = ("feature_parallel", "naive", "redis_mget", "redis_mget_dedup", "torchrec_local")
SWEEP_MODES = (("feature_parallel", "feature-parallel"), ("naive", "naive"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--items", type=int, default=200_000, help="rows of the item table (default 200000)")
    p.add_argument("--dim", type=int, default=64, help="embedding width (default 64)")
    p.add_argument("--shards", type=int, default=4, help="shard processes (default 4)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight in closed-loop modes (default 64)")
    p.add_argument("--ids-per-request", type=int, default=64, help="ids per request (default 64)")
    p.add_argument("--bags", type=int, default=8, help="bags (examples) per request; pooled output is [bags, dim] (default 8)")
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of id popularity (default 1.05)")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per mode (default 5)")
    p.add_argument("--open-loop-seconds", type=float, default=4.0, help="seconds of the open-loop latency run (default 4)")
    p.add_argument("--rate", type=float, default=None, help="open-loop arrivals per second (default: half the client's closed-loop throughput)")
    p.add_argument("--row-cache-fraction", type=float, default=0.10, help="shard row cache as a fraction of its cold bytes (default 0.10)")
    p.add_argument("--near-cache-rows", type=int, default=None, help="client near-cache rows (default: the plan's hot tier, 1%% of items)")
    p.add_argument("--window-ms", type=float, default=1.0, help="lookup window (default 1 ms)")
    p.add_argument("--max-window-ms", type=float, default=2.0, help="adaptive window cap (default 2 ms)")
    p.add_argument("--stream-requests", type=int, default=60_000, help="requests in the shared Zipf stream; a mode stops early if it runs out (default 60000)")
    p.add_argument("--prebuilt-kjts", type=int, default=30_000, help="requests whose KJT is built before timing (default 30000)")
    p.add_argument("--target-ids", type=int, default=8192, help="ids that close a window early (lookup.target_ids, default 8192)")
    p.add_argument("--max-inflight", type=int, default=4, help="windows in flight (lookup.max_inflight_batches, default 4)")
    p.add_argument("--check-requests", type=int, default=2000, help="client results kept for the TorchRec check (default 2000)")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis modes (fields null)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="keep shard data here (default: a temp dir, removed)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--sweep-rates", type=parse_rates, default=None, metavar="R1,R2,...", help="after the run, open-loop sweep of feature_parallel and naive at these offered requests/s (default: no sweep)")
    p.add_argument("--sweep-seconds", type=float, default=1.5, help="arrival period of each sweep point and mode (default 1.5 s)")
    p.add_argument("--sweep-timeout-ms", type=float, default=1000.0, help="sweep: each request's deadline after its scheduled arrival; later = failed (client: degraded) (default 1000 ms)")
    p.add_argument("--slo-ms", type=float, default=50.0, help="latency SLO of the sweep's goodput (default 50 ms)")
    p.add_argument("--plot", default=None, metavar="PATH", help="with --sweep-rates: write a PNG of p99 and goodput vs offered rate")


def run(args: argparse.Namespace) -> int:
    import torch

    if args.plot is not None and args.sweep_rates is None:
        raise SystemExit("--plot needs --sweep-rates")
    for flag, value in (("--sweep-seconds", args.sweep_seconds), ("--sweep-timeout-ms", args.sweep_timeout_ms), ("--slo-ms", args.slo_ms)):
        if not value > 0:
            raise SystemExit(f"{flag} = {value!r} is invalid: use a positive number")
    torch.set_num_threads(1)  # the shards share the 2 cores; one torch thread here
    own_dir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="recserve-bench-lookup-")) if own_dir else Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        report = _run(args, workdir)
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.plot is not None:
        c = report["config"]
        title = f"recserve bench lookup: {c['items']:,} x {c['dim']} rows, {c['shards']} shards, {c['ids_per_request']} ids/request, Zipf {c['zipf']}"
        plot_sweep(args.plot, report["sweep"], SWEEP_MODES, title=title, slo_ms=args.slo_ms)
        _log(f"sweep plot written to {args.plot}")
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    return 0


def _log(msg: str) -> None:
    print(f"[bench lookup] {msg}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from recserve.bench.lookup_modes import Stream
    from recserve.catalog.items import make_popularity
    from recserve.catalog.zipf import PopularitySampler
    from recserve.cluster.shards import ShardCluster
    from recserve.config.spec import FeatureConfig, ShardingConfig, ShardServerConfig, TableConfig
    from recserve.sharding.planner import plan_tables

    rng = np.random.default_rng(args.seed)
    popularity, order = make_popularity(rng, args.items, args.zipf)
    weights = rng.standard_normal((args.items, args.dim), dtype=np.float32)
    np.save(workdir / "item.npy", weights)
    table = TableConfig("item", rows=args.items, dim=args.dim, pooling="sum")
    feature = FeatureConfig("item_id", "item")
    sharding = ShardingConfig(num_shards=args.shards, hot_replicas=min(2, args.shards))
    plan = plan_tables([table], {"item": popularity}, sharding, seed=args.seed).plan
    plan.save(workdir / "plan.json")
    cold_bytes_per_shard = plan.table("item").num_cold * args.dim * 4 // args.shards
    row_cache_bytes = int(args.row_cache_fraction * cold_bytes_per_shard)

    k, b = args.ids_per_request, args.bags
    lengths = np.diff(np.linspace(0, k, b + 1).astype(np.int64))
    n_requests = args.stream_requests
    stream = Stream(ids=PopularitySampler(popularity, order).sample(n_requests * k, rng).reshape(n_requests, k), lengths=lengths)
    _log(f"{args.items:,} x {args.dim} rows, {args.shards} shards, {n_requests:,} requests of {k} ids; row cache {row_cache_bytes:,} B/shard")

    server = ShardServerConfig(threads=1, row_cache_bytes=row_cache_bytes)
    t0 = time.perf_counter()
    with ShardCluster(workdir / "plan.json", workdir / "data", load_from=workdir, server=server) as cluster:
        _log(f"shards SERVING after {time.perf_counter() - t0:.1f} s")
        report = asyncio.run(_network_modes(args, workdir, plan, table, feature, weights, stream, cluster))
    _log("torchrec local")
    from recserve.bench.lookup_modes import torchrec_local

    local, ebc = torchrec_local(weights, stream, args.concurrency, args.seconds)
    report["rows_per_s"]["torchrec_local"] = local.rows_per_s(k)
    report.update(_check(ebc, stream, report.pop("_checks")))
    _ratios(report)
    report["config"] = {
        "items": args.items, "dim": args.dim, "shards": args.shards, "concurrency": args.concurrency,
        "ids_per_request": k, "bags_per_request": b, "zipf": args.zipf, "seconds_per_mode": args.seconds,
        "row_cache_bytes_per_shard": row_cache_bytes, "window_ms": args.window_ms, "max_window_ms": args.max_window_ms,
        "hot_rows": int(plan.table("item").hot_ids.size), "warm_rows": int(plan.table("item").warm_ids.size),
        "column_splits": plan.table("item").column_splits,
    }  # fmt: skip
    if args.sweep_rates is not None:
        report["config"].update(sweep_seconds=args.sweep_seconds, sweep_timeout_ms=args.sweep_timeout_ms, slo_ms=args.slo_ms)
    return report


async def _network_modes(args: argparse.Namespace, workdir: Path, plan: Any, table: Any, feature: Any, weights: np.ndarray, stream: Any, cluster: Any) -> dict[str, Any]:
    from recserve.bench.lookup_modes import closed_loop, make_kjt, naive_handler, open_loop
    from recserve.bench.sweep import percentile_ms
    from recserve.config.spec import LookupConfig
    from recserve.lookup.client import LookupClient
    from recserve.lookup.config import LookupClientConfig
    from recserve.lookup.transport import GrpcShardTransport

    k = stream.ids_per_request
    near_rows = int(plan.table("item").hot_ids.size) if args.near_cache_rows is None else args.near_cache_rows
    config = LookupClientConfig(
        tables=(table,),
        features=(feature,),
        lookup=LookupConfig(
            window_ms=args.window_ms,
            max_window_ms=args.max_window_ms,
            target_ids=args.target_ids,
            max_inflight_batches=args.max_inflight,
            near_cache_rows=near_rows,
        ),
    )
    client = LookupClient.connect(config, plan, cluster.addresses)
    await client.start()
    checks: dict[int, np.ndarray] = {}
    # Callers (a ranker) hold their features as a KJT already: build them before timing.
    _log("building request KJTs")
    kjts = [make_kjt(stream.ids[i], stream.lengths, stream.feature) for i in range(min(args.prebuilt_kjts, stream.ids.shape[0]))]

    async def fp(i: int) -> None:
        kjt = kjts[i] if i < len(kjts) else make_kjt(stream.ids[i], stream.lengths, stream.feature)
        res = await client.lookup(kjt, pooled=True, timeout_s=5.0)
        if i < args.check_requests and res.pooled is not None:
            checks[i] = res.pooled.values().numpy()

    report: dict[str, Any] = {"rows_per_s": dict.fromkeys(MODES)}
    total = stream.ids.shape[0]
    gc.collect()
    gc.freeze()  # start-up objects (torch, torchrec, the stream) leave the GC's working set
    try:
        _log("warm-up")
        await closed_loop(args.concurrency, 1.0, total, fp)
        checks.clear()
        before = await _shard_counters(client)
        stats0 = dict(client.stats.as_dict())
        hits0, lookups0 = _near(client)
        _log("feature-parallel client")
        res = await closed_loop(args.concurrency, args.seconds, total, fp)
        after = await _shard_counters(client)
        server_ms = await _server_latency_ms(client)
        stats1 = client.stats.as_dict()
        hits1, lookups1 = _near(client)
        report["rows_per_s"]["feature_parallel"] = res.rows_per_s(k)
        fp_req_per_s = res.requests / res.seconds
        d = {key: stats1[key] - stats0[key] for key in stats0 if isinstance(stats0[key], (int, float))}
        report["dedup_ratio"] = d["ids_requested"] / d["ids_unique"] if d["ids_unique"] else None
        report["near_cache_hit_rate"] = (hits1 - hits0) / (lookups1 - lookups0) if lookups1 > lookups0 else 0.0
        hits, misses = after[1] - before[1], after[2] - before[2]
        report["row_cache_hit_rate"] = hits / (hits + misses) if hits + misses else None
        report["client"] = {
            "windows": d["windows"], "callers_per_window": d["callers"] / max(d["windows"], 1),
            "rpcs_primary": d["rpcs_primary"], "rpcs_hedge": d["rpcs_hedge"], "server_rpcs": int(after[0] - before[0]),
            "ids_per_rpc": d["ids_fetched"] / max(d["rpcs_primary"], 1), "missing": d["missing"],
            # The shards' own Lookup handler time (median over shards of their recent
            # p50 / p99): the part of "rpc" spent inside a shard, the rest is transport,
            # queueing for a core and the client's event loop.
            "server_p50_ms": server_ms[0], "server_p99_ms": server_ms[1],
        }  # fmt: skip
        per_window = 1000.0 / max(d["windows"], 1)
        report["profile_ms_per_window"] = {
            "dedup_route": d["prep_s"] * per_window,  # merge, np.unique, near cache, routing
            "serialisation": d["serialise_s"] * per_window,  # packing requests, decoding replies
            "rpc": d["rpc_wall_s"] * per_window,  # first send to last reply (wall)
            "gather": (d["scatter_s"] + d["gather_s"]) * per_window,  # rows into window matrices, per-caller takes
            "pooling": d["pool_s"] * per_window,  # embedding_bag + per-caller results
        }
        report["_checks"] = dict(checks)

        _log("naive: one RPC per request per shard")
        naive_transport = GrpcShardTransport(cluster.addresses)
        try:
            res = await closed_loop(args.concurrency, args.seconds, total, naive_handler(naive_transport, plan, stream, table.dim))
            report["rows_per_s"]["naive"] = res.rows_per_s(k)
        finally:
            await naive_transport.close()

        report.update(await _redis_modes(args, workdir, weights, stream, report["client"]["callers_per_window"]))

        rate = args.rate if args.rate is not None else 0.5 * fp_req_per_s
        _log(f"open loop at {rate:.0f} requests/s")
        latencies, failures = await open_loop(rate, args.open_loop_seconds, total, fp, seed=args.seed + 1)
        report["open_loop_rate_per_s"] = rate
        report["p50_ms"] = percentile_ms(latencies, 50)
        report["p99_ms"] = percentile_ms(latencies, 99)
        report["open_loop_requests"] = int(latencies.size)
        report["open_loop_failures"] = failures
        if args.sweep_rates is not None:
            from recserve.bench.lookup_modes import client_vs_naive_sweep

            rates = ", ".join(f"{r:g}" for r in args.sweep_rates)
            _log(f"open-loop sweep at {rates} requests/s, {args.sweep_seconds:g} s per point and mode")
            report["sweep"] = await client_vs_naive_sweep(
                client, kjts, plan, stream, cluster.addresses, args.sweep_rates,
                seconds=args.sweep_seconds, timeout_s=args.sweep_timeout_ms / 1000.0, slo_ms=args.slo_ms, seed=args.seed + 2,
            )  # fmt: skip
        report["reference"] = await _reference(client, weights)
    finally:
        await client.aclose()
    return report


def _near(client: Any) -> tuple[int, int]:
    """(hits, lookups) of the near cache, counting callers' id lookups with repeats."""
    cache = client.runtime.near_cache
    return (cache.occurrence_hits, cache.occurrence_lookups) if cache is not None else (0, 0)


async def _shard_counters(client: Any) -> np.ndarray:
    infos = await asyncio.gather(*(client.transport.shard_info(s, 5.0) for s in range(client.plan.num_shards)))
    return np.array([sum(i.rpcs for i in infos), sum(i.row_cache_hits for i in infos), sum(i.row_cache_misses for i in infos)], dtype=np.int64)


async def _server_latency_ms(client: Any) -> tuple[float, float]:
    infos = await asyncio.gather(*(client.transport.shard_info(s, 5.0) for s in range(client.plan.num_shards)))
    return float(np.median([i.p50_ms for i in infos])), float(np.median([i.p99_ms for i in infos]))


async def _redis_modes(args: argparse.Namespace, workdir: Path, weights: np.ndarray, stream: Any, callers_per_window: float) -> dict[str, Any]:
    from recserve.bench.lookup_modes import closed_loop, load_redis, redis_handler, redis_window_handler
    from recserve.bench.redis_proc import start_redis

    out: dict[str, Any] = {"redis_reason": None, "redis_window_requests": None}
    if args.no_redis:
        out["redis_reason"] = "skipped (--no-redis)"
        return out
    proc, reason = start_redis(workdir)
    if proc is None:
        out["redis_reason"] = reason
        return out
    import redis.asyncio as aioredis

    k = stream.ids_per_request
    r = aioredis.Redis(host="127.0.0.1", port=proc.port)
    try:
        _log("loading redis")
        await load_redis(r, weights)
        _log("redis MGET per request")
        res = await closed_loop(args.concurrency, args.seconds, stream.ids.shape[0], redis_handler(r, stream, weights.shape[1]))
        rows = {"redis_mget": res.rows_per_s(k)}
        window = max(1, int(round(callers_per_window)))
        _log(f"redis MGET per window of {window} requests")
        workers = max(1, args.concurrency // window)
        res = await closed_loop(workers, args.seconds, stream.ids.shape[0] // window, redis_window_handler(r, stream, weights.shape[1], window))
        rows["redis_mget_dedup"] = res.requests * window * k / res.seconds
        out["redis_rows_per_s"] = rows
        out["redis_window_requests"] = window
    finally:
        await r.aclose()
        proc.stop()
    return out


async def _reference(client: Any, weights: np.ndarray) -> dict[str, float]:
    """Figures from DESIGN.md §10 measured in this run: loopback unary RTT and a local
    np.take gather rate."""
    t0 = time.perf_counter()
    n = 200
    for _ in range(n):
        await client.transport.shard_info(0, 5.0)
    rtt_ms = (time.perf_counter() - t0) / n * 1000.0
    ids = np.random.default_rng(0).integers(0, weights.shape[0], 1 << 18)
    t0 = time.perf_counter()
    np.take(weights, ids, axis=0)
    return {"grpc_unary_rtt_ms": rtt_ms, "np_take_rows_per_s": ids.size / (time.perf_counter() - t0)}


def _check(ebc: Any, stream: Any, checks: dict[int, np.ndarray]) -> dict[str, Any]:
    """Compare the client's pooled outputs with the EBC on the same requests."""
    import torch

    from recserve.bench.lookup_modes import make_kjt

    if not checks:
        return {"pooled_matches_torchrec": None, "max_abs_err": None, "checked_requests": 0}
    idx = np.array(sorted(checks))
    worst = 0.0
    with torch.no_grad():
        for start in range(0, idx.size, 256):
            sel = idx[start : start + 256]
            kjt = make_kjt(stream.ids[sel].reshape(-1), np.tile(stream.lengths, sel.size), stream.feature)
            want = ebc(kjt).values().numpy().reshape(sel.size, stream.lengths.size, -1)
            got = np.stack([checks[int(i)] for i in sel])
            worst = max(worst, float(np.abs(got - want).max()))
    return {"pooled_matches_torchrec": worst == 0.0, "max_abs_err": worst, "checked_requests": int(idx.size)}


def _ratios(report: dict[str, Any]) -> None:
    from recserve.bench.lookup_modes import safe_ratio

    rows = report["rows_per_s"]
    redis_rows = report.pop("redis_rows_per_s", None) or {}
    rows.update(redis_rows)
    fp = rows["feature_parallel"]
    best_redis = max((v for v in (rows.get("redis_mget"), rows.get("redis_mget_dedup")) if v is not None), default=None)
    report["speedup_vs_naive"] = safe_ratio(fp, rows["naive"])
    report["speedup_vs_redis"] = safe_ratio(fp, best_redis)
    report["fraction_of_local"] = safe_ratio(fp, rows["torchrec_local"])


def format_report(r: dict[str, Any]) -> str:
    def f(v: Any, spec: str = ",.0f") -> str:
        return "n/a" if v is None else format(v, spec)

    c = r["config"]
    lines = [
        f"lookup benchmark: {c['items']:,} x {c['dim']} fp32 rows on {c['shards']} shards, concurrency {c['concurrency']}, "
        f"{c['ids_per_request']} ids/request in {c['bags_per_request']} bags, Zipf {c['zipf']}",
        "",
        f"{'mode':<20}{'rows/s':>14}{'vs naive':>10}",
    ]
    naive = r["rows_per_s"].get("naive")
    for mode in MODES:
        v = r["rows_per_s"].get(mode)
        lines.append(f"{mode:<20}{f(v):>14}{f(None if v is None or not naive else v / naive, '.2f'):>10}")
    lines += [
        "",
        f"speedup vs naive {f(r['speedup_vs_naive'], '.2f')}   vs redis {f(r['speedup_vs_redis'], '.2f')}   fraction of local {f(r['fraction_of_local'], '.3f')}",
        f"dedup ratio {f(r['dedup_ratio'], '.2f')}   near-cache hit rate {f(r['near_cache_hit_rate'], '.3f')}   shard row-cache hit rate {f(r['row_cache_hit_rate'], '.3f')}",
        f"open loop at {f(r['open_loop_rate_per_s'])} req/s: p50 {f(r['p50_ms'], '.2f')} ms  p99 {f(r['p99_ms'], '.2f')} ms  ({r['open_loop_requests']} requests, {r['open_loop_failures']} failed)",
        f"pooled output matches TorchRec: {r['pooled_matches_torchrec']} (max |err| {r['max_abs_err']}, {r['checked_requests']} requests)",
    ]
    if r.get("redis_reason"):
        lines.append(f"redis: {r['redis_reason']}")
    cl = r["client"]
    lines += [
        f"client: {cl['windows']:,} windows, {cl['callers_per_window']:.1f} callers/window, {cl['ids_per_rpc']:.0f} ids/RPC, "
        f"{cl['rpcs_primary']:,} RPCs + {cl['rpcs_hedge']:,} hedges (servers counted {cl['server_rpcs']:,})",
        "profile per window (ms): " + "  ".join(f"{key} {v:.3f}" for key, v in r["profile_ms_per_window"].items()),
        f"shard Lookup handler time (median over shards): p50 {cl['server_p50_ms']:.2f} ms  p99 {cl['server_p99_ms']:.2f} ms",
        f"reference (this run): gRPC unary RTT {r['reference']['grpc_unary_rtt_ms']:.3f} ms, np.take {r['reference']['np_take_rows_per_s']:,.0f} rows/s",
    ]
    if r.get("sweep"):
        lines += ["", format_sweep(r["sweep"], SWEEP_MODES, slo_ms=c["slo_ms"])]
    return "\n".join(lines)
