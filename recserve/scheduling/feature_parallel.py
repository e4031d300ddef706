"""Feature-parallel windows (lookup client, reference §10.6.6, DESIGN.md §5).

Everything that arrives within one time/size window forms one batch: the lookup client
then dedups the batch's ids per table and groups them by shard, so each shard gets one
RPC per window however many callers contributed. Cost = number of ids.

The window is ``window_ms`` from its first arrival, or with ``adaptive``
``min(max_window_ms, target_cost / arrival_rate)``; it closes early when ``max_cost`` ids
are waiting or when the tightest caller's slack only just covers the expected batch time.
"""

from __future__ import annotations

import dataclasses

from recserve.errors import require
from recserve.scheduling.policy_base import PolicyKind, register_policy
from recserve.scheduling.window import WindowPolicy


@dataclasses.dataclass(frozen=True)
class FeatureParallelConfig:
    """``window_ms``: the fixed window; ``max_cost``: ids per batch. With ``adaptive`` the
    window is ``min(max_window_ms, target_cost / rate)`` (``max_window_ms`` defaults to
    ``window_ms``, ``target_cost`` to ``max_cost``)."""

    window_ms: float = 1.0
    max_cost: float = 8192
    adaptive: bool = False
    max_window_ms: float | None = None
    target_cost: float | None = None
    rate_tau_s: float = 0.25
    dispatch_margin_ms: float = 0.5

    def __post_init__(self) -> None:
        require(0 <= self.window_ms <= 100, "feature_parallel.window_ms", self.window_ms, "use 0..100 ms")
        require(self.max_cost > 0, "feature_parallel.max_cost", self.max_cost, "use a positive id count")
        require(self.max_window_ms is None or 0 <= self.max_window_ms <= 100, "feature_parallel.max_window_ms", self.max_window_ms, "use 0..100 ms")
        require(self.target_cost is None or self.target_cost > 0, "feature_parallel.target_cost", self.target_cost, "use a positive id count")
        require(self.rate_tau_s > 0, "feature_parallel.rate_tau_s", self.rate_tau_s, "use a positive time constant in seconds")
        require(self.dispatch_margin_ms >= 0, "feature_parallel.dispatch_margin_ms", self.dispatch_margin_ms, "use >= 0 ms")


class FeatureParallelPolicy(WindowPolicy):
    kind = PolicyKind.FEATURE_PARALLEL

    def __init__(self, config: FeatureParallelConfig) -> None:
        super().__init__(rate_tau_s=config.rate_tau_s, dispatch_margin_s=config.dispatch_margin_ms / 1e3)
        self.config = config
        self._window_s = config.window_ms / 1e3
        self._max_window_s = (config.max_window_ms if config.max_window_ms is not None else config.window_ms) / 1e3
        self._target = config.target_cost if config.target_cost is not None else config.max_cost

    def cap(self) -> float:
        return self.config.max_cost

    def window_s(self) -> float:
        if not self.config.adaptive:
            return self._window_s
        rate = self.arrivals.last_rate()
        if rate <= 0.0:
            return self._max_window_s
        return min(self._max_window_s, self._target / rate)

    def gauges(self) -> dict[str, float]:
        return {"cap": self.cap()}


register_policy(PolicyKind.FEATURE_PARALLEL, FeatureParallelPolicy)
