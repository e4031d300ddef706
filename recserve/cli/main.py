"""The ``recserve`` command.

Subcommand modules are light (argparse only); each imports heavy libraries (torch,
torchrec, grpc servers) inside its ``run`` so ``recserve --help`` stays fast
(docs/architecture.md §12: torch costs ≈2.8 s to import here, torchrec ≈6.2 s).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from recserve.errors import RecserveError
from recserve.logs import configure as configure_logging

# Subcommands in help order: name -> module exposing add_parser(subparsers) and run(args).
COMMANDS: dict[str, str] = {
    "catalog": "recserve.cli.catalog_cmd",
    "shard": "recserve.cli.shard_cmd",
    "bench": "recserve.cli.bench_cmd",
    "demo": "recserve.cli.demo_cmd",
    "train": "recserve.cli.train_cmd",
    "ranker": "recserve.cli.ranker_cmd",
    "cascade": "recserve.cli.cascade_cmd",
    "generate": "recserve.cli.generate_cmd",
    "serve": "recserve.cli.serve_cmd",
    "gateway": "recserve.cli.gateway_cmd",
    "loadtest": "recserve.cli.loadtest_cmd",
    "plan": "recserve.cli.plan_cmd",
    "deploy": "recserve.cli.deploy_cmd",
}
# Planned subcommands (later issues); listed in --help so users see the roadmap.
PLANNED: dict[str, str] = {}


def _planned(args: argparse.Namespace) -> int:
    print(f"recserve {args.command}: not built yet ({PLANNED[args.command]})", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recserve", description="Recommendation serving: catalogs, shard servers, lookups, benchmarks.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.add_parser(sub)
    for name, text in PLANNED.items():
        p = sub.add_parser(name, help=f"(planned) {text}")
        p.set_defaults(func=_planned)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Launched by recserve.cluster.process.spawn_child (its LIFELINE_FD_ENV; checked by
    # name so that plain commands do not import recserve.cluster, which loads grpc).
    if "RECSERVE_LIFELINE_FD" in os.environ:
        from recserve.cluster.process import exit_with_parent

        exit_with_parent()  # first: a server child must not outlive its parent
    parser = build_parser()
    args = parser.parse_args(argv)
    # Third-party libraries (fbgemm, torch) log chatter at INFO on the root logger; keep
    # them at WARNING and show recserve's own INFO lines, each with its request id and
    # with secrets masked (recserve.logs).
    configure_logging(logging.DEBUG if args.verbose else logging.WARNING, own_level=logging.DEBUG if args.verbose else logging.INFO)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except RecserveError as exc:
        print(f"recserve: error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
