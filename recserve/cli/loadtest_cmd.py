"""``recserve loadtest``: an open-loop load test of a running cluster (recserve.loadtest).

``recserve loadtest --target recommend|rank|lookup [--rate R] [--duration S] [--slo-ms X]
[--http [URL] | --grpc ADDR[,ADDR]] [--json]``

* Poisson arrivals at ``--rate`` that never slow down for slow answers; latency from each
  request's scheduled send time; the generator's own lag is reported (and flagged when it
  fell behind). A progress bar on stderr while it runs, a table at the end; ``--json``
  prints the report as JSON on stdout (the table then goes to stderr).
* Requests come from the catalog (``--catalog``, default: the one ``recserve serve``
  generated in its cache for the same spec): Zipf users, their real candidates and
  histories.
* Addresses: ``--grpc``, or those of a ``recserve serve`` from the same ``--config``
  (fixed ``[topology]`` ports, or its ``--data DIR`` port files); ``--http [URL]`` goes
  through the gateway instead.
* ``--sweep-rate`` bisects for the knee (recserve.bench.knee) and plots p99 and goodput
  against offered rate (``--png``). ``--sweep-window 0,0.25,0.5,1,2,4`` sweeps the
  lookup client's accumulation window against the shards (recserve.loadtest.sweeps).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from pathlib import Path
from typing import Any

TARGETS = ("recommend", "rank", "lookup")


def _windows(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--sweep-window {text!r}: {e}") from None
    if not values or not all(0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"--sweep-window {text!r}: give windows in ms within 0..100, comma-separated (e.g. 0,0.25,0.5,1,2,4)")
    return values


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("loadtest", help="open-loop load test of a running cluster (recommend, rank, lookup; knee and window sweeps)")
    p.add_argument("--target", choices=TARGETS, default="recommend", help="what to load (default recommend)")
    p.add_argument("--rate", type=float, default=100.0, help="offered requests per second, Poisson (default 100)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals (default 10)")
    p.add_argument("--slo-ms", type=float, default=50.0, help="goodput counts answers within this (default 50 ms)")
    p.add_argument("--timeout-ms", type=float, default=1000.0, help="each request's deadline after its scheduled send (default 1000 ms)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--grpc", default=None, metavar="ADDR[,ADDR]", help="gRPC address(es): the cascade, the rankers or the shards (in shard order)")
    where.add_argument("--http", nargs="?", const="", default=None, metavar="URL", help="the HTTP gateway (default: the one of --data)")
    p.add_argument("--config", type=Path, default=None, help="the cluster spec of the `recserve serve` under test (default: the embedded spec)")
    p.add_argument("--data", type=Path, default=None, help="the --data DIR of that `recserve serve` (its port files)")
    p.add_argument("--catalog", type=Path, default=None, help="catalog to draw requests from (default: the serve cache's for the spec)")
    p.add_argument("--k", type=int, default=0, help="items per Recommend (0 = the server's default)")
    p.add_argument("--model", default="", help="Rank model (default: the server's)")
    p.add_argument("--candidates", type=int, default=64, help="candidates per Rank / lookup request (default 64)")
    p.add_argument("--history", type=int, default=8, help="the user's latest history items sent with each request: Recommend recent_item_ids, Rank history_item_ids (default 8; 0 = none)")
    p.add_argument("--pool-size", type=int, default=4096, help="distinct requests drawn (default 4096; a run cycles through them)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the user draw (default 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--sweep-rate", action="store_true", help="find the knee (bisection) and plot p99 / goodput against offered rate")
    p.add_argument("--sweep-window", type=_windows, default=None, metavar="MS[,MS]", help="sweep the lookup accumulation window (e.g. 0,0.25,0.5,1,2,4)")
    p.add_argument("--knee-lo", type=float, default=50.0, help="knee search: lowest rate (default 50/s)")
    p.add_argument("--knee-hi", type=float, default=5000.0, help="knee search: highest rate (default 5,000/s)")
    p.add_argument("--knee-rps", type=float, default=None, help="--sweep-window: the window-0 knee, known (skips its search)")
    p.add_argument("--probe-seconds", type=float, default=3.0, help="seconds per knee probe / window-sweep point (default 3)")
    p.add_argument("--png", type=Path, default=None, help="where the sweep's plot goes (default loadtest-<sweep>.png)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    report = asyncio.run(_main(args))
    text = report.pop("_table")
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps(report, indent=2, default=str))
    else:
        print(text)
    return 0


def _catalog(args: argparse.Namespace) -> Path:
    from recserve.cli.serve_cmd import default_cache_dir
    from recserve.config import DEFAULT_SPEC

    if args.catalog is not None:
        return args.catalog
    spec_text = args.config.read_text() if args.config is not None else DEFAULT_SPEC
    return default_cache_dir(spec_text) / "catalog"


def _progress(args: argparse.Namespace, total: float, desc: str) -> tuple[Any, Any]:
    """A tqdm bar over the schedule's sends, and the driver's progress callback."""
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (a log file gets the table only).
    bar = tqdm(total=int(total), desc=desc, unit="req", file=sys.stderr, disable=True if args.no_progress else None, leave=False, dynamic_ncols=True)

    def update(schedule: Any, recorder: Any) -> None:
        if bar.total != schedule.size:
            bar.total = schedule.size
        bar.n = schedule.sent
        bar.set_postfix_str(f"in flight {recorder.in_flight}, ok {recorder.ok}, late {recorder.late}, errors {sum(recorder.errors.values())}", refresh=False)
        bar.refresh()

    return bar, update


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    from ranker.scrubbed import open_scrubbed
    from recserve.config import load
    from recserve.errors import ConfigError
    from recserve.loadtest import discover
    from recserve.loadtest.driver import run_open_loop
    from recserve.loadtest.report import format_rate_sweep, format_summary, format_window_sweep
    from recserve.loadtest.requests import RequestPool
    from recserve.loadtest.targets import Target, TargetKind, make_target

    cluster = load(args.config)
    kind = TargetKind(args.target)
    if args.sweep_window is not None and kind is not TargetKind.LOOKUP:
        raise ConfigError(f"--sweep-window drives the shards through a lookup client: use --target lookup (not {args.target!r})")
    catalog = _catalog(args)
    try:
        view = open_scrubbed(catalog)
    except Exception as exc:
        raise ConfigError(f"--catalog {str(catalog)!r} cannot be read ({exc}); pass the catalog the cluster serves (`recserve serve` keeps it in its cache)") from None
    pool = RequestPool.from_catalog(view, size=args.pool_size, candidates=args.candidates, history=args.history, zipf_a=args.zipf, seed=args.seed)
    http = None
    addresses: list[str] = []
    if args.http is not None:
        http = args.http or discover.gateway_url(cluster, args.data)
    elif args.grpc:
        addresses = [a.strip() for a in args.grpc.split(",") if a.strip()]
    else:
        addresses = discover.grpc_addresses(kind, cluster, args.data)
    slo_s, timeout_s = args.slo_ms / 1e3, args.timeout_ms / 1e3
    seeds = iter(range(args.seed + 1, args.seed + 1_000_000))

    kjts: dict[int, Any] = {}  # the lookup requests' KJTs, built once for every arm

    def new_target(lookup_config: Any = None) -> Target:
        return make_target(kind, pool, grpc_addresses=addresses, http_url=http, cluster=cluster, lookup_config=lookup_config, view=view, k=args.k,
                           model=args.model, kjt_cache=kjts)  # fmt: skip

    async def run_at(target: Target, rate: float, seconds: float, desc: str, *, timeout: float = timeout_s) -> Any:
        # Collect now, then freeze what exists (the request pool, prebuilt KJTs): a full
        # collection walking them mid-run would stall the generator itself.
        gc.collect()
        gc.freeze()
        bar, update = _progress(args, rate * seconds, desc)
        try:
            return await run_open_loop(target, rate_rps=rate, duration_s=seconds, slo_s=slo_s, timeout_s=timeout, seed=next(seeds), progress=update)
        finally:
            bar.close()

    if args.sweep_window is not None:
        from recserve.lookup.config import LookupClientConfig
        from recserve.loadtest.sweeps import plot_window_sweep, sweep_window

        base = LookupClientConfig.from_cluster(cluster)
        # The lookup's deadline is the SLO: a window must close in time for its callers.
        result = await sweep_window(
            lambda cfg: new_target(cfg), base, args.sweep_window,  # type: ignore[arg-type,return-value]
            run=lambda t, r: run_at(t, r, args.probe_seconds, f"lookup {r:,.0f}/s", timeout=slo_s), lo_rps=args.knee_lo, hi_rps=args.knee_hi,
            slo_ms=args.slo_ms, knee_per_s=args.knee_rps, log=lambda line: print(f"recserve loadtest: {line}", file=sys.stderr, flush=True),
        )  # fmt: skip
        png = args.png or Path("loadtest-window.png")
        plot_window_sweep(png, result)
        result["png"] = str(png)
        result["_table"] = format_window_sweep(result) + f"\nplot: {png}"
        return result

    target = new_target()
    await target.start()
    try:
        if args.sweep_rate:
            from recserve.loadtest.sweeps import sweep_rate

            png = args.png or Path(f"loadtest-{kind.value}.png")
            result = await sweep_rate(lambda r: run_at(target, r, args.probe_seconds, f"{kind.value} {r:,.0f}/s"), lo_rps=args.knee_lo, hi_rps=args.knee_hi,
                                      png=png, title=f"recserve loadtest --target {kind.value}")  # fmt: skip
            result["png"] = str(png)
            result["_table"] = format_rate_sweep(result["sweep"], result["knee"]) + f"\nplot: {png}"
            return result
        before = await _server_requests(target)
        client = getattr(target, "client", None)
        stats_before = dataclasses.replace(client.stats) if kind is TargetKind.LOOKUP and client is not None else None
        summary = await run_at(target, args.rate, args.duration, f"{kind.value} {args.rate:,.0f}/s")
        after = await _server_requests(target)
    finally:
        await target.aclose()
    report = summary.to_dict()
    report["target"] = {"kind": kind.value, "via": "http" if http is not None else "grpc", "label": target.label}
    report["server_requests"] = None if before is None or after is None else after - before
    attempts = getattr(target, "attempts", None)
    if attempts is not None:
        report["attempts"] = attempts  # Rank RPCs sent, the router's retries included
    if stats_before is not None and client is not None:
        report["lookup"] = _stats_delta(stats_before, client.stats)  # windows, dedup, RPCs of the run (not the warm-up)
        report["lookup_total"] = client.stats.as_dict()  # since the client started, its warm-up included
    report["_table"] = format_summary(summary, title=f"recserve loadtest: {target.label}, {args.rate:,.0f}/s for {args.duration:g} s")
    return report


def _stats_delta(before: Any, after: Any) -> dict[str, float]:
    """The lookup client's counters over the run (LookupStats fields, after - before),
    with its ratios recomputed."""
    delta = type(after)(**{f.name: getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(after)})
    out: dict[str, float] = delta.as_dict()
    return out


async def _server_requests(target: Any) -> int | None:
    """The servers' own request count, None where it cannot be read (e.g. over HTTP)."""
    try:
        value = await target.server_requests()
        return None if value is None else int(value)
    except Exception:
        return None
