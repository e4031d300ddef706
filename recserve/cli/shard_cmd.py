"""``recserve shard``: run, load and inspect embedding shard servers.

- ``recserve shard serve --plan PLAN --shard-id K --data DIR --port P [--load-from SRC [--overwrite]]``
  runs one shard process (gRPC EmbeddingShard + health + reflection, Prometheus
  ``/metrics`` on ``--metrics-port``) until SIGTERM.
- ``recserve shard load --plan PLAN --shard-id K --data DIR --from SRC`` bulk-loads the
  shard's owned rows into RocksDB (idempotent: a re-run is skipped via the manifest).
  Both refuse to load over upserts newer than the store's last load unless ``--overwrite``.
- ``recserve shard migrate --from-plan OLD --to-plan NEW --from-data ROOT --to-data ROOT``
  copies every row, upserts included, from the old plan's shards (``ROOT/shard-K``) to
  the new plan's, offline (stop the shards first); the new shards then start without
  ``--load-from``.
- ``recserve shard info --address HOST:PORT`` prints a shard's ShardInfo.
- ``recserve shard plan --out PLAN [--config SPEC] [--catalog DIR] [--shards S]`` plans
  the spec's tables (item popularity from a catalog) and prints the planner's estimates.

Argument parsing only at import; grpc, numpy and RocksDB load inside ``run``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

ADMIN_TOKEN_ENV = "RECSERVE_ADMIN_TOKEN"  # [admin] token_env's default; --admin-token-env overrides


def _int_bytes(text: str) -> int:
    """Parse ``67108864``, ``64M``, ``1G``, ``512k`` as bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("b")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 67108864, 64M, 1G)") from None


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("shard", help="embedding shard servers: serve, bulk load, info")
    sub = parser.add_subparsers(dest="shard_command", metavar="ACTION")

    serve = sub.add_parser("serve", help="run one shard server process")
    _add_common(serve)
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=0, help="TCP port (0 = pick a free one; see --port-file)")
    serve.add_argument("--port-file", default=None, help="write the bound port here once listening")
    serve.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics HTTP port (0 = a free one, -1 = none; default 0)")
    serve.add_argument("--metrics-port-file", default=None, help="write the bound metrics port here (atomically) before listening for gRPC")
    serve.add_argument("--unix-socket", default=None, help="also listen on this Unix domain socket path (clients on this host: unix:PATH)")
    serve.add_argument("--load-from", default=None, help="bulk-load this source first if not loaded yet (dir of <table>.npy, .npz, .npy)")
    serve.add_argument("--overwrite", action="store_true", help="let --load-from overwrite upserts acknowledged since the last load (they are lost)")
    serve.add_argument("--row-cache-bytes", type=_int_bytes, default=None, help="cold-row LRU cache bound (default 64M)")
    serve.add_argument("--block-cache-bytes", type=_int_bytes, default=None, help="RocksDB block cache (default 64M)")
    serve.add_argument("--threads", type=int, default=None, help="gather threads and torch/BLAS threads (default 1)")
    serve.add_argument("--max-ids-per-rpc", type=int, default=None, help="larger requests get RESOURCE_EXHAUSTED (default 262144)")
    serve.add_argument("--max-message-bytes", type=_int_bytes, default=None, help="gRPC send/receive limit (default 256M)")
    serve.add_argument("--max-bags-per-rpc", type=int, default=None, help="pooled lookups with more bags get INVALID_ARGUMENT (default 1048576)")
    serve.add_argument("--tier-dtype", choices=("plan", "float32", "float16", "int8"), default="plan", help="DRAM hot/warm tier element type (default: each table's plan dtype)")
    serve.add_argument("--default-value", type=float, default=0.0, help="fill value of the default row for missing ids")
    serve.add_argument("--admin-token", default=None, help="require this token on Upsert (prefer the variable --admin-token-env names: a flag shows in ps)")
    serve.add_argument("--admin-token-env", default=ADMIN_TOKEN_ENV, help=f"read the admin token from this variable ([admin] token_env; default ${ADMIN_TOKEN_ENV})")
    serve.add_argument("--insecure-admin", action="store_true", help="accept Upsert without a token (only when no token is set; never on a shared network)")
    serve.add_argument("--sync-writes", action="store_true", help="fsync the WAL on every upsert (power-loss durability)")
    serve.add_argument("--fault-hook", action="store_true", help="TEST ONLY: enable injected latency/errors (also RECSERVE_FAULT_HOOK=1)")
    serve.add_argument("--load-gate", default=None, help="TEST ONLY (needs --fault-hook): wait for this file before loading tiers")
    serve.set_defaults(func=run)

    load = sub.add_parser("load", help="bulk-load a shard's owned rows into RocksDB (idempotent)")
    _add_common(load)
    load.add_argument("--from", dest="source", required=True, help="source: dir of <table>.npy, .npz, or .npy for a one-table plan")
    load.add_argument("--method", choices=("sst", "batch"), default="sst", help="SST ingestion (default) or WAL-less write batches + flush")
    load.add_argument("--force", action="store_true", help="load again even if the manifest records this load (overwrites upserts)")
    load.add_argument("--overwrite", action="store_true", help="load even over upserts acknowledged since the last load (they are lost)")
    load.add_argument("--json", action="store_true", help="print the load report as one JSON object")
    load.set_defaults(func=run)

    migrate = sub.add_parser(
        "migrate", help="copy every row (upserts included) from an old plan's shards to a new plan's (offline)",
        description="Copy every row, upserts included, from the stopped shards of OLD (data in FROM/shard-K) to the "
        "owners under NEW (written to TO/shard-K): hot replicas, warm column slices, cold owners. Stop the shards "
        "first: a running shard holds its RocksDB lock. Idempotent; the new shards then start without --load-from.",
    )  # fmt: skip
    migrate.add_argument("--from-plan", required=True, help="the plan the old shards served")
    migrate.add_argument("--to-plan", required=True, help="the new plan (e.g. one more shard: recserve.sharding.replan)")
    migrate.add_argument("--from-data", required=True, help="the old cluster's data root: shard K's RocksDB is in FROM/shard-K/rocksdb")
    migrate.add_argument("--to-data", required=True, help="the new cluster's data root (another directory; created)")
    migrate.add_argument("--overwrite", action="store_true", help="re-run even over upserts the new shards acknowledged since")
    migrate.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    migrate.set_defaults(func=run)

    info = sub.add_parser("info", help="print a running shard's ShardInfo")
    info.add_argument("--address", required=True, help="HOST:PORT of the shard")
    info.set_defaults(func=run)

    plan = sub.add_parser("plan", help="plan the cluster spec's tables into a sharding plan JSON, with estimates")
    plan.add_argument("--out", required=True, help="where to write the plan JSON")
    plan.add_argument("--config", default=None, help="cluster spec TOML (default: the embedded spec)")
    plan.add_argument("--catalog", default=None, help="catalog dir: its item popularity is the access-frequency estimate of tables with as many rows as it has items")
    plan.add_argument("--shards", type=int, default=None, help="override sharding.num_shards")
    plan.add_argument("--version", type=int, default=1, help="plan version (bump on every re-plan)")
    plan.add_argument("--json", action="store_true", help="print the estimates as one JSON object")
    plan.set_defaults(func=run)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", required=True, help="sharding plan JSON (recserve.sharding)")
    p.add_argument("--shard-id", type=int, required=True, help="this shard's index in the plan")
    p.add_argument("--data", required=True, help="the shard's data directory (RocksDB lives in DIR/rocksdb)")


def run(args: argparse.Namespace) -> int:
    if args.shard_command == "serve":
        return _serve(args)
    if args.shard_command == "load":
        return _load(args)
    if args.shard_command == "plan":
        return _plan(args)
    if args.shard_command == "migrate":
        return _migrate(args)
    return _info(args)


def _server_config(args: argparse.Namespace) -> Any:
    import dataclasses

    from recserve.config.spec import ShardServerConfig

    overrides = {
        "row_cache_bytes": args.row_cache_bytes,
        "block_cache_bytes": args.block_cache_bytes,
        "threads": args.threads,
        "max_ids_per_rpc": args.max_ids_per_rpc,
        "max_bags_per_rpc": args.max_bags_per_rpc,
        "max_message_bytes": args.max_message_bytes,
        "metrics_port": args.metrics_port,
    }
    return dataclasses.replace(ShardServerConfig(), **{k: v for k, v in overrides.items() if v is not None})


def _serve(args: argparse.Namespace) -> int:
    # Pin BLAS/OpenMP pools before numpy loads (several shards share the cores); the
    # launcher also passes these in the environment.
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        os.environ.setdefault(name, str(args.threads or 1))
    from embedding_server.config import ShardProcessConfig
    from embedding_server.server import run_process
    from recserve.logs import register_secret

    config = ShardProcessConfig(
        shard_id=args.shard_id,
        plan_path=args.plan,
        data_dir=args.data,
        host=args.host,
        port=args.port,
        port_file=args.port_file,
        metrics_port_file=args.metrics_port_file,
        unix_socket=args.unix_socket,
        server=_server_config(args),
        tier_dtype=args.tier_dtype,
        default_value=args.default_value,
        admin_token=args.admin_token if args.admin_token is not None else os.environ.get(args.admin_token_env, ""),
        admin_token_env=args.admin_token_env,
        insecure_admin=args.insecure_admin,
        sync_writes=args.sync_writes,
        fault_hook=args.fault_hook or os.environ.get("RECSERVE_FAULT_HOOK", "") not in ("", "0", "false", "False"),
        load_gate_file=args.load_gate,
        load_from=args.load_from,
        overwrite_upserts=args.overwrite,
    )
    register_secret(config.admin_token)  # a token given by flag is masked in logs too (recserve.logs)
    run_process(config)  # exits the process (no interpreter teardown) after a clean stop
    return 0


def _load(args: argparse.Namespace) -> int:
    from embedding_server.bulk_load import LoadMethod, bulk_load, open_source, source_model_version, source_model_versions
    from embedding_server.layout import layouts_from_plan
    from embedding_server.server import data_paths
    from embedding_server.store import RowStore
    from recserve.sharding.plan import ShardingPlan

    plan = ShardingPlan.load(args.plan)
    layouts = layouts_from_plan(plan, args.shard_id)
    source, source_id = open_source(args.source, sorted(layouts))
    store = RowStore(data_paths(args.data), {n: l.dim for n, l in layouts.items()})
    try:
        report = bulk_load(
            store, layouts, source, source_id=source_id, plan_version=plan.version, shard_id=args.shard_id,
            method=LoadMethod(args.method), force=args.force, overwrite=args.overwrite, progress=not args.json and sys.stderr.isatty(),
            model_version=source_model_version(args.source), model_versions=source_model_versions(args.source),
        )  # fmt: skip
    finally:
        store.close()
    doc = {
        "key": report.key, "skipped": report.skipped, "rows_written": report.rows_written, "seconds": round(report.seconds, 3),
        "method": report.method.value, "overwritten_upserts": report.overwritten_upserts,
    }  # fmt: skip
    if args.json:
        print(json.dumps(doc))
    else:
        state = "already loaded (skipped)" if report.skipped else f"loaded {sum(report.rows_written.values()):,} rows in {report.seconds:.2f} s"
        print(f"shard {args.shard_id}: {state} [{report.key}]")
    return 0


def _migrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from embedding_server.migrate import migrate
    from embedding_server.server import data_paths
    from embedding_server.store import RowStore
    from recserve.cluster.shards import shard_data_dir
    from recserve.errors import ConfigError
    from recserve.sharding.plan import ShardingPlan

    old, new = ShardingPlan.load(args.from_plan), ShardingPlan.load(args.to_plan)
    from_root, to_root = Path(args.from_data).resolve(), Path(args.to_data).resolve()
    if from_root == to_root:
        raise ConfigError(f"--to-data {args.to_data!r} is --from-data: migrate into another directory (the old one stays as the rollback)")
    old_paths = [data_paths(shard_data_dir(from_root, i)) for i in range(old.num_shards)]
    absent = [str(p) for p in old_paths if not (p / "CURRENT").exists()]
    if absent:
        raise ConfigError(f"--from-data {args.from_data!r}: plan v{old.version} has {old.num_shards} shards but these hold no RocksDB: {absent}")
    stores: list[RowStore] = []
    try:  # opening takes each RocksDB's lock: a shard still running fails here, clearly
        olds = [RowStore(p, {n: t.dim for n, t in old.tables.items()}) for p in old_paths]
        stores += olds
        news = [RowStore(data_paths(shard_data_dir(to_root, j)), {n: t.dim for n, t in new.tables.items()}) for j in range(new.num_shards)]
        stores += news
        report = migrate(old, new, olds, news, overwrite=args.overwrite, progress=not args.json and sys.stderr.isatty())
    finally:
        for store in stores:
            store.close()
    doc = {
        "from_plan_version": report.from_version, "to_plan_version": report.to_version, "to_data": str(to_root),
        "rows_written": {str(j): rows for j, rows in report.rows_written.items()}, "ids_incomplete": report.ids_incomplete,
        "carried_upserts": report.carried_upserts, "carried_rows": report.carried_rows, "tables_dropped": report.tables_dropped,
        "seconds": round(report.seconds, 3),
    }  # fmt: skip
    if args.json:
        print(json.dumps(doc))
        return 0
    print(f"migrated plan v{report.from_version} ({old.num_shards} shards) -> v{report.to_version} ({new.num_shards} shards) into {to_root} in {report.seconds:.2f} s")
    tables = sorted(new.tables)
    print("  shard  " + "  ".join(f"{t:>12s}" for t in tables))
    for j, rows in report.rows_written.items():
        print(f"  {j:5d}  " + "  ".join(f"{rows[t]:12,d}" for t in tables))
    print(f"  upserts carried over: {report.carried_upserts:,} batches ({report.carried_rows:,} rows, summed over the old shards' replicas)")
    if any(report.ids_incomplete.values()):
        print(f"  ids no old shard held in full (stay missing): {report.ids_incomplete}")
    if report.tables_dropped:
        print(f"  tables not in the new plan (not copied): {report.tables_dropped}")
    print(f"  start the new shards on {to_root} without --load-from")
    return 0


def _info(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import json_format

    from recserve.errors import Unavailable
    from recserve.v1 import embedding_pb2, embedding_pb2_grpc

    with grpc.insecure_channel(args.address) as channel:
        try:
            reply = embedding_pb2_grpc.EmbeddingShardStub(channel).ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=10)
        except grpc.RpcError as exc:  # unreachable / not a shard: one line, not a traceback
            raise Unavailable(f"--address {args.address!r}: ShardInfo failed with {exc.code().name}: {exc.details()}") from None
    print(json_format.MessageToJson(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))
    return 0


def _plan(args: argparse.Namespace) -> int:
    import dataclasses

    import numpy as np

    from recserve.config import load
    from recserve.sharding import plan_tables

    cluster = load(args.config)
    sharding = cluster.sharding
    if args.shards is not None:
        hot = min(sharding.hot_replicas, args.shards)
        sharding = dataclasses.replace(sharding, num_shards=args.shards, hot_replicas=hot, column_splits=min(sharding.column_splits, args.shards), cold_replicas=min(sharding.cold_replicas, args.shards))
    freqs: dict[str, np.ndarray] = {}
    if args.catalog is not None:
        from recserve.catalog import load_catalog

        catalog = load_catalog(args.catalog)
        freqs = {t.name: np.asarray(catalog.item_popularity, dtype=np.float64) for t in cluster.tables if t.rows == catalog.num_items}
    result = plan_tables(cluster.tables, freqs or None, sharding, version=args.version)
    result.plan.save(args.out)
    doc = result.to_dict()
    doc["out"] = args.out
    doc["popularity_from_catalog"] = sorted(freqs)
    if args.json:
        print(json.dumps(doc, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
    else:
        print(f"plan v{result.plan.version}: {result.plan.num_shards} shards, tables {sorted(result.plan.tables)} -> {args.out}")
        print(f"popularity from catalog for: {sorted(freqs) or 'none (uniform)'}")
        print(f"expected imbalance (max/mean unique rows per shard per window): {result.imbalance:.3f}")
        for tier, per_shard in result.estimate.bytes_per_shard.items():
            print(f"  {tier:8s} bytes/shard: " + ", ".join(f"{int(b):,}" for b in per_shard))
        if sharding.placement == "budget":  # under "fractions" the row cache is the server's own setting
            print(f"  {'rowcache':8s} bytes/shard: " + ", ".join(f"{int(b):,}" for b in result.row_cache_bytes) + f" (budget {result.shard_memory_bytes:,}, placement {sharding.placement!r})")
        print(_tier_table(result.tier_rows()))
    return 0


def _tier_table(rows: list[dict[str, Any]]) -> str:
    """The planner's tiers, one line per table (ids per tier, copies, bytes on the fullest shard)."""
    head = f"{'table':16s} {'rows':>10s} {'hot ids':>10s} {'xR':>3s} {'warm ids':>10s} {'xC':>3s} {'cold ids':>10s} {'xR':>3s} {'DRAM B/shard':>14s} {'RocksDB B/shard':>16s}"
    lines = [head]
    for r in rows:
        name = r["table"] + (" (whole)" if r["replicated_whole"] else "")
        lines.append(
            f"{name:16s} {r['rows']:>10,} {r['hot_ids']:>10,} {r['hot_replicas']:>3d} {r['warm_ids']:>10,} {r['column_splits']:>3d} "
            f"{r['cold_ids']:>10,} {r['cold_replicas']:>3d} {r['dram_bytes_max_shard']:>14,} {r['rocksdb_bytes_max_shard']:>16,}"
        )
    return "\n".join(lines)
