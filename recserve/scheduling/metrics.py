"""Per-scheduler metrics: summaries (queue wait, batch size/cost, service time, latency),
drop counters by reason and queue-depth gauges, read through ``Scheduler.stats()``.

Recording is O(1) (one write into a ring buffer); percentiles are computed only when
``stats()`` is called, over the most recent ``window`` samples. Count and mean cover all
samples since start. A Prometheus exporter can read :class:`SchedulerStats` later.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

from recserve.errors import require


class DropReason(enum.Enum):
    """Why an item left without running to completion."""

    DEADLINE = "deadline"  # deadline passed before it ran (never executed), including already past at add
    CANCELLED = "cancelled"
    REJECTED = "rejected"  # refused at add: RESOURCE_EXHAUSTED (queue / quota), a cost no bound admits, the policy


@dataclasses.dataclass(frozen=True)
class SummaryStats:
    """count / mean over all samples; p50 / p99 / max over the recent window."""

    count: int
    mean: float
    p50: float
    p99: float
    max: float


class Summary:
    """A ring buffer of the last ``window`` samples plus all-time count and sum."""

    __slots__ = ("_buf", "_mask", "count", "total")

    def __init__(self, window: int = 2048) -> None:
        require(window > 0 and not window & (window - 1), "Summary.window", window, "use a positive power of two")
        self._buf = [0.0] * window
        self._mask = window - 1
        self.count = 0
        self.total = 0.0

    def record(self, value: float) -> None:
        self._buf[self.count & self._mask] = value
        self.count += 1
        self.total += value

    def record_many(self, values: Sequence[float]) -> None:
        """:meth:`record` of each of ``values`` in order, in one call (a batch's queue
        waits, a window's latencies): the same ring contents, count and total — the
        total summed left to right as ``record`` does, not ``sum``'s compensated way
        (Python 3.12+), so it stays bit-identical — without a call per value."""
        n = len(values)
        if not n:
            return
        total = self.total
        for value in values:
            total += value
        size = self._mask + 1
        start = self.count
        if n > size:  # only the last ``size`` values survive the wrap-around
            values = values[n - size:]
            start += n - size
        at = start & self._mask
        head = min(size - at, len(values))
        buf = self._buf
        buf[at:at + head] = values[:head]
        if head < len(values):
            buf[:len(values) - head] = values[head:]
        self.count += n
        self.total = total

    def recent(self) -> list[float]:
        """The recent samples (ring order, not time order)."""
        n = min(self.count, self._mask + 1)
        return self._buf[:n]

    def summary(self) -> SummaryStats:
        if not self.count:
            return SummaryStats(0, math.nan, math.nan, math.nan, math.nan)
        xs = sorted(self.recent())
        return SummaryStats(
            count=self.count,
            mean=self.total / self.count,
            p50=_quantile(xs, 0.50),
            p99=_quantile(xs, 0.99),
            max=xs[-1],
        )


def _quantile(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank quantile (numpy's 'inverted_cdf'): the smallest sample with at least
    a fraction ``q`` of samples at or below it."""
    rank = max(1, math.ceil(q * len(sorted_xs)))
    return sorted_xs[rank - 1]


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile of unsorted ``values`` (nan when empty)."""
    if not values:
        return math.nan
    return _quantile(sorted(values), q)


class SchedulerMetrics:
    """The mutable counters the core updates; ``Scheduler.stats()`` snapshots them."""

    __slots__ = (
        "queue_wait_s", "batch_size", "batch_cost", "service_s", "latency_s",
        "completed", "failed", "preempted", "batches", "drops",
    )

    def __init__(self, window: int = 2048) -> None:
        self.queue_wait_s = Summary(window)  # per item, each time it leaves the queue
        self.batch_size = Summary(window)  # items per batch
        self.batch_cost = Summary(window)  # cost per batch
        self.service_s = Summary(window)  # per batch, schedule -> complete
        self.latency_s = Summary(window)  # per finished item, add -> Done (queue + service)
        self.completed = 0
        self.failed = 0
        self.preempted = 0
        self.batches = 0
        self.drops = {reason: 0 for reason in DropReason}


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of one scheduler. Times in seconds; ``policy`` holds the policy's own
    gauges (e.g. the current window and SLO scale)."""

    queued_items: int
    queued_cost: float
    running_items: int
    resident_items: int
    inflight_batches: int
    admitted: int
    completed: int
    failed: int
    preempted: int
    batches: int
    drops: dict[str, int]
    queue_wait_s: SummaryStats
    batch_size: SummaryStats
    batch_cost: SummaryStats
    service_s: SummaryStats
    latency_s: SummaryStats
    policy: dict[str, float]
