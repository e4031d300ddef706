"""``recserve generate``: run the Generation service.

- ``recserve generate serve --config SPEC [--model DIR] [--port P] [--port-file F]``
  streams ``Generation.Generate`` from the decode engine: the ``recserve train --lm``
  checkpoint ``--model`` (default: the spec's ``generation.checkpoint``; none: seeded
  random weights of the ``[generation]`` shape); Prometheus ``/metrics`` on
  ``--metrics-port`` (default: the spec's ``generation.metrics_port``; the flag wins).
  Health "" and ``recserve.v1.Generation`` say NOT_SERVING until the model is loaded;
  SIGTERM drains and exits 0.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("generate", help="the Generation service: streamed LLM decode (explanations)")
    sub = parser.add_subparsers(dest="generate_command", metavar="SUBCOMMAND")
    serve = sub.add_parser("serve", help="run one generation process")
    serve.add_argument("--config", type=Path, default=None, help="cluster spec TOML (default: the embedded spec)")
    serve.add_argument("--model", type=Path, default=None,
                       help="a `recserve train --lm` checkpoint directory (default: the spec's generation.checkpoint; none: seeded random weights)")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=0, help="listen port (0 = pick a free one; see --port-file)")
    serve.add_argument("--port-file", default="", help="write the bound port here (atomically) once listening")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="Prometheus /metrics HTTP port (0 = a free one, -1 = none; default: the spec's generation.metrics_port)")
    serve.add_argument("--metrics-port-file", default="", help="write the bound metrics port here (atomically) before listening for gRPC")
    serve.set_defaults(func=_serve)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from generation.server import GenerationProcessConfig, serve
    from recserve.config import load

    cluster = load(args.config)
    config = GenerationProcessConfig(
        cluster=cluster, checkpoint=str(args.model) if args.model is not None else "", host=args.host, port=args.port,
        port_file=args.port_file, metrics_port=cluster.generation.metrics_port if args.metrics_port is None else args.metrics_port,
        metrics_port_file=args.metrics_port_file,
    )  # fmt: skip
    asyncio.run(serve(config))
    return 0
