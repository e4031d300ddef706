"""``--sweep-rate`` (the knee) and ``--sweep-window`` (the accumulation windows).

**Rate sweep.** The shared bisection of :mod:`recserve.bench.knee` probes the target at
offered rates between ``lo_rps`` and ``hi_rps`` (each probe one open-loop run of
:func:`~recserve.loadtest.driver.run_open_loop`); every probe is also a point of
:mod:`recserve.bench.sweep`'s format, so the PNG is its p99 / goodput plot.

**Window sweep.** The shards of a running cluster are driven through a
:class:`~recserve.lookup.client.LookupClient` of the load test's own (the cluster's own
lookup clients live inside the rankers and the cascade, out of reach), one client per
*arm*. An arm sets what it claims to (:func:`window_arm_config`):

* a fixed window of ``W`` ms: ``window_ms = max_window_ms = W`` (so the adaptive
  window, which ignores ``window_ms`` whenever ``max_window_ms`` is larger, is off) and
  ``close_at_dispatch`` off (else a busy client closes windows at dispatch, whatever W);
* one extra arm, ``dispatch-close``: window 0 with ``close_at_dispatch`` on;
* every arm: the same ``max_inflight_batches``, the near cache off (``near_cache_rows =
  0``), so what differs is how many callers a window merges and dedups.

Each arm runs at the same offered rates: ``fractions`` (25%, 50%, 75%) of the knee of the
window-0 arm, found first. Per arm and rate: p50/p99, goodput, callers per window, ids
per RPC, the dedup ratio and **ids requested (before dedup) per shard CPU-second**, the
CPU read from the shards' own ``ShardInfo.cpu_seconds`` before and after the run.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from recserve.bench.knee import KneeResult, ProbeResult, find_knee_async
from recserve.lookup.config import LookupClientConfig
from recserve.loadtest.driver import run_open_loop
from recserve.loadtest.record import LoadSummary
from recserve.loadtest.targets import GrpcLookupTarget, Target

DISPATCH_ARM = "dispatch-close"
RATE_FRACTIONS = (0.25, 0.5, 0.75)


def summary_point(s: LoadSummary) -> dict[str, Any]:
    """One :mod:`recserve.bench.sweep` point (its POINT_KEYS and a few more)."""
    return {
        "requests": s.requests, "arrived_per_s": s.generator.offered_rps, "achieved_per_s": s.completed_rps, "p50_ms": s.p50_ms,
        "p99_ms": s.p99_ms, "goodput_per_s": s.goodput_rps, "failures": s.failed + s.shed, "late": s.late, "degraded_fraction": s.degraded_fraction,
        "generator_lag_ms": s.generator_lag_ms, "slo_ms": s.slo_ms,
    }  # fmt: skip


async def sweep_rate(
    run: Callable[[float], Awaitable[LoadSummary]], *, lo_rps: float, hi_rps: float, png: str | Path | None = None, title: str = "recserve loadtest",
) -> dict[str, Any]:
    """Bisect for the knee with ``run(rate) -> LoadSummary``; every probe becomes a
    point (``points``: ascending offered rate) and, with ``png``, the plot."""
    points: list[dict[str, Any]] = []

    async def probe(rate: float) -> ProbeResult:
        gc.collect()  # not inside a probe: a full collection there reads as a stall
        s = await run(rate)
        points.append({"offered_per_s": rate, "loadtest": summary_point(s)})
        return s.probe()

    knee = await find_knee_async(probe, lo_rps=lo_rps, hi_rps=hi_rps)
    points.sort(key=lambda p: p["offered_per_s"])
    slo_ms = points[0]["loadtest"]["slo_ms"] if points else 0.0
    if png is not None and points:
        from recserve.bench.sweep import plot_sweep

        plot_sweep(png, points, [("loadtest", title)], title=f"{title}: knee {knee.knee_per_s or 0:,.0f}/s ({knee.status.value})", slo_ms=slo_ms)
    return {"knee": knee.to_dict(), "points": [dict(p["loadtest"], offered_per_s=p["offered_per_s"]) for p in points], "sweep": points}


def window_arm_config(base: LookupClientConfig, window_ms: float, *, close_at_dispatch: bool = False) -> LookupClientConfig:
    """The client config of one arm: a fixed window (``window_ms = max_window_ms``),
    dispatch-close as given, the near cache off; everything else (``max_inflight_batches``
    included) as ``base``. ``base`` is not modified."""
    lookup = dataclasses.replace(base.lookup, window_ms=float(window_ms), max_window_ms=float(window_ms), close_at_dispatch=close_at_dispatch, near_cache_rows=0)
    return dataclasses.replace(base, lookup=lookup)


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    window_ms: float
    close_at_dispatch: bool


def window_arms(windows_ms: Sequence[float]) -> list[Arm]:
    """One fixed-window arm per W (dispatch-close off), plus the dispatch-close arm."""
    return [Arm(f"{w:g} ms", float(w), False) for w in windows_ms] + [Arm(DISPATCH_ARM, 0.0, True)]


async def _measure(target: GrpcLookupTarget, run: Callable[[Target, float], Awaitable[LoadSummary]], rate: float) -> dict[str, Any]:
    """One open-loop run of ``target`` at ``rate`` with the client's and the shards'
    counters read around it."""
    before_infos = await target.shard_infos()
    before = dataclasses.replace(target.client.stats)
    s = await run(target, rate)
    after = target.client.stats
    after_infos = await target.shard_infos()
    cpu_s = float(sum(a.cpu_seconds - b.cpu_seconds for a, b in zip(after_infos, before_infos)))
    d = {f: getattr(after, f) - getattr(before, f) for f in ("windows", "callers", "ids_requested", "ids_unique", "ids_fetched", "rpcs_primary")}
    return {
        "offered_rps": s.offered_rps, "p50_ms": s.p50_ms, "p99_ms": s.p99_ms, "goodput_rps": s.goodput_rps, "late": s.late, "shed": s.shed,
        "errors": s.errors, "degraded_fraction": s.degraded_fraction, "generator_lag_ms": s.generator_lag_ms,
        "callers_per_window": d["callers"] / d["windows"] if d["windows"] else None,
        "ids_per_rpc": d["ids_fetched"] / d["rpcs_primary"] if d["rpcs_primary"] else None,
        "dedup_ratio": d["ids_requested"] / d["ids_unique"] if d["ids_unique"] else None,
        "ids_requested": d["ids_requested"], "shard_cpu_s": cpu_s, "server_rpcs": int(sum(a.rpcs - b.rpcs for a, b in zip(after_infos, before_infos))),
        "ids_per_shard_cpu_s": d["ids_requested"] / cpu_s if cpu_s > 0 else None,
    }  # fmt: skip


async def sweep_window(
    make_target: Callable[[LookupClientConfig], GrpcLookupTarget],
    base: LookupClientConfig,
    windows_ms: Sequence[float],
    *,
    run: Callable[[Target, float], Awaitable[LoadSummary]],
    lo_rps: float,
    hi_rps: float,
    slo_ms: float,
    fractions: Sequence[float] = RATE_FRACTIONS,
    knee_per_s: float | None = None,
    warmup: bool = True,
    log: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """The window sweep (module docstring). ``make_target(config)`` builds an unstarted
    lookup target for one arm; ``run(target, rate)`` one open-loop run. ``knee_per_s``
    skips the knee search (a known window-0 knee). ``warmup``: each arm's fresh client
    first serves one discarded run at ``lo_rps`` (channels, the shards' hedge-delay
    estimates, first-window set-up), so no arm pays its start-up in its first point."""
    # The window-0 arm runs first: its knee sets every arm's rates.
    arms = window_arms(sorted(set(float(w) for w in windows_ms) | {0.0}))
    knee: dict[str, Any]
    out_arms: list[dict[str, Any]] = []
    rates: list[float] = []
    for arm in arms:
        target = make_target(window_arm_config(base, arm.window_ms, close_at_dispatch=arm.close_at_dispatch))
        await target.start()
        try:
            if warmup:
                log(f"arm {arm.name}: warm-up at {lo_rps:,.0f}/s (discarded)")
                await run(target, lo_rps)
            if not rates:  # the first arm is window 0
                if knee_per_s is None:
                    log(f"knee of the window-0 arm (bisection in [{lo_rps:,.0f}, {hi_rps:,.0f}]/s)")

                    async def probe(rate: float) -> ProbeResult:
                        gc.collect()
                        return (await run(target, rate)).probe()

                    found: KneeResult = await find_knee_async(probe, lo_rps=lo_rps, hi_rps=hi_rps)
                    knee = found.to_dict()
                    knee_per_s = found.knee_per_s
                else:
                    knee = {"knee_per_s": knee_per_s, "status": "given", "reason": "--knee-rps", "probes": []}
                if not knee_per_s:
                    raise_no_knee(knee)
                rates = [f * knee_per_s for f in fractions]
            points = []
            for f, rate in zip(fractions, rates):
                log(f"arm {arm.name}: {rate:,.0f}/s ({f:.0%} of the window-0 knee)")
                gc.collect()
                points.append({"rate_fraction": f, **(await _measure(target, run, rate))})
            lk = target.config.lookup
            out_arms.append({"arm": arm.name, "window_ms": arm.window_ms, "close_at_dispatch": arm.close_at_dispatch, "max_window_ms": lk.max_window_ms,
                             "near_cache_rows": lk.near_cache_rows, "max_inflight_batches": lk.max_inflight_batches, "points": points})  # fmt: skip
        finally:
            await target.aclose()
    return window_result(out_arms, knee, rates, slo_ms=slo_ms, max_inflight_batches=base.lookup.max_inflight_batches)


def raise_no_knee(knee: dict[str, Any]) -> NoReturn:
    from recserve.errors import FailedPrecondition

    raise FailedPrecondition(f"the window-0 arm has no knee to take fractions of ({knee['status']}: {knee['reason']}); pass --knee-lo/--knee-hi around it or --knee-rps")


def window_result(arms: list[dict[str, Any]], knee: dict[str, Any], rates: Sequence[float], *, slo_ms: float, max_inflight_batches: int) -> dict[str, Any]:
    """The JSON of a window sweep, with ``ids_per_shard_cpu_s_ratio_1ms_vs_0`` (1 ms arm
    over window-0 arm at 50% of the knee; None when either is missing)."""

    def at_half(window: float) -> dict[str, Any] | None:
        for arm in arms:
            if arm["window_ms"] == window and not arm["close_at_dispatch"]:
                for p in arm["points"]:
                    if abs(p["rate_fraction"] - 0.5) < 1e-9:
                        return p
        return None

    one, zero = at_half(1.0), at_half(0.0)
    ratio = None
    if one is not None and zero is not None and one["ids_per_shard_cpu_s"] and zero["ids_per_shard_cpu_s"]:
        ratio = one["ids_per_shard_cpu_s"] / zero["ids_per_shard_cpu_s"]
    return {
        "knee_window0": knee, "rates_rps": list(rates), "slo_ms": slo_ms, "max_inflight_batches": max_inflight_batches, "arms": arms,
        "ids_per_shard_cpu_s_ratio_1ms_vs_0": ratio, "p99_ms_1ms_at_50": one["p99_ms"] if one is not None else None,
        "goal_met": ratio is not None and ratio >= 5.0 and one is not None and one["p99_ms"] is not None and one["p99_ms"] <= slo_ms,
    }  # fmt: skip


def plot_window_sweep(path: str | Path, result: dict[str, Any]) -> None:
    """PNG: p99 latency and shard CPU per id (µs) against the window, one line per rate
    fraction; the dispatch-close arm as a separate marker at window 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_cpu) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    fixed = [a for a in result["arms"] if not a["close_at_dispatch"]]
    dispatch = [a for a in result["arms"] if a["close_at_dispatch"]]
    fractions = sorted({p["rate_fraction"] for a in result["arms"] for p in a["points"]})
    for j, f in enumerate(fractions):
        color = f"C{j}"
        xs, lat, cpu = [], [], []
        for a in sorted(fixed, key=lambda a: a["window_ms"]):
            p = next((p for p in a["points"] if p["rate_fraction"] == f), None)
            if p is not None:
                xs.append(a["window_ms"])
                lat.append(p["p99_ms"] if p["p99_ms"] is not None else float("nan"))
                cpu.append(1e6 / p["ids_per_shard_cpu_s"] if p["ids_per_shard_cpu_s"] else float("nan"))
        label = f"{f:.0%} of knee ({f * (result['knee_window0'].get('knee_per_s') or 0):,.0f}/s)"
        ax_lat.plot(xs, lat, marker="o", color=color, label=label)
        ax_cpu.plot(xs, cpu, marker="o", color=color, label=label)
        for a in dispatch:
            p = next((p for p in a["points"] if p["rate_fraction"] == f), None)
            if p is not None:
                ax_lat.plot([0], [p["p99_ms"] or float("nan")], marker="*", markersize=12, color=color, linestyle="none")
                ax_cpu.plot([0], [1e6 / p["ids_per_shard_cpu_s"] if p["ids_per_shard_cpu_s"] else float("nan")], marker="*", markersize=12, color=color, linestyle="none")
    ax_lat.axhline(result["slo_ms"], color="grey", linestyle="--", linewidth=1, label=f"SLO {result['slo_ms']:g} ms")
    ax_lat.set_ylabel("p99 latency (ms)")
    ax_lat.set_title("p99 latency (star: dispatch-close arm)")
    ax_cpu.set_ylabel("shard CPU per id requested (µs)")
    ax_cpu.set_title("shard CPU per id (before dedup)")
    for ax in (ax_lat, ax_cpu):
        ax.set_xlabel("accumulation window (ms, fixed)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("recserve loadtest --sweep-window")
    fig.savefig(path, dpi=110)
    plt.close(fig)
