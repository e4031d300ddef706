"""``recserve bench sharding``: row-only vs hybrid plans through real shard processes.

One Zipf lookup stream (ids drawn i.i.d. from a Zipf(A) popularity scattered over the
id space) is cut into windows of ``--window-lookups`` draws, each deduplicated as the
lookup client does (docs/architecture.md §5), and replayed open-loop (Poisson window arrivals at
``--rate`` per second) through ``--shards`` real shard processes, once per plan:

- ``row_only``: every id cold, row-sharded on the ring;
- ``hybrid``: top 1% hot (replicated), next 10% warm (column-split ``--column-splits``
  ways), rest cold;
- ``hybrid_no_colsplit``: the same with warm rows whole.

Per plan, from the servers' own ``ShardInfo`` counters (deltas over the replay):
``imbalance`` = max/mean (slice-)rows served per shard, ``rows_per_cpu_s`` = rows
served / server CPU seconds, ``p99_ms`` = the worst shard's p99 service time, and each
shard's RSS and DRAM tier bytes beside the planner's DRAM estimate. Also the
planner's expected imbalance on the same stream, the client-side window p99, and, as
the same-run reference, a local ``np.take`` gather rate. Top level:
``remap_fraction_on_add`` (cold ids moved when a shard is added to the hybrid plan)
and ``expected_remap`` = 1/(S+1).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TABLE = "item"
VARIANTS = ("row_only", "hybrid", "hybrid_no_colsplit")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--items", type=int, default=100_000, help="rows of the table (default 100000)")
    parser.add_argument("--dim", type=int, default=64, help="row width (default 64)")
    parser.add_argument("--shards", type=int, default=4, help="shard processes (default 4)")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the access stream (default 1.05)")
    parser.add_argument("--column-splits", type=int, default=2, help="warm column splits of the hybrid plan (default 2)")
    parser.add_argument("--windows", type=int, default=300, help="windows replayed per plan (default 300)")
    parser.add_argument("--window-lookups", type=int, default=4096, help="lookups per window before dedup (default 4096)")
    parser.add_argument("--rate", type=float, default=30.0, help="Poisson window arrivals per second (default 30; keep shards below saturation)")
    parser.add_argument("--threads", type=int, default=1, help="threads per shard process (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None, help="keep shard data here (default: a temp dir, removed)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


@dataclasses.dataclass
class Replay:
    window_latencies_s: list[float]
    rpcs: int
    rows_expected: Any  # float64 [S]: the planner's model on this exact stream


def _group(ids: Any, dest: Any, num_shards: int) -> list[Any]:
    """Split ids [N] by destination shard [N] -> S arrays (one argsort, no per-id loop)."""
    import numpy as np

    order = np.argsort(dest, kind="stable")
    cuts = np.searchsorted(dest[order], np.arange(1, num_shards))
    return np.split(np.take(ids, order), cuts)


def _window_requests(plan: Any, ids: Any) -> dict[int, Any]:
    """One LookupRequest per destination shard for a deduplicated window ``ids``: hot
    ids spread evenly over their replicas, warm ids to every slice shard (one
    TableLookup per slice), cold ids to the ring owner."""
    import numpy as np

    from recserve.rpc.tensors import pack
    from recserve.v1 import embedding_pb2

    t, s = plan.tables[TABLE], plan.num_shards
    rt = plan.router(TABLE).route(ids)
    replica = np.arange(len(rt.hot_index)) % t.hot_replicas
    full_ids = np.concatenate([np.take(ids, rt.hot_index), np.take(ids, rt.cold_index)])
    full_dest = np.concatenate([np.take_along_axis(rt.hot_shards, replica[:, None], axis=1)[:, 0], rt.cold_shards[:, 0]])
    requests: dict[int, Any] = {}

    def add(shard: int, part: Any, cols: tuple[int, int]) -> None:
        if len(part):
            req = requests.setdefault(shard, embedding_pb2.LookupRequest())
            req.tables.add(table=TABLE, ids=pack(np.sort(part)), col_start=cols[0], col_end=cols[1])

    for shard, part in enumerate(_group(full_ids, full_dest, s)):
        add(shard, part, (0, 0))
    warm_ids = np.take(ids, rt.warm_index)
    for k, cols in enumerate(t.col_bounds()):
        for shard, part in enumerate(_group(warm_ids, rt.warm_shards[:, k], s)):
            add(shard, part, cols if t.column_splits > 1 else (0, 0))
    return requests


async def _replay(plan: Any, addresses: list[str], windows: list[Any], rate: float, seed: int) -> Replay:
    """Open loop: window i starts at its Poisson arrival time whether or not earlier
    windows have finished; its latency is until its last shard reply."""
    import grpc
    import numpy as np

    from recserve.bench.arrivals import poisson_arrivals
    from recserve.sharding.estimates import expected_owner_counts
    from recserve.v1 import embedding_pb2_grpc

    # Route and encode every window before the clock starts: the sender then does no
    # CPU work between arrivals, so it neither delays arrivals nor steals the cores the
    # shards are measured on (2 cores here, shared by the client and every shard).
    prepared = [_window_requests(plan, w) for w in windows]
    expected = np.sum([expected_owner_counts(plan, TABLE, w) for w in windows], axis=0)
    rpcs = sum(len(r) for r in prepared)
    options = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
    channels = [grpc.aio.insecure_channel(a, options=options) for a in addresses]
    stubs = [embedding_pb2_grpc.EmbeddingShardStub(c) for c in channels]
    arrivals = poisson_arrivals(rate, count=len(windows), rng=np.random.default_rng(seed))
    latencies: list[float] = []

    async def one(requests: dict[int, Any], started: float) -> None:
        await asyncio.gather(*(stubs[k].Lookup(r, timeout=30) for k, r in requests.items()))
        latencies.append(time.monotonic() - started)

    tasks = []
    t0 = time.monotonic()
    for requests, at in zip(prepared, arrivals):
        delay = t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        # Latency from the scheduled arrival, not from when the sender got to it, so a
        # late sender shows up in the figure instead of hiding (open loop).
        tasks.append(asyncio.create_task(one(requests, t0 + at)))
    await asyncio.gather(*tasks)
    for c in channels:
        await c.close(None)
    return Replay(window_latencies_s=latencies, rpcs=rpcs, rows_expected=expected)


def _infos(addresses: list[str]) -> list[Any]:
    import grpc

    from recserve.v1 import embedding_pb2, embedding_pb2_grpc

    out = []
    for a in addresses:
        with grpc.insecure_channel(a) as ch:
            out.append(embedding_pb2_grpc.EmbeddingShardStub(ch).ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=10))
    return out


def _run_plan(name: str, result: Any, root: Path, source_dir: Path, windows: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from recserve.bench.sweep import percentile_ms
    from recserve.cluster import ShardCluster
    from recserve.config.spec import ShardServerConfig

    plan = result.plan
    plan_path = root / f"plan-{name}.json"
    plan.save(plan_path)
    server = ShardServerConfig(threads=args.threads, max_ids_per_rpc=1 << 20)
    with ShardCluster(plan_path, root / name, server=server, load_from=source_dir, start_timeout_s=300) as cluster:
        before = _infos(cluster.addresses)
        replay = asyncio.run(_replay(plan, cluster.addresses, windows, args.rate, args.seed))
        after = _infos(cluster.addresses)
    served = np.array([(a.rows_served_hot + a.rows_served_warm + a.rows_served_cold) - (b.rows_served_hot + b.rows_served_warm + b.rows_served_cold) for a, b in zip(after, before)], dtype=np.float64)
    cpu = float(sum(a.cpu_seconds - b.cpu_seconds for a, b in zip(after, before)))
    t = plan.tables[TABLE]
    est = result.estimate
    return {
        "hot_rows": int(t.hot_ids.size),
        "warm_rows": int(t.warm_ids.size),
        "column_splits": int(t.column_splits),
        "rows_served_per_shard": served.astype(int).tolist(),
        "rows_expected_per_shard": np.round(replay.rows_expected, 1).tolist(),
        "imbalance": float(served.max() / served.mean()) if served.mean() > 0 else 1.0,
        "expected_imbalance": float(replay.rows_expected.max() / replay.rows_expected.mean()),
        "planner_imbalance": float(est.imbalance),
        "planner_lookup_imbalance_no_dedup": float(est.lookup_imbalance),
        "rows_per_cpu_s": float(served.sum() / cpu) if cpu > 0 else 0.0,
        "server_cpu_s": cpu,
        "p50_ms": float(max(a.p50_ms for a in after)),
        "p99_ms": float(max(a.p99_ms for a in after)),
        "p99_ms_per_shard": [round(a.p99_ms, 3) for a in after],
        "client_window_p99_ms": percentile_ms(np.asarray(replay.window_latencies_s), 99),
        "rpcs": replay.rpcs,
        "memory_rss_bytes_per_shard": [int(a.rss_bytes) for a in after],
        # The servers' own DRAM tier sizes (hot + warm tensors), to read against the
        # planner's DRAM estimate; RSS also holds the interpreter, gRPC and RocksDB.
        "dram_tier_bytes_per_shard": [int(sum(t.hot_bytes + t.warm_bytes for t in a.tables)) for a in after],
        "planner_dram_bytes_per_shard": est.bytes_per_shard["dram"].astype(int).tolist(),
        "planner_rocksdb_bytes_per_shard": est.bytes_per_shard["rocksdb"].astype(int).tolist(),
        "errors": int(sum(a.errors for a in after)),
    }


def _gather_reference(items: int, dim: int, n: int, seed: int) -> float:
    """Rows/s of one-core ``np.take`` of ``n`` random rows from an [items, dim] fp32
    table: the DRAM gather speed the shards' rows/CPU-s is to be read against."""
    import numpy as np

    rng = np.random.default_rng(seed)
    table = rng.standard_normal((items, dim)).astype(np.float32)
    ids = rng.integers(0, items, n)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        np.take(table, ids, axis=0)
        best = min(best, time.perf_counter() - started)
    return n / best


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from recserve.catalog import sample_lookup_stream, zipf_weights
    from recserve.config.spec import ShardingConfig, TableConfig
    from recserve.sharding.planner import plan_variants
    from recserve.sharding.replan import replan_add_shard

    rng = np.random.default_rng(args.seed)
    popularity = zipf_weights(args.items, args.zipf)[rng.permutation(args.items)]  # hot ids scattered
    stream = sample_lookup_stream(popularity, args.windows * args.window_lookups, rng)
    windows = [np.unique(w) for w in np.split(stream, args.windows)]
    table = TableConfig(name=TABLE, rows=args.items, dim=args.dim)
    sharding = ShardingConfig(num_shards=args.shards, column_splits=args.column_splits, hot_replicas=min(2, args.shards))
    results = plan_variants([table], {TABLE: popularity}, sharding, seed=args.seed, window_lookups=args.window_lookups)
    with tempfile.TemporaryDirectory(prefix="bench-sharding-") as tmp:
        root = Path(args.data_dir) if args.data_dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        source_dir = root / "source"
        source_dir.mkdir(exist_ok=True)
        np.save(source_dir / f"{TABLE}.npy", rng.standard_normal((args.items, args.dim)).astype(np.float32))
        plans = {}
        for name in VARIANTS:
            print(f"bench sharding: {name} ...", file=sys.stderr, flush=True)
            plans[name] = _run_plan(name, results[name], root, source_dir, windows, args)
    _, remap = replan_add_shard(results["hybrid"].plan)
    unique = np.array([len(w) for w in windows])
    report = {
        "items": args.items, "dim": args.dim, "shards": args.shards, "zipf": args.zipf,
        "windows": args.windows, "window_lookups": args.window_lookups, "unique_ids_per_window": float(unique.mean()),
        "rate_windows_per_s": args.rate, "threads_per_shard": args.threads,
        "plans": plans,
        "ratios": {
            "imbalance_row_only_over_hybrid": plans["row_only"]["imbalance"] / plans["hybrid"]["imbalance"],
            "imbalance_row_only_over_hybrid_no_colsplit": plans["row_only"]["imbalance"] / plans["hybrid_no_colsplit"]["imbalance"],
            "rows_per_cpu_s_hybrid_over_row_only": plans["hybrid"]["rows_per_cpu_s"] / max(plans["row_only"]["rows_per_cpu_s"], 1e-9),
            "p99_ms_hybrid_over_row_only": plans["hybrid"]["p99_ms"] / max(plans["row_only"]["p99_ms"], 1e-9),
        },
        "reference_local_gather_rows_per_s": _gather_reference(args.items, args.dim, int(unique.mean()), args.seed),
        "remap_fraction_on_add": remap,
        "expected_remap": 1.0 / (args.shards + 1),
    }  # fmt: skip
    if args.json:
        print(json.dumps(report))
    else:
        print(_table(report))
    return 0


def _table(r: dict[str, Any]) -> str:
    mb = 1 << 20
    lines = [
        f"sharding benchmark: {r['items']:,} x {r['dim']} rows, {r['shards']} shards, Zipf {r['zipf']}, "
        f"{r['windows']} windows of {r['window_lookups']:,} lookups (~{r['unique_ids_per_window']:.0f} unique) at {r['rate_windows_per_s']:.0f}/s",
        f"{'plan':<20}{'C':>3}{'imbalance':>11}{'expected':>10}{'rows/cpu-s':>12}{'p99 ms':>9}{'win p99':>9}{'RSS MB/shard':>14}{'DRAM MB':>9}{'est DRAM MB':>13}",
    ]
    for name, p in r["plans"].items():
        lines.append(
            f"{name:<20}{(p['column_splits'] if p['warm_rows'] else '-'):>3}{p['imbalance']:>11.3f}{p['expected_imbalance']:>10.3f}{p['rows_per_cpu_s']:>12,.0f}"
            f"{p['p99_ms']:>9.2f}{p['client_window_p99_ms']:>9.2f}{max(p['memory_rss_bytes_per_shard']) / mb:>14.1f}"
            f"{max(p['dram_tier_bytes_per_shard']) / mb:>9.2f}"
            f"{max(p['planner_dram_bytes_per_shard']) / mb:>13.2f}"
        )
    q = r["ratios"]
    lines += [
        f"imbalance row_only / hybrid = {q['imbalance_row_only_over_hybrid']:.2f}x, / hybrid_no_colsplit = {q['imbalance_row_only_over_hybrid_no_colsplit']:.2f}x; "
        f"rows/cpu-s hybrid / row_only = {q['rows_per_cpu_s_hybrid_over_row_only']:.2f}x",
        f"reference: local np.take gather {r['reference_local_gather_rows_per_s']:,.0f} rows/s (one core, same run)",
        f"remap on adding a shard: {r['remap_fraction_on_add']:.4f} of cold ids (expected 1/(S+1) = {r['expected_remap']:.4f})",
    ]
    return "\n".join(lines)
