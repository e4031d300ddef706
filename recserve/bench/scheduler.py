"""``recserve bench scheduler``: the scheduler core's and serving loop's own cost, and
batched vs unbatched throughput under open-loop Poisson arrivals.

Measured in one run, side by side:

- ``core_us_per_item`` — ``Scheduler.add + schedule + complete`` per item on a fake clock
  (1 ms feature-parallel windows of 64 items; the items are built beforehand); the best
  of ``_CORE_REPEATS`` runs (timeit's rule: the least-disturbed run on a shared machine);
- ``reject_us_per_item`` — one ``add`` refused with RESOURCE_EXHAUSTED (queue full);
- ``loop_us_per_item`` — wall time per item through ``ServingLoop`` (submit → batch →
  no-op coroutine runner → future resolved), core included;
- ``batched_items_per_s`` vs ``unbatched_items_per_s`` — items completed per second
  (``goodput_per_s``: completed within the deadline), arrivals open-loop Poisson at
  ``--rate`` (they do not slow down when the server stalls; latency counts from the
  intended arrival time; ``arrival_lag_p99_ms`` says how far the generator fell behind). Each item's
  work is a real ``np.take`` gather of 64 rows; each batch also pays a fixed cost equal to
  a loopback gRPC round trip measured at the start of this run (slept on the executor
  thread, like a thread waiting on an RPC). Unbatched = max batch 1 item; batched = a
  1 ms FeatureParallelPolicy window. Same ``--max-inflight`` for both.

With ``--sweep-rates R1,R2,...`` both contenders then run at each offered rate
(``--sweep-seconds`` of arrivals each, same arrivals and items for both at one rate; the
deadline is the SLO) and the JSON gains ``sweep`` (see :mod:`recserve.bench.sweep`);
``--plot PATH`` writes p99 latency and goodput vs offered rate as a PNG.

Prints a table, or one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import math
import time
from typing import Any

from recserve.bench.arrivals import poisson_arrivals
from recserve.bench.sweep import format_sweep, parse_rates, percentile_ms, plot_sweep

_PING = "/recserve.bench.Echo/Ping"
_CORE_REPEATS = 20
SWEEP_MODES = (("batched", "batched"), ("unbatched", "unbatched (batch 1)"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, default=5000.0, help="open-loop Poisson arrival rate, items/s (default 5000)")
    parser.add_argument("--duration-s", type=float, default=3.0, help="arrival period per contender (default 3 s)")
    parser.add_argument("--deadline-ms", type=float, default=50.0, help="per-item deadline after its arrival (default 50 ms)")
    parser.add_argument("--max-inflight", type=int, default=4, help="batches in flight, both contenders (default 4)")
    parser.add_argument("--window-ms", type=float, default=1.0, help="the batched contender's window (default 1 ms)")
    parser.add_argument("--rows-per-item", type=int, default=64, help="rows gathered per item (default 64)")
    parser.add_argument("--table-rows", type=int, default=250_000, help="rows in the gathered table (default 250k)")
    parser.add_argument("--dim", type=int, default=64, help="row width, fp32 (default 64)")
    parser.add_argument("--core-items", type=int, default=200_000, help="items for core_us_per_item, over 20 runs (default 200k)")
    parser.add_argument("--loop-items", type=int, default=40_000, help="items for loop_us_per_item (default 40k)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--sweep-rates", type=parse_rates, default=None, metavar="R1,R2,...",
                        help="then run both contenders at each of these offered items/s (default: no sweep)")
    parser.add_argument("--sweep-seconds", type=float, default=1.5, help="arrival period per sweep point and contender (default 1.5 s)")
    parser.add_argument("--plot", default=None, metavar="PATH", help="with --sweep-rates: write a PNG of p99 and goodput vs offered rate")


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--rate", args.rate), ("--duration-s", args.duration_s), ("--deadline-ms", args.deadline_ms),
                        ("--max-inflight", args.max_inflight), ("--rows-per-item", args.rows_per_item),
                        ("--table-rows", args.table_rows), ("--dim", args.dim), ("--core-items", args.core_items),
                        ("--loop-items", args.loop_items), ("--sweep-seconds", args.sweep_seconds)):
        if not value > 0:
            raise SystemExit(f"{flag} = {value!r} is invalid: use a positive number")
    if not 0 <= args.window_ms <= 100:
        raise SystemExit(f"--window-ms = {args.window_ms!r} is invalid: use 0..100 ms")
    if args.plot is not None and args.sweep_rates is None:
        raise SystemExit("--plot needs --sweep-rates")
    result = asyncio.run(_bench(args))
    if args.plot is not None:
        title = (f"recserve bench scheduler: {args.rows_per_item} rows/item, {args.window_ms:g} ms window, "
                 f"max_inflight {args.max_inflight}, RPC {result['grpc_loopback_rtt_ms']:.2f} ms/batch")
        plot_sweep(args.plot, result["sweep"], SWEEP_MODES, title=title, slo_ms=args.deadline_ms, unit="items")
    if args.json:
        print(json.dumps(_json_safe(result), sort_keys=True, allow_nan=False))
    else:
        _print_table(result)
    return 0


def _json_safe(value: Any) -> Any:
    """NaN (no samples, e.g. nothing completed) is not JSON: write null."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def measure_core(n_items: int, batch_items: int = 64, policy_kind: str = "feature_parallel") -> float:
    """µs per item of add + schedule + complete on a fake clock."""
    from recserve.scheduling import (
        Done, DynamicBatchConfig, FeatureParallelConfig, PolicyKind, Priority, Scheduler, WorkItem, make_policy,
    )

    if policy_kind == "dynamic":
        policy = make_policy(PolicyKind.DYNAMIC, DynamicBatchConfig(max_batch_cost=batch_items, max_wait_ms=1.0, slo_ms=50.0))
    else:
        policy = make_policy(PolicyKind.FEATURE_PARALLEL, FeatureParallelConfig(window_ms=1.0, max_cost=batch_items))
    sched = Scheduler(policy)
    items = [WorkItem(f"r{i}", "bench", Priority.STANDARD, 1e12, 1.0, None) for i in range(n_items)]
    done = [Done(None)] * batch_items
    add, schedule, complete = sched.add, sched.schedule, sched.complete
    now = 0.0
    start = time.perf_counter()
    for k in range(0, n_items, batch_items):
        for item in items[k:k + batch_items]:
            add(item, now)
        now += 0.001
        batch = schedule(now)
        assert batch is not None
        complete(batch, done[:len(batch)], now)
    elapsed = time.perf_counter() - start
    assert sched.idle
    return elapsed / n_items * 1e6


def measure_reject(n_items: int) -> float:
    """µs per ``add`` refused because the queue is full (RESOURCE_EXHAUSTED + retry-after)."""
    from recserve.errors import ResourceExhausted
    from recserve.scheduling import AdmissionConfig, FeatureParallelConfig, FeatureParallelPolicy, Priority, Scheduler, WorkItem

    sched = Scheduler(FeatureParallelPolicy(FeatureParallelConfig()), AdmissionConfig(max_queued_items=1))
    sched.add(WorkItem("first", "bench", Priority.STANDARD, 1e12, 1.0, None), 0.0)
    item = WorkItem("refused", "bench", Priority.STANDARD, 1e12, 1.0, None)
    add = sched.add
    start = time.perf_counter()
    for _ in range(n_items):
        try:
            add(item, 0.0)
        except ResourceExhausted:
            pass
    elapsed = time.perf_counter() - start
    assert sched.stats().drops["rejected"] == n_items
    return elapsed / n_items * 1e6


async def measure_loop(n_items: int) -> float:
    """µs per item through ServingLoop with a no-op coroutine runner."""
    from recserve.scheduling import Done, FeatureParallelConfig, FeatureParallelPolicy, Scheduler, ServingLoop

    async def runner(batch: Any) -> list[Any]:
        return [Done(None)] * len(batch)

    sched = Scheduler(FeatureParallelPolicy(FeatureParallelConfig(window_ms=1.0, max_cost=256)))
    loop = ServingLoop(sched, runner, max_inflight=4, name="bench-loop")
    loop.start()
    start = time.perf_counter()
    futures = [loop.submit_nowait(i) for i in range(n_items)]
    for future in futures:  # not gather: its per-future callbacks are the caller's cost
        await future
    elapsed = time.perf_counter() - start
    await loop.aclose()
    return elapsed / n_items * 1e6


async def measure_grpc_rtt_s(calls: int = 300) -> float:
    """Mean round trip of a tiny unary call to a grpc.aio server on 127.0.0.1."""
    import grpc
    from grpc import aio

    async def echo(request: bytes, context: Any) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler("recserve.bench.Echo", {"Ping": grpc.unary_unary_rpc_method_handler(echo)})
    server = aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            ping = channel.unary_unary(_PING, request_serializer=None, response_deserializer=None)  # raw bytes
            for _ in range(50):
                await ping(b"x")
            start = time.perf_counter()
            for _ in range(calls):
                await ping(b"x")
            return (time.perf_counter() - start) / calls
    finally:
        await server.stop(None)


def measure_gather_rows_per_s(table: Any, rows: int, seed: int) -> float:
    """np.take rows/s on this table: the reference figure for the work per item."""
    import numpy as np

    ids = np.random.default_rng(seed).integers(0, table.shape[0], size=rows)
    np.take(table, ids, axis=0)  # warm
    start = time.perf_counter()
    for _ in range(5):
        np.take(table, ids, axis=0)
    return 5 * rows / (time.perf_counter() - start)


async def open_loop(args: argparse.Namespace, *, batched: bool, table: Any, ids: Any, offsets: Any, rtt_s: float) -> dict[str, Any]:
    """One contender under the same precomputed Poisson arrival offsets."""
    import numpy as np

    from recserve.errors import DeadlineExceeded, RecserveError
    from recserve.scheduling import AdmissionConfig, Done, FeatureParallelConfig, FeatureParallelPolicy, Scheduler, ServingLoop

    rows = args.rows_per_item

    def runner(batch: Any) -> list[Any]:
        flat = np.concatenate(batch.payloads) if len(batch) > 1 else batch.payloads[0]
        gathered = np.take(table, flat, axis=0)  # [len(batch) * rows, dim]
        time.sleep(rtt_s)  # the fixed per-batch cost: one RPC round trip
        return [Done(gathered[i * rows:(i + 1) * rows]) for i in range(len(batch))]

    if batched:
        policy = FeatureParallelPolicy(FeatureParallelConfig(window_ms=args.window_ms, max_cost=rows * 512))
    else:
        policy = FeatureParallelPolicy(FeatureParallelConfig(window_ms=0.0, max_cost=rows))  # max batch: 1 item
    sched = Scheduler(policy, AdmissionConfig(max_queued_items=100_000))
    loop = ServingLoop(sched, runner, max_inflight=args.max_inflight, name="batched" if batched else "unbatched")
    loop.start()
    deadline_s = args.deadline_ms / 1e3
    latencies: list[float] = []  # completed items, from intended arrival to result
    lags: list[float] = []  # how late the generator submitted each arrival
    finished_at = [0.0]
    rejected = late_at_submit = 0
    futures = []

    def on_done(intended: float, future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is None:
            now = time.monotonic()
            latencies.append(now - intended)
            finished_at[0] = max(finished_at[0], now)

    t0 = time.monotonic()
    i, n = 0, len(offsets)
    while i < n:
        now = time.monotonic()
        while i < n and t0 + offsets[i] <= now:
            intended = t0 + offsets[i]
            lags.append(now - intended)
            try:
                future = loop.submit_nowait(ids[i], cost=float(rows), deadline=intended + deadline_s)
            except DeadlineExceeded:
                late_at_submit += 1  # the generator fell more than a deadline behind
            except RecserveError:
                rejected += 1
            else:
                future.add_done_callback(functools.partial(on_done, intended))
                futures.append(future)
            i += 1
        if i < n:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.monotonic()))
    await asyncio.gather(*futures, return_exceptions=True)
    await loop.aclose()
    stats = sched.stats()
    span = max(finished_at[0], t0 + offsets[-1]) - t0
    lat = np.asarray(latencies, dtype=np.float64)
    return {
        "items_per_s": lat.size / span,
        "goodput_per_s": int(np.count_nonzero(lat <= deadline_s)) / span,
        "offered": n,
        "completed": int(lat.size),
        "dropped_deadline": stats.drops["deadline"] - late_at_submit,
        "late_at_submit": late_at_submit,
        "rejected": rejected,
        "failed": stats.failed,
        "p50_ms": percentile_ms(lat, 50),  # None when nothing completed
        "p99_ms": percentile_ms(lat, 99),
        "arrival_lag_p99_ms": percentile_ms(np.asarray(lags), 99),
        "mean_batch_items": stats.batch_size.mean,
        "batches": stats.batches,
    }


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(args.seed)
    chunk = max(64, args.core_items // _CORE_REPEATS)
    core_us = min(measure_core(chunk) for _ in range(_CORE_REPEATS))
    core_us_dynamic = min(measure_core(chunk, policy_kind="dynamic") for _ in range(_CORE_REPEATS))
    reject_us = min(measure_reject(max(1, chunk // 4)) for _ in range(_CORE_REPEATS))
    loop_us = await measure_loop(args.loop_items)
    rtt_s = await measure_grpc_rtt_s()
    table = rng.standard_normal((args.table_rows, args.dim), dtype=np.float32)
    gather_rows_per_s = measure_gather_rows_per_s(table, 65_536, args.seed)
    n = max(1, int(args.rate * args.duration_s))
    offsets = poisson_arrivals(args.rate, count=n, rng=rng)
    ids = rng.integers(0, args.table_rows, size=(n, args.rows_per_item))
    gc.collect()  # each contender starts with no garbage of the previous phase to collect
    unbatched = await open_loop(args, batched=False, table=table, ids=ids, offsets=offsets, rtt_s=rtt_s)
    gc.collect()
    batched = await open_loop(args, batched=True, table=table, ids=ids, offsets=offsets, rtt_s=rtt_s)
    sweep = None if args.sweep_rates is None else await rate_sweep(args, table=table, rtt_s=rtt_s)
    return {
        "core_us_per_item": core_us,
        "core_us_per_item_dynamic_slo": core_us_dynamic,
        "reject_us_per_item": reject_us,
        "loop_us_per_item": loop_us,
        "batched_items_per_s": batched["items_per_s"],
        "unbatched_items_per_s": unbatched["items_per_s"],
        "batched_over_unbatched": batched["items_per_s"] / max(unbatched["items_per_s"], 1e-9),
        "arrival_rate_per_s": args.rate,
        "arrivals": "open-loop Poisson",
        "duration_s": args.duration_s,
        "deadline_ms": args.deadline_ms,
        "max_inflight": args.max_inflight,
        "window_ms": args.window_ms,
        "rows_per_item": args.rows_per_item,
        "dim": args.dim,
        "grpc_loopback_rtt_ms": rtt_s * 1e3,
        "gather_rows_per_s": gather_rows_per_s,
        "batched": batched,
        "unbatched": unbatched,
        **({} if sweep is None else {"sweep": sweep, "sweep_seconds": args.sweep_seconds}),
    }


async def rate_sweep(args: argparse.Namespace, *, table: Any, rtt_s: float) -> list[dict[str, Any]]:
    """Both contenders at each ``--sweep-rates`` rate, same Poisson arrivals and items
    for both at one rate; one dict per rate in the shape of :mod:`recserve.bench.sweep`
    (the deadline is the SLO: a late item is dropped, so failures include drops)."""
    import numpy as np

    rng = np.random.default_rng(args.seed + 1)  # its own stream: the main run's is untouched
    out: list[dict[str, Any]] = []
    for rate in args.sweep_rates:
        n = max(1, int(rate * args.sweep_seconds))
        offsets = poisson_arrivals(rate, count=n, rng=rng)
        ids = rng.integers(0, args.table_rows, size=(n, args.rows_per_item))
        point: dict[str, Any] = {"offered_per_s": float(rate)}
        for name, batched in (("unbatched", False), ("batched", True)):
            gc.collect()
            c = await open_loop(args, batched=batched, table=table, ids=ids, offsets=offsets, rtt_s=rtt_s)
            point[name] = {
                "requests": c["offered"], "completed": c["completed"], "arrived_per_s": c["offered"] / float(offsets[-1]),
                "achieved_per_s": c["items_per_s"], "goodput_per_s": c["goodput_per_s"],
                "p50_ms": c["p50_ms"], "p99_ms": c["p99_ms"],
                "failures": c["dropped_deadline"] + c["late_at_submit"] + c["rejected"] + c["failed"],
                "mean_batch_items": c["mean_batch_items"],
            }
        out.append(point)
    return out


def _ms(value: float | None) -> str:
    """A percentile in ms for the table ("n/a": nothing completed)."""
    return "n/a" if value is None else f"{value:.2f}"


def _print_table(r: dict[str, Any]) -> None:
    print("recserve bench scheduler")
    print(f"  core_us_per_item (feature-parallel, 64/batch) {r['core_us_per_item']:8.2f} us   (goal: well under 10 us)")
    print(f"  core_us_per_item (dynamic + SLO control)      {r['core_us_per_item_dynamic_slo']:8.2f} us")
    print(f"  reject_us_per_item (queue full, at add)       {r['reject_us_per_item']:8.2f} us")
    print(f"  loop_us_per_item (ServingLoop, no-op runner)  {r['loop_us_per_item']:8.2f} us")
    print(f"  gRPC loopback round trip (per-batch cost)     {r['grpc_loopback_rtt_ms']:8.3f} ms   (docs/architecture.md §10: 0.3-0.45 ms back to back)")
    print(f"  np.take gather, {r['dim']}-wide fp32 rows          {r['gather_rows_per_s'] / 1e6:8.2f} M rows/s (docs/architecture.md §10: 6-9 M)")
    print(f"\n  open-loop Poisson {r['arrival_rate_per_s']:,.0f} items/s for {r['duration_s']:g} s, deadline {r['deadline_ms']:g} ms, "
          f"{r['rows_per_item']} rows/item, max_inflight {r['max_inflight']}")
    print(f"  {'contender':<22}{'items/s':>9}{'in SLO/s':>10}{'p50 ms':>8}{'p99 ms':>8}{'per batch':>11}"
          f"{'dropped':>9}{'rejected':>9}{'gen lag p99':>13}")
    for name, key in ((f"batched ({r['window_ms']:g} ms window)", "batched"), ("unbatched (batch 1)", "unbatched")):
        c = r[key]
        print(f"  {name:<22}{c['items_per_s']:>9,.0f}{c['goodput_per_s']:>10,.0f}{_ms(c['p50_ms']):>8}{_ms(c['p99_ms']):>8}"
              f"{c['mean_batch_items']:>11.1f}{c['dropped_deadline'] + c['late_at_submit']:>9,}{c['rejected']:>9,}"
              f"{_ms(c['arrival_lag_p99_ms']):>10} ms")
    print(f"  batched / unbatched items/s: {r['batched_over_unbatched']:.2f}x   "
          "(items/s: completed; in SLO/s: completed within the deadline; dropped: deadline passed before running)")
    if "sweep" in r:
        print()
        print(format_sweep(r["sweep"], SWEEP_MODES, slo_ms=r["deadline_ms"], unit="items"))


def main() -> int:
    parser = argparse.ArgumentParser(prog="recserve bench scheduler", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
