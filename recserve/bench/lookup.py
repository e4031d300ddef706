"""``recserve bench lookup``: the feature-parallel lookup client against its alternatives.

**Equal memory.** Redis is loaded with the table first and its ``used_memory`` read;
recserve's DRAM tiers, shard row caches, block caches and the client's near cache are
then capped together at that figure through the memory-budgeted planner
(``sharding.placement = "budget"``, :mod:`recserve.bench.lookup_capacity`). The
processes' RSS is reported beside it (``redis_rss_bytes``, ``shard_rss_bytes``), not
capped: an idle Python shard alone is tens of MB. Every mode of
:mod:`recserve.bench.lookup_modes` is driven with the same Zipf request stream, side by
side in one run:

* closed loop at ``--concurrency`` (C=64) and ``--concurrency-high`` (C=256): the client,
  naive (one RPC per request per shard), Redis MGET per request (the faster of the
  asyncio pool and sync clients on threads), Redis MGET on the client's own
  deduplicated windows with the same near cache, and in-process TorchRec. At C=64 the
  client and the Redis modes run in ``--rounds`` interleaved rounds and each C=64 ratio
  is the median of the rounds' own ratios (``c64_rounds``, ``*_c64_spread``;
  :mod:`recserve.bench.rounds`): the box's speed drifts by 2x over minutes;
* open loop: each contender's **knee** (the highest Poisson rate with >= 99% of offered
  requests OK within ``--knee-slo-ms``; :mod:`recserve.bench.knee`), and the client's
  unloaded p50 at ``--unloaded-rate`` (25 req/s);
* a **tiered** run: DRAM tiers plus row cache at ``--tiered-fraction`` of the table, the
  rest in RocksDB read with direct I/O, so the page cache does not hold it in hiding.
  It also reports what bounds it: the RocksDB reads per window, the disk's random
  direct-read rate and the rows/s floor they imply (``tiered.io_floor_rows_per_s``,
  ``tiered.equal_memory_vs_io_floor``).

* the **bare ceiling** (:mod:`recserve.bench.bare`, ``--no-bare`` skips it): raw-bytes
  shard processes and a numpy client, the design with nothing but its physics, in the
  same C=64 rounds, knee search and unloaded run (``bare_vs_redis_*``,
  ``client_vs_bare_c64``, ``knee_ratio_vs_bare``, ``bare_unloaded_p50_ms``): what the
  goals' ratios can reach on this box in this run.

The pooled outputs of requests the client actually served are checked against an
in-process TorchRec ``EmbeddingBagCollection`` on the same weights. With
``--sweep-rates`` the open-loop sweep of the client and naive also runs (JSON ``sweep``,
:mod:`recserve.bench.sweep`; ``--plot``); ``--capacity-plot`` draws p99 against offered
rate from the knee probes of every contender.

Example::

    recserve bench lookup --items 200000 --dim 64 --shards 2 --concurrency 64 \\
        --ids-per-request 64 --zipf 1.05 --json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from recserve.bench.lookup_capacity import RedisContenders
from recserve.bench.rounds import median_of, median_ratio, ratio_spread, with_ratios
from recserve.bench.sweep import format_sweep, parse_rates, plot_sweep

MODES = ("feature_parallel", "naive", "redis_mget", "redis_mget_dedup", "torchrec_local", "bare_ceiling")
SWEEP_MODES = (("feature_parallel", "feature-parallel"), ("naive", "naive"))
# The C=64 ratios taken within each interleaved round: report key -> (numerator, denominator).
RATIO_PAIRS = {
    "speedup_vs_redis_per_request_c64": ("feature_parallel", "redis_mget"),
    "speedup_vs_redis_dedup_c64": ("feature_parallel", "redis_mget_dedup"),
    # The bare ceiling (recserve.bench.bare): what the design reaches here with nothing
    # but its physics, in the same rounds; the goals' ratios are bounded by these.
    "bare_vs_redis_per_request_c64": ("bare_ceiling", "redis_mget"),
    "bare_vs_redis_dedup_c64": ("bare_ceiling", "redis_mget_dedup"),
    "client_vs_bare_c64": ("feature_parallel", "bare_ceiling"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--items", type=int, default=200_000, help="rows of the item table (default 200000)")
    p.add_argument("--dim", type=int, default=64, help="embedding width (default 64)")
    p.add_argument("--shards", type=int, default=4, help="shard processes (default 4)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight in closed-loop modes (default 64)")
    p.add_argument("--ids-per-request", type=int, default=64, help="ids per request (default 64)")
    p.add_argument("--bags", type=int, default=8, help="bags (examples) per request; pooled output is [bags, dim] (default 8)")
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of id popularity (default 1.05)")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per mode (default 5)")
    p.add_argument("--rounds", type=int, default=3,
                   help="C=64 closed loop: the client and each Redis mode run in this many interleaved rounds of --seconds / --rounds each; "
                        "ratios are the median of the rounds' own (default 3)")  # fmt: skip
    p.add_argument("--open-loop-seconds", type=float, default=4.0, help="seconds of the open-loop latency run (default 4)")
    p.add_argument("--rate", type=float, default=None, help="open-loop arrivals per second (default: half the client's closed-loop throughput)")
    p.add_argument("--concurrency-high", type=int, default=256, help="the second closed-loop concurrency (default 256; 0 = skip)")
    p.add_argument("--memory-bytes", type=int, default=None, help="total cache/tier budget (default: Redis's used_memory after loading; without Redis 1.35x the raw rows)")
    p.add_argument("--block-cache-bytes", type=int, default=None, help="RocksDB block cache per shard, inside the budget (default: 4 MiB, at most 2%% of a shard's share)")
    p.add_argument("--tiered-fraction", type=float, default=0.10, help="tiered run: DRAM tiers + row cache as a fraction of the table (default 0.10)")
    p.add_argument("--no-tiered", action="store_true", help="skip the tiered (RocksDB, direct reads) run")
    p.add_argument("--no-knees", action="store_true", help="skip the knee searches (knee fields null)")
    p.add_argument("--knee-seconds", type=float, default=1.5, help="seconds of each knee probe (default 1.5)")
    p.add_argument("--knee-settle-after-fail-s", type=float, default=2.0,
                   help="pause before the probe that follows a failed one (default 2 s; 0.5 s after a passed one): an overloaded probe leaves a backlog")  # fmt: skip
    p.add_argument("--knee-slo-ms", type=float, default=20.0, help="a request is OK if answered, not degraded, within this (default 20 ms)")
    p.add_argument("--fail-retries", type=int, default=1,
                   help="knee search: re-probe a failed rate this many times; it fails only if every try fails (default 1, as bench rank: one stall of the shared box must not set a knee)")
    p.add_argument("--unloaded-rate", type=float, default=25.0, help="open-loop rate of the unloaded-latency run (default 25 req/s)")
    p.add_argument("--unloaded-seconds", type=float, default=4.0, help="seconds of the unloaded-latency run (default 4)")
    p.add_argument("--capacity-plot", default=None, metavar="PATH", help="write a PNG of p99 vs offered rate (the knee probes) for every contender")
    p.add_argument("--tcp", action="store_true", help="clients reach the shards over loopback TCP, not their Unix domain sockets")
    p.add_argument("--grpc-experiments", default=None, help="GRPC_EXPERIMENTS for the shard processes (default: lookup.grpc_experiments)")
    p.add_argument("--near-cache-rows", type=int, default=None, help="client near-cache rows (default: the plan's hot tier, 1%% of items)")
    p.add_argument("--window-ms", type=float, default=None, help="lookup.window_ms: the idle window (default: LookupConfig's, 0 ms)")
    p.add_argument("--max-window-ms", type=float, default=None, help="lookup.max_window_ms: the adaptive cap without close-at-dispatch (default: LookupConfig's, 2 ms)")
    p.add_argument("--no-close-at-dispatch", action="store_true", help="lookup.close_at_dispatch = false: every window waits its timer")
    p.add_argument("--stream-requests", type=int, default=60_000, help="requests in the shared Zipf stream; a mode stops early if it runs out (default 60000)")
    p.add_argument("--prebuilt-kjts", type=int, default=60_000, help="requests whose KJT is built before timing (default 60000, the whole default stream)")
    p.add_argument("--target-ids", type=int, default=8192, help="ids that close a window early (lookup.target_ids, default 8192)")
    p.add_argument("--max-inflight", type=int, default=4, help="windows in flight (lookup.max_inflight_batches, default 4)")
    p.add_argument("--check-requests", type=int, default=2000, help="client results kept for the TorchRec check (default 2000)")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis modes (fields null)")
    p.add_argument("--no-bare", action="store_true", help="skip the bare ceiling contender in the C=64 rounds (fields null)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="keep shard data here (default: a temp dir, removed)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--sweep-rates", type=parse_rates, default=None, metavar="R1,R2,...", help="after the run, open-loop sweep of feature_parallel and naive at these offered requests/s (default: no sweep)")
    p.add_argument("--sweep-seconds", type=float, default=1.5, help="arrival period of each sweep point and mode (default 1.5 s)")
    p.add_argument("--sweep-timeout-ms", type=float, default=1000.0, help="sweep: each request's deadline after its scheduled arrival; later = failed (client: degraded) (default 1000 ms)")
    p.add_argument("--slo-ms", type=float, default=50.0, help="latency SLO of the sweep's goodput (default 50 ms)")
    p.add_argument("--plot", default=None, metavar="PATH", help="with --sweep-rates: write a PNG of p99 and goodput vs offered rate")


def run(args: argparse.Namespace) -> int:
    from recserve.config.spec import LookupConfig

    experiments = LookupConfig().grpc_experiments if args.grpc_experiments is None else args.grpc_experiments
    if "grpc" not in sys.modules and experiments and "GRPC_EXPERIMENTS" not in os.environ:
        # gRPC reads it once, when its core starts: the client in this process uses the
        # same I/O path as the shards (a process that already loaded grpc keeps its own).
        os.environ["GRPC_EXPERIMENTS"] = experiments
    client_experiments = os.environ.get("GRPC_EXPERIMENTS", "") if "grpc" not in sys.modules else None
    import torch

    if args.plot is not None and args.sweep_rates is None:
        raise SystemExit("--plot needs --sweep-rates")
    if not args.knee_settle_after_fail_s >= 0:
        raise SystemExit(f"--knee-settle-after-fail-s = {args.knee_settle_after_fail_s!r} is invalid: use seconds >= 0")
    if args.rounds < 1:
        raise SystemExit(f"--rounds = {args.rounds!r} is invalid: use at least 1")
    for flag, value in (("--sweep-seconds", args.sweep_seconds), ("--sweep-timeout-ms", args.sweep_timeout_ms), ("--slo-ms", args.slo_ms)):
        if not value > 0:
            raise SystemExit(f"{flag} = {value!r} is invalid: use a positive number")
    torch.set_num_threads(1)  # the shards share the 2 cores; one torch thread here
    own_dir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="recserve-bench-lookup-")) if own_dir else Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        report = _run(args, workdir)
        report["config"]["client_grpc_experiments"] = client_experiments  # None: grpc was loaded before the bench set it
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.plot is not None:
        c = report["config"]
        title = f"recserve bench lookup: {c['items']:,} x {c['dim']} rows, {c['shards']} shards, {c['ids_per_request']} ids/request, Zipf {c['zipf']}"
        plot_sweep(args.plot, report["sweep"], SWEEP_MODES, title=title, slo_ms=args.slo_ms)
        _log(f"sweep plot written to {args.plot}")
    if args.capacity_plot is not None and report.get("knees"):
        from recserve.bench.lookup_capacity import plot_capacity

        c = report["config"]
        plot_capacity(args.capacity_plot, {n: k["curve"] for n, k in report["knees"].items()}, slo_ms=args.knee_slo_ms,
                      title=f"p99 vs offered rate: {c['items']:,} x {c['dim']}, {c['shards']} shards, {c['ids_per_request']} ids/request, equal memory")
        _log(f"capacity plot written to {args.capacity_plot}")
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    return 0


def _log(msg: str) -> None:
    print(f"[bench lookup] {msg}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from recserve.bench import lookup_capacity as cap
    from recserve.bench.lookup_modes import Stream, load_redis
    from recserve.bench.redis_proc import start_redis
    from recserve.catalog.items import make_popularity
    from recserve.catalog.zipf import PopularitySampler
    from recserve.cluster.shards import ShardCluster
    from recserve.config.spec import FeatureConfig, LookupConfig, ShardServerConfig, TableConfig
    from recserve.lookup.transport import transport_env

    rng = np.random.default_rng(args.seed)
    popularity, order = make_popularity(rng, args.items, args.zipf)
    weights = rng.standard_normal((args.items, args.dim), dtype=np.float32)
    np.save(workdir / "item.npy", weights)
    table = TableConfig("item", rows=args.items, dim=args.dim, pooling="sum")
    feature = FeatureConfig("item_id", "item")
    k, b = args.ids_per_request, args.bags
    lengths = np.diff(np.linspace(0, k, b + 1).astype(np.int64))
    n_requests = args.stream_requests
    stream = Stream(ids=PopularitySampler(popularity, order).sample(n_requests * k, rng).reshape(n_requests, k), lengths=lengths)
    overrides: dict[str, Any] = {"close_at_dispatch": not args.no_close_at_dispatch}
    for key in ("window_ms", "max_window_ms", "grpc_experiments"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    lookup_cfg = dataclasses.replace(LookupConfig(), **overrides)
    env = transport_env(lookup_cfg)

    # Redis first: its used_memory after loading is the equal-memory budget.
    redis_proc, redis_reason = (None, "skipped (--no-redis)") if args.no_redis else start_redis(workdir)
    report: dict[str, Any] = {"redis_reason": redis_reason or None, "redis_used_memory": None, "redis_rss_bytes": None}
    try:
        if redis_proc is not None:
            _log("loading redis")
            asyncio.run(_load_redis(redis_proc.port, weights, load_redis))
            mem = cap.redis_memory(redis_proc.port)
            report["redis_used_memory"], report["redis_rss_bytes"] = mem["used_memory"], mem["used_memory_rss"]
        raw_bytes = args.items * args.dim * 4
        total = args.memory_bytes or report["redis_used_memory"] or int(1.35 * raw_bytes)
        report["memory_budget_source"] = "--memory-bytes" if args.memory_bytes else ("redis used_memory" if report["redis_used_memory"] else "1.35x raw rows (no Redis)")
        near_rows = max(1, int(round(0.01 * args.items))) if args.near_cache_rows is None else args.near_cache_rows
        block_cache = args.block_cache_bytes or max(64 << 10, min(4 << 20, total // (50 * args.shards)))
        budget = cap.split_budget(total, args.shards, near_cache_rows=near_rows, dim=args.dim, block_cache_bytes=block_cache, id_space=args.items)
        result = cap.plan_for_budget(table, popularity, args.shards, budget.shard_memory_bytes, warm_fraction=0.99, seed=args.seed)
        plan = result.plan
        plan.save(workdir / "plan.json")
        row_cache_bytes = int(result.row_cache_bytes.min())
        report["recserve_data_bytes"] = cap.data_bytes(result, budget, row_cache_bytes)
        report["memory_budget"] = budget.to_dict()
        report["tiers"] = result.tier_rows()
        _log(f"{args.items:,} x {args.dim} rows, {args.shards} shards, {n_requests:,} requests of {k} ids; budget {total:,} B "
             f"({report['memory_budget_source']}): {report['tiers'][0]['hot_ids']:,} hot, {report['tiers'][0]['warm_ids']:,} warm, "
             f"{report['tiers'][0]['cold_ids']:,} cold ids; row cache {row_cache_bytes:,} B/shard")  # fmt: skip

        server = ShardServerConfig(threads=1, row_cache_bytes=row_cache_bytes, block_cache_bytes=block_cache)
        t0 = time.perf_counter()
        with ShardCluster(workdir / "plan.json", workdir / "data", load_from=workdir, server=server, env=env, unix_sockets=not args.tcp) as cluster:
            _log(f"shards SERVING after {time.perf_counter() - t0:.1f} s")
            bare = None
            if not args.no_bare:
                from recserve.bench.bare import BareCeiling

                bare = BareCeiling(workdir / "item.npy", num_shards=args.shards, workdir=workdir, env=env)
                bare.start()
            try:
                report.update(asyncio.run(_network_modes(args, plan, table, feature, weights, stream, cluster, lookup_cfg, near_rows, redis_proc, bare)))
            finally:
                if bare is not None:
                    bare.stop()
            rss = [cap.rss_bytes(cluster.pid(s)) for s in range(args.shards)]
            report["shard_rss_bytes"] = None if None in rss else int(sum(r for r in rss if r is not None))
        if not args.no_tiered:
            report.update(_tiered(args, table, feature, popularity, stream, workdir, lookup_cfg, env, block_cache))
    finally:
        if redis_proc is not None:
            redis_proc.stop()
    _log("torchrec local")
    from recserve.bench.lookup_modes import torchrec_local

    local, ebc = torchrec_local(weights, stream, args.concurrency, args.seconds)
    report["rows_per_s"]["torchrec_local"] = local.rows_per_s(k)
    report.update(_check(ebc, stream, report.pop("_checks")))
    _ratios(report)
    t = plan.table("item")
    report["config"] = {
        "items": args.items, "dim": args.dim, "shards": args.shards, "concurrency": args.concurrency,
        "concurrency_high": args.concurrency_high, "ids_per_request": k, "bags_per_request": b, "zipf": args.zipf,
        "seconds_per_mode": args.seconds, "row_cache_bytes_per_shard": row_cache_bytes, "window_ms": lookup_cfg.window_ms,
        "max_window_ms": lookup_cfg.max_window_ms, "close_at_dispatch": lookup_cfg.close_at_dispatch,
        "grpc_experiments": lookup_cfg.grpc_experiments, "hot_rows": int(t.hot_ids.size), "warm_rows": int(t.warm_ids.size),
        "cold_rows": t.num_cold, "column_splits": t.column_splits, "knee_seconds": args.knee_seconds, "knee_settle_after_fail_s": args.knee_settle_after_fail_s, "knee_slo_ms": args.knee_slo_ms, "knee_fail_retries": args.fail_retries,
        "tiered_fraction": args.tiered_fraction, "unix_sockets": not args.tcp,
    }  # fmt: skip
    if args.sweep_rates is not None:
        report["config"].update(sweep_seconds=args.sweep_seconds, sweep_timeout_ms=args.sweep_timeout_ms, slo_ms=args.slo_ms)
    return report


async def _load_redis(port: int, weights: np.ndarray, load: Any) -> None:
    import redis.asyncio as aioredis

    r = aioredis.Redis(host="127.0.0.1", port=port)
    try:
        await load(r, weights)
    finally:
        await r.aclose()


def _tiered(
    args: argparse.Namespace, table: Any, feature: Any, popularity: np.ndarray, stream: Any, workdir: Path, lookup_cfg: Any,
    env: dict[str, str], block_cache: int,
) -> dict[str, Any]:
    """The bigger-than-RAM case: DRAM tiers plus row cache at ``--tiered-fraction`` of
    the table, filled by the budget planner (hot, then warm by popularity, then the row
    cache), the rest in RocksDB with direct reads."""
    from embedding_server.store import DIRECT_READS_ENV
    from recserve.bench import lookup_capacity as cap
    from recserve.cluster.shards import ShardCluster
    from recserve.config.spec import ShardServerConfig

    per_shard = int(args.tiered_fraction * args.items * args.dim * 4 / args.shards)
    result = cap.plan_for_budget(table, popularity, args.shards, per_shard, warm_fraction=min(0.99, args.tiered_fraction), seed=args.seed)
    tdir = workdir / "tiered"
    tdir.mkdir(exist_ok=True)
    result.plan.save(tdir / "plan.json")
    row_cache = int(result.row_cache_bytes.min())
    server = ShardServerConfig(threads=1, row_cache_bytes=row_cache, block_cache_bytes=block_cache)
    _log(f"tiered run: {result.tier_rows()[0]['cold_ids']:,} of {args.items:,} ids in RocksDB (direct reads), row cache {row_cache:,} B/shard")
    with ShardCluster(tdir / "plan.json", tdir / "data", load_from=workdir, server=server, env={**env, DIRECT_READS_ENV: "1"}, unix_sockets=not args.tcp) as cluster:
        rows, io = asyncio.run(_tiered_client(args, result.plan, table, feature, stream, cluster, lookup_cfg))
    # The disk's own ceiling, measured once the shards are stopped: every cold id that
    # misses the row and block caches costs one random data-block read, so this rate
    # over the run's reads per row bounds the tiered run whatever the software does.
    disk = cap.direct_read_rate(sorted(tdir.glob("data/shard-*/rocksdb/*.sst")), seed=args.seed)
    floor = cap.io_floor_rows_per_s(disk, io["cold_reads"], io["rows"])
    _log(f"tiered: {io['cold_reads_per_window']:.0f} RocksDB reads per window; disk {disk or 0:,.0f} direct 4 KiB reads/s -> at most {floor or 0:,.0f} rows/s")
    tiered = {
        "tiers": result.tier_rows(), "row_cache_bytes_per_shard": row_cache, "dram_bytes_per_shard": result.bytes_per_shard["dram"].tolist(),
        "cold_reads_per_window": io["cold_reads_per_window"], "cold_reads_per_row": io["cold_reads"] / io["rows"] if io["rows"] else None,
        "row_cache_hit_rate": io["row_cache_hit_rate"], "shard_p50_ms": io["shard_p50_ms"], "disk_direct_reads_per_s": disk, "io_floor_rows_per_s": floor,
    }  # fmt: skip
    return {"tiered_rows_per_s": rows, "tiered": tiered}


async def _tiered_client(args: argparse.Namespace, plan: Any, table: Any, feature: Any, stream: Any, cluster: Any, lookup_cfg: Any) -> tuple[float, dict[str, Any]]:
    """Closed-loop rows/s of the tiered run, and what its shards did for it: the cold
    ids they looked up past the row cache (``cold_reads``: one RocksDB point read each,
    a disk read unless the block cache holds its block, ≈ 2% here), per window and
    against the ``rows`` requested."""
    from recserve.bench.lookup_modes import closed_loop, make_kjt

    client = _make_client(args, plan, table, feature, cluster, lookup_cfg, int(plan.table("item").hot_ids.size))
    await client.start()
    try:
        async def fp(i: int) -> None:
            await client.lookup(make_kjt(stream.ids[i], stream.lengths, stream.feature), pooled=True, timeout_s=5.0)

        await closed_loop(args.concurrency, min(1.0, args.seconds), stream.ids.shape[0], fp)  # warm-up: the row cache fills
        before, windows0 = await _shard_counters(client), client.stats.as_dict()["windows"]
        res = await closed_loop(args.concurrency, args.seconds, stream.ids.shape[0], fp)
        after, windows = await _shard_counters(client), client.stats.as_dict()["windows"] - windows0
        server_ms = await _server_latency_ms(client)
        hits, misses = int(after[1] - before[1]), int(after[2] - before[2])
        io = {
            "cold_reads": misses, "rows": res.requests * stream.ids_per_request, "cold_reads_per_window": misses / max(windows, 1),
            "row_cache_hit_rate": hits / (hits + misses) if hits + misses else None, "shard_p50_ms": server_ms[0],
        }  # fmt: skip
        return res.rows_per_s(stream.ids_per_request), io
    finally:
        await client.aclose()


def _make_client(args: argparse.Namespace, plan: Any, table: Any, feature: Any, cluster: Any, lookup_cfg: Any, near_rows: int) -> Any:
    from recserve.lookup.client import LookupClient
    from recserve.lookup.config import LookupClientConfig

    lookup = dataclasses.replace(lookup_cfg, target_ids=args.target_ids, max_inflight_batches=args.max_inflight, near_cache_rows=near_rows)
    return LookupClient.connect(LookupClientConfig(tables=(table,), features=(feature,), lookup=lookup), plan, cluster.client_addresses)


async def _network_modes(
    args: argparse.Namespace, plan: Any, table: Any, feature: Any, weights: np.ndarray, stream: Any, cluster: Any,
    lookup_cfg: Any, near_rows: int, redis_proc: Any, bare: Any = None,
) -> dict[str, Any]:
    from recserve.bench import lookup_capacity as cap
    from recserve.bench.lookup_modes import closed_loop, make_kjt, naive_handler, open_loop
    from recserve.bench.sweep import percentile_ms
    from recserve.lookup.transport import GrpcShardTransport

    k = stream.ids_per_request
    client = _make_client(args, plan, table, feature, cluster, lookup_cfg, near_rows)
    await client.start()
    checks: dict[int, np.ndarray] = {}
    # Callers (a ranker) hold their features as a KJT already: build them before timing.
    _log("building request KJTs")
    kjts = [make_kjt(stream.ids[i], stream.lengths, stream.feature) for i in range(min(args.prebuilt_kjts, stream.ids.shape[0]))]

    def kjt_of(i: int) -> Any:
        return kjts[i] if i < len(kjts) else make_kjt(stream.ids[i], stream.lengths, stream.feature)

    async def fp(i: int) -> None:
        res = await client.lookup(kjt_of(i), pooled=True, timeout_s=5.0)
        if i < args.check_requests and res.pooled is not None:
            checks[i] = res.pooled.values().numpy()

    # The bare ceiling's client (recserve.bench.bare), open for the whole run; the pooled
    # sums of the checked requests it served are compared with the weights' own.
    bare_client = None if bare is None else await bare.client(stream.lengths).__aenter__()
    bare_checks: dict[int, np.ndarray] = {}

    async def bare_fp(i: int) -> None:
        assert bare_client is not None
        pooled = await bare_client.lookup(stream.ids[i])
        if i < args.check_requests:
            bare_checks[i] = pooled

    report: dict[str, Any] = {"rows_per_s": dict.fromkeys(MODES), "rows_per_s_c_high": {}}
    total = stream.ids.shape[0]
    gc.collect()
    gc.freeze()  # start-up objects (torch, torchrec, the stream) leave the GC's working set
    redis: RedisContenders | None = None
    try:
        _log("warm-up")
        await closed_loop(args.concurrency, 1.0, total, fp)
        checks.clear()
        if bare_client is not None:
            await closed_loop(args.concurrency, 0.5, total, bare_fp)
            bare_checks.clear()
        if redis_proc is not None:
            redis = RedisContenders(redis_proc.port, weights, stream, plan, max(c for c in (args.concurrency, args.concurrency_high) if c), log=_log)
            _log("redis warm-up")
            await redis.warm_up(args.concurrency, min(1.0, args.seconds))
        before = await _shard_counters(client)
        stats0 = dict(client.stats.as_dict())
        hits0, lookups0 = _near(client)
        # Interleaved rounds (recserve.bench.rounds): the client, then each Redis mode, in
        # turn; ratios are taken within a round, so each compares runs seconds apart.
        # Redis does not touch the client or the shards: the client's counters below
        # cover its own segments only.
        segment_s = args.seconds / args.rounds
        rounds: list[dict[str, float | None]] = []
        fp_requests, fp_seconds = 0, 0.0
        window = 1
        for r in range(args.rounds):
            _log(f"round {r + 1}/{args.rounds}: feature-parallel client, C={args.concurrency}")
            res = await closed_loop(args.concurrency, segment_s, total, fp)
            fp_requests, fp_seconds = fp_requests + res.requests, fp_seconds + res.seconds
            entry: dict[str, float | None] = {"feature_parallel": res.rows_per_s(k), "redis_mget": None, "redis_mget_dedup": None, "bare_ceiling": None}
            if r == 0:  # Redis's dedup windows hold as many requests as the client's did
                now = client.stats.as_dict()
                window = max(1, int(round((now["callers"] - stats0["callers"]) / max(now["windows"] - stats0["windows"], 1))))
            if redis is not None:
                got = await redis.measure(args.concurrency, segment_s, window)
                entry.update(redis_mget=got["per_request"], redis_mget_dedup=got["dedup"], redis_mget_asyncio=got["per_request_asyncio"],
                             redis_mget_threads=got["per_request_threads"])  # fmt: skip
            if bare is not None:
                _log(f"bare ceiling (raw-bytes shards, numpy client), C={args.concurrency}")
                entry["bare_ceiling"] = (await closed_loop(args.concurrency, segment_s, total, bare_fp)).rows_per_s(k)
            rounds.append(entry)
        after = await _shard_counters(client)
        server_ms = await _server_latency_ms(client)
        stats1 = client.stats.as_dict()
        hits1, lookups1 = _near(client)
        report["c64_rounds"] = with_ratios(rounds, RATIO_PAIRS)
        for mode in ("feature_parallel", "redis_mget", "redis_mget_dedup", "bare_ceiling"):
            report["rows_per_s"][mode] = median_of(rounds, mode)
        report["bare_matches_oracle"] = _bare_check(weights, stream, bare_checks) if bare is not None else None
        report["redis_window_requests"] = window if redis is not None else None
        report["redis_rows_per_s"] = {}
        if redis is not None:  # medians over the rounds, under the keys of the C-high entry
            report["redis_rows_per_s"][str(args.concurrency)] = {
                "per_request_asyncio": median_of(rounds, "redis_mget_asyncio"), "per_request_threads": median_of(rounds, "redis_mget_threads"),
                "per_request": median_of(rounds, "redis_mget"), "dedup": median_of(rounds, "redis_mget_dedup"),
            }  # fmt: skip
        fp_req_per_s = fp_requests / fp_seconds if fp_seconds > 0 else 0.0
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
            "dedup_route": d["prep_s"] * per_window,  # merge, dedup, near cache, routing
            "serialisation": d["serialise_s"] * per_window,  # packing requests, decoding replies
            "rpc": d["rpc_wall_s"] * per_window,  # first send to last reply (wall)
            "gather": (d["scatter_s"] + d["gather_s"]) * per_window,  # rows into window matrices, per-caller takes
            "pooling": d["pool_s"] * per_window,  # embedding_bag + per-caller results
        }
        report["_checks"] = dict(checks)
        if args.concurrency_high:
            _log(f"feature-parallel client, C={args.concurrency_high}")
            res = await closed_loop(args.concurrency_high, args.seconds, total, fp)
            report["rows_per_s_c_high"]["feature_parallel"] = res.rows_per_s(k)

        _log("naive: one RPC per request per shard")
        naive_transport = GrpcShardTransport(cluster.client_addresses)
        naive = naive_handler(naive_transport, plan, stream, table.dim)
        try:
            res = await closed_loop(args.concurrency, args.seconds, total, naive)
            report["rows_per_s"]["naive"] = res.rows_per_s(k)
            if redis is not None and args.concurrency_high:
                high = await redis.measure(args.concurrency_high, args.seconds, window)
                report["redis_rows_per_s"][str(args.concurrency_high)] = high
                report["rows_per_s_c_high"].update(redis_mget=high["per_request"], redis_mget_dedup=high["dedup"])

            rate = args.rate if args.rate is not None else 0.5 * fp_req_per_s
            _log(f"open loop at {rate:.0f} requests/s")
            latencies, failures = await open_loop(rate, args.open_loop_seconds, total, fp, seed=args.seed + 1)
            report["open_loop_rate_per_s"] = rate
            report["p50_ms"] = percentile_ms(latencies, 50)
            report["p99_ms"] = percentile_ms(latencies, 99)
            report["open_loop_requests"] = int(latencies.size)
            report["open_loop_failures"] = failures

            _log(f"unloaded: open loop at {args.unloaded_rate:g} requests/s")
            latencies, failures = await open_loop(args.unloaded_rate, args.unloaded_seconds, total, fp, seed=args.seed + 3)
            report["unloaded_rate_per_s"] = args.unloaded_rate
            report["unloaded_p50_ms"] = percentile_ms(latencies, 50)
            report["unloaded_p99_ms"] = percentile_ms(latencies, 99)
            report["bare_unloaded_p50_ms"] = None
            if bare_client is not None:
                _log(f"bare ceiling unloaded: open loop at {args.unloaded_rate:g} requests/s")
                latencies, _ = await open_loop(args.unloaded_rate, args.unloaded_seconds, total, bare_fp, seed=args.seed + 3)
                report["bare_unloaded_p50_ms"] = percentile_ms(latencies, 50)

            report["knees"] = None
            if not args.no_knees:
                closed = {name: (v or 0.0) / k for name, v in report["rows_per_s"].items()}  # requests/s closed loop
                report["knees"] = await _knees(args, client, kjt_of, naive, None if redis is None else redis.per_request_handler, closed, total,
                                               bare=None if bare_client is None else bare_fp)  # fmt: skip
        finally:
            await naive_transport.close()
        if args.sweep_rates is not None:
            from recserve.bench.lookup_modes import client_vs_naive_sweep

            rates = ", ".join(f"{r:g}" for r in args.sweep_rates)
            _log(f"open-loop sweep at {rates} requests/s, {args.sweep_seconds:g} s per point and mode")
            report["sweep"] = await client_vs_naive_sweep(
                client, kjts, plan, stream, cluster.client_addresses, args.sweep_rates,
                seconds=args.sweep_seconds, timeout_s=args.sweep_timeout_ms / 1000.0, slo_ms=args.slo_ms, seed=args.seed + 2,
            )  # fmt: skip
        report["reference"] = await _reference(client, weights)
    finally:
        if redis is not None:
            await redis.close()
        if bare_client is not None:
            await bare_client.__aexit__(None, None, None)
        await client.aclose()
    return report


async def _knees(args: argparse.Namespace, client: Any, kjt_of: Any, naive: Any, redis_handle: Any, closed_req_per_s: dict[str, float], total: int,
                 *, bare: Any = None) -> dict[str, Any]:  # fmt: skip
    """Each contender's knee (same arrivals per probe rate, deadline = arrival + SLO): the
    client answers degraded at its deadline, naive and Redis are cancelled and fail."""
    from recserve.bench import lookup_capacity as cap

    slo_s = args.knee_slo_ms / 1000.0

    async def fp(i: int, deadline: float) -> bool:
        return not (await client.lookup(kjt_of(i), pooled=True, deadline=deadline)).degraded

    def timed(handle: Any) -> Any:
        async def run(i: int, deadline: float) -> None:
            await asyncio.wait_for(handle(i), max(deadline - time.monotonic(), 1e-4))

        return run

    contenders: dict[str, Any] = {"feature_parallel": fp, "naive": timed(naive)}
    if redis_handle is not None:
        contenders["redis_mget"] = timed(redis_handle)
    if bare is not None:  # last: the contenders' seeds stay what they were without it
        contenders["bare_ceiling"] = timed(bare)
    out: dict[str, Any] = {}
    for j, (name, handle) in enumerate(contenders.items()):
        # The bracket: from far below any knee to 1.5x the contender's own closed-loop
        # rate (an open-loop knee above its closed-loop capacity would be noise).
        hi = max(4.0 * 25.0, 1.5 * closed_req_per_s.get(name, 0.0))
        _log(f"knee of {name} (bisection in [{25:g}, {hi:,.0f}] req/s, {args.knee_seconds:g} s probes)")
        gc.collect()
        out[name] = await cap.knee_of(handle, lo_rps=25.0, hi_rps=hi, seconds=args.knee_seconds, total=total, slo_s=slo_s, seed=args.seed + 100 * (j + 1),
                                      settle_after_fail_s=args.knee_settle_after_fail_s, fail_retries=args.fail_retries)  # fmt: skip
    return out


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


async def _reference(client: Any, weights: np.ndarray) -> dict[str, float]:
    """Figures from docs/architecture.md §10 measured in this run: loopback unary RTT and a local
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


def _bare_check(weights: np.ndarray, stream: Any, checks: dict[int, np.ndarray]) -> bool | None:
    """Whether the bare ceiling's pooled sums [B, D] equal the bags' fp64 sums of the
    weights (to fp32 rounding): it must do the work it is timed for. None: no request
    of the checked range was served while timed."""
    if not checks:
        return None
    starts = stream.bag_starts().tolist()
    ends = starts[1:] + [stream.ids_per_request]
    for i, got in checks.items():
        rows = weights[stream.ids[i]].astype(np.float64)
        want = np.stack([rows[a:b].sum(axis=0) for a, b in zip(starts, ends)])
        if got.shape != want.shape or not np.allclose(got, want, rtol=1e-5, atol=1e-4):
            return False
    return True


def _ratios(report: dict[str, Any]) -> None:
    """The issue's ratios under explicit names (None where a side was not measured)."""
    from recserve.bench.lookup_modes import safe_ratio

    rows = report["rows_per_s"]
    high = report.get("rows_per_s_c_high") or {}
    fp = rows["feature_parallel"]
    best_redis = max((v for v in (rows.get("redis_mget"), rows.get("redis_mget_dedup")) if v is not None), default=None)
    report["speedup_vs_naive"] = safe_ratio(fp, rows["naive"])
    report["speedup_vs_redis"] = safe_ratio(fp, best_redis)  # the landed key: the better Redis mode
    # C=64: the median of the interleaved rounds' own ratios (recserve.bench.rounds), and
    # their spread; a report without rounds falls back to the ratio of the figures.
    rounds = report.get("c64_rounds")
    for key, (num, den) in RATIO_PAIRS.items():
        report[key] = median_ratio(rounds, num, den) if rounds else safe_ratio(rows.get(num), rows.get(den))
        report[f"{key}_spread"] = ratio_spread(rounds, num, den) if rounds else None
    report["speedup_vs_redis_per_request_c256"] = safe_ratio(high.get("feature_parallel"), high.get("redis_mget"))
    report["speedup_vs_redis_dedup_c256"] = safe_ratio(high.get("feature_parallel"), high.get("redis_mget_dedup"))
    report["fraction_of_local"] = safe_ratio(fp, rows["torchrec_local"])
    knees = report.get("knees") or {}

    def knee(name: str) -> float | None:
        return (knees.get(name) or {}).get("knee_per_s")

    report["knee_per_s"] = {name: knee(name) for name in knees} if knees else None
    report["knee_ratio_vs_redis"] = safe_ratio(knee("feature_parallel"), knee("redis_mget"))
    report["knee_ratio_vs_naive"] = safe_ratio(knee("feature_parallel"), knee("naive"))
    report["bare_knee_ratio_vs_redis"] = safe_ratio(knee("bare_ceiling"), knee("redis_mget"))  # the ceiling's own
    report["knee_ratio_vs_bare"] = safe_ratio(knee("feature_parallel"), knee("bare_ceiling"))
    tiered = report.get("tiered_rows_per_s")
    report["equal_memory_vs_tiered"] = safe_ratio(fp, tiered)  # goal: <= 2
    if isinstance(report.get("tiered"), dict):  # the best ratio the disk allows (see _tiered)
        report["tiered"]["equal_memory_vs_io_floor"] = safe_ratio(fp, report["tiered"].get("io_floor_rows_per_s"))


def _spread(v: list[float] | None) -> str:
    return "n/a" if not v else f"{v[0]:.2f}-{v[1]:.2f}"


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
        f"C={c['concurrency']} vs redis, median of {len(r.get('c64_rounds') or [])} interleaved rounds: per request {f(r['speedup_vs_redis_per_request_c64'], '.2f')} "
        f"(rounds {_spread(r.get('speedup_vs_redis_per_request_c64_spread'))})   dedup windows {f(r['speedup_vs_redis_dedup_c64'], '.2f')} "
        f"(rounds {_spread(r.get('speedup_vs_redis_dedup_c64_spread'))})",
        f"bare ceiling (raw-bytes shards, numpy client; all rows in DRAM) in the same rounds: vs redis per request "
        f"{f(r.get('bare_vs_redis_per_request_c64'), '.2f')}   vs redis dedup {f(r.get('bare_vs_redis_dedup_c64'), '.2f')}   "
        f"client / bare {f(r.get('client_vs_bare_c64'), '.2f')} (rounds {_spread(r.get('client_vs_bare_c64_spread'))})   oracle match {r.get('bare_matches_oracle')}",
        f"  bare ceiling unloaded p50 {f(r.get('bare_unloaded_p50_ms'), '.2f')} ms (client {f(r.get('unloaded_p50_ms'), '.2f')})   "
        f"bare knee vs redis {f(r.get('bare_knee_ratio_vs_redis'), '.2f')}   client knee / bare knee {f(r.get('knee_ratio_vs_bare'), '.2f')}",
        f"dedup ratio {f(r['dedup_ratio'], '.2f')}   near-cache hit rate {f(r['near_cache_hit_rate'], '.3f')}   shard row-cache hit rate {f(r['row_cache_hit_rate'], '.3f')}",
        f"open loop at {f(r['open_loop_rate_per_s'])} req/s: p50 {f(r['p50_ms'], '.2f')} ms  p99 {f(r['p99_ms'], '.2f')} ms  ({r['open_loop_requests']} requests, {r['open_loop_failures']} failed)",
        f"pooled output matches TorchRec: {r['pooled_matches_torchrec']} (max |err| {r['max_abs_err']}, {r['checked_requests']} requests)",
    ]
    if r.get("redis_reason"):
        lines.append(f"redis: {r['redis_reason']}")
    from recserve.bench.lookup_capacity import format_capacity

    lines += format_capacity(r)
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
