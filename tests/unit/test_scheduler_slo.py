"""The SLO-adaptive controller against a simulated plant with seeded noise and a
one-period measurement lag (reference §10.6.8). No clocks at all: one call per period.

The plant: p99 of queue + service time = (base + gain · scale) · (1 + noise), where
``scale`` multiplies the window and max batch; load changes base and gain. The controller
at the end of period t sees the p99 of period t-1 (the lag).
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from recserve.errors import ConfigError
from recserve.scheduling.slo import PeriodicP99, SloControlConfig, SloController

SLO_S = 0.050
LOW, HIGH = 0.5 * SLO_S, 0.9 * SLO_S


@dataclasses.dataclass(frozen=True)
class Load:
    base_s: float
    gain_s: float  # p99 added at scale 1.0

    def p99(self, scale: float) -> float:
        return self.base_s + self.gain_s * scale


LIGHT = Load(0.005, 0.015)  # 20 ms at full scale: far below the SLO
HEAVY = Load(0.010, 0.080)  # 90 ms at full scale: must shrink to ~0.33-0.43
STEEP = Load(0.012, 0.250)  # a narrow in-band range of scales: 0.05..0.13
OVERLOAD = Load(0.060, 0.050)  # above the SLO at any scale


@dataclasses.dataclass
class Trace:
    scales: list[float]  # scale in force during each period
    true_p99: list[float]  # the plant's noise-free p99 in each period
    controller: SloController


def simulate(phases: list[tuple[Load, int]], *, seed: int, noise: float = 0.08,
             config: SloControlConfig = SloControlConfig()) -> Trace:
    rng = random.Random(seed)
    ctl = SloController(SLO_S, config)
    scale, pending = ctl.scale, None
    trace = Trace([], [], ctl)
    for load, periods in phases:
        for _ in range(periods):
            measured = load.p99(scale) * (1.0 + rng.gauss(0.0, noise))
            trace.scales.append(scale)
            trace.true_p99.append(load.p99(scale))
            new_scale = ctl.update(pending)  # sees the previous period: one-period lag
            pending = measured
            scale = new_scale
    return trace


def changes(scales: list[float], start: int, end: int) -> list[int]:
    """Periods t in [start, end) where the scale changed going into t + 1."""
    return [t for t in range(start, min(end, len(scales) - 1)) if scales[t + 1] != scales[t]]


def direction_changes(scales: list[float], start: int, end: int) -> int:
    signs = [math.copysign(1, scales[t + 1] - scales[t]) for t in changes(scales, start, end)]
    return sum(1 for a, b in zip(signs, signs[1:]) if a != b)


@pytest.mark.parametrize("seed", range(10))
def test_step_up_in_load_settles_within_n_periods_without_oscillating(seed: int) -> None:
    step, heavy_periods = 40, 80
    trace = simulate([(LIGHT, step), (HEAVY, heavy_periods)], seed=seed)
    s = trace.scales
    assert s[:step + 1] == [1.0] * (step + 1)  # light load: already at the top bound, stays
    # Settled: from some period on, the true p99 stays inside the deadband to the end.
    settle = next(t for t in range(step, len(s)) if all(LOW <= p <= HIGH for p in trace.true_p99[t:]))
    assert settle - step <= 12, f"took {settle - step} periods to settle"
    assert direction_changes(s, step, len(s)) == 0  # only ever shrinks under a load step up
    assert len(changes(s, settle, len(s))) <= 2  # no chatter once settled
    assert all(SloControlConfig().min_scale <= x <= 1.0 for x in s)


@pytest.mark.parametrize("seed", range(10))
def test_step_down_in_load_grows_back_to_the_bound_slowly_and_monotonically(seed: int) -> None:
    trace = simulate([(HEAVY, 60), (LIGHT, 60)], seed=seed)
    s = trace.scales
    assert s[59] < 0.45  # shrunk under heavy load
    assert direction_changes(s, 60, 120) == 0  # grows only
    grow = changes(s, 60, 120)
    # Slow by design: each x1.1 needs two low periods plus a cooldown period.
    assert all(b - a >= 3 for a, b in zip(grow, grow[1:]))
    assert s[-1] == 1.0 and s.index(1.0, 60) - 60 <= 45
    assert direction_changes(s, 0, 120) <= 1  # down then up: at most one reversal in all


@pytest.mark.parametrize("seed", range(5))
def test_never_leaves_its_bounds(seed: int) -> None:
    cfg = SloControlConfig(min_scale=0.1)
    # 0.1 -> 1.0 takes 25 increases of x1.1, 3 periods each: the idle phase is long enough.
    trace = simulate([(OVERLOAD, 60), (Load(0.0, 0.001), 90)], seed=seed, config=cfg)
    s = trace.scales
    assert min(s) == 0.1 and s[59] == 0.1  # pinned at the lower bound under overload
    assert max(s) == 1.0 and s[-1] == 1.0  # pinned at the upper bound when idle


def test_damping_beats_the_plain_heuristic_on_a_steep_noisy_plant() -> None:
    """The undamped reference heuristic (act every period on lagged, noisy p99) reverses
    direction far more often than the damped controller in the same plant and noise."""
    plain = SloControlConfig(cooldown_periods=0, up_hold_periods=1)
    damped_flips = plain_flips = 0
    for seed in range(20):
        phases = [(LIGHT, 20), (STEEP, 150)]
        damped = simulate(phases, seed=seed, noise=0.12)
        undamped = simulate(phases, seed=seed, noise=0.12, config=plain)
        damped_flips += damped.controller.direction_changes
        plain_flips += undamped.controller.direction_changes
        assert damped.controller.direction_changes <= 2
        assert all(0.05 <= x <= 1.0 for x in damped.scales)
    assert damped_flips * 4 < plain_flips, (damped_flips, plain_flips)


def test_too_few_samples_hold_the_scale() -> None:
    ctl = SloController(SLO_S)
    assert ctl.update(None) == 1.0
    assert ctl.update(1.0) == pytest.approx(0.8)
    assert ctl.update(1.0) == pytest.approx(0.8)  # cooldown period: the lagged p99 is stale
    assert ctl.update(None) == pytest.approx(0.8)
    assert ctl.update(1.0) == pytest.approx(0.64)


def test_periodic_p99_yields_one_value_per_period_of_the_callers_clock() -> None:
    window = PeriodicP99(period_s=1.0, min_samples=10)
    for i in range(100):
        window.record(0.001 * (i + 1), now=0.5)
    assert window.roll(0.9) == (False, None)
    ended, p99 = window.roll(1.5)
    assert ended and p99 == pytest.approx(0.099)  # nearest rank: the 99th of 1..100 ms
    window.record(0.5, now=1.6)
    assert window.roll(2.6) == (True, None)  # one sample: too few, hold


def test_controller_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="low_frac"):
        SloControlConfig(low_frac=0.9, high_frac=0.5)
    with pytest.raises(ConfigError, match="decrease_factor"):
        SloControlConfig(decrease_factor=1.2)
