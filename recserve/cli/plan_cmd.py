"""``recserve plan``: capacity planning without hardware.

- ``recserve plan simulate --rows R --dim D --zipf A --shards S --qps Q
  --ids-per-request K [--config SPEC] [--json]`` prints what a table of ``R`` rows costs
  each of ``S`` shards under the spec's ``[sharding]`` knobs: bytes per tier, unique ids
  per window and shard, RPCs/s, imbalance, remap on +1 shard, network bytes/s and the
  routing structures' memory. Closed-form Zipf estimators
  (:mod:`recserve.sharding.simulate`): nothing is allocated per row, so 10**9 rows and
  256 shards answer in well under a second.

Argument parsing only at import; numpy loads inside ``run``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _count(text: str) -> int:
    """Parse ``1000000``, ``1e9``, ``200k``, ``100M``, ``1G`` as a count."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 200000, 2e5, 200k, 1G)") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("plan", help="capacity planning: simulate a sharding spec at scale")
    sub = parser.add_subparsers(dest="plan_command", metavar="ACTION")
    sim = sub.add_parser("simulate", help="closed-form capacity estimate of one table on S shards (no per-row memory)")
    sim.add_argument("--rows", type=_count, required=True, help="table rows (e.g. 1e9)")
    sim.add_argument("--dim", type=int, required=True, help="row width")
    sim.add_argument("--zipf", type=float, required=True, help="Zipf exponent of the id popularity")
    sim.add_argument("--shards", type=int, required=True, help="shard count (overrides sharding.num_shards)")
    sim.add_argument("--qps", type=float, required=True, help="requests per second")
    sim.add_argument("--ids-per-request", type=int, required=True, help="ids of this table looked up per request")
    sim.add_argument("--window-ms", type=float, default=0.0, help="lookup-client dedup window (default 0: one request per window)")
    sim.add_argument("--config", default=None, help="cluster spec whose [sharding] and [shard_server] knobs apply")
    sim.add_argument("--dtype", default="float32", choices=("float32", "float16", "int8"), help="stored dtype (default float32)")
    sim.add_argument("--hot-fraction", type=float, default=None, help="override sharding.hot_fraction")
    sim.add_argument("--warm-fraction", type=float, default=None, help="override sharding.warm_fraction")
    sim.add_argument("--hot-replicas", type=int, default=None, help="override sharding.hot_replicas")
    sim.add_argument("--column-splits", type=int, default=None, help="override sharding.column_splits (0 = from width)")
    sim.add_argument("--cold-replicas", type=int, default=None, help="override sharding.cold_replicas")
    sim.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    sim.set_defaults(func=run_simulate)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])


def run_simulate(args: argparse.Namespace) -> int:
    import dataclasses

    from recserve.sharding.simulate import SimulationInput, format_report, simulate

    from recserve.config.load import load

    spec = load(args.config)  # None -> the embedded default spec
    sharding, row_cache = spec.sharding, spec.shard_server.row_cache_bytes
    overrides = {
        key: getattr(args, key)
        for key in ("hot_fraction", "warm_fraction", "hot_replicas", "column_splits", "cold_replicas")
        if getattr(args, key) is not None
    }
    # Replicas / splits above the new shard count are capped, as replan_remove_shard does.
    fan = {k: min(overrides.get(k, getattr(sharding, k)), max(args.shards, 1)) for k in ("hot_replicas", "cold_replicas", "column_splits")}
    sharding = dataclasses.replace(sharding, num_shards=args.shards, **{**overrides, **fan})
    report = simulate(
        SimulationInput(
            rows=args.rows, dim=args.dim, zipf=args.zipf, qps=args.qps, ids_per_request=args.ids_per_request,
            sharding=sharding, window_ms=args.window_ms, dtype=args.dtype, row_cache_bytes=row_cache,
        )  # fmt: skip
    )
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    sys.stdout.flush()
    return 0
