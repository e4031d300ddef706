"""``recserve catalog generate|info``: synthetic catalogs (see :mod:`recserve.catalog`).

Argparse only at import time; numpy/tqdm load inside :func:`run` (never torch).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from recserve.errors import FailedPrecondition

_DEFAULTS: dict[str, Any] = {}


def _defaults() -> dict[str, Any]:
    # Read the defaults off CatalogConfig itself so help text and library never drift.
    if not _DEFAULTS:
        import dataclasses

        from recserve.catalog.config import CatalogConfig

        _DEFAULTS.update({f.name: f.default for f in dataclasses.fields(CatalogConfig)})
    return _DEFAULTS


# (flag, config field, type, help); every one maps 1:1 onto a CatalogConfig field.
_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--items", "items", int, "number of items"),
    ("--users", "users", int, "number of users"),
    ("--dim", "dim", int, "latent vector width"),
    ("--zipf", "zipf", float, "Zipf exponent of item popularity"),
    ("--seed", "seed", int, "random seed (same seed, same arrays)"),
    ("--categories", "categories", int, "number of item categories (latent clusters)"),
    ("--tags", "tags", int, "tag vocabulary size"),
    ("--tags-per-item", "tags_per_item", float, "mean distinct tags per item"),
    ("--history-len", "history_len", int, "max history items per user (each user gets len/2..len)"),
    ("--candidates", "candidates", int, "popularity-sampled candidates per history pool"),
    ("--users-per-pool", "users_per_pool", int, "users sharing one candidate pool (1 = independent, slowest)"),
    ("--impressions", "impressions", int, "rows of the impression/click log (train + test)"),
    ("--holdout-fraction", "holdout_fraction", float, "fraction of the log held out as the test split (its last rows)"),
)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("catalog", help="generate or inspect a synthetic catalog (items, users, popularity, click log)")
    sub = parser.add_subparsers(dest="catalog_command", metavar="ACTION")
    defaults = _defaults()

    gen = sub.add_parser("generate", help="generate a catalog into a directory of .npy arrays + manifest.json")
    for flag, field, kind, text in _FLAGS:
        gen.add_argument(flag, dest=field, type=kind, default=defaults[field], help=f"{text} (default {defaults[field]})")
    gen.add_argument("--out", type=Path, required=True, help="output directory")
    gen.add_argument("--force", action="store_true", help="replace a catalog already in --out")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    gen.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    gen.set_defaults(func=run)

    info = sub.add_parser("info", help="summarise a catalog directory")
    info.add_argument("dir", type=Path, help="catalog directory (holds manifest.json)")
    info.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    info.set_defaults(func=run)

    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])


def _print_summary(summary: dict[str, Any], as_json: bool) -> None:
    from recserve.catalog.summary import format_summary

    if as_json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(format_summary(summary))


def _generate(args: argparse.Namespace) -> int:
    from recserve.catalog import CatalogConfig, generate_catalog, summarize
    from recserve.catalog.storage import MANIFEST

    config = CatalogConfig(**{field: getattr(args, field) for _, field, _, _ in _FLAGS})
    out: Path = args.out
    if (out / MANIFEST).exists() and not args.force:
        raise FailedPrecondition(f"{out} already holds a catalog; pass --force to replace it or choose another --out")
    if out.exists() and not out.is_dir():
        raise FailedPrecondition(f"--out {out} is a file; pass a directory (it is created if missing)")
    start = time.perf_counter()
    try:
        catalog = generate_catalog(config, out, progress=not args.no_progress)
    except OSError as exc:  # unwritable / full disk: a clear error, not a traceback
        raise FailedPrecondition(f"cannot write the catalog to --out {out}: {exc.strerror or exc} ({exc.filename}); pass a writable directory with room for it") from exc
    elapsed = time.perf_counter() - start
    summary = summarize(catalog)
    summary["generate_seconds"] = round(elapsed, 3)
    _print_summary(summary, args.json)
    if not args.json:
        print(f"generated in {elapsed:.1f} s", file=sys.stderr)
    return 0


def _info(args: argparse.Namespace) -> int:
    from recserve.catalog import load_catalog, summarize

    _print_summary(summarize(load_catalog(args.dir)), args.json)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.catalog_command == "generate":
        return _generate(args)
    if args.catalog_command == "info":
        return _info(args)
    raise FailedPrecondition(f"unknown catalog action {args.catalog_command!r}; use 'generate' or 'info'")
