"""The fault suite's figures from per-request records (pure: no I/O, no clock).

Every request of the suite is one row of :class:`Records` (column arrays, one entry per
request): its scheduled send time, when it finished, its outcome and, when answered, its
coverage. Outcomes partition the requests (the precedence of
:mod:`recserve.loadtest.record`): ``shed`` (RESOURCE_EXHAUSTED), ``failed`` (any other
error or no answer), else answered — ``degraded`` when the reply says so. Goodput is
answered, in the SLO and not degraded, per second.

:func:`fault_figures` computes the issue's keys for one fault from three windows on the
scheduled-time axis: *before* ``[t_before, t_start)``, *during* ``[t_start, t_end)`` and
*after* ``[t_end, t_stop)``; :func:`total_figures` sums several. :func:`timeline` buckets
requests per second for the PNG.

Example::

    rec = Records.from_lists(sched, done, status, degraded, coverage)
    fault_figures(rec, t_before=0, t_start=5, t_end=10, t_stop=15, slo_s=0.5)["failed"]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

FIGURE_KEYS = ("requests", "failed", "degraded", "shed", "p99_ms_before", "p99_ms_during", "goodput_during_vs_before",
               "coverage_mean", "shed_p99_ms", "lost_upserts", "recovery_s")  # fmt: skip
BURST_KEY = "goodput_vs_knee"
RECOVERY_WITHIN = 1.2  # p99 back within 20% of its pre-fault value
RECOVERY_BUCKET_S = 1.0
OK_STATUS = "OK"
SHED_STATUS = "RESOURCE_EXHAUSTED"


@dataclasses.dataclass(frozen=True)
class Records:
    """Per-request columns, N requests: ``sched_s`` / ``done_s`` float64 [N] (monotonic
    seconds), ``status`` object [N] (``"OK"`` or a gRPC status name), ``degraded`` bool
    [N], ``coverage`` float64 [N] (NaN when not answered)."""

    sched_s: np.ndarray
    done_s: np.ndarray
    status: np.ndarray
    degraded: np.ndarray
    coverage: np.ndarray

    @classmethod
    def from_lists(cls, sched: Sequence[float], done: Sequence[float], status: Sequence[str], degraded: Sequence[bool], coverage: Sequence[float]) -> Records:
        return cls(np.asarray(sched, dtype=np.float64), np.asarray(done, dtype=np.float64), np.asarray(status, dtype=object),
                   np.asarray(degraded, dtype=bool), np.asarray(coverage, dtype=np.float64))  # fmt: skip

    @property
    def size(self) -> int:
        return int(self.sched_s.shape[0])

    @property
    def latency_ms(self) -> np.ndarray:
        """float64 [N]: scheduled send to finish (the client's view, shed answers too)."""
        return (self.done_s - self.sched_s) * 1e3

    @property
    def answered(self) -> np.ndarray:
        return self.status == OK_STATUS

    @property
    def shed(self) -> np.ndarray:
        return self.status == SHED_STATUS

    @property
    def failed(self) -> np.ndarray:
        return ~self.answered & ~self.shed


def _p99(values: np.ndarray) -> float | None:
    return float(np.percentile(values, 99)) if values.size else None


def _window(rec: Records, lo: float, hi: float) -> np.ndarray:
    return (rec.sched_s >= lo) & (rec.sched_s < hi)


def _goodput_per_s(rec: Records, mask: np.ndarray, span_s: float, slo_s: float) -> float:
    good = mask & rec.answered & ~rec.degraded & (rec.latency_ms <= slo_s * 1e3)
    return float(good.sum()) / span_s if span_s > 0 else 0.0


def recovery_s(rec: Records, *, t_end: float, t_stop: float, p99_before_ms: float | None, bucket_s: float = RECOVERY_BUCKET_S) -> float | None:
    """Seconds from ``t_end`` to the start of the first ``bucket_s`` bucket whose p99
    (answered requests scheduled in it) is within 20% of ``p99_before_ms``; 0.0 when
    the first one already is, None when none is before ``t_stop`` (not recovered)."""
    if p99_before_ms is None:
        return None
    lat = rec.latency_ms
    for b in range(max(int(math.ceil((t_stop - t_end) / bucket_s)), 0)):  # one per second, not per request
        m = _window(rec, t_end + b * bucket_s, min(t_end + (b + 1) * bucket_s, t_stop)) & rec.answered
        p = _p99(lat[m])
        if p is not None and p <= RECOVERY_WITHIN * p99_before_ms:
            return b * bucket_s
    return None


def fault_figures(rec: Records, *, t_before: float, t_start: float, t_end: float, t_stop: float, slo_s: float,
                  lost_upserts: int = 0, knee_rps: float | None = None) -> dict[str, Any]:  # fmt: skip
    """The issue's keys for one fault (module docstring); ``knee_rps`` adds
    ``goodput_vs_knee`` (the burst: goodput during / the knee's rate)."""
    whole = _window(rec, t_before, t_stop)
    before = _window(rec, t_before, t_start)
    during = _window(rec, t_start, t_end)
    lat = rec.latency_ms
    p99_before = _p99(lat[before & rec.answered])
    g_before = _goodput_per_s(rec, before, t_start - t_before, slo_s)
    g_during = _goodput_per_s(rec, during, t_end - t_start, slo_s)
    cov = rec.coverage[during & rec.answered]
    out: dict[str, Any] = {
        "requests": int(whole.sum()),
        "failed": int((whole & rec.failed).sum()),
        "degraded": int((whole & rec.answered & rec.degraded).sum()),
        "shed": int((whole & rec.shed).sum()),
        "p99_ms_before": p99_before,
        "p99_ms_during": _p99(lat[during & rec.answered]),
        "goodput_during_vs_before": g_during / g_before if g_before > 0 else None,
        "coverage_mean": float(cov.mean()) if cov.size else None,
        "shed_p99_ms": _p99(lat[whole & rec.shed]),
        "lost_upserts": int(lost_upserts),
        "recovery_s": recovery_s(rec, t_end=t_end, t_stop=t_stop, p99_before_ms=p99_before),
    }
    if knee_rps is not None:
        out[BURST_KEY] = g_during / knee_rps if knee_rps > 0 else None
    return out


def total_figures(faults: dict[str, dict[str, Any]], records: dict[str, Records], windows: dict[str, tuple[float, float, float, float]], *, slo_s: float) -> dict[str, Any]:
    """The same keys over every fault: counts summed; percentiles, coverage and goodput
    over all faults' windows pooled; ``recovery_s`` the worst (None if any did not recover)."""
    lat_b: list[np.ndarray] = []
    lat_d: list[np.ndarray] = []
    cov: list[np.ndarray] = []
    shed: list[np.ndarray] = []
    good_b = good_d = span_b = span_d = 0.0
    for name, rec in records.items():
        t0, t1, t2, t3 = windows[name]
        b, d, w = _window(rec, t0, t1), _window(rec, t1, t2), _window(rec, t0, t3)
        lat_b.append(rec.latency_ms[b & rec.answered])
        lat_d.append(rec.latency_ms[d & rec.answered])
        cov.append(rec.coverage[d & rec.answered])
        shed.append(rec.latency_ms[w & rec.shed])
        good_b += _goodput_per_s(rec, b, 1.0, slo_s)
        good_d += _goodput_per_s(rec, d, 1.0, slo_s)
        span_b += t1 - t0
        span_d += t2 - t1
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0)  # noqa: E731
    recov = [f["recovery_s"] for f in faults.values()]
    c = cat(cov)
    rate_b = good_b / span_b if span_b > 0 else 0.0
    return {
        "requests": sum(f["requests"] for f in faults.values()),
        "failed": sum(f["failed"] for f in faults.values()),
        "degraded": sum(f["degraded"] for f in faults.values()),
        "shed": sum(f["shed"] for f in faults.values()),
        "p99_ms_before": _p99(cat(lat_b)),
        "p99_ms_during": _p99(cat(lat_d)),
        "goodput_during_vs_before": (good_d / span_d) / rate_b if rate_b > 0 and span_d > 0 else None,
        "coverage_mean": float(c.mean()) if c.size else None,
        "shed_p99_ms": _p99(cat(shed)),
        "lost_upserts": sum(f["lost_upserts"] for f in faults.values()),
        "recovery_s": None if not recov or any(r is None for r in recov) else max(recov),
    }


def timeline(rec: Records, *, t0: float, t1: float, slo_s: float, bucket_s: float = 1.0) -> dict[str, np.ndarray]:
    """Per ``bucket_s`` from ``t0``: ``t_s`` (bucket start - t0), ``goodput_rps``,
    ``p99_ms`` (NaN: no answers) and ``shed_rps``, each float64 [B]."""
    n = max(int(math.ceil((t1 - t0) / bucket_s)), 1)
    idx = np.floor((rec.sched_s - t0) / bucket_s).astype(np.int64)
    keep = (idx >= 0) & (idx < n)
    good = keep & rec.answered & ~rec.degraded & (rec.latency_ms <= slo_s * 1e3)
    goodput = np.bincount(idx[good], minlength=n)[:n] / bucket_s
    shed = np.bincount(idx[keep & rec.shed], minlength=n)[:n] / bucket_s
    p99 = np.full(n, np.nan)
    ans = keep & rec.answered
    order = np.argsort(idx[ans], kind="stable")
    lat, ids = rec.latency_ms[ans][order], idx[ans][order]
    cuts = np.flatnonzero(np.diff(ids)) + 1
    for group, b in zip(np.split(lat, cuts), ids[np.r_[0, cuts]] if ids.size else []):  # one per bucket
        p99[int(b)] = float(np.percentile(group, 99))
    return {"t_s": np.arange(n) * bucket_s, "goodput_rps": goodput.astype(np.float64), "p99_ms": p99, "shed_rps": shed.astype(np.float64)}


def format_table(report: dict[str, Any]) -> str:
    """The human table: one row per fault and the total."""
    cols = ("requests", "failed", "degraded", "shed", "p99_ms_before", "p99_ms_during", "goodput_during_vs_before", "coverage_mean", "shed_p99_ms",
            "lost_upserts", "recovery_s")  # fmt: skip
    heads = ("requests", "failed", "degr", "shed", "p99 bef", "p99 dur", "goodput d/b", "coverage", "shed p99", "lost", "recov s")

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.2f}"
        return f"{v:,}"

    rows = [(name, [cell(f[c]) for c in cols]) for name, f in report["faults"].items()] + [("total", [cell(report["total"][c]) for c in cols])]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'fault':<{width}}  " + "  ".join(f"{h:>11}" for h in heads)]
    lines += [f"{name:<{width}}  " + "  ".join(f"{v:>11}" for v in vals) for name, vals in rows]
    burst = next((f for f in report["faults"].values() if BURST_KEY in f), None)
    if burst is not None:
        lines.append(f"burst goodput vs the knee: {cell(burst[BURST_KEY])}")
    return "\n".join(lines)
