"""Dynamic batching with an adaptive, SLO-controlled window (ranker stages).

The window (reference §10.6.8, traffic-adaptive batching) is

    window = min(max_wait · s, min(target_batch_cost, cap) / measured_arrival_rate)

where the arrival rate is an EWMA in cost units per second and ``s`` is the SLO
controller's scale (1.0 without an SLO). High traffic fills the target quickly, so the
window shrinks; low traffic is capped at ``max_wait``. The cost cap is
``max(min_batch_cost, max_batch_cost · s)``: when p99 (queue + service) nears the SLO the controller shrinks
both, and grows them back when p99 is far below (see :mod:`recserve.scheduling.slo`).
"""

from __future__ import annotations

import dataclasses
import math

from recserve.errors import require
from recserve.scheduling.policy_base import PolicyKind, register_policy
from recserve.scheduling.slo import PeriodicP99, SloControlConfig, SloController
from recserve.scheduling.types import Batch, Handle, ItemStatus
from recserve.scheduling.window import WindowPolicy


@dataclasses.dataclass(frozen=True)
class DynamicBatchConfig:
    """``max_batch_cost`` in the stage's cost unit (e.g. candidates); ``max_wait_ms`` caps
    batch formation; ``adaptive`` turns on the rate-based window; ``slo_ms`` (None = off)
    turns on the SLO controller; ``target_batch_cost`` (default ``max_batch_cost``) is the
    batch the adaptive window waits for."""

    max_batch_cost: float
    max_wait_ms: float
    adaptive: bool = True
    slo_ms: float | None = None
    target_batch_cost: float | None = None
    # The cap never shrinks below this (e.g. the largest single request): a cap under one
    # request leaves every batch a single oversized item, i.e. unbatched, exactly when
    # overload needs batching most (measured by `recserve bench rank`: the controller
    # drove 0.05 x 8,192 = 410 candidates < one 500-candidate request and never recovered).
    min_batch_cost: float = 0.0
    rate_tau_s: float = 0.25
    dispatch_margin_ms: float = 0.5
    slo_control: SloControlConfig = SloControlConfig()

    def __post_init__(self) -> None:
        require(self.max_batch_cost > 0, "dynamic_batch.max_batch_cost", self.max_batch_cost, "use a positive cost (e.g. candidates per batch)")
        require(0 <= self.max_wait_ms <= 1000, "dynamic_batch.max_wait_ms", self.max_wait_ms, "use 0..1000 ms")
        require(self.slo_ms is None or self.slo_ms > 0, "dynamic_batch.slo_ms", self.slo_ms, "use a positive SLO in ms, or None to disable")
        require(self.target_batch_cost is None or 0 < self.target_batch_cost <= self.max_batch_cost,
                "dynamic_batch.target_batch_cost", self.target_batch_cost, f"use 0 < target <= max_batch_cost ({self.max_batch_cost:g})")
        require(0 <= self.min_batch_cost <= self.max_batch_cost, "dynamic_batch.min_batch_cost", self.min_batch_cost,
                f"use 0..max_batch_cost ({self.max_batch_cost:g})")
        require(self.rate_tau_s > 0, "dynamic_batch.rate_tau_s", self.rate_tau_s, "use a positive time constant in seconds")
        require(self.dispatch_margin_ms >= 0, "dynamic_batch.dispatch_margin_ms", self.dispatch_margin_ms, "use >= 0 ms")


class DynamicBatchPolicy(WindowPolicy):
    kind = PolicyKind.DYNAMIC

    def __init__(self, config: DynamicBatchConfig) -> None:
        super().__init__(rate_tau_s=config.rate_tau_s, dispatch_margin_s=config.dispatch_margin_ms / 1e3)
        self.config = config
        self._max_wait_s = config.max_wait_ms / 1e3
        self._target = config.target_batch_cost if config.target_batch_cost is not None else config.max_batch_cost
        self.controller: SloController | None = None
        self._p99: PeriodicP99 | None = None
        if config.slo_ms is not None:
            self.controller = SloController(config.slo_ms / 1e3, config.slo_control)
            self._p99 = PeriodicP99(config.slo_control.period_s, config.slo_control.min_samples)

    @property
    def scale(self) -> float:
        return self.controller.scale if self.controller is not None else 1.0

    def cap(self) -> float:
        return max(self.config.min_batch_cost, self.config.max_batch_cost * self.scale)

    def window_s(self) -> float:
        max_wait = self._max_wait_s * self.scale
        if not self.config.adaptive:
            return max_wait
        rate = self.arrivals.last_rate()
        if rate <= 0.0:
            return max_wait
        return min(max_wait, min(self._target, self.cap()) / rate)

    def on_finish(self, handle: Handle, now: float) -> None:
        if self._p99 is None:
            return
        if handle.status is ItemStatus.DONE:
            self._p99.record(now - handle.arrived_at, now)
        elif handle.status is ItemStatus.DROPPED:
            self._p99.record(math.inf, now)  # a deadline drop is an SLO miss of unbounded size
        self._roll(now)

    def on_batch_done(self, batch: Batch, service_s: float, now: float) -> None:
        self._roll(now)

    def _roll(self, now: float) -> None:
        if self._p99 is None or self.controller is None:
            return
        ended, p99 = self._p99.roll(now)
        if ended:
            self.controller.update(p99)

    def gauges(self) -> dict[str, float]:
        return {"scale": self.scale, "cap": self.cap(), "arrival_rate": self.arrivals.last_rate(), "window_ms": self.window_s() * 1e3}


register_policy(PolicyKind.DYNAMIC, DynamicBatchPolicy)
