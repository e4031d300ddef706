"""``recserve gateway``: the HTTP gateway.

``recserve gateway serve --recommenders HOST:PORT[,...] [--rankers HOST:PORT,...]
[--generators HOST:PORT,...] [--config SPEC] [--scrape NAME=URL,...] [--host H] [--port P]
[--port-file FILE]`` serves ``POST /v1/recommendations``, ``POST /v1/rank``,
``POST /v1/generate`` (server-sent events from the ``--generators``), the probes, ``/metrics``,
``/openapi.json`` and the status page (``GET /``, scraping the ``--scrape`` targets).
``--host`` / ``--port`` default to the spec's ``[gateway]``. Tenant keys are read from
the environment variables the spec's ``[[tenants]] api_key_env`` name.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("gateway", help="the HTTP gateway: JSON over HTTP in front of the cascade and the rankers")
    sub = parser.add_subparsers(dest="gateway_command", metavar="SUBCOMMAND")
    serve = sub.add_parser("serve", help="run one gateway process")
    serve.add_argument("--config", type=Path, default=None, help="cluster spec TOML (default: the embedded spec)")
    serve.add_argument("--recommenders", required=True, help="comma-separated cascade (Recommender) addresses")
    serve.add_argument("--rankers", default="", help="comma-separated ranker addresses (POST /v1/rank; none: it answers 412)")
    serve.add_argument("--generators", default="", help="comma-separated generation replica addresses (POST /v1/generate; none: it answers 503)")
    serve.add_argument("--scrape", default="", help="status page targets: comma-separated NAME=URL of each process's /metrics")
    serve.add_argument("--host", default=None, help="listen address (default: the spec's gateway.host)")
    serve.add_argument("--port", type=int, default=None, help="listen port (default: the spec's gateway.port; 0 = a free one, see --port-file)")
    serve.add_argument("--port-file", default="", help="write the bound port here (atomically) once listening")
    serve.set_defaults(func=_serve)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def parse_scrape(text: str) -> tuple[tuple[str, str], ...]:
    """``"shard-0=http://h:1/metrics,cascade-0=http://h:2/metrics"`` -> pairs; a
    ConfigError naming the bad entry otherwise."""
    from recserve.errors import ConfigError

    pairs = []
    for entry in filter(None, text.split(",")):
        name, sep, url = entry.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ConfigError(f"--scrape entry {entry!r} is invalid: use NAME=http://HOST:PORT/metrics, e.g. shard-0=http://127.0.0.1:9100/metrics")
        pairs.append((name, url))
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ConfigError(f"--scrape names {names} repeat: give each process one entry")
    return tuple(pairs)


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from recserve.config import load
    from recserve.errors import ConfigError
    from recserve.gateway.server import GatewayProcessConfig, serve

    cluster = load(args.config)
    recommenders = tuple(a for a in args.recommenders.split(",") if a)
    if not recommenders:
        raise ConfigError("--recommenders = '' is invalid: give the cascade addresses (HOST:PORT,...)")
    config = GatewayProcessConfig(
        cluster=cluster, recommenders=recommenders, rankers=tuple(a for a in args.rankers.split(",") if a),
        generators=tuple(a for a in args.generators.split(",") if a), scrape=parse_scrape(args.scrape),
        host=cluster.gateway.host if args.host is None else args.host, port=cluster.gateway.port if args.port is None else args.port,
        port_file=args.port_file,
    )  # fmt: skip
    asyncio.run(serve(config))
    return 0
