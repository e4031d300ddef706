"""``recserve bench <name>``: benchmarks. Each lives in ``recserve/bench/<name>.py``
with ``add_arguments(parser)`` and ``run(args) -> int``."""

from __future__ import annotations

import importlib
from typing import Any

BENCHMARKS: dict[str, str] = {
    "scheduler": "scheduler core and serving loop: batched vs unbatched, open-loop",
    "sharding": "row-only vs hybrid plans through real shard processes",
    "lookup": "feature-parallel client vs naive, Redis and local TorchRec",
    "decode": "LLM decode engine: static vs continuous batching, paged KV, chunked prefill",
    "rank": "Ranking service knee: batched vs unbatched, 1 and 2 rankers, forward cost, dedup",
    "recall": "L0-L3 cascade: per-stage recall vs ground truth, exhaustive DLRM and exact FAISS; latency and speedup",
    "mixed": "ranker + decoder on one device behind the bulkhead: Rank p99 and decode tokens/s, alone and mixed",
    "faults": "six faults under open-loop Recommend load on a supervised cluster: failed, shed, p99, coverage, lost upserts, recovery; PNG timeline",
    "fuzz": "bad input: hypothesis requests to every gRPC method of every service, schemathesis + hostile bodies on the gateway; leaks",
}


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (human table; one JSON object with --json)")
    bench_sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    for name, text in BENCHMARKS.items():
        module_name = f"recserve.bench.{name}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        p = bench_sub.add_parser(name, help=text)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])
