"""The one validated config of a :class:`~recserve.routing.router.Router`."""

from __future__ import annotations

import dataclasses

from recserve.errors import require
from recserve.routing.choice import ChoiceKind

__all__ = ["RoutingConfig"]


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    """How one replica set is routed (defaults: reference §10.11).

    * ``policy``: a :class:`~recserve.routing.choice.ChoiceKind` value (``two_choices``;
      ``weighted_random`` / ``least_loaded`` are baselines for benchmarks).
    * ``retry_budget`` / ``retry_burst``: retries + hedges stay within ``retry_budget`` x
      primary calls + ``retry_burst`` (:class:`~recserve.routing.budget.RetryBudget`).
    * ``breaker_failures`` consecutive retryable failures open a replica's breaker for
      ``breaker_open_ms``; then ``half_open_probes`` calls at a time test it.
    * ``affinity_virtual_nodes`` / ``affinity_seed``: the session-affinity ring.
    * ``hedge_percentile``: the hedge delay is this percentile of a replica's recent
      latency (:class:`~recserve.routing.latency.LatencyTracker`), floored at
      ``hedge_min_ms``.
    """

    policy: str = ChoiceKind.TWO_CHOICES.value
    retry_budget: float = 0.1
    retry_burst: float = 10.0
    breaker_failures: int = 3
    breaker_open_ms: float = 500.0
    half_open_probes: int = 1
    affinity_virtual_nodes: int = 128
    affinity_seed: int = 0
    hedge_percentile: float = 95.0
    hedge_min_ms: float = 2.0

    def __post_init__(self) -> None:
        kinds = [k.value for k in ChoiceKind]
        require(self.policy in kinds, "routing.policy", self.policy, f"use one of {kinds}")
        require(0.0 <= self.retry_budget <= 1.0, "routing.retry_budget", self.retry_budget, "use a fraction of primary calls in [0, 1]")
        require(self.retry_burst >= 0.0, "routing.retry_burst", self.retry_burst, "use >= 0 tokens")
        require(self.breaker_failures >= 1, "routing.breaker_failures", self.breaker_failures, "use at least 1 failure")
        require(self.breaker_open_ms > 0, "routing.breaker_open_ms", self.breaker_open_ms, "use a positive duration in ms")
        require(self.half_open_probes >= 1, "routing.half_open_probes", self.half_open_probes, "let at least 1 probe through")
        require(self.affinity_virtual_nodes >= 1, "routing.affinity_virtual_nodes", self.affinity_virtual_nodes, "use at least 1 point per replica")
        require(50.0 <= self.hedge_percentile < 100.0, "routing.hedge_percentile", self.hedge_percentile, "use a percentile in [50, 100)")
        require(self.hedge_min_ms >= 0.0, "routing.hedge_min_ms", self.hedge_min_ms, "use >= 0 ms")
