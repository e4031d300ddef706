"""The sweeps of recserve.loadtest on fakes (no sockets): ``--sweep-rate`` is the shared
knee bisection with each probe one run and a PNG of the probes; ``--sweep-window`` finds
the window-0 arm's knee, runs every arm at the same fractions of it, with each arm's
client config as the arm claims, and reads CPU from the shards' counters."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from recserve.config import load
from recserve.lookup.config import LookupClientConfig
from recserve.lookup.stats import LookupStats
from recserve.loadtest.record import LoadRecorder, LoadSummary
from recserve.loadtest.report import format_window_sweep
from recserve.loadtest.schedule import OpenLoopSchedule
from recserve.loadtest.sweeps import DISPATCH_ARM, plot_window_sweep, sweep_rate, sweep_window

CAPACITY_RPS = 300.0  # the fake system answers in time up to this rate, late above it


def fake_run(rate: float, *, seconds: float = 2.0, latency_s: float | None = None) -> LoadSummary:
    """A run at ``rate`` whose every request is answered in 5 ms below CAPACITY_RPS and in
    200 ms above it (the SLO is 50 ms)."""
    n = int(rate * seconds)
    offsets = np.linspace(seconds / n, seconds, n)
    schedule = OpenLoopSchedule(offsets, start_s=0.0)
    schedule.due(seconds)
    schedule.sent_at_s[:] = schedule.scheduled_s  # every send on time
    r = LoadRecorder(slo_s=0.050)
    lat = latency_s if latency_s is not None else (0.005 if rate <= CAPACITY_RPS else 0.200)
    for _ in range(n):
        r.on_send()
        r.on_answer(lat, degraded=False, done_s=seconds)
    return r.summary(schedule.lag(), start_s=0.0, duration_s=seconds)


def test_sweep_rate_bisects_to_the_knee_and_plots_every_probe(tmp_path: Path) -> None:
    async def run(rate: float) -> LoadSummary:
        return fake_run(rate)

    png = tmp_path / "knee.png"
    out = asyncio.run(sweep_rate(run, lo_rps=50.0, hi_rps=2000.0, png=png))
    knee = out["knee"]
    assert knee["status"] == "found"
    assert CAPACITY_RPS / 1.05 <= knee["knee_per_s"] <= CAPACITY_RPS  # within the 5% tolerance, below capacity
    rates = [p["offered_per_s"] for p in out["points"]]
    assert rates == sorted(rates) and len(rates) == len(knee["probes"])
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


@dataclasses.dataclass
class _Info:
    cpu_seconds: float
    rpcs: int


class FakeLookupTarget:
    """Stands in for GrpcLookupTarget: a run adds windows to the client's stats — the
    wider the window, the more callers each merges — and CPU to the fake shards, per
    unique id (so dedup is what saves shard CPU)."""

    made: list[LookupClientConfig] = []

    def __init__(self, config: LookupClientConfig) -> None:
        self.config = config
        self.client = type("C", (), {"stats": LookupStats()})()
        self.cpu = 0.0
        self.rpcs = 0
        self.started = self.closed = False
        FakeLookupTarget.made.append(config)

    async def start(self) -> None:
        self.started = True

    async def aclose(self) -> None:
        self.closed = True

    async def shard_infos(self) -> list[_Info]:
        return [_Info(self.cpu / 2, self.rpcs // 2), _Info(self.cpu / 2, self.rpcs - self.rpcs // 2)]


def test_sweep_window_runs_every_arm_at_fractions_of_the_window0_knee(tmp_path: Path) -> None:
    FakeLookupTarget.made = []
    base = LookupClientConfig.from_cluster(load(None))
    runs: list[tuple[float, bool, float]] = []

    async def run(target: Any, rate: float) -> LoadSummary:
        lk = target.config.lookup
        runs.append((lk.window_ms, lk.close_at_dispatch, rate))
        n = int(rate * 2.0)
        per_window = 1 + int(2 * lk.window_ms) + (3 if lk.close_at_dispatch else 0)  # callers a window merges
        s = target.client.stats
        windows = n // per_window
        s.windows += windows
        s.callers += n
        s.ids_requested += n * 100
        s.ids_unique += windows * 100  # each window dedups its callers' ids to one caller's worth
        s.ids_fetched += windows * 100
        s.rpcs_primary += windows * 2
        target.rpcs += windows * 2
        target.cpu += windows * 100 * 1e-5  # 10 µs of shard CPU per unique id
        return fake_run(rate)

    out = asyncio.run(sweep_window(FakeLookupTarget, base, [1, 0.5], run=run, lo_rps=50.0, hi_rps=2000.0, slo_ms=50.0, warmup=False))  # type: ignore[arg-type]
    knee = out["knee_window0"]["knee_per_s"]
    assert CAPACITY_RPS / 1.05 <= knee <= CAPACITY_RPS
    assert out["rates_rps"] == pytest.approx([0.25 * knee, 0.5 * knee, 0.75 * knee])
    assert [a["arm"] for a in out["arms"]] == ["0 ms", "0.5 ms", "1 ms", DISPATCH_ARM]  # window 0 added, first
    # Every arm at the same three rates; the knee search ran on the window-0 arm only.
    measured = runs[-12:]
    assert [(w, d) for w, d, _ in measured] == [(w, d) for w, d in [(0.0, False), (0.5, False), (1.0, False), (0.0, True)] for _ in range(3)]
    assert all(w == 0.0 and not d for w, d, _ in runs[:-12])
    assert [r for _, _, r in measured] == pytest.approx(out["rates_rps"] * 4)
    for cfg in FakeLookupTarget.made:
        assert cfg.lookup.near_cache_rows == 0 and cfg.lookup.max_inflight_batches == base.lookup.max_inflight_batches
    # The oracle of the fake: ids per shard CPU-s = (ids per window) / (unique ids per window * 10 µs).
    zero, one = out["arms"][0]["points"][1], out["arms"][2]["points"][1]
    assert zero["ids_per_shard_cpu_s"] == pytest.approx(1e5, rel=0.05)  # 1 caller per window: no dedup
    assert one["callers_per_window"] > zero["callers_per_window"]
    assert out["ids_per_shard_cpu_s_ratio_1ms_vs_0"] == pytest.approx(3.0, rel=0.05)  # the fake's 1 ms window merges 3 callers
    assert one["server_rpcs"] > 0 and one["dedup_ratio"] == pytest.approx(one["callers_per_window"], rel=0.05)
    # With warm-ups each arm's fresh client first serves one discarded run at lo_rps.
    runs.clear()
    FakeLookupTarget.made = []
    asyncio.run(sweep_window(FakeLookupTarget, base, [1], run=run, lo_rps=50.0, hi_rps=2000.0, slo_ms=50.0, knee_per_s=400.0))  # type: ignore[arg-type]
    assert [r for _, _, r in runs] == pytest.approx([50.0, 100.0, 200.0, 300.0] * 3)  # 3 arms: warm-up, then 25/50/75% of 400/s
    table = format_window_sweep(out)
    assert "dispatch-close" in table and "ids per shard CPU-second" in table
    png = tmp_path / "window.png"
    plot_window_sweep(png, out)
    assert png.read_bytes()[:4] == b"\x89PNG"
