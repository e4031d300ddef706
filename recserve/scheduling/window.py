"""Window batching shared by the dynamic and feature-parallel policies.

A batch is dispatched at the first of:

1. the queue holds at least the cost cap (a full batch is ready);
2. the formation window has elapsed since it opened (``view.open_since``);
3. the slack trigger: the earliest queued deadline minus the estimated service time of
   the batch that would go now, minus a margin for wake-up latency. No item is held past
   the point where its remaining slack still covers the estimated service time;
4. resident items (an item that returned Continue) or a flush: dispatch now.

The batch takes resident items first (they already started), then queued items in
priority / EDF order while the cost stays within the cap; the first item is always
taken, so an item larger than the cap runs alone instead of blocking the queue.
Subclasses say what the window and the cap are.
"""

from __future__ import annotations

import abc

from recserve.scheduling.estimators import RateEstimator
from recserve.scheduling.policy_base import Policy, SchedulerView
from recserve.scheduling.types import Handle


class WindowPolicy(Policy):
    """Base for policies that batch everything inside a time/size window."""

    def __init__(self, *, rate_tau_s: float, dispatch_margin_s: float) -> None:
        self.arrivals = RateEstimator(rate_tau_s)  # cost units / s
        self.dispatch_margin_s = dispatch_margin_s

    @abc.abstractmethod
    def window_s(self) -> float:
        """The formation window (seconds). It may depend on the arrival rate, but only as
        measured at the latest arrival: between arrivals it is constant, so the time
        ``ready_at`` promises is the time ``select`` agrees to dispatch."""

    @abc.abstractmethod
    def cap(self) -> float:
        """Maximum batch cost (an oversized single item still runs alone)."""

    def on_add(self, handle: Handle, now: float) -> None:
        self.arrivals.observe(handle.cost, now)

    def ready_at(self, view: SchedulerView, now: float) -> float | None:
        if view.resident_count or view.flush:
            return now
        if view.queued_count == 0:
            return None
        cap = self.cap()
        queued_cost = view.queued_cost
        if queued_cost >= cap:
            return now
        opened = view.open_since
        window_end = (now if opened is None else opened) + self.window_s()
        slack_end = view.earliest_deadline() - view.estimate_service_s(queued_cost) - self.dispatch_margin_s
        return min(window_end, slack_end)

    def select(self, view: SchedulerView, now: float) -> None:
        due = self.ready_at(view, now)
        if due is None or due > now:
            return
        cap = self.cap()
        for handle in view.resident:
            if view.batch_size and view.batch_cost + handle.cost > cap:
                break
            view.run(handle)
        view.take_while(cap)
