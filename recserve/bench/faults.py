"""``recserve bench faults``: six faults, one after another, under open-loop Recommend load.

It starts a real, supervised cluster (:class:`~recserve.cluster.stack.ServingStack`:
3 shards with the test-only fault hook, 2 rankers, the cascade and the gateway), finds
the knee of open-loop ``Recommend`` over gRPC with :mod:`recserve.bench.knee` (or takes
``--knee-rps``), then drives Poisson load at ``--load`` (0.7) of it with
:func:`recserve.loadtest.driver.run_open_loop` through a recording target, and injects:

1. ``shard_kill``: SIGKILL of shard 0, restarted by the supervisor;
2. ``shard_slow``: +200 ms on shard 1's data RPCs (the fault hook) for ``--during``;
3. ``ranker_kill``: SIGKILL of ranker 0 (restarted by the supervisor);
4. ``burst``: a second open-loop stream so the offered load is 3x the knee, for ``--during``;
5. ``upserts``: ``--upserts`` acknowledged rows on shards 0 and 1, SIGKILL of both,
   supervisor restart, every row read back (``lost_upserts``: rows not read back equal);
6. ``disk_full``: shard 2's RocksDB writes raise a full disk's I/O error (the fault
   hook's ``disk_full``): upserts fail loudly, the rows stay as they were, reads go on.

Each fault runs ``--before`` s of plain load, the fault for ``--during`` s (longer when
a restart takes longer) and ``--after`` s. Figures: :mod:`recserve.bench.faults_report`;
``--json`` prints ``{"faults": {NAME: {...}}, "total": {...}, "meta": {...}}``; a PNG
timeline goes to ``OUT/faults.png``. ``--faults`` picks a subset (CI runs two or three).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from recserve.bench.faults_report import Records, fault_figures, format_table, timeline, total_figures
from recserve.loadtest.requests import RequestPool
from recserve.logs import secrets_in

if TYPE_CHECKING:
    from recserve.bench.faults_target import RecordingTarget

FAULTS = ("shard_kill", "shard_slow", "ranker_kill", "burst", "upserts", "disk_full")
TENANT, TENANT_KEY_ENV = "feed", "RECSERVE_FAULTS_FEED_KEY"
ADMIN_TOKEN_ENV = "RECSERVE_ADMIN_TOKEN"  # [admin] token_env's default, which the bench's spec keeps
SLOW_SHARD_MS = 200.0
BURST_FACTOR = 3.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", type=Path, default=None, help="a trained export (default: generate and train a small one into OUT)")
    p.add_argument("--catalog", type=Path, default=None, help="the catalog --models was trained on (default: MODELS/../catalog)")
    p.add_argument("--config", type=Path, default=None, help="cluster spec (default: the export's, with 3 shards and 2 rankers)")
    p.add_argument("--items", type=int, default=20_000, help="catalog items when generating (default 20000)")
    p.add_argument("--users", type=int, default=5_000, help="catalog users when generating (default 5000)")
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--train-rows", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset, in this order: {','.join(FAULTS)}")
    p.add_argument("--before", type=float, default=10.0, help="seconds of plain load before each fault (default 10)")
    p.add_argument("--during", type=float, default=10.0, help="seconds each fault lasts (default 10)")
    p.add_argument("--after", type=float, default=15.0, help="seconds after each fault, for recovery (default 15)")
    p.add_argument("--load", type=float, default=0.7, help="offered load as a fraction of the knee (default 0.7)")
    p.add_argument("--knee-rps", type=float, default=0.0, help="skip the knee search and use this rate (default 0 = search)")
    p.add_argument("--knee-lo", type=float, default=5.0)
    p.add_argument("--knee-hi", type=float, default=400.0)
    p.add_argument("--probe-s", type=float, default=5.0, help="seconds per knee probe (default 5)")
    p.add_argument("--slo-ms", type=float, default=500.0, help="the SLO of goodput and the knee (default 500)")
    p.add_argument("--timeout-ms", type=float, default=0.0,
                   help="each Recommend's deadline (default 0 = the SLO: a feed service's deadline is its SLO, and shedding keys on it)")
    p.add_argument("--upserts", type=int, default=1000, help="acknowledged rows written before the kill of fault 5 (default 1000)")
    p.add_argument("--pool-size", type=int, default=2048)
    p.add_argument("--out", type=Path, default=Path("out/bench-faults"), help="world, run data, faults.json and faults.png (default out/bench-faults)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.faults.split(",") if n.strip()]
    unknown = sorted(set(names) - set(FAULTS))
    if unknown or not names:
        raise SystemExit(f"--faults {args.faults!r} is invalid: use a comma-separated subset of {','.join(FAULTS)}")
    for flag, value in (("--before", args.before), ("--during", args.during), ("--after", args.after), ("--load", args.load)):
        if not value > 0:
            raise SystemExit(f"{flag} = {value!r} is invalid: use a positive number")
    if args.timeout_ms <= 0:
        args.timeout_ms = args.slo_ms
    args.out.mkdir(parents=True, exist_ok=True)
    report = run_suite(args, [n for n in FAULTS if n in names])
    (args.out / "faults.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report) if args.json else format_table(report))
    return 0


def _log(msg: str) -> None:
    print(f"[bench faults] {msg}", file=sys.stderr, flush=True)


def _spec_text(models: Path) -> str:
    from ranker.spec import cluster_spec_toml

    manifest = json.loads((models / "manifest.json").read_text())
    text = cluster_spec_toml(manifest, models, num_shards=3)
    # The export's cascade (100 ms, L1 2,000 candidates: more than a default ranker takes)
    # answers every request degraded on 2 cores, and a knee of degraded answers is 0:
    # small stages and a 1 s budget, so "degraded" means a fault did it.
    head = "[cascade]\ndefault_deadline_ms = 100.0\n"
    if head in text:
        text = text.replace(head, "[cascade]\ndefault_deadline_ms = 1000.0\nl0_out = 400\nl1_out = 200\nl2_out = 50\nl3_out = 10\n", 1)
    # A deployment that must keep its coverage through a lost or slow shard replicates
    # every row: hot rows on all 3 shards, cold rows on 2, and no column-split warm tier
    # (a column-split row is lost with any one of its shards). With the export's default
    # (cold rows on one shard) a killed shard's rows are simply gone until its restart.
    sharding = "[sharding]\nnum_shards = 3\nhot_fraction = 0.01\nwarm_fraction = 0.10\nhot_replicas = 2\n"
    if sharding in text:
        text = text.replace(sharding, "[sharding]\nnum_shards = 3\nhot_fraction = 0.01\nwarm_fraction = 0.0\nhot_replicas = 3\ncold_replicas = 2\n", 1)
    return text + "\n[topology]\nrankers = 2\n"


def _spec(text: str, run_dir: Path) -> Path:
    """``text`` (the given spec, or the bench's own) plus a keyed tenant that the load
    authenticates as, so the no-secrets log check (meta.no_secrets) has a key to look
    for beside the admin token."""
    path = run_dir / "cluster.toml"
    path.write_text(text + f'\n[[tenants]]\nname = "{TENANT}"\napi_key_env = "{TENANT_KEY_ENV}"\n')
    return path


def _start_stack(args: argparse.Namespace, models: Path, run_dir: Path) -> Any:
    from recserve.cli.serve_cmd import _prepare
    from recserve.cluster.supervise import SupervisorConfig

    spec = _spec(args.config.read_text() if args.config is not None else _spec_text(models), run_dir)
    ns = argparse.Namespace(models=models, config=spec, no_cascade=False, no_gateway=False, insecure_admin=False, cache=None)
    with contextlib.redirect_stdout(sys.stderr):  # serve's lines, not the --json
        stack = _prepare(ns, run_dir / "data")
        stack.shards.fault_hook = True  # the test-only hook (latency, errors) on every shard
        stack.start()
    stack.supervise(SupervisorConfig(initial_backoff_s=0.2, max_backoff_s=2.0), on_event=lambda line: _log(f"supervisor: {line}"))
    return stack


# ---- the faults: each a blocking function run in a thread while the load goes on --------


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _wait_restarted(group: Any, k: int, old_pid: int, timeout_s: float = 120.0) -> None:
    """Until the supervisor has restarted member ``k`` (a new pid) and it is SERVING."""
    limit = time.monotonic() + timeout_s

    def restarted() -> bool:
        try:
            return group.pid(k) != old_pid and group._group.exit_code(k) is None  # the launcher's ProcessGroup
        except KeyError:  # the supervisor is between the old member and the new one
            return False

    while not restarted():
        if time.monotonic() > limit:
            raise TimeoutError(f"{type(group).__name__} member {k} was not restarted within {timeout_s:.0f} s")
        time.sleep(0.05)  # polling a process table, not synchronising a test
    group.wait_serving(k, timeout_s)


def _upsert_parts(plan: Any, shard_ids: tuple[int, ...], n: int, seed: int) -> tuple[str, list[tuple[int, np.ndarray, np.ndarray]]]:
    """``n`` new rows for cold ids whose every owner is among ``shard_ids``, written to
    every owner (each replica, as the client's replicated upsert writes them): ``(table,
    [(shard, ids, rows)])``, one part per owner. A row written to one replica of two
    would be read from either: two answers for one row, and every exact deep check
    failing on them."""
    table = max(plan.tables.values(), key=lambda t: t.rows)
    router = plan.router(table.name)
    rng = np.random.default_rng(seed)
    cold = np.unique(np.concatenate([plan.assignment(k, table.name).cold_ids for k in shard_ids])).astype(np.int64)
    owners = router.cold_owners_of(cold)
    inside = np.isin(owners, np.asarray(shard_ids)).all(axis=1)
    ids = rng.choice(cold[inside], size=min(n, int(inside.sum())), replace=False).astype(np.int64)
    rows = rng.standard_normal((ids.size, table.dim)).astype(np.float32)
    owners = router.cold_owners_of(ids)
    parts = []
    for k in shard_ids:
        mine = (owners == k).any(axis=1)
        if mine.any():
            parts.append((k, ids[mine], rows[mine]))
    return table.name, parts


def _upsert(address: str, table: str, ids: np.ndarray, rows: np.ndarray) -> int:
    import grpc

    from recserve.rpc.tensors import pack
    from recserve.v1 import embedding_pb2, embedding_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        req = embedding_pb2.UpsertRequest()
        req.tables.add(table=table, ids=pack(ids), rows=pack(rows))
        token = (("authorization", f"Bearer {os.environ[ADMIN_TOKEN_ENV]}"),)
        return int(embedding_pb2_grpc.EmbeddingShardStub(ch).Upsert(req, timeout=30, metadata=token).rows_written)


def _read(address: str, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    import grpc

    from recserve.rpc.tensors import pack, unpack
    from recserve.v1 import embedding_pb2, embedding_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        req = embedding_pb2.LookupRequest()
        req.tables.add(table=table, ids=pack(ids))
        t = embedding_pb2_grpc.EmbeddingShardStub(ch).Lookup(req, timeout=30).tables[0]
    return unpack(t.found, "found"), unpack(t.rows, "rows")


def _fault_upserts(stack: Any, n: int, seed: int, details: dict[str, Any]) -> int:
    """Fault 5: ``n`` acknowledged rows (batches of 10 rows per Upsert) on shards 0 and 1,
    SIGKILL both, wait for the supervisor's restarts, read every row back; returns lost rows."""
    from recserve.sharding.plan import ShardingPlan

    shards = stack.shards
    table, parts = _upsert_parts(ShardingPlan.load(stack.plan_path), (0, 1), n, seed)
    acked = 0
    for k, ids, rows in parts:
        for lo in range(0, ids.size, 10):  # one RPC per batch of 10: each acknowledged before the next
            acked += _upsert(shards.address(k), table, ids[lo : lo + 10], rows[lo : lo + 10])
    pids = {k: shards.pid(k) for k, _, _ in parts}
    for pid in pids.values():
        _kill(pid)
    for k, pid in pids.items():
        _wait_restarted(shards, k, pid)
    lost = 0
    for k, ids, rows in parts:
        found, got = _read(shards.address(k), table, ids)
        same = found.astype(bool) & np.all(np.isclose(got, rows), axis=1) if got.shape == rows.shape else np.zeros(ids.size, dtype=bool)
        lost += int((~same).sum())
    details["upserts"] = {"table": table, "rows_acknowledged": acked, "rows_read_back": int(sum(p[1].size for p in parts)) - lost,
                          "rows": int(np.unique(np.concatenate([p[1] for p in parts])).size)}  # fmt: skip
    return lost


def _owned_rows(plan: Any, shard: int, n: int, seed: int) -> tuple[str, np.ndarray, np.ndarray]:
    """``n`` cold ids ``shard`` owns (maybe with other replicas) and new rows for them."""
    table = max(plan.tables.values(), key=lambda t: t.rows)
    rng = np.random.default_rng(seed)
    ids = plan.assignment(shard, table.name).cold_ids
    ids = rng.choice(ids, size=min(n, ids.size), replace=False).astype(np.int64)
    return table.name, ids, rng.standard_normal((ids.size, table.dim)).astype(np.float32)


def _fault_disk_full(stack: Any, seed: int, details: dict[str, Any]) -> None:
    """Fault 6 (start): shard 2's RocksDB writes fail as on a full disk (the fault hook's
    ``disk_full``): every upsert must fail loudly and leave the old rows; reads go on."""
    from embedding_server.fault import set_fault
    from recserve.sharding.plan import ShardingPlan

    address = stack.shards.address(2)
    table, ids, rows = _owned_rows(ShardingPlan.load(stack.plan_path), 2, 20, seed + 1)  # refused: no replica diverges
    _, old = _read(address, table, ids)
    set_fault(address, disk_full=True)
    refused = 0
    codes: set[str] = set()
    for lo in range(0, ids.size, 5):
        try:
            _upsert(address, table, ids[lo : lo + 5], rows[lo : lo + 5])
        except Exception as exc:  # grpc.RpcError: the loud failure the fault must produce
            refused += 1
            from recserve.loadtest.targets import status_name

            codes.add(status_name(exc))
    found, got = _read(address, table, ids)
    details["disk_full"] = {"upserts_tried": (ids.size + 4) // 5, "upserts_refused": refused, "refused_with": sorted(codes), "reads_found": int(found.astype(bool).sum()), "reads_tried": int(ids.size),
                            "rows_unchanged": int(np.all(got == old, axis=1).sum()) if got.shape == old.shape else 0}  # fmt: skip


async def _one_fault(name: str, stack: Any, target: RecordingTarget, args: argparse.Namespace, knee: float, details: dict[str, Any]) -> tuple[dict[str, Any], Records, tuple[float, float, float, float]]:
    from recserve.loadtest.driver import run_open_loop

    rate = args.load * knee
    slo_s, timeout_s = args.slo_ms / 1e3, args.timeout_ms / 1e3
    total_s = args.before + args.during + args.after
    target.take()
    target.recording = True
    t_before = time.monotonic()
    load = asyncio.ensure_future(run_open_loop(target, rate_rps=rate, duration_s=total_s, slo_s=slo_s, timeout_s=timeout_s, seed=args.seed + FAULTS.index(name)))
    await asyncio.sleep(args.before)  # the timeline itself
    t_start = time.monotonic()
    lost = 0
    extra: Awaitable[Any] | None = None
    blocking: Callable[[], Any] | None = None
    if name == "shard_kill":
        pid = stack.shards.pid(0)
        _kill(pid)
        blocking = lambda: _wait_restarted(stack.shards, 0, pid)  # noqa: E731
    elif name == "ranker_kill":
        assert stack.rankers is not None
        pid = stack.rankers.pid(0)
        _kill(pid)
        blocking = lambda: _wait_restarted(stack.rankers, 0, pid)  # noqa: E731
    elif name == "shard_slow":
        await asyncio.to_thread(stack.shards.set_fault, 1, delay_ms=SLOW_SHARD_MS)
    elif name == "burst":
        extra = run_open_loop(target, rate_rps=(BURST_FACTOR - args.load) * knee, duration_s=args.during, slo_s=slo_s, timeout_s=timeout_s, seed=args.seed + 100)
    elif name == "upserts":
        blocking = lambda: _fault_upserts(stack, args.upserts, args.seed, details)  # noqa: E731
    elif name == "disk_full":
        blocking = lambda: _fault_disk_full(stack, args.seed, details)  # noqa: E731
    results = await asyncio.gather(asyncio.sleep(args.during), *(x for x in (extra, asyncio.to_thread(blocking) if blocking else None) if x is not None))
    if name == "upserts":
        lost = int(results[-1])
    if name == "burst":  # the burst stream's own generator: did it hold (3 - load) x the knee?
        details.setdefault("generator", {})["burst_stream"] = results[1].generator.to_dict()
    if name == "shard_slow":
        await asyncio.to_thread(stack.shards.set_fault, 1)
    if name == "disk_full":
        await asyncio.to_thread(stack.shards.set_fault, 2)
    t_end = time.monotonic()
    summary = await load  # the load runs on past t_end if a restart took longer: "after" shrinks
    target.recording = False
    reasons = dict(target.reasons)
    rec = target.take()
    statuses, counts = np.unique(rec.status[rec.failed].astype(str), return_counts=True)
    details.setdefault("failed_by_status", {})[name] = {str(k): int(v) for k, v in zip(statuses, counts)}
    details.setdefault("degraded_by_reason", {})[name] = reasons
    # The schedule starts a few ms after t_before: its last request may fall past t_before + total_s.
    t_stop = max(t_end, t_before + total_s, float(rec.sched_s.max()) + 1e-6 if rec.size else 0.0)
    figures = fault_figures(rec, t_before=t_before, t_start=t_start, t_end=t_end, t_stop=t_stop, slo_s=slo_s, lost_upserts=lost,
                            knee_rps=knee if name == "burst" else None)  # fmt: skip
    details.setdefault("generator", {})[name] = summary.generator.to_dict()
    _log(f"{name}: {figures}")
    return figures, rec, (t_before, t_start, t_end, t_stop)


async def _suite(stack: Any, pool: RequestPool, args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    from recserve.bench.knee import find_knee_async
    from recserve.loadtest.driver import run_open_loop

    from recserve.bench.faults_target import RecordingTarget  # loads grpc: not at parser build (bench lookup sets gRPC's I/O path first)

    target = RecordingTarget([stack.cascade.address], pool, timeout_s=args.timeout_ms / 1e3, tenant=TENANT, api_key=os.environ[TENANT_KEY_ENV])
    await target.start()
    meta: dict[str, Any] = {"faults_run": names, "load_fraction": args.load, "before_s": args.before, "during_s": args.during, "after_s": args.after}
    try:
        if args.knee_rps > 0:
            knee = float(args.knee_rps)
            meta["knee"] = {"knee_per_s": knee, "status": "GIVEN"}
        else:
            async def probe(rate: float) -> Any:
                s = await run_open_loop(target, rate_rps=rate, duration_s=args.probe_s, slo_s=args.slo_ms / 1e3, timeout_s=args.timeout_ms / 1e3)
                _log(f"knee probe {rate:,.1f}/s: ok {s.ok}/{s.requests}")
                return s.probe()

            result = await find_knee_async(probe, lo_rps=args.knee_lo, hi_rps=args.knee_hi)
            meta["knee"] = result.to_dict()
            knee = float(result.knee_per_s or args.knee_lo)
        _log(f"knee {knee:,.1f}/s; load {args.load * knee:,.1f}/s")
        faults: dict[str, dict[str, Any]] = {}
        records: dict[str, Records] = {}
        windows: dict[str, tuple[float, float, float, float]] = {}
        for name in names:
            faults[name], records[name], windows[name] = await _one_fault(name, stack, target, args, knee, meta)
    finally:
        await target.aclose()
    total = total_figures(faults, records, windows, slo_s=args.slo_ms / 1e3)
    png = args.out / "faults.png"
    _plot(png, records, windows, slo_s=args.slo_ms / 1e3)
    meta["timeline_png"] = str(png)
    return {"faults": faults, "total": total, "meta": meta}


def _plot(path: Path, records: dict[str, Records], windows: dict[str, tuple[float, float, float, float]], *, slo_s: float) -> None:
    """PNG: goodput, p99 and shed per second over the whole suite, each fault's window shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 7), sharex=True, constrained_layout=True)
    origin = min(w[0] for w in windows.values())
    for name, rec in records.items():
        t0, t1, t2, t3 = windows[name]
        tl = timeline(rec, t0=t0, t1=t3, slo_s=slo_s)
        x = tl["t_s"] + (t0 - origin)
        for ax, key in zip(axes, ("goodput_rps", "p99_ms", "shed_rps")):
            ax.plot(x, tl[key], color="tab:blue")
            ax.axvspan(t1 - origin, t2 - origin, color="tab:red", alpha=0.15)
        axes[0].annotate(name, (t1 - origin, 0), fontsize="small", xytext=(2, 2), textcoords="offset points")
    for ax, label in zip(axes, ("goodput (OK/s)", "p99 (ms)", "shed (/s)")):
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("seconds (faults shaded)")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_suite(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """Start the world and the cluster, run the faults, stop everything; the report."""
    import shutil

    from ranker.scrubbed import open_scrubbed
    from recserve.bench.recall import _world

    catalog, models, _ = _world(args)
    run_dir = args.out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    pool = RequestPool.from_catalog(open_scrubbed(catalog), size=args.pool_size, candidates=16, seed=args.seed)
    # Fresh secrets for this run, in the environment every child inherits: the admin
    # token (Upsert) and the tenant's API key (Recommend). Afterwards every log the run
    # wrote is searched for them (the gateway issue's no-secrets check).
    secret_values = {"admin token": secrets.token_urlsafe(24), "tenant api key": secrets.token_urlsafe(24)}
    saved = {k: os.environ.get(k) for k in (ADMIN_TOKEN_ENV, TENANT_KEY_ENV)}
    os.environ[ADMIN_TOKEN_ENV], os.environ[TENANT_KEY_ENV] = secret_values["admin token"], secret_values["tenant api key"]
    try:
        stack = _start_stack(args, models, run_dir)
        try:
            report = asyncio.run(_suite(stack, pool, args, names))
        finally:
            stack.stop()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    logs = {str(p.relative_to(run_dir)): p.read_text(errors="replace") for p in sorted(run_dir.rglob("*.log"))}
    report["meta"]["no_secrets"] = {"logs_scanned": len(logs), "found": [list(f) for f in secrets_in(logs, secret_values)]}
    return report
