"""``recserve ranker``: run the Ranking service.

- ``recserve ranker serve --models MODELS --config SPEC [--shards HOST:PORT,...] [--port P]``
  serves Rank, EmbedUser and Admin for every model in ``ranker.models``, reading its
  embeddings from the shards (``--shards``, else the spec's ``shard_addresses``), which
  must serve the export's tables at its ``model_version``; Prometheus ``/metrics`` on
  ``--metrics-port`` (default: the spec's ``ranker.metrics_port``; the flag wins).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("ranker", help="the Ranking service: batched Rank and EmbedUser over remote embeddings")
    sub = parser.add_subparsers(dest="ranker_command", metavar="SUBCOMMAND")
    serve = sub.add_parser("serve", help="run one ranker process")
    serve.add_argument("--models", type=Path, default=None, help="a `recserve train --out` directory (default: the spec's ranker.models_dir)")
    serve.add_argument("--config", type=Path, default=None, help="cluster spec TOML (default: the embedded spec)")
    serve.add_argument("--shards", default="", help="comma-separated shard addresses (default: the spec's shard_addresses)")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=0, help="listen port (0 = pick a free one; see --port-file)")
    serve.add_argument("--port-file", default="", help="write the bound port here (atomically) once listening")
    serve.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics HTTP port (0 = a free one, -1 = none; default: the spec's ranker.metrics_port)")
    serve.add_argument("--metrics-port-file", default="", help="write the bound metrics port here (atomically) before listening for gRPC")
    serve.set_defaults(func=_serve)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from ranker.server import ADMIN_TOKEN_ENV, RankerProcessConfig, serve
    from recserve.config import load
    from recserve.errors import ConfigError

    cluster = load(args.config)
    shards = tuple(a for a in args.shards.split(",") if a) or cluster.shard_addresses
    if not shards:
        raise ConfigError("--shards = '' is invalid: give the shard addresses (HOST:PORT,...) or set shard_addresses in the spec")
    models = str(args.models) if args.models is not None else cluster.ranker.models_dir
    if not models:
        raise ConfigError("--models is missing: name a `recserve train --out` directory, or set ranker.models_dir in the spec")
    config = RankerProcessConfig(
        cluster=cluster, models_dir=models, shard_addresses=shards, host=args.host, port=args.port, port_file=args.port_file,
        admin_token=os.environ.get(ADMIN_TOKEN_ENV, ""),
        metrics_port=cluster.ranker.metrics_port if args.metrics_port is None else args.metrics_port, metrics_port_file=args.metrics_port_file,
    )  # fmt: skip
    asyncio.run(serve(config))
    return 0
