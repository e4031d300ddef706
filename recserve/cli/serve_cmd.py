"""``recserve serve``: the whole serving cluster from one spec, until SIGINT/SIGTERM.

``recserve serve [--config SPEC] [--catalog DIR] [--models DIR] [--cache DIR] [--data DIR]``

1. **What to serve.** ``--models DIR`` (a ``recserve train --out`` export) is served as
   is. Without it, the models are trained once into the cache dir (default
   ``~/.cache/recserve/<spec hash>``, ``$XDG_CACHE_HOME`` honoured) from ``--catalog DIR``,
   or from a catalog generated there, sized from the spec's ``dlrm_item`` / ``dlrm_user``
   / ``dlrm_category`` / ``dlrm_tag`` tables so the export's tables are the spec's; both
   steps show progress bars. A later start reuses the cache when the export's manifest is
   there and its catalog fingerprint is the catalog's.
2. **The spec every child reads**: ``--config`` (default: the export's
   ``MODELS/cluster.toml``, written by training; with neither ``--config`` nor ``--models``
   that export was trained from the embedded default, so it is the same cluster). Its
   tables must be the export's. ``[topology]`` says how many rankers and where they listen.
3. **Start** (:class:`recserve.cluster.stack.ServingStack`): the export's tables are
   planned (the training log's item counts as access frequency), shards load them, the
   rankers and the cascade start on top, and the HTTP gateway last; each endpoint is
   printed as it turns SERVING (``gRPC Ranking at 127.0.0.1:PORT (ranker 0, pid ...,
   log ...)``, ``HTTP gateway at http://127.0.0.1:PORT (pid ..., log ...)``), then
   exactly ``recserve: ready`` once every child is SERVING. The gateway listens on the
   spec's ``[gateway] host`` / ``port``; tenants' keys come from this process's
   environment (``[[tenants]] api_key_env``).
4. **Supervise**: from then on a child that exits on its own (crash, OOM kill, SIGKILL)
   is restarted on its port with its data (a shard reopens its RocksDB), after a
   backoff that doubles per consecutive crash (:mod:`recserve.cluster.supervise`); each
   exit and restart is printed (``recserve: shard-1 exited with code -9; restarting in
   0.5 s ...``), and a child crash-looping (3 exits in 2 minutes) makes the gateway's
   ``/readyz`` 503 and shows on its status page.
5. **Stop** on SIGINT/SIGTERM: the supervisor, then the gateway, the cascade (drains in-flight calls), then
   the rankers, then the shards; exit 0. Every child is orphan-protected (lifeline pipe +
   PDEATHSIG), so a SIGKILLed ``recserve serve`` leaves no child behind either.

Children keep their RocksDB, logs and port files under ``--data`` (default: a temp dir,
removed on exit).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recserve.cluster.stack import ServingStack

READY_LINE = "recserve: ready"


class _Signalled(BaseException):
    """SIGINT/SIGTERM arrived: unwind whatever runs (training, start-up, the wait), then stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum



SERVE_TRAIN_ROWS = 500_000  # training rows per epoch and model of a first start (0 = all)

def _raise_signalled(signum: int, frame: Any) -> None:
    raise _Signalled(signum)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("serve", help="serve the whole cluster (shards, rankers, the cascade's Recommend, the HTTP gateway) from one spec")
    parser.add_argument("--config", type=Path, default=None, help="cluster spec TOML (default: the export's cluster.toml, or the embedded spec)")
    parser.add_argument("--catalog", type=Path, default=None, help="train on this catalog dir when --models is not given (default: generate one in the cache)")
    parser.add_argument("--models", type=Path, default=None, help="serve this `recserve train --out` export (default: train one into the cache, once)")
    parser.add_argument("--cache", type=Path, default=None, help="where generated catalogs and trained models are kept (default ~/.cache/recserve/<spec hash>)")
    parser.add_argument("--data", type=Path, default=None, help="children's RocksDB, logs and port files (default: a temp dir removed on exit)")
    parser.add_argument("--no-cascade", action="store_true", help="serve shards and rankers only (the Ranking service, no Recommender, no gateway)")
    parser.add_argument("--no-gateway", action="store_true", help="serve no HTTP gateway (gRPC only)")
    parser.add_argument("--insecure-admin", action="store_true",
                        help="serve admin operations (Upsert, ReloadModels, RefreshIndex, AddItems) without a token; only when [admin] token_env is unset")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    previous = {s: signal.signal(s, _raise_signalled) for s in (signal.SIGINT, signal.SIGTERM)}
    temp_data = args.data is None
    data_root = Path(tempfile.mkdtemp(prefix="recserve-serve-")) if temp_data else args.data
    stack: ServingStack | None = None
    try:
        stack = _prepare(args, data_root)
        stack.start()
        stack.wait_serving()  # every child, again: ready means all of them SERVING now
        # From here a child that exits on its own is restarted with backoff (its port,
        # its data); each exit and restart is printed, crash-loops reach /readyz.
        stack.supervise(on_event=lambda line: print(f"recserve: {line}", flush=True))
        print(READY_LINE, flush=True)
        while True:  # the handlers raise _Signalled out of here
            signal.pause()
    except _Signalled as sig:
        print(f"recserve: {signal.Signals(sig.signum).name}: stopping", flush=True)
        return 0
    finally:
        # A second signal must not cut the shutdown short: the children are stopped with
        # a bounded grace (then SIGKILL), so ignoring more signals cannot hang us.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        if stack is not None:
            stack.stop()
            print("recserve: stopped", flush=True)
        if temp_data:
            shutil.rmtree(data_root, ignore_errors=True)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _prepare(args: argparse.Namespace, data_root: Path) -> ServingStack:
    """Resolve (and, once, generate and train) what to serve; plan it; the unstarted stack."""
    import dataclasses

    from ranker.serving import open_export
    from ranker.spec import tables_and_features
    from recserve.cluster.stack import ServingStack
    from recserve.config import load
    from recserve.errors import ConfigError

    if args.models is not None:
        models = args.models.resolve()
        if not (models / "manifest.json").is_file():
            raise ConfigError(f"--models = {str(args.models)!r} is invalid: it holds no export (no manifest.json); pass a `recserve train --out` directory, or omit --models to train one into the cache")
    else:
        from recserve.config import DEFAULT_SPEC

        spec_text = args.config.read_text() if args.config is not None and args.config.is_file() else DEFAULT_SPEC
        load(args.config)  # a bad spec fails here, before anything is generated
        models = _cached_models(args, spec_text)
    spec_path = args.config.resolve() if args.config is not None else models / "cluster.toml"
    if not spec_path.is_file():
        raise ConfigError(f"--config is missing and {spec_path} does not exist: pass the cluster spec of the export {models}")
    cluster = load(spec_path)
    export = open_export(models)
    tables, _ = tables_and_features(export.manifest)
    _check_tables(cluster, tables, spec_path, models)
    plan_path, row_cache_bytes = _plan(cluster, export, tables, data_root)
    server = cluster.shard_server if row_cache_bytes is None else dataclasses.replace(cluster.shard_server, row_cache_bytes=row_cache_bytes)
    topo = cluster.topology
    print(
        f"recserve serve: spec {spec_path}, models {models} (model_version {export.model_version}), data {data_root}\n"
        f"recserve serve: {cluster.sharding.num_shards} shards, {topo.rankers} rankers{'' if args.no_cascade else ', the cascade'}"
        f"{'' if args.no_cascade or args.no_gateway else ', the HTTP gateway'} on {topo.host}",
        flush=True,
    )  # fmt: skip
    return ServingStack(
        cluster, spec_path=spec_path, models_dir=models, plan_path=plan_path, data_root=data_root, cascade=not args.no_cascade, gateway=not args.no_gateway,
        shard_server=server, admin_token=os.environ.get(cluster.admin.token_env, ""),
        insecure_admin=args.insecure_admin, on_endpoint=lambda e: print(e.line(), flush=True),
    )  # fmt: skip


def default_cache_dir(spec_text: str) -> Path:
    """``$XDG_CACHE_HOME/recserve/<first 12 hex of sha256(spec)>`` (default ``~/.cache``)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "recserve" / hashlib.sha256(spec_text.encode()).hexdigest()[:12]


def _cached_models(args: argparse.Namespace, spec_text: str) -> Path:
    """The cache's export, trained now (once) unless it is there and was trained on the
    catalog being used (its manifest's catalog fingerprint). A lock file keeps two
    concurrent starts from training into the same directory."""
    import fcntl

    cache = (args.cache or default_cache_dir(spec_text)).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        catalog = args.catalog.resolve() if args.catalog is not None else _cached_catalog(cache / "catalog", spec_text)
        models = cache / "models"
        if _export_matches(models, catalog):
            print(f"recserve serve: reusing the models in {models} (trained on {catalog})", flush=True)
            return models
        from ranker.config import TrainConfig
        from ranker.evaluate import format_metrics
        from ranker.pipeline import train_and_export
        from recserve.config import loads

        num_shards = loads(spec_text).sharding.num_shards
        print(f"recserve serve: training the models on {catalog} into {models} (once; later starts reuse them)", flush=True)
        # The demo's settings: one torch thread (more spin against each other on a shared
        # box), 500 users for the recall metrics; and at most SERVE_TRAIN_ROWS rows per
        # epoch, so a first start fits its 10 minutes (all 2M impressions of the default
        # catalog took 587 s of training alone on the loaded 2-core box).
        config = TrainConfig(eval_users=500, threads=1, max_rows=SERVE_TRAIN_ROWS)
        report = train_and_export(catalog, models, config, num_shards=num_shards)
        print(format_metrics(report.metrics, report.seconds), flush=True)
        return models


def _cached_catalog(directory: Path, spec_text: str) -> Path:
    """A catalog sized from the spec's tables in ``directory``, generated unless one with
    exactly this config is there (its manifest is written last: present = complete)."""
    from recserve.catalog import CatalogConfig, generate_catalog
    from recserve.catalog.storage import read_manifest
    from recserve.config import loads
    from recserve.errors import RecserveError

    cluster = loads(spec_text)
    rows = {t.name: t.rows for t in cluster.tables}
    sizes = {"items": rows.get("dlrm_item"), "users": rows.get("dlrm_user"), "categories": rows.get("dlrm_category"), "tags": rows.get("dlrm_tag")}
    if sizes["items"] is None:
        from recserve.errors import ConfigError

        raise ConfigError(f"recserve serve sizes its catalog from a table named 'dlrm_item'; the spec declares {sorted(rows)}: add it, or pass --catalog/--models")
    from ranker.export import NEW_ITEM_ROWS

    sizes["items"] -= NEW_ITEM_ROWS  # the item tables hold the catalog plus the rows reserved for new items
    fields = {k: v for k, v in sizes.items() if v is not None}
    users = fields.get("users", CatalogConfig().users)
    config = CatalogConfig(**fields, impressions=20 * users)  # 20 impressions a user, as the default catalog
    try:
        if read_manifest(directory).get("config") == config.to_dict():
            return directory
    except RecserveError:
        pass  # none yet, or unreadable: generate
    print(f"recserve serve: generating a catalog of {config.items:,} items, {config.users:,} users in {directory} (once)", flush=True)
    generate_catalog(config, out_dir=directory, progress=True)
    return directory


def _export_matches(models: Path, catalog: Path) -> bool:
    """Whether ``models`` holds a complete export trained on ``catalog``."""
    import json

    from ranker.scrubbed import open_scrubbed

    try:
        manifest = json.loads((models / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    complete = (models / "cluster.toml").is_file() and (models / "metrics.json").is_file()
    return complete and manifest.get("catalog", {}).get("fingerprint") == open_scrubbed(catalog).fingerprint()


def _check_tables(cluster: Any, tables: Any, spec_path: Path, models: Path) -> None:
    """The spec's tables must be the export's (the shards load the export; the rankers
    and the cascade read the spec): name, rows and width."""
    from recserve.errors import ConfigError

    def shape(v: tuple[int, int] | None) -> str:
        return "absent" if v is None else f"{v[0]:,} x {v[1]}"

    want = {t.name: (t.rows, t.dim) for t in tables}
    have = {t.name: (t.rows, t.dim) for t in cluster.tables}
    for name in sorted(set(want) | set(have)):
        if want.get(name) != have.get(name):
            raise ConfigError(
                f"table {name!r} is {shape(have.get(name))} in {spec_path} but {shape(want.get(name))} in the export {models}: "
                f"serve the export with its own spec ({models / 'cluster.toml'}) or retrain it on a catalog of the spec's sizes"
            )


def _plan(cluster: Any, export: Any, tables: Any, data_root: Path) -> tuple[Path, int | None]:
    """Plan the export's tables over the spec's shards; its path under ``data_root`` and,
    for a ``placement = "budget"`` plan, the row cache its budget leaves per shard."""
    from ranker.spec import access_frequencies
    from recserve.sharding import plan_tables

    # Item-keyed tables are read as often as their items are shown: the training log's
    # impression counts (what a real system knows), not the catalog's popularity.
    freq = access_frequencies(export.manifest, export.arrays.counts.item[:, 0])
    result = plan_tables(list(tables), freq, cluster.sharding)
    data_root.mkdir(parents=True, exist_ok=True)
    path = data_root / "plan.json"
    result.plan.save(path)
    row_cache = int(result.row_cache_bytes.min()) if cluster.sharding.placement == "budget" else None
    return path, row_cache
