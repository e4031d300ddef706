"""``recserve demo``: the main job on the embedded default cluster spec.

Today: generate a small synthetic catalog sized from the default spec's ``item`` table
and print its summary (items, users, head/tail popularity share). Later issues extend it
until it serves the whole cascade.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="run the main job on the embedded default cluster spec")
    parser.add_argument("--config", type=Path, default=None, help="cluster spec TOML (default: the embedded spec)")
    parser.add_argument("--users", type=int, default=5_000, help="users in the demo catalog")
    parser.add_argument("--out", type=Path, default=None, help="keep the catalog here (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from recserve.catalog import CatalogConfig, format_summary, generate_catalog, summarize
    from recserve.config import load

    cluster = load(args.config)
    item_table = cluster.tables[0]
    with tempfile.TemporaryDirectory(prefix="recserve-demo-") as tmp:
        out = args.out if args.out is not None else Path(tmp) / "catalog"
        cfg = CatalogConfig(
            items=item_table.rows,
            users=args.users,
            dim=item_table.dim,
            seed=args.seed,
            impressions=20 * args.users,
        )
        catalog = generate_catalog(cfg, out_dir=out, progress=True)
        print("== catalog ==")
        print(format_summary(summarize(catalog)))
    return 0
