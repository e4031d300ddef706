"""Open-loop offered-rate sweeps shared by the benchmarks (``--sweep-rates``, ``--plot``).

A sweep runs each contender at a list of offered rates (Poisson arrivals that do not
slow down when the system stalls) and records, per rate and contender, one *point*:

* ``arrived_per_s`` — arrivals actually issued per second of the arrival period (a
  Poisson draw: a short point lands a few percent off the offered rate);
* ``achieved_per_s`` — requests that got an answer, per second of the run (arrival
  period, or until the last answer if later);
* ``p50_ms`` / ``p99_ms`` — latency of answered requests, from the *scheduled* arrival
  (so a stalled generator cannot hide queueing), ``None`` when nothing was answered;
* ``goodput_per_s`` — full answers within the SLO, per second (a degraded answer or
  one later than the SLO does not count);
* ``failures`` — requests that got no answer (an error, a timeout, a deadline drop).

The JSON form is a list with one dict per offered rate::

    [{"offered_per_s": 250.0, "<mode>": {point}, "<other mode>": {point}}, ...]

This module prints that list as a table and plots it (matplotlib, Agg backend,
imported only when a plot is asked for). No I/O besides the PNG it is told to write.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: The keys every point has, whatever the benchmark; table and plot read only these.
POINT_KEYS = ("requests", "arrived_per_s", "achieved_per_s", "p50_ms", "p99_ms", "goodput_per_s", "failures")


def parse_rates(text: str) -> tuple[float, ...]:
    """``"250,500,1e3"`` -> ``(250.0, 500.0, 1000.0)``; an argparse ``type=``. Rates must
    be positive and finite; they are sorted (a sweep reads left to right)."""
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--sweep-rates {text!r}: {e}") from None
    if not rates or not all(0 < r < float("inf") for r in rates):
        raise argparse.ArgumentTypeError(f"--sweep-rates {text!r}: give positive rates, comma-separated (e.g. 250,500,1000)")
    return tuple(sorted(rates))


def percentile_ms(latencies_s: np.ndarray, q: float) -> float | None:
    """The ``q``-th percentile of latencies given in seconds, in ms (None when empty)."""
    return float(np.percentile(latencies_s, q) * 1000.0) if latencies_s.size else None


def summarise(latencies_s: np.ndarray, good: np.ndarray, *, requests: int, failures: int, arrival_s: float, span_s: float, slo_ms: float) -> dict[str, Any]:
    """One point from one open-loop run.

    ``latencies_s``: float [A], seconds from scheduled arrival to answer, for the A
    answered requests; ``good``: bool [A], True for a full (not degraded) answer;
    ``requests``: arrivals issued over ``arrival_s`` seconds; ``failures``: arrivals
    that got no answer; ``span_s``: seconds the answer rates are measured over.
    """
    lat = np.asarray(latencies_s, dtype=np.float64)
    in_slo = np.asarray(good, dtype=bool) & (lat <= slo_ms / 1000.0)
    return {
        "requests": int(requests),
        "completed": int(lat.size),
        "arrived_per_s": requests / arrival_s if arrival_s > 0 else 0.0,
        "achieved_per_s": lat.size / span_s if span_s > 0 else 0.0,
        "p50_ms": percentile_ms(lat, 50),
        "p99_ms": percentile_ms(lat, 99),
        "goodput_per_s": int(in_slo.sum()) / span_s if span_s > 0 else 0.0,
        "degraded": int(lat.size - int(np.count_nonzero(good))),
        "failures": int(failures),
    }


def format_sweep(sweep: Sequence[dict[str, Any]], modes: Sequence[tuple[str, str]], *, slo_ms: float, unit: str = "req") -> str:
    """Human table: one row per (offered rate, mode). ``modes``: (key, label) pairs."""

    def f(v: Any, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    width = max(len(label) for _, label in modes) + 2
    lines = [
        f"open-loop sweep (Poisson arrivals; goodput = full answers within the {slo_ms:g} ms SLO)",
        f"{'offered ' + unit + '/s':>16}  {'mode':<{width}}{'arrived/s':>11}{'achieved/s':>12}{'p50 ms':>10}{'p99 ms':>10}{'goodput/s':>12}{'failures':>10}",
    ]
    for point in sweep:
        for key, label in modes:
            p = point[key]
            lines.append(
                f"{point['offered_per_s']:>16,.0f}  {label:<{width}}{p['arrived_per_s']:>11,.0f}{p['achieved_per_s']:>12,.0f}{f(p['p50_ms'], '.2f'):>10}"
                f"{f(p['p99_ms'], '.2f'):>10}{p['goodput_per_s']:>12,.0f}{p['failures']:>10,}"
            )
    return "\n".join(lines)


def plot_sweep(path: str | Path, sweep: Sequence[dict[str, Any]], modes: Sequence[tuple[str, str]], *, title: str, slo_ms: float, unit: str = "req") -> None:
    """Write a PNG: p99 latency vs offered rate (log y, SLO dashed) and goodput vs
    offered rate (the offered rate itself dotted: the most any mode can reach), one
    line per mode."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    offered = np.array([p["offered_per_s"] for p in sweep], dtype=np.float64)
    fig, (ax_lat, ax_good) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for key, label in modes:
        p99 = np.array([np.nan if p[key]["p99_ms"] is None else p[key]["p99_ms"] for p in sweep], dtype=np.float64)
        good = np.array([p[key]["goodput_per_s"] for p in sweep], dtype=np.float64)
        ax_lat.plot(offered, p99, marker="o", label=label)
        ax_good.plot(offered, good, marker="o", label=label)
    ax_lat.axhline(slo_ms, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo_ms:g} ms")
    ax_lat.set_yscale("log")
    # Plain numbers on the log axis (not 4x10^1); minor ticks labelled at 2 and 5 only.
    ax_lat.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_lat.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if v > 0 and round(v / 10 ** np.floor(np.log10(v))) in (2, 5) else ""))
    ax_lat.set_xlabel(f"offered load ({unit}/s, Poisson)")
    ax_lat.set_ylabel("p99 latency (ms, log)")
    ax_lat.set_title("p99 latency")
    ax_good.plot(offered, offered, color="grey", linestyle=":", linewidth=1, label="offered")
    ax_good.set_xlabel(f"offered load ({unit}/s, Poisson)")
    ax_good.set_ylabel(f"goodput ({unit}/s within SLO)")
    ax_good.set_title(f"goodput (full answers within {slo_ms:g} ms)")
    ax_good.set_ylim(bottom=0)
    for ax in (ax_lat, ax_good):
        ax.set_xlim(left=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
