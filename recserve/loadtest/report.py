"""The human-readable tables of ``recserve loadtest`` (the JSON is the dataclasses' dicts)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from recserve.loadtest.record import LoadSummary


def _f(v: Any, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def format_summary(s: LoadSummary, *, title: str) -> str:
    """The end-of-run table: rates, outcomes, latency percentiles, the generator's lag."""
    errors = ", ".join(f"{k} {v:,}" for k, v in s.errors.items()) or "none"
    rows = [
        ("offered", f"{s.offered_rps:,.1f}/s", f"{s.requests:,} requests (Poisson), {s.sent:,} sent"),
        ("completed", f"{s.completed_rps:,.1f}/s", f"{s.answered:,} answered"),
        ("goodput", f"{s.goodput_rps:,.1f}/s", f"{s.ok:,} OK within the {s.slo_ms:g} ms SLO, not degraded"),
        ("late", f"{s.late:,}", f"answered after {s.slo_ms:g} ms"),
        ("degraded", f"{s.degraded_fraction:.2%}", f"of answers ({s.degraded:,} in time but degraded)"),
        ("shed", f"{s.shed:,}", "RESOURCE_EXHAUSTED"),
        ("errors", f"{sum(s.errors.values()):,}", errors),
        ("p50", f"{_f(s.p50_ms, ',.2f')} ms", "from the scheduled send time"),
        ("p99", f"{_f(s.p99_ms, ',.2f')} ms", ""),
        ("p99.9", f"{_f(s.p999_ms, ',.2f')} ms", f"max {_f(s.max_ms, ',.2f')} ms"),
        ("generator lag", f"{s.generator_lag_ms:,.1f} ms", f"max (p99 {s.generator.p99_ms:,.1f} ms)"),
    ]
    width = max(len(r[1]) for r in rows)
    lines = [title] + [f"  {name:<14}{value:>{width}}  {note}".rstrip() for name, value, note in rows]
    for status, message in s.error_samples.items():
        lines.append(f"  first {status}: {message}")
    if s.generator.behind:
        lines.append("  " + s.generator.describe())
    return "\n".join(lines)


def format_window_sweep(result: dict[str, Any]) -> str:
    """The accumulation-window table: one row per (arm, rate)."""
    knee = result["knee_window0"]
    lines = [
        f"accumulation-window sweep: window-0 knee {_f(knee.get('knee_per_s'), ',.0f')}/s ({knee['status']}); "
        f"rates {', '.join(f'{r:,.0f}' for r in result['rates_rps'])}/s; near cache off; max_inflight_batches {result['max_inflight_batches']}",
        f"{'arm':<16}{'rate':>6}{'offered/s':>11}{'p50 ms':>9}{'p99 ms':>9}{'goodput/s':>11}{'callers/win':>12}{'ids/RPC':>9}{'dedup':>7}{'ids/shard-CPU-s':>17}",
    ]
    for arm in result["arms"]:
        for p in arm["points"]:
            lines.append(
                f"{arm['arm']:<16}{p['rate_fraction']:>6.0%}{p['offered_rps']:>11,.0f}{_f(p['p50_ms'], '.2f'):>9}{_f(p['p99_ms'], '.2f'):>9}"
                f"{p['goodput_rps']:>11,.0f}{_f(p['callers_per_window'], '.1f'):>12}{_f(p['ids_per_rpc'], ',.0f'):>9}{_f(p['dedup_ratio'], '.2f'):>7}"
                f"{_f(p['ids_per_shard_cpu_s'], ',.0f'):>17}"
            )
    lines.append(f"ids per shard CPU-second, 1 ms window / window 0, at 50% of the knee: {_f(result.get('ids_per_shard_cpu_s_ratio_1ms_vs_0'), '.2f')}"
                 f" (1 ms p99 {_f(result.get('p99_ms_1ms_at_50'), '.2f')} ms, SLO {result['slo_ms']:g} ms)")  # fmt: skip
    return "\n".join(lines)


def format_rate_sweep(points: Sequence[dict[str, Any]], knee: dict[str, Any]) -> str:
    from recserve.bench.sweep import format_sweep

    head = f"knee: {_f(knee.get('knee_per_s'), ',.0f')}/s ({knee['status']}: {knee['reason']})"
    return head + "\n" + format_sweep(points, [("loadtest", "loadtest")], slo_ms=float(points[0]["slo_ms"]) if points else 0.0)
