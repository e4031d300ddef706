"""``recserve cascade``: run the cascade service (Recommend).

- ``recserve cascade serve --models MODELS --rankers HOST:PORT,... [--config SPEC]
  [--shards HOST:PORT,...] [--index DIR] [--port P]`` serves ``Recommender.Recommend``
  (L0 and L1 in this process, L2 and L3 on the rankers) and ``Admin.RefreshIndex``;
  Prometheus ``/metrics`` on ``--metrics-port`` (default: the spec's
  ``cascade.metrics_port``; the flag wins).
- ``recserve cascade build-index --models MODELS --out DIR [--config SPEC] [--factory F]``
  builds the L0 index over the export's item vectors (progress bar) and saves it with its
  ``model_version``, for ``serve --index DIR`` or ``Admin.RefreshIndex(index_path=DIR)``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("cascade", help="the cascade service: Recommend through L0-L3 within a deadline")
    sub = parser.add_subparsers(dest="cascade_command", metavar="SUBCOMMAND")
    serve = sub.add_parser("serve", help="run one cascade process")
    serve.add_argument("--models", type=Path, default=None, help="a `recserve train --out` directory (default: the spec's ranker.models_dir)")
    serve.add_argument("--config", type=Path, default=None, help="cluster spec TOML (default: the embedded spec)")
    serve.add_argument("--rankers", required=True, help="comma-separated ranker addresses")
    serve.add_argument("--shards", default="", help="comma-separated shard addresses (default: the spec's shard_addresses)")
    serve.add_argument("--index", default="", help="a saved L0 index directory (default: build it from the export's item vectors)")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=0, help="listen port (0 = pick a free one; see --port-file)")
    serve.add_argument("--port-file", default="", help="write the bound port here (atomically) once listening")
    serve.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics HTTP port (0 = a free one, -1 = none; default: the spec's cascade.metrics_port)")
    serve.add_argument("--metrics-port-file", default="", help="write the bound metrics port here (atomically) before listening for gRPC")
    serve.add_argument("--insecure-admin", action="store_true",
                       help="serve admin operations without a token (only when the [admin] token_env variable is unset; never on a shared network)")
    serve.set_defaults(func=_serve)
    build = sub.add_parser("build-index", help="build the L0 FAISS index of an export and save it")
    build.add_argument("--models", type=Path, required=True, help="a `recserve train --out` directory")
    build.add_argument("--out", type=Path, required=True, help="directory to save the index in")
    build.add_argument("--config", type=Path, default=None, help="cluster spec TOML (its [cascade] index settings; default: the embedded spec)")
    build.add_argument("--factory", default="", help="FAISS factory string overriding cascade.index_factory (e.g. IVF1024,PQ32)")
    build.set_defaults(func=_build_index)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from cascade.server import CascadeProcessConfig, serve
    from recserve.config import load
    from recserve.errors import ConfigError

    cluster = load(args.config)
    rankers = tuple(a for a in args.rankers.split(",") if a)
    if not rankers:
        raise ConfigError("--rankers = '' is invalid: give the ranker addresses (HOST:PORT,...)")
    models = str(args.models) if args.models is not None else cluster.ranker.models_dir
    if not models:
        raise ConfigError("--models is missing: name a `recserve train --out` directory, or set ranker.models_dir in the spec")
    config = CascadeProcessConfig(
        cluster=cluster, models_dir=models, ranker_addresses=rankers, shard_addresses=tuple(a for a in args.shards.split(",") if a) or cluster.shard_addresses,
        host=args.host, port=args.port, port_file=args.port_file, admin_token=os.environ.get(cluster.admin.token_env, ""),
        insecure_admin=args.insecure_admin, index_dir=args.index,
        metrics_port=cluster.cascade.metrics_port if args.metrics_port is None else args.metrics_port, metrics_port_file=args.metrics_port_file,
    )  # fmt: skip
    from recserve.logs import register_secret

    register_secret(config.admin_token)  # [admin] token_env may name any variable: masked in logs
    asyncio.run(serve(config))
    return 0


def _build_index(args: argparse.Namespace) -> int:
    import dataclasses

    import numpy as np

    from cascade.export_view import open_export_view
    from cascade.index import build_index
    from cascade.service import index_config
    from recserve.config import load

    cluster = load(args.config)
    cascade = dataclasses.replace(cluster.cascade, index_factory=args.factory) if args.factory else cluster.cascade
    view = open_export_view(args.models)
    index = build_index(np.asarray(view.item_vectors), None, index_config(cascade), model_version=view.model_version, progress=True)
    index.save(args.out)
    print(f"index {index.factory} over {index.ntotal:,} items, index_version {index.index_version}, saved to {args.out}")
    return 0
