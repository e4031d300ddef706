"""``recserve bench rank``: the Ranking service's knee, batched against unbatched, 1 and 2 rankers.

The world is built here, tiny but real: a synthetic catalog (``--items``, ``--users``),
the three models trained on its scrubbed view (``--train-rows`` per epoch) and
exported; the DLRM tables planned over ``--shards`` real shard processes (RocksDB in
the work dir). Then real ``recserve ranker serve`` processes serve ``dlrm`` on them:

* ``batched``: one ranker with the spec's ``[ranker]`` batching (DynamicBatchPolicy,
  cost = candidates; ``--max-wait-ms``, ``--max-batch-candidates``);
* ``unbatched``: one ranker with ``batching = false`` (one request per forward; the
  lookups still go through its LookupClient);
* ``batched_2_rankers``: two batched rankers behind :class:`recserve.client.RankingClient`
  (two choices on in-flight candidates).

Every config is driven by the same open-loop Poisson ``Rank`` calls: ``--candidates``
(500) distinct items per request drawn by the catalog's popularity (successive
sampling, as a retrieval stage returns a popularity-skewed list), the user Zipf
(``--user-zipf``) over a random permutation of the users. A request's deadline is its
scheduled arrival + ``--timeout-ms`` (later = failed), so p99 can show the overload
beyond the SLO. Each config's knee comes from the shared
:func:`recserve.bench.knee.find_knee_async`: the highest offered rate at which >= 99% of
the requests are answered OK within ``--slo-ms`` (50) and not degraded. Probes are
independent: before each one the rankers' counters must stand still (the last probe's
backlog has drained), and after a probe that did not pass the config's rankers are
restarted (``--keep-rankers`` turns that off; see :func:`knee_of` for why). After the
search a closed-loop run (``--saturation-concurrency`` in flight for
``--saturation-seconds``) measures each config's throughput ceiling, latency unbounded.

Reported (table, or one JSON object with ``--json``; PNG of p99 against the offered
rate at ``--plot``, default ``OUT/rank_p99.png``):

* per config and probe: goodput within the SLO, p50 / p99, the mean requests per
  forward and the lookup dedup ratio (ids / unique ids), both from ``Admin.ModelStatus``
  counter deltas around the probe;
* top level: ``knee_batched``, ``knee_unbatched``, ``knee_batched_2_rankers``
  (requests/s), ``batching_gain`` (= batched / unbatched knee), ``scaling_2_rankers``
  (= 2-ranker / 1-ranker batched knee), candidates scored per second at each knee,
  ``forward_cost`` (:mod:`recserve.bench.rank_costs`: fixed ms + per-candidate µs of
  DLRM's ``score_pooled``, fitted in this process on CPU; ``forward_cost_cuda`` when
  CUDA is present), ``dedup_ratio`` (batched, at its knee) and
  ``theoretical_batching_cap`` (the forward-only cap at the batched knee's mean batch,
  formula in ``theoretical_batching_cap_formula``); the closed-loop ceilings
  (``saturation_requests_per_s``, ``saturation_gain``, ``saturation_scaling_2_rankers``,
  the cap at the closed loop's mean batch). Each probe also records the host's 1-minute
  load average: other work on a shared machine shows up there.

Goals (issue 11): batched knee >= 3x the unbatched one; two rankers >= 1.6x one. On a
2-core machine the shards, the rankers and this load generator share the cores, so a
second ranker adds a process, not a CPU: ``note`` says so with the measured figures.

This module runs the world and the probes; :mod:`recserve.bench.rank_costs` fits the
forward cost, :mod:`recserve.bench.rank_report` derives the figures and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from recserve.bench.rank_report import CONFIGS, LABELS, format_report, summarise

if TYPE_CHECKING:
    from recserve.bench.knee import ProbeResult

SPEC_RANKER_ANCHOR = '[ranker]\nmodels = ["dlrm", "two_tower", "l3"]\n'
QUIET_S = 0.25  # the rankers are idle once their counters stand still this long
QUIET_MAX_S = 20.0


def _configs(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in CONFIGS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"--configs {text!r}: name some of {list(CONFIGS)}, comma-separated")
    return tuple(n for n in CONFIGS if n in names)  # report order


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        sizes = ()
    if len(sizes) < 2 or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"--cost-sizes {text!r}: give at least two positive batch sizes (pairs), comma-separated")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--items", type=int, default=20_000, help="catalog items (default 20000)")
    p.add_argument("--users", type=int, default=2_000, help="catalog users (default 2000)")
    p.add_argument("--impressions", type=int, default=100_000, help="click-log impressions of the catalog (default 100000)")
    p.add_argument("--train-rows", type=int, default=50_000, help="training rows per epoch and model (default 50000; 0 = all)")
    p.add_argument("--candidates", type=int, default=500, help="candidates per Rank request (default 500)")
    p.add_argument("--user-zipf", type=float, default=1.05, help="Zipf exponent of the users sending requests (default 1.05; 0 = uniform)")
    p.add_argument("--request-pool", type=int, default=2_048, help="distinct requests drawn before timing, sent round-robin (default 2048)")
    p.add_argument("--shards", type=int, default=2, help="shard processes (default 2)")
    p.add_argument("--configs", type=_configs, default=tuple(CONFIGS), help=f"which of {','.join(CONFIGS)} to run (default all)")
    p.add_argument("--max-wait-ms", type=float, default=None, help="ranker.max_wait_ms of the batched rankers (default: RankerConfig's)")
    p.add_argument("--max-batch-candidates", type=int, default=None, help="ranker.max_batch_candidates (default: RankerConfig's)")
    p.add_argument("--slo-ms", type=float, default=50.0, help="a request is OK if answered, not degraded, within this (default 50 ms)")
    p.add_argument("--timeout-ms", type=float, default=250.0, help="each request's deadline after its scheduled arrival (default 250 ms)")
    p.add_argument("--probe-seconds", type=float, default=3.0, help="shortest arrival period of a knee probe (default 3 s)")
    p.add_argument("--min-probe-requests", type=int, default=200,
                   help="a probe lasts until about this many arrivals (a 99%% target needs a few hundred), up to --max-probe-seconds (default 200)")
    p.add_argument("--max-probe-seconds", type=float, default=15.0, help="longest arrival period of a knee probe (default 15 s)")
    p.add_argument("--max-probe-requests", type=int, default=1_500, help="at most this many arrivals per probe: an overloaded probe stays short (default 1500)")
    p.add_argument("--warmup-requests", type=int, default=200, help="closed-loop requests before each config's search (shard caches, channels; default 200)")
    p.add_argument("--saturation-seconds", type=float, default=3.0, help="closed-loop run after each knee search, the throughput ceiling (default 3 s; 0 = skip)")
    p.add_argument("--saturation-concurrency", type=int, default=64, help="requests in flight in the closed-loop run (default 64)")
    p.add_argument("--keep-rankers", action="store_true",
                   help="do not restart the rankers after a probe that failed (later probes then inherit its overload state)")
    p.add_argument("--lo-rps", type=float, default=10.0, help="knee search: lowest offered rate (default 10/s)")
    p.add_argument("--hi-rps", type=float, default=1_000.0, help="knee search: highest offered rate (default 1000/s)")
    p.add_argument("--tolerance", type=float, default=0.05, help="knee search: stop when the bracket is within this ratio (default 0.05)")
    p.add_argument("--fail-retries", type=int, default=1,
                   help="knee search: re-probe a failed rate this many times; it fails only if every try fails (default 1: on a shared box one "
                        "tail event from another tenant must not set the knee; every config gets the same rule)")
    p.add_argument("--cost-sizes", type=_sizes, default=(1, 16, 128, 500, 1000, 2000, 4000, 8000), help="pairs per timed forward (default 1,16,...,8000)")
    p.add_argument("--cost-repeats", type=int, default=7, help="timed forwards per size (median; default 7)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="keep the catalog, models and shard data here (default: a temp dir, removed)")
    p.add_argument("--out", default="out/bench-rank", help="where the plot goes by default (default out/bench-rank)")
    p.add_argument("--plot", default=None, metavar="PATH", help="PNG of p99 vs offered rate (default OUT/rank_p99.png; '' = none)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--slo-ms", args.slo_ms), ("--probe-seconds", args.probe_seconds), ("--candidates", args.candidates), ("--items", args.items),
                        ("--users", args.users), ("--request-pool", args.request_pool), ("--shards", args.shards)):  # fmt: skip
        if not value > 0:
            raise SystemExit(f"{flag} = {value!r} is invalid: use a positive number")
    if args.timeout_ms < args.slo_ms:
        raise SystemExit(f"--timeout-ms = {args.timeout_ms!r} is invalid: use at least --slo-ms ({args.slo_ms:g}), or late answers read as failures")
    if args.candidates > args.items:
        raise SystemExit(f"--candidates = {args.candidates} is invalid: draw at most --items ({args.items:,}) distinct items per request")
    from recserve.bench.knee import KneeSearch

    KneeSearch(lo_rps=args.lo_rps, hi_rps=args.hi_rps, tolerance=args.tolerance, fail_retries=args.fail_retries)  # bad search flags fail now, not minutes in
    import torch

    torch.set_num_threads(1)  # the shards and rankers share the cores; one torch thread here
    own_dir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="recserve-bench-rank-")) if own_dir else Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        report = _run(args, workdir)
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    plot = args.plot if args.plot is not None else str(Path(args.out) / "rank_p99.png")
    report["plot"] = None
    if plot and any(c["probes"] for c in report["configs"].values()):
        from recserve.bench.lookup_capacity import plot_capacity

        Path(plot).parent.mkdir(parents=True, exist_ok=True)
        curves: dict[str, Sequence[tuple[float, float | None]]] = {
            LABELS[n]: [(float(pr["offered_per_s"]), pr["p99_ms"]) for pr in k["probes"]] for n, k in report["configs"].items()
        }
        c = report["config"]
        plot_capacity(plot, curves, slo_ms=args.slo_ms,
                      title=f"recserve bench rank: {c['items']:,} items, {c['candidates']} candidates/request, {c['shards']} shards, {c['cpus']} CPUs")
        report["plot"] = plot
        _log(f"plot written to {plot}")
    print(json.dumps(report, allow_nan=False) if args.json else format_report(report))
    return 0


def _log(msg: str) -> None:
    print(f"[bench rank] {msg}", file=sys.stderr, flush=True)


# ---- the world ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class World:
    models: Path
    plan_path: Path
    specs: dict[bool, Path]  # batching -> spec path
    users: np.ndarray  # int64 [R]
    candidates: np.ndarray  # int64 [R, C], distinct within a row


def build_world(args: argparse.Namespace, root: Path) -> World:
    """Catalog, trained export, DLRM plan, the two specs and the request pool."""
    from ranker.config import TrainConfig
    from ranker.export import export_models
    from ranker.scrubbed import open_scrubbed
    from ranker.spec import cluster_spec_toml, tables_and_features
    from ranker.train import train_all
    from recserve.catalog import CatalogConfig, generate_catalog
    from recserve.config import loads
    from recserve.config.spec import RankerConfig, ShardingConfig
    from recserve.sharding import plan_tables

    t0 = time.perf_counter()
    catalog = generate_catalog(CatalogConfig(items=args.items, users=args.users, impressions=args.impressions, seed=args.seed), root / "catalog", progress=False)
    view = open_scrubbed(root / "catalog")
    manifest = export_models(train_all(view, TrainConfig(seed=args.seed, device="cpu", max_rows=args.train_rows, progress=False, threads=1)), view, root / "models")
    _log(f"catalog {args.items:,} items x {args.users:,} users, models trained and exported in {time.perf_counter() - t0:.1f} s (model_version {manifest['model_version']})")
    tables, _ = tables_and_features(manifest)
    dlrm_tables = [t for t in tables if t.name.startswith("dlrm_")]  # the benchmark serves DLRM only
    # The item table's access frequency: its training-log impressions (what a real system knows).
    shown = np.asarray(view.train.item, dtype=np.int64)
    item_rows = next(t.rows for t in dlrm_tables if t.name == "dlrm_item")  # may exceed --items (rows reserved by the export)
    freq = {"dlrm_item": np.bincount(shown, minlength=item_rows).astype(np.float64) + 1.0}
    sharding = ShardingConfig(num_shards=args.shards, hot_fraction=0.01, warm_fraction=0.1, hot_replicas=min(2, args.shards))
    plan_tables(dlrm_tables, freq, sharding, seed=args.seed).plan.save(root / "plan.json")
    base = cluster_spec_toml(manifest, root / "models", num_shards=args.shards)
    if SPEC_RANKER_ANCHOR not in base:
        raise SystemExit(f"bench rank: the export's cluster spec has no {SPEC_RANKER_ANCHOR!r} section to replace; update SPEC_RANKER_ANCHOR")
    specs = {}
    for batching in (True, False):
        lines = ["[ranker]", 'models = ["dlrm"]', 'device = "cpu"', "threads = 1", f"slo_ms = {args.slo_ms}", f"batching = {'true' if batching else 'false'}"]
        if args.candidates > RankerConfig.max_candidates:  # the default cap already admits a request; the cascade section checks against it
            lines.append(f"max_candidates = {args.candidates}")
        if args.max_wait_ms is not None:
            lines.append(f"max_wait_ms = {args.max_wait_ms}")
        if args.max_batch_candidates is not None:
            lines.append(f"max_batch_candidates = {args.max_batch_candidates}")
        text = base.replace(SPEC_RANKER_ANCHOR, "\n".join(lines) + "\n", 1)
        parsed = loads(text).ranker  # a bad flag fails here, naming the field, not in a child process
        assert parsed.batching is batching and parsed.models == ("dlrm",)
        specs[batching] = root / f"cluster-{'batched' if batching else 'unbatched'}.toml"
        specs[batching].write_text(text)
    users, candidates = request_pool(catalog.item_popularity, args.users, args.request_pool, args.candidates, user_zipf=args.user_zipf, seed=args.seed)
    return World(root / "models", root / "plan.json", specs, users, candidates)


def request_pool(item_popularity: np.ndarray, num_users: int, count: int, candidates: int, *, user_zipf: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` requests: users int64 [R] (Zipf over a permutation of the users) and
    candidates int64 [R, C], each row C distinct items drawn by popularity without
    replacement (Gumbel top-C of ``log p``, i.e. successive sampling), in chunks so the
    [chunk, N] key block stays small."""
    from recserve.catalog import PopularitySampler, zipf_weights

    rng = np.random.default_rng(seed + 1)
    weights = zipf_weights(num_users, user_zipf)[rng.permutation(num_users)]
    users = PopularitySampler(weights).sample(count, rng)
    logp = np.log(np.maximum(np.asarray(item_popularity, dtype=np.float64), 1e-300))
    chunk = max(1, (1 << 22) // logp.shape[0])
    out = np.empty((count, candidates), dtype=np.int64)
    for lo in range(0, count, chunk):  # per chunk of requests, before any timing
        keys = logp[None, :] + rng.gumbel(size=(min(chunk, count - lo), logp.shape[0]))
        out[lo : lo + keys.shape[0]] = np.argpartition(-keys, candidates - 1, axis=1)[:, :candidates]
    return users.astype(np.int64), out


# ---- probes ------------------------------------------------------------------------

#: ``send(i, deadline)`` ranks request i by ``deadline`` (monotonic s); returns whether
#: the answer was degraded; raises a RecserveError for none.
Send = Callable[[int, float], Awaitable[bool]]
COUNTERS = ("forwards", "requests", "lookup_windows", "lookup_ids", "lookup_unique_ids")


async def probe(rate_per_s: float, send: Send, *, seconds: float, max_requests: int, slo_s: float, timeout_s: float, seed: int) -> tuple[ProbeResult, dict[str, Any]]:
    """One open-loop Poisson probe: (the :class:`~recserve.bench.knee.ProbeResult`, its
    latency figures). Latency runs from the scheduled arrival to the answer; an arrival
    the generator reaches after its deadline is shed, RESOURCE_EXHAUSTED is shed, any
    other error (DEADLINE_EXCEEDED included) is failed."""
    from recserve.bench.arrivals import poisson_arrivals
    from recserve.bench.knee import ProbeResult
    from recserve.errors import ResourceExhausted

    arrivals = poisson_arrivals(rate_per_s, duration_s=seconds, count=max_requests, rng=np.random.default_rng(seed))
    n = int(arrivals.size)
    latency = np.full(n, np.nan)
    degraded = np.zeros(n, dtype=bool)
    shed = np.zeros(n, dtype=bool)
    sent_at = np.zeros(n)
    errors: dict[str, int] = {}
    t0 = time.monotonic()

    async def one(i: int, deadline: float) -> None:
        try:
            degraded[i] = await send(i, deadline)
        except ResourceExhausted:
            shed[i] = True
            return
        except Exception as exc:  # no answer: failed, counted by kind for the report
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            return
        latency[i] = time.monotonic() - (t0 + arrivals[i])

    tasks = []
    for i, at in enumerate(arrivals.tolist()):  # the arrival schedule: one task per arrival
        delay = t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)  # the schedule itself, not synchronisation
        now = time.monotonic()
        sent_at[i] = now - t0
        deadline = t0 + at + timeout_s
        if now >= deadline:
            shed[i] = True
            continue
        tasks.append(asyncio.ensure_future(one(i, deadline)))
    await asyncio.gather(*tasks)
    offered = n / float(arrivals[-1]) if n and arrivals[-1] > 0 else rate_per_s
    achieved = n / float(sent_at[-1]) if n and sent_at[-1] > 0 else 0.0
    result = ProbeResult.from_requests(offered, achieved_per_s=achieved, latency_s=latency, slo_s=slo_s, degraded=degraded, shed=shed)
    answered = latency[~np.isnan(latency)]
    figures = {
        "p50_ms": float(np.percentile(answered, 50) * 1e3) if answered.size else None,
        "p99_ms": float(np.percentile(answered, 99) * 1e3) if answered.size else None,
        "goodput_per_s": result.ok_fraction * offered,
        "errors": errors,
    }
    return result, figures


async def model_status(addresses: Sequence[str]) -> list[dict[str, int]]:
    """``Admin.ModelStatus`` counters (:data:`COUNTERS`) of each ranker."""
    import grpc

    from recserve.rpc.deadline import make_header
    from recserve.v1 import admin_pb2
    from recserve.v1.admin_pb2_grpc import AdminStub

    out = []
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await AdminStub(channel).ModelStatus(admin_pb2.ModelStatusRequest(header=make_header(timeout_s=10.0)), timeout=10.0)
        out.append({key: int(getattr(reply, key)) for key in COUNTERS})
    return out


async def quiet_status(addresses: Sequence[str]) -> list[dict[str, int]]:
    """:func:`model_status` once the counters have stood still for ``QUIET_S``: work an
    earlier probe left queued (its callers gone at their deadlines) has finished, so it
    neither loads the next probe nor lands in its deltas. Gives up after ``QUIET_MAX_S``."""
    status = await model_status(addresses)
    stop = time.monotonic() + QUIET_MAX_S
    while time.monotonic() < stop:
        await asyncio.sleep(QUIET_S)  # polling a remote counter: there is no event to wait on
        again = await model_status(addresses)
        if again == status:
            return status
        status = again
    _log(f"rankers {list(addresses)} still busy after {QUIET_MAX_S:g} s; probing anyway")
    return status


def _deltas(before: list[dict[str, int]], after: list[dict[str, int]]) -> dict[str, Any]:
    """Counter deltas summed over the rankers, with the derived batch and dedup figures."""
    per_ranker = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before)]
    # "ranker_requests", not "requests": a probe record also holds ProbeResult.requests (offered).
    delta: dict[str, Any] = {("ranker_requests" if k == "requests" else k): sum(d[k] for d in per_ranker) for k in COUNTERS}
    delta["requests_by_ranker"] = [d["requests"] for d in per_ranker]
    delta["mean_batch_requests"] = delta["ranker_requests"] / delta["forwards"] if delta["forwards"] else None
    delta["dedup_ratio"] = delta["lookup_ids"] / delta["lookup_unique_ids"] if delta["lookup_unique_ids"] else None
    return delta


async def saturate(send: Send, addresses: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    """Closed loop at ``--saturation-concurrency`` for ``--saturation-seconds``: the
    throughput ceiling whatever the latency (how far batching lifts capacity, beside
    how far it lifts the SLO knee)."""
    from recserve.errors import RecserveError, Unavailable

    before = await quiet_status(addresses)
    stop = time.monotonic() + args.saturation_seconds
    latencies: list[float] = []
    failures = 0

    async def worker(first: int) -> None:
        nonlocal failures
        i = first
        while time.monotonic() < stop:
            t = time.monotonic()
            try:
                await send(i, t + 10.0)
                latencies.append(time.monotonic() - t)
            except RecserveError as exc:  # counted, not fatal: the ceiling is what was answered
                failures += 1
                if isinstance(exc, Unavailable):  # every breaker open: back off as told, do not spin
                    await asyncio.sleep(exc.retry_after_s or 0.1)
            i += args.saturation_concurrency

    t0 = time.monotonic()
    await asyncio.gather(*(worker(k) for k in range(args.saturation_concurrency)))
    span = time.monotonic() - t0
    after = await model_status(addresses)
    lat = np.asarray(latencies)
    out = {"concurrency": args.saturation_concurrency, "seconds": span, "answered": int(lat.size), "failures": failures,
           "requests_per_s": lat.size / span, "candidates_per_s": lat.size * args.candidates / span,
           "p50_ms": float(np.percentile(lat, 50) * 1e3) if lat.size else None, **_deltas(before, after)}  # fmt: skip
    _log(f"saturation: {out['requests_per_s']:,.1f} requests/s at {args.saturation_concurrency} in flight, "
         f"{out['mean_batch_requests'] or 0:.1f} requests/forward, dedup {out['dedup_ratio'] or 0:.2f}")
    return out


async def warm(send: Send, count: int, rankers: int) -> None:
    """``count`` closed-loop requests, 2 in flight per ranker (connect the channels, run
    the first forwards). A refusal (a breaker still half-open, a ranker still loading)
    waits its ``retry_after_s``; only a warm-up where every request failed raises."""
    from recserve.errors import RecserveError, Unavailable

    failed: list[str] = []

    async def one(first: int) -> None:
        for i in range(first, count, 2 * rankers):
            try:
                await send(i, time.monotonic() + 30.0)
            except RecserveError as exc:
                failed.append(exc.message)
                if isinstance(exc, Unavailable):
                    await asyncio.sleep(exc.retry_after_s or 0.1)  # the server's own back-off hint

    await asyncio.gather(*(one(k) for k in range(min(count, 2 * rankers))))
    if count and len(failed) >= count:
        raise Unavailable(f"bench rank: all {count} warm-up requests failed; the last: {failed[-1]}", retry_after_s=1.0)


async def knee_of(name: str, addresses: Sequence[str], world: World, args: argparse.Namespace, routing: Any,
                  restart: Callable[[], None] | None) -> dict[str, Any]:
    """Warm up, then bisect for this config's knee; every probe with its latency,
    batch and dedup figures (ModelStatus deltas around it), then the closed-loop ceiling.

    ``restart`` (None: never) restarts this config's rankers; it runs before any probe
    that follows one which did not pass, so every probe starts from a fresh ranker. A
    ranker keeps state from an overload: its SLO controller shrinks the batch cap (down
    to 5% of ``max_batch_candidates``, below one 500-candidate request) and grows it back
    only after p99 stays under half the SLO, so without the restart the probes after
    the search's overloaded ``hi_rps`` probe measure that recovery, not the rate."""
    from recserve.bench.knee import OK_TARGET, find_knee_async
    from recserve.client import RankingClient

    users, cands = world.users, world.candidates
    pool = users.shape[0]
    extras: list[dict[str, Any]] = []
    rng = np.random.default_rng(args.seed)
    dirty = False  # the last probe did not pass: the rankers carry its overload
    restarts = 0

    async def session(warmup: int, body: Callable[[Send], Awaitable[Any]]) -> Any:
        """``body(send)`` on a fresh client (no breaker, budget or in-flight state left
        by the last probe's overload), after ``warmup`` closed-loop requests."""
        async with RankingClient(addresses, routing, rng=rng) as client:

            async def send(i: int, deadline: float) -> bool:
                k = i % pool
                return (await client.rank(int(users[k]), cands[k], model="dlrm", deadline=deadline)).degraded

            await warm(send, warmup, len(addresses))
            return await body(send)

    async def fresh() -> bool:
        nonlocal dirty, restarts
        if not dirty or restart is None:
            return False
        await asyncio.to_thread(restart)  # blocks until SERVING: off the loop
        dirty, restarts = False, restarts + 1
        return True

    async def run(rate: float) -> ProbeResult:
        nonlocal dirty
        restarted = await fresh()
        # A restarted ranker is cold (first forwards, lookup client); the shards are warm.
        warmup = min(args.warmup_requests, 16 * len(addresses)) if restarted else 2 * len(addresses)
        seconds = min(max(args.probe_seconds, args.min_probe_requests / rate), max(args.probe_seconds, args.max_probe_seconds))

        async def measured(send: Send) -> tuple[ProbeResult, dict[str, Any]]:
            before = await quiet_status(addresses)  # the warm-up and the last probe's backlog have finished
            result, figures = await probe(rate, send, seconds=seconds, max_requests=args.max_probe_requests, slo_s=args.slo_ms / 1e3,
                                          timeout_s=args.timeout_ms / 1e3, seed=args.seed + 1000 + len(extras))  # fmt: skip
            figures.update(_deltas(before, await model_status(addresses)))
            return result, figures

        result, figures = await session(warmup, measured)
        figures["loadavg_1m"] = os.getloadavg()[0]  # other work on the box shows up here
        figures["after_restart"] = restarted
        dirty = result.ok_fraction < OK_TARGET
        extras.append(figures)
        p99 = "n/a" if figures["p99_ms"] is None else f"{figures['p99_ms']:.1f}"
        _log(f"{name}: {rate:,.0f}/s offered -> {result.ok_fraction:.1%} OK, p99 {p99} ms, {figures['mean_batch_requests'] or 0:.1f} requests/forward")
        return result

    async def nothing(send: Send) -> None:
        return None

    await session(args.warmup_requests, nothing)
    found = await find_knee_async(run, lo_rps=args.lo_rps, hi_rps=args.hi_rps, tolerance=args.tolerance, fail_retries=args.fail_retries)
    saturation = None
    if args.saturation_seconds > 0:
        await fresh()
        saturation = await session(2 * len(addresses), lambda send: saturate(send, addresses, args))
    out = found.to_dict()
    out["saturation"] = saturation
    out["restarts"] = restarts
    out["probes"] = [{**p, **e} for p, e in zip(out["probes"], extras)]
    at_knee = [p for p in out["probes"] if p["passed"] and p["rate_per_s"] == found.knee_per_s]
    knee_probe = at_knee[-1] if at_knee else None
    out["rankers"] = len(addresses)
    out["candidates_per_s_at_knee"] = None if found.knee_per_s is None else found.knee_per_s * args.candidates
    for key in ("mean_batch_requests", "dedup_ratio", "p50_ms", "p99_ms"):
        out[f"{key}_at_knee"] = None if knee_probe is None else knee_probe[key]
    _log(f"{name}: knee {found.knee_per_s}/s ({found.status.value}: {found.reason})")
    return out


# ---- the run -----------------------------------------------------------------------


def _run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from ranker.models.dlrm import DlrmRanker
    from ranker.serving import load_model, open_export
    from recserve.bench.rank_costs import CAP_FORMULA, batching_cap, measure_forward_cost
    from recserve.cluster import ShardCluster
    from recserve.cluster.rankers import RankerCluster
    from recserve.config import load

    started = time.perf_counter()
    world = build_world(args, root)
    dlrm = load_model(open_export(world.models), "dlrm", device="cpu")
    assert isinstance(dlrm, DlrmRanker)
    costs = {"cpu": measure_forward_cost(dlrm, sizes=args.cost_sizes, device="cpu", repeats=args.cost_repeats, seed=args.seed)}
    import torch

    if torch.cuda.is_available():
        costs["cuda"] = measure_forward_cost(dlrm, sizes=args.cost_sizes, device="cuda", repeats=args.cost_repeats, seed=args.seed)
    for dev, c in costs.items():
        _log(f"forward cost on {dev}: {c.fixed_ms:.3f} ms + {c.per_candidate_us:.3f} us/candidate (fit within {c.max_rel_error:.0%})")
    cluster = load(world.specs[True])
    configs: dict[str, dict[str, Any]] = {}
    with ShardCluster(world.plan_path, root / "shards", load_from=world.models, server=cluster.shard_server) as shards:
        _log(f"{args.shards} shards SERVING at {shards.addresses}")
        with contextlib.ExitStack() as stack:
            # Every ranker loads at once (start-up is mostly imports: overlapped, not
            # queued); a config's idle rankers wait on their sockets while another runs.
            clusters: dict[bool, RankerCluster] = {}
            for batching in (True, False):
                counts = [CONFIGS[n][1] for n in args.configs if CONFIGS[n][0] is batching]
                if counts:
                    clusters[batching] = RankerCluster(world.specs[batching], world.models, shards.addresses, num_rankers=max(counts),
                                                       data_root=root / f"rankers-{'batched' if batching else 'unbatched'}")  # fmt: skip
                    stack.callback(clusters[batching].stop)
                    clusters[batching].start(wait=False)
            for rankers in clusters.values():
                for k in range(rankers.num_rankers):
                    rankers.wait_serving(k)
            _log("rankers SERVING: " + ", ".join(f"{'batched' if b else 'unbatched'} {c.addresses}" for b, c in clusters.items()))
            for n in args.configs:
                rankers, used = clusters[CONFIGS[n][0]], range(CONFIGS[n][1])

                def restart(rankers: RankerCluster = rankers, used: range = used) -> None:
                    for k in used:
                        rankers.restart(k)

                addresses = [rankers.address(k) for k in used]
                configs[n] = asyncio.run(knee_of(n, addresses, world, args, cluster.routing, None if args.keep_rankers else restart))
    return summarise(args, configs, costs, cap_formula=CAP_FORMULA, cap=batching_cap, seconds=time.perf_counter() - started)
