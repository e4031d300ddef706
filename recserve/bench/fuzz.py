"""``recserve bench fuzz``: the full bad-input run over a real stack (issue 17).

It builds a tiny world (a synthetic catalog, the three models trained for one epoch and
exported, their tables planned over 2 shards), starts it with
:class:`~recserve.cluster.stack.ServingStack` — 2 shards, 1 ranker, the cascade, 1
generation replica (seeded random weights) and the HTTP gateway, every process with an
admin token — and then:

1. sends every gRPC method of every service (EmbeddingShard, Ranking, Admin on the ranker
   and on the cascade, Recommender, Generation) hypothesis-drawn bad requests
   (:mod:`recserve.bench.fuzz_grpc`), ``--cases`` per service (split evenly over its
   methods; a method whose request type runs out of distinct cases passes its share to
   the others), and judges each answer (a client-error status; DEADLINE_EXCEEDED for an
   expired deadline);
2. fuzzes the gateway from its ``/openapi.json`` with schemathesis plus hostile bodies
   (:mod:`recserve.bench.fuzz_http`), ``--http-cases`` per operation and mode;
3. counts every process's open fds and threads (``/proc``) after a warm-up and at the
   end, checks every process is still alive and answers good requests.

Prints a table (or one JSON object with ``--json``): cases tried and status codes per
service, violations, leaks, ``ok``. Exits 1 when anything was violated. The CI-sized run
is ``tests/integration/test_fuzz_properties.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ADMIN_TOKEN = "bench-fuzz-admin-token"
FD_SLACK = 6
THREAD_SLACK = 4
SKIP_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")
EXTRA_SPEC = """
[cascade]
l0_out = 400
l1_out = 200
l2_out = 50
l3_out = 10
default_deadline_ms = 5000.0
index_factory = "Flat"

[generation]
device = "cpu"
n_layers = 2
n_heads = 2
dim = 16
max_seq_len = 96
num_blocks = 64
block_tokens = 4
max_seqs = 8
token_budget = 64
prefill_chunk_tokens = 16
max_new_tokens_cap = 16
stop_token = -1

[topology]
rankers = 1
generators = 1

[gateway]
timeout_ms = 10000.0
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", type=int, default=10_000, help="gRPC cases per service, split over its methods (default 10,000)")
    # 3 POST operations x (valid, schema-breaking, hostile) x 1,200 >= 10,000 gateway cases.
    p.add_argument("--http-cases", type=int, default=1_200, help="schemathesis cases per gateway operation and mode, and hostile bodies per POST operation (default 1,200)")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed (same seed, same cases)")
    p.add_argument("--items", type=int, default=5_000, help="catalog items of the tiny world (default 5,000)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--keep", type=Path, default=None, help="keep the world and the processes' logs in this directory")


def run(args: argparse.Namespace) -> int:
    if args.cases < 1 or args.http_cases < 1:
        raise SystemExit(f"bench fuzz: --cases = {args.cases} and --http-cases = {args.http_cases} must be >= 1")
    root = args.keep or Path(tempfile.mkdtemp(prefix="recserve-bench-fuzz-"))
    try:
        result = fuzz_stack(args, root)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0 if result["ok"] else 1


def _log(msg: str) -> None:
    print(f"bench fuzz: {msg}", file=sys.stderr, flush=True)


def build_world(root: Path, items: int, seed: int) -> tuple[Path, Path, Path]:
    """Catalog, a one-epoch export of the three models, a 2-shard plan and the spec:
    ``(spec_path, models_dir, plan_path)``."""
    from ranker.config import DlrmConfig, L3Config, TrainConfig, TwoTowerConfig
    from ranker.export import export_models
    from ranker.scrubbed import open_scrubbed
    from ranker.spec import cluster_spec_toml, tables_and_features
    from ranker.train import train_all
    from recserve.catalog import CatalogConfig, generate_catalog
    from recserve.config import loads
    from recserve.config.spec import ShardingConfig
    from recserve.sharding import plan_tables

    catalog = CatalogConfig(items=items, users=400, impressions=8_000, categories=16, tags=64, history_len=12, candidates=128, dim=32, seed=seed)
    generate_catalog(catalog, root / "catalog", progress=False)
    view = open_scrubbed(root / "catalog")
    train = TrainConfig(dlrm=DlrmConfig(embedding_dim=8, dense_arch=(16, 8), over_arch=(16, 1)), two_tower=TwoTowerConfig(embedding_dim=8, hidden=16, out_dim=8),
                        l3=L3Config(embedding_dim=8, history=6, hidden=16), device="cpu", batch_size=512, tt_batch_size=256, epochs=1, tt_epochs=1,
                        max_rows=2048, progress=False, seed=seed, threads=1)  # fmt: skip
    manifest = export_models(train_all(view, train), view, root / "models")
    tables, _ = tables_and_features(manifest)
    sharding = ShardingConfig(num_shards=2, hot_fraction=0.01, warm_fraction=0.1, hot_replicas=2)
    plan_tables(list(tables), None, sharding, seed=seed).plan.save(root / "plan.json")
    text = cluster_spec_toml(manifest, root / "models", num_shards=2)
    for header in ("[cascade]",):  # the export's own section is replaced by ours
        start = text.index(header + "\n")
        end = text.find("\n\n", start)
        text = text[:start] + text[end + 2 if end >= 0 else len(text) :]
    text += EXTRA_SPEC
    loads(text)
    (root / "cluster.toml").write_text(text)
    return root / "cluster.toml", root / "models", root / "plan.json"


def good_requests(plan_path: Path) -> dict[str, list[Any]]:
    """A request per data-path method that must succeed (crossover seeds; the after-check)."""
    import numpy as np

    from recserve.rpc.deadline import make_header
    from recserve.rpc.tensors import pack
    from recserve.sharding.plan import ShardingPlan
    from recserve.v1 import embedding_pb2, generation_pb2, ranking_pb2, recommender_pb2

    plan = ShardingPlan.load(plan_path)
    table = sorted(plan.tables)[0]
    ids = np.asarray(plan.assignment(0, table).cold_ids[:4], np.int64)
    items = np.arange(10, 30, dtype=np.int64)
    return {
        "/recserve.v1.EmbeddingShard/Lookup": [embedding_pb2.LookupRequest(header=make_header(timeout_s=10), tables=[embedding_pb2.TableLookup(table=table, ids=pack(ids))])],
        "/recserve.v1.Ranking/Rank": [ranking_pb2.RankRequest(header=make_header(timeout_s=10), user_id=3, candidate_ids=pack(items))],
        "/recserve.v1.Ranking/EmbedUser": [ranking_pb2.EmbedUserRequest(header=make_header(timeout_s=10), user_id=3)],
        "/recserve.v1.Recommender/Recommend": [recommender_pb2.RecommendRequest(header=make_header(timeout_s=10), user_id=3, k=5)],
        "/recserve.v1.Generation/Generate": [generation_pb2.GenerateRequest(header=make_header(timeout_s=10), prompt="hello", max_new_tokens=4)],
    }  # fmt: skip


def check_good_requests(addresses: dict[str, str], plan_path: Path) -> list[str]:
    """Send every good request (freshly stamped) to the process serving its service;
    the failures, as text."""
    import grpc

    from recserve.v1 import generation_pb2

    by_service = {"EmbeddingShard": addresses["shard-0"], "Ranking": addresses["ranker-0"], "Recommender": addresses["cascade-0"], "Generation": addresses["generation-0"]}
    failures = []
    for path, requests in good_requests(plan_path).items():
        service = path.split("/")[1].rsplit(".", 1)[-1]
        with grpc.insecure_channel(by_service[service]) as channel:
            for request in requests:
                try:
                    if service == "Generation":
                        call = channel.unary_stream(path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=generation_pb2.GenerateChunk.FromString)
                        chunks = list(call(request, timeout=30))
                        if not chunks or not chunks[-1].finished:
                            failures.append(f"{path}: the stream ended unfinished after {len(chunks)} chunk(s)")
                    else:
                        channel.unary_unary(path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=None)(request, timeout=30)
                except grpc.RpcError as exc:
                    failures.append(f"{path}: {exc.code().name} {exc.details()}")  # type: ignore[attr-defined]
    return failures


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # "shard-0", "ranker-0", ...
    address: str
    pid: int


def fuzz_stack(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import grpc

    from recserve.bench.fuzz_grpc import ResourceProbe, fuzz_methods, list_methods
    from recserve.bench.fuzz_http import fuzz_gateway
    from recserve.cluster.stack import ServingStack
    from recserve.config import load

    started = time.perf_counter()
    spec, models, plan = build_world(root, args.items, args.seed)
    _log(f"world trained and planned in {time.perf_counter() - started:.1f} s")
    stack = ServingStack(load(spec), spec_path=spec, models_dir=models, plan_path=plan, data_root=root / "run", admin_token=ADMIN_TOKEN)
    with stack:
        assert stack.rankers is not None and stack.cascade is not None and stack.generation is not None and stack.gateway is not None
        targets = [Target(f"shard-{k}", stack.shards.address(k), stack.shards.pid(k)) for k in range(stack.shards.num_shards)]
        targets += [Target("ranker-0", stack.rankers.address(0), stack.rankers.pid(0)), Target("cascade-0", stack.cascade.address, stack.cascade.pid),
                    Target("generation-0", stack.generation.address(0), stack.generation.pid(0))]  # fmt: skip
        addresses = {t.name: t.address for t in targets}
        probe = ResourceProbe({**{t.name: t.pid for t in targets}, "gateway": stack.gateway.pid})
        examples = good_requests(plan)
        _log(f"stack SERVING; warming up ({', '.join(addresses)}, gateway {stack.gateway.url})")
        with_methods = []
        for t in targets:
            with grpc.insecure_channel(t.address) as channel:
                methods = list_methods(channel, skip_services=SKIP_SERVICES)
                fuzz_methods(channel, methods, cases_per_method=3, seed=args.seed + 1, examples=examples, admin_token=ADMIN_TOKEN)
            with_methods.append((t, methods))
        fuzz_gateway(stack.gateway.url, cases_per_operation=3, seed=args.seed + 1)
        before = probe.sample()
        services: dict[str, Any] = {}
        for t, methods in with_methods:
            by_service: dict[str, list[Any]] = {}
            for m in methods:
                by_service.setdefault(m.path.split("/")[1], []).append(m)
            for service, ms in by_service.items():
                t0 = time.perf_counter()
                per_method = math.ceil(args.cases / len(ms))
                with grpc.insecure_channel(t.address) as channel:
                    report = fuzz_methods(channel, ms, cases_per_method=per_method, seed=args.seed, examples=examples, admin_token=ADMIN_TOKEN)
                    # A method with an empty request type (ShardInfo, GetPlan) runs out of
                    # distinct cases after a few; the others take its share of --cases.
                    still_drawing = [m for m in ms if report.methods[m.path].cases >= per_method]
                    if report.cases < args.cases and still_drawing:
                        more = fuzz_methods(channel, still_drawing, cases_per_method=math.ceil((args.cases - report.cases) / len(still_drawing)),
                                            seed=args.seed + 7_919, examples=examples, admin_token=ADMIN_TOKEN)  # fmt: skip
                        for path, extra in more.methods.items():
                            stats = report.methods[path]
                            stats.cases += extra.cases
                            stats.codes.update(extra.codes)
                            stats.violations.extend(extra.violations)
                codes: dict[str, int] = {}
                for stats in report.methods.values():
                    for code, n in stats.codes.items():
                        codes[code] = codes.get(code, 0) + n
                services[f"{t.name} {service}"] = {"cases": report.cases, "methods": {p: s.cases for p, s in report.methods.items()}, "codes": codes,
                                                   "violations": report.violations, "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
                _log(f"{t.name} {service}: {report.cases:,} cases, {len(report.violations)} violation(s), {codes}")
        t0 = time.perf_counter()
        http = fuzz_gateway(stack.gateway.url, cases_per_operation=args.http_cases, seed=args.seed)
        http_out = {"cases": http.cases, "hostile_cases": http.hostile_cases, "violations": http.violations, "seconds": round(time.perf_counter() - t0, 1),
                    "operations": {label: {"cases": op.cases, "statuses": {str(k): v for k, v in sorted(op.statuses.items())}} for label, op in http.operations.items()}}  # fmt: skip
        _log(f"gateway: {http.cases:,} cases ({http.hostile_cases:,} hostile bodies), {len(http.violations)} violation(s)")
        failures = check_good_requests(addresses, plan)
        leaks = ResourceProbe.leaks(before, probe.sample(), fd_slack=FD_SLACK, thread_slack=THREAD_SLACK)
        crashed = probe.dead()
    violations = sum(len(s["violations"]) for s in services.values()) + len(http.violations)
    return {
        "services": services,
        "http": http_out,
        "grpc_cases": sum(s["cases"] for s in services.values()),
        "violations": violations,
        "leaks": leaks,
        "good_request_failures": failures,
        "crashed": crashed,
        "ok": violations == 0 and not leaks and not failures and not crashed,
        "seconds": round(time.perf_counter() - started, 1),
        "seed": args.seed,
    }


def format_report(r: dict[str, Any]) -> str:
    lines = [f"{'service':<40} {'cases':>8} {'viol.':>6}  codes"]
    for name, s in r["services"].items():
        codes = ", ".join(f"{c} {n:,}" for c, n in sorted(s["codes"].items(), key=lambda kv: -kv[1]))
        lines.append(f"{name:<40} {s['cases']:>8,} {len(s['violations']):>6}  {codes}")
    h = r["http"]
    lines.append(f"{'gateway (HTTP)':<40} {h['cases']:>8,} {len(h['violations']):>6}  {h['hostile_cases']:,} hostile bodies")
    for v in [v for s in r["services"].values() for v in s["violations"]][:20] + h["violations"][:20]:
        lines.append(f"  violation: {v}")
    lines.append(f"gRPC cases {r['grpc_cases']:,}; leaks {r['leaks'] or 'none'}; good requests {'all answered' if not r['good_request_failures'] else r['good_request_failures']}; "
                 f"crashed {r['crashed'] or 'none'}; {r['seconds']:.0f} s; {'OK' if r['ok'] else 'FAILED'}")  # fmt: skip
    return "\n".join(lines)
