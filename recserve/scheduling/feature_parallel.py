"""Feature-parallel windows (lookup client, reference §10.6.6, docs/architecture.md §5).

Everything that arrives within one time/size window forms one batch: the lookup client
then dedups the batch's ids per table and groups them by shard, so each shard gets one
RPC per window however many callers contributed. Cost = number of ids.

The window is ``window_ms`` from its first arrival, or with ``adaptive``
``min(max_window_ms, target_cost / arrival_rate)``; it closes early when ``max_cost`` ids
are waiting or when the tightest caller's slack only just covers the expected batch time.

With ``close_at_dispatch`` that timer applies only while the client is **idle**, and
then it is the fixed ``window_ms`` (the adaptive cap would wait its whole length at low
load, where ``target_cost / rate`` is far above it). While the client is **busy** — a
window in flight, or one finished less than a window ago (closed-loop callers resubmit
right after their window) — the next window collects every caller that arrives while
the previous window's RPCs are in flight and closes at dispatch, the moment that window
is done and the slot is free: no timer. It still closes early at ``max_cost`` ids, at
the tightest caller's slack point, or once the window in flight has taken twice its
expected time (a stuck window must not hold the queue: the next one then runs beside
it). Not after ``max_window_ms``: windows in flight take longer than that, and a cap
that starts the next window beside every one of them makes all of them slower. An RPC
costs hundreds of µs whatever its size, so few large windows win: splitting a closed
loop's callers into two alternating windows costs 10-25% of throughput.
"""

from __future__ import annotations

import dataclasses
import math

from recserve.errors import require
from recserve.scheduling.policy_base import PolicyKind, SchedulerView, register_policy
from recserve.scheduling.types import Batch
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
    close_at_dispatch: bool = False

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
        # close_at_dispatch: when the last window finished, and when the latest window
        # started and its cost (to tell a window in flight from a stuck one).
        self._busy_at = -math.inf
        self._started_at = -math.inf
        self._started_cost = 0.0

    def cap(self) -> float:
        return self.config.max_cost

    def window_s(self) -> float:
        if not self.config.adaptive:
            return self._window_s
        rate = self.arrivals.last_rate()
        if rate <= 0.0:
            return self._max_window_s
        return min(self._max_window_s, self._target / rate)

    def on_batch_done(self, batch: Batch, service_s: float, now: float) -> None:
        self._busy_at = now

    def ready_at(self, view: SchedulerView, now: float) -> float | None:
        if not self.config.close_at_dispatch or view.resident_count or view.flush or view.queued_count == 0:
            return super().ready_at(view, now)
        queued_cost = view.queued_cost
        if queued_cost >= self.cap():
            return now
        opened = view.open_since
        opened = now if opened is None else opened
        slack_end = view.earliest_deadline() - view.estimate_service_s(queued_cost) - self.dispatch_margin_s
        if view.inflight_batches:
            # Busy: collect until the window in flight is done (its completion wakes the
            # loop), but not past twice the latest window's expected time (a stuck window
            # must not hold the queue behind it: the next one then runs beside it), nor
            # past the slack point. Not also at most max_window_ms: a window in flight
            # takes several ms here, so that cap started a window beside nearly every
            # one under open-loop load, and windows sharing the loop each took longer,
            # so more of them overlapped (issue 9: at 3,200 req/s windows of 7-12
            # callers, 4 in flight, an estimated 13 ms each, 10 % of callers late).
            expected_end = self._started_at + 2.0 * view.estimate_service_s(self._started_cost)
            return min(max(opened + self._window_s, expected_end), slack_end)
        if opened - self._busy_at <= self._window_s:
            return now  # the slot just freed: close at dispatch
        return min(opened + self._window_s, slack_end)  # idle: the small fixed timer

    def select(self, view: SchedulerView, now: float) -> None:
        super().select(view, now)
        if view.batch_size:
            self._started_at, self._started_cost = now, view.batch_cost

    def gauges(self) -> dict[str, float]:
        return {"cap": self.cap()}


register_policy(PolicyKind.FEATURE_PARALLEL, FeatureParallelPolicy)
