"""The fault suite's figures (recserve/bench/faults_report.py) from hand-made records:
windows, outcome partition, goodput ratios, recovery and the total (no I/O, no clock)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from recserve.bench.faults_report import BURST_KEY, FIGURE_KEYS, Records, fault_figures, format_table, recovery_s, timeline, total_figures

SLO_S = 0.5


def make_records(rows: list[tuple[float, float, str, bool, float]]) -> Records:
    """rows of (scheduled s, latency ms, status, degraded, coverage)."""
    sched = [r[0] for r in rows]
    return Records.from_lists(sched, [r[0] + r[1] / 1e3 for r in rows], [r[2] for r in rows], [r[3] for r in rows], [r[4] for r in rows])


def steady(t0: float, t1: float, per_s: int, latency_ms: float) -> list[tuple[float, float, str, bool, float]]:
    return [(t, latency_ms, "OK", False, 1.0) for t in np.arange(t0, t1, 1.0 / per_s)]


def test_fault_figures_partition_outcomes_by_window() -> None:
    rows = steady(0, 5, 10, 20.0)  # before: 50 OK at 20 ms
    rows += [(5.0 + i * 0.1, 40.0, "OK", i % 2 == 1, 0.5 if i % 2 else 1.0) for i in range(20)]  # during: 10 degraded
    rows += [(7.0, 3.0, "RESOURCE_EXHAUSTED", False, math.nan), (7.1, 5.0, "UNAVAILABLE", False, math.nan)]
    rows += steady(8, 10, 10, 20.0)  # after: back to 20 ms at once
    f = fault_figures(make_records(rows), t_before=0, t_start=5, t_end=8, t_stop=10, slo_s=SLO_S, lost_upserts=2)
    assert tuple(f) == FIGURE_KEYS
    assert (f["requests"], f["failed"], f["degraded"], f["shed"], f["lost_upserts"]) == (92, 1, 10, 1, 2)
    assert (f["p99_ms_before"], f["p99_ms_during"]) == pytest.approx((20.0, 40.0))
    assert f["coverage_mean"] == 0.75  # over the 20 answers during: half 1.0, half 0.5
    assert f["shed_p99_ms"] == pytest.approx(3.0)
    # goodput before 50 / 5 s = 10/s; during 10 OK / 3 s
    assert math.isclose(f["goodput_during_vs_before"], (10 / 3) / 10)
    assert f["recovery_s"] == 0.0


def test_burst_adds_goodput_vs_knee_and_late_answers_are_not_goodput() -> None:
    rows = steady(0, 2, 10, 10.0) + [(2.0 + i * 0.05, 900.0 if i % 4 == 0 else 10.0, "OK", False, 1.0) for i in range(40)]
    f = fault_figures(make_records(rows), t_before=0, t_start=2, t_end=4, t_stop=4, slo_s=SLO_S, knee_rps=20.0)
    assert f[BURST_KEY] == (30 / 2) / 20.0  # 10 of 40 answered past the 500 ms SLO
    assert f["failed"] == 0 and f["recovery_s"] is None  # no time after the fault: not shown to recover


def test_recovery_is_the_first_second_back_within_20_percent() -> None:
    rows = steady(0, 2, 10, 100.0) + steady(2, 3, 10, 500.0) + steady(3, 4, 10, 300.0) + steady(4, 5, 10, 119.0)
    rec = make_records(rows)
    assert recovery_s(rec, t_end=2, t_stop=5, p99_before_ms=100.0) == 2.0
    assert recovery_s(rec, t_end=2, t_stop=4, p99_before_ms=100.0) is None


def test_total_sums_counts_and_takes_the_worst_recovery() -> None:
    a = make_records(steady(0, 2, 10, 10.0) + [(2.5, 1.0, "RESOURCE_EXHAUSTED", False, math.nan)] + steady(3, 4, 10, 10.0))
    b = make_records(steady(10, 12, 10, 10.0) + steady(12, 13, 10, 50.0) + steady(13, 14, 10, 10.0))
    wa, wb = (0.0, 2.0, 3.0, 4.0), (10.0, 12.0, 13.0, 14.0)
    faults = {"x": fault_figures(a, t_before=0, t_start=2, t_end=3, t_stop=4, slo_s=SLO_S),
              "y": fault_figures(b, t_before=10, t_start=12, t_end=13, t_stop=14, slo_s=SLO_S, lost_upserts=1)}  # fmt: skip
    t = total_figures(faults, {"x": a, "y": b}, {"x": wa, "y": wb}, slo_s=SLO_S)
    assert tuple(t) == FIGURE_KEYS
    assert (t["requests"], t["shed"], t["lost_upserts"]) == (faults["x"]["requests"] + faults["y"]["requests"], 1, 1)
    assert t["recovery_s"] == max(faults["x"]["recovery_s"], faults["y"]["recovery_s"])
    assert "total" in format_table({"faults": faults, "total": t})


def test_timeline_buckets_goodput_p99_and_shed_per_second() -> None:
    rows = steady(0, 1, 10, 10.0) + [(1.2, 2.0, "RESOURCE_EXHAUSTED", False, math.nan)] * 3
    tl = timeline(make_records(rows), t0=0, t1=3, slo_s=SLO_S)
    assert list(tl["goodput_rps"]) == [10.0, 0.0, 0.0] and list(tl["shed_rps"]) == [0.0, 3.0, 0.0]
    assert tl["p99_ms"][0] == pytest.approx(10.0) and np.isnan(tl["p99_ms"][1:]).all()
