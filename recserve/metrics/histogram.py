"""A Prometheus histogram that also takes a batch of observations in one call.

A scheduler's queue-wait histogram gets one sample per item a batch takes (a lookup
window: dozens). prometheus_client's ``Histogram.observe`` costs several Python calls and
two lock round trips per sample, which is most of what the scheduler spends per item
(issue 9). :meth:`BatchHistogram.observe_many` files a whole batch under one lock: what
a scrape then reads — every bucket, ``_count``, ``_sum`` (summed left to right, as
``observe`` sums it, so bit-identical) and ``_created`` — is exactly what ``observe`` of
each value in turn leaves. It is a ``Histogram`` subclass, so names, labels, buckets and
the exposition stay prometheus_client's own.

It reads prometheus_client's per-child value cells (``_sum``, ``_buckets``,
``_upper_bounds``; pinned in requirements.lock); the unit test that compares it with
``observe`` sample by sample fails if an upgrade moves them.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from typing import Any

from prometheus_client import Histogram


class BatchHistogram(Histogram):
    """``Histogram`` plus :meth:`observe_many`. Its children (``labels(...)``) are
    BatchHistograms too; ``observe`` and ``observe_many`` may be mixed."""

    def _metric_init(self) -> None:
        super()._metric_init()
        # observe_many reads ``_sum`` and writes it back: writers of one child (two
        # loops of one name may run on two threads) take turns, and observe goes
        # through the same lock so it cannot land between that read and write.
        self._batch_lock = threading.Lock()

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        self._raise_if_not_observable()  # before the lock: a labelled parent has none
        with self._batch_lock:
            super().observe(amount, exemplar)

    def observe_many(self, amounts: Sequence[float]) -> None:
        """``observe(a)`` for each ``a`` of ``amounts`` ([N] seconds), in order, in one call."""
        self._raise_if_not_observable()
        if not amounts:
            return
        bounds = self._upper_bounds  # sorted, ending at +Inf
        nowhere = len(bounds)  # NaN: observe files it in no bucket (bisect would say 0)
        counts = [0] * (nowhere + 1)
        where = bisect.bisect_left  # the first bound >= a: observe's ``a <= bound``
        # A C call per sample beats numpy here: searchsorted + bincount on a list of
        # 1-64 floats cost 5-11 us against 0.3-8 us for this loop.
        for amount in amounts:
            counts[where(bounds, amount) if amount == amount else nowhere] += 1
        buckets: list[Any] = self._buckets
        with self._batch_lock:
            total = self._sum.get()
            for amount in amounts:
                total += amount
            self._sum.set(total)
            for i, n in enumerate(counts[:-1]):
                if n:
                    buckets[i].inc(n)
