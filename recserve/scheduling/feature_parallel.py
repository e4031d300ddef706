"""Feature-parallel windows (lookup client, reference §10.6.6, docs/architecture.md §5).

Everything that arrives within one time/size window forms one batch: the lookup client
then dedups the batch's ids per table and groups them by shard, so each shard gets one
RPC per window however many callers contributed. Cost = number of ids.

The window is ``window_ms`` from its first arrival, or with ``adaptive``
``min(max_window_ms, target_cost / arrival_rate)``; it closes early when ``max_cost`` ids
are waiting or when the tightest caller's slack only just covers the expected batch time.

With ``close_at_dispatch`` that timer applies only while the client is **idle**. A
window that opens while the client is **busy** — a window in flight, or one finished
less than a window ago (closed-loop callers resubmit right after their window) — closes
at dispatch instead: as soon as no earlier window is still preparing its RPCs (the
runner reports each window's send with :meth:`FeatureParallelPolicy.on_dispatched`), so
it takes every caller that arrived meanwhile and never waits on a timer. An RPC costs
hundreds of µs whatever its size, so few large windows win; a timer under load only
adds latency, and at low load the adaptive window waits its whole cap.
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
        # close_at_dispatch state: windows formed whose RPCs are not sent yet, and when
        # the client was last busy (a window finished or was sent).
        self._preparing = 0
        self._busy_at = -math.inf

    def cap(self) -> float:
        return self.config.max_cost

    def on_dispatched(self, now: float) -> None:
        """The runner sent a window's RPCs (or gave up before sending): the next window
        may close now. Call it exactly once per batch, then wake the serving loop."""
        self._preparing = max(0, self._preparing - 1)
        self._busy_at = now

    def on_batch_done(self, batch: Batch, service_s: float, now: float) -> None:
        self._busy_at = now

    def ready_at(self, view: SchedulerView, now: float) -> float | None:
        if not self.config.close_at_dispatch or view.resident_count or view.flush or view.queued_count == 0:
            return super().ready_at(view, now)
        inflight = view.inflight_batches
        opened = view.open_since
        busy = inflight > 0 or (opened is not None and opened - self._busy_at <= self.window_s())
        if not busy or view.queued_cost >= self.cap():
            return super().ready_at(view, now)  # idle: the window's timer (or a full window: now)
        # Nothing in flight means nothing is preparing (a runner that never reported does
        # not block the queue forever).
        if inflight == 0 or self._preparing == 0:
            return now
        # An earlier window is still preparing: collect until it sends (on_dispatched
        # wakes the loop), but never past the tightest caller's slack point.
        slack_end = view.earliest_deadline() - view.estimate_service_s(view.queued_cost) - self.dispatch_margin_s
        return None if math.isinf(slack_end) else slack_end

    def select(self, view: SchedulerView, now: float) -> None:
        if view.inflight_batches == 0:
            self._preparing = 0  # nothing in flight: no window can still be preparing
        before = view.batch_size
        super().select(view, now)
        if self.config.close_at_dispatch and view.batch_size > before:
            self._preparing += 1

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
