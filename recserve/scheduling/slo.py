"""The SLO-adaptive controller (reference §10.6.8), damped.

The reference heuristic: when p99 > 0.9·SLO cut the batch limits by 20 %; when
p99 < 0.5·SLO raise them by 10 %. It warns that feedback delay and noisy percentiles
make this oscillate. This controller keeps the heuristic's shape and adds the damping:

- **deadband** between ``low_frac``·SLO and ``high_frac``·SLO: no change;
- **fast decrease, slow increase**: ×0.8 when near the SLO, ×1.1 when far below (the
  reference's factors), and the increase only after a hold (below);
- **cooldown** of ``cooldown_periods`` after every change: with a one-period measurement
  lag the next p99 still reflects the old setting, and acting on it double-counts;
- **hysteresis** on the way up: grow only after ``up_hold_periods`` consecutive low
  periods, so one lucky period does not undo a decrease;
- **bounds**: the scale never leaves ``[min_scale, 1.0]``.

Its output is a scale in ``[min_scale, 1]`` that the dynamic policy multiplies into its
max window and max batch cost. It is a pure function of the p99 it is fed, once per
period; :class:`PeriodicP99` turns a stream of latencies into that per-period p99.
"""

from __future__ import annotations

import dataclasses

from recserve.errors import ConfigError, require
from recserve.scheduling.metrics import quantile


@dataclasses.dataclass(frozen=True)
class SloControlConfig:
    """Tuning of the SLO controller. Defaults follow reference §10.6.8: shrink by 20 % above
    0.9·SLO, grow by 10 % below 0.5·SLO; plus the damping (hold, cooldown)."""

    period_s: float = 1.0  # one control period; p99 is measured per period
    min_samples: int = 20  # a period with fewer latencies holds (p99 of 5 samples is noise)
    high_frac: float = 0.9
    low_frac: float = 0.5
    decrease_factor: float = 0.8
    increase_factor: float = 1.1
    up_hold_periods: int = 2
    cooldown_periods: int = 1
    min_scale: float = 0.05

    def __post_init__(self) -> None:
        require(self.period_s > 0, "slo_control.period_s", self.period_s, "use a positive period in seconds")
        require(self.min_samples >= 1, "slo_control.min_samples", self.min_samples, "use at least 1 sample")
        require(0 < self.low_frac < self.high_frac <= 1.0, "slo_control.low_frac", (self.low_frac, self.high_frac),
                "use 0 < low_frac < high_frac <= 1 (a deadband between them)")
        require(0 < self.decrease_factor < 1, "slo_control.decrease_factor", self.decrease_factor, "use a factor in (0, 1)")
        require(1 < self.increase_factor <= 2, "slo_control.increase_factor", self.increase_factor, "use a factor in (1, 2]")
        require(self.up_hold_periods >= 1, "slo_control.up_hold_periods", self.up_hold_periods, "use at least 1 period")
        require(self.cooldown_periods >= 0, "slo_control.cooldown_periods", self.cooldown_periods, "use >= 0 periods")
        require(0 < self.min_scale <= 1, "slo_control.min_scale", self.min_scale, "use a scale in (0, 1]")


class SloController:
    """Damped multiplicative control of a scale in ``[min_scale, 1]``; starts at 1 (the
    configured limits)."""

    def __init__(self, slo_s: float, config: SloControlConfig = SloControlConfig()) -> None:
        if not slo_s > 0:
            raise ConfigError(f"slo_ms = {slo_s * 1e3!r} is invalid: use a positive SLO")
        self.slo_s = slo_s
        self.config = config
        self.scale = 1.0
        self.direction_changes = 0  # sign flips between consecutive adjustments
        self.adjustments = 0
        self._last_direction = 0
        self._cooldown = 0
        self._low_streak = 0

    def update(self, p99_s: float | None) -> float:
        """Feed one period's p99 (None: too few samples, hold). Returns the new scale."""
        cfg = self.config
        if self._cooldown > 0:
            self._cooldown -= 1
            return self.scale
        if p99_s is None:
            return self.scale
        new = self.scale
        if p99_s > cfg.high_frac * self.slo_s:
            self._low_streak = 0
            new = max(cfg.min_scale, self.scale * cfg.decrease_factor)
        elif p99_s < cfg.low_frac * self.slo_s:
            self._low_streak += 1
            if self._low_streak >= cfg.up_hold_periods:
                self._low_streak = 0
                new = min(1.0, self.scale * cfg.increase_factor)
        else:
            self._low_streak = 0
        if new != self.scale:
            direction = 1 if new > self.scale else -1
            if self._last_direction and direction != self._last_direction:
                self.direction_changes += 1
            self._last_direction = direction
            self.adjustments += 1
            self.scale = new
            self._cooldown = cfg.cooldown_periods
        return self.scale


class PeriodicP99:
    """Collects latencies and yields one p99 per ``period_s`` of the caller's clock.

    Samples are capped per period (``max_samples``, keeping the first ones) so a flood
    of completions cannot grow memory; p99 of a few thousand samples is stable enough.
    """

    __slots__ = ("period_s", "min_samples", "max_samples", "_start", "_samples")

    def __init__(self, period_s: float, min_samples: int, max_samples: int = 4096) -> None:
        self.period_s = period_s
        self.min_samples = min_samples
        self.max_samples = max_samples
        self._start: float | None = None
        self._samples: list[float] = []

    def record(self, latency_s: float, now: float) -> None:
        if self._start is None:
            self._start = now
        if len(self._samples) < self.max_samples:
            self._samples.append(latency_s)

    def roll(self, now: float) -> tuple[bool, float | None]:
        """If a period has ended at ``now``: (True, its p99 or None if too few samples)
        and start the next period; else (False, None)."""
        if self._start is None:
            self._start = now
            return False, None
        if now - self._start < self.period_s:
            return False, None
        samples, self._samples = self._samples, []
        # Periods with no traffic at all are skipped as one: restart the clock at now.
        self._start = now
        if len(samples) < self.min_samples:
            return True, None
        return True, quantile(samples, 0.99)
