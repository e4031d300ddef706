"""The one open-loop arrival generator the benchmarks share: Poisson arrivals.

Open loop means the arrival times are fixed before the run starts and do not slow down
when the system stalls, so queueing shows up as latency instead of hiding as a lower
offered rate. Every benchmark (scheduler, sharding, lookup sweeps, the knee finder)
draws its offsets here, so "offered rate" means the same thing in each report.

Example::

    rng = np.random.default_rng(0)
    poisson_arrivals(1000.0, count=3, rng=rng)          # array([0.00068, 0.0017, 0.00172]) s
    poisson_arrivals(1000.0, duration_s=2.0, rng=rng)   # ~2,000 offsets, all < 2.0 s
"""

from __future__ import annotations

import math

import numpy as np

from recserve.errors import InvalidArgument, require


def poisson_arrivals(rate_per_s: float, *, duration_s: float | None = None, count: int | None = None, rng: np.random.Generator) -> np.ndarray:
    """Arrival offsets of a Poisson process at ``rate_per_s``: float64 ``[N]``, seconds
    from the start, sorted ascending, the first one > 0 (one exponential gap after 0).

    ``count`` alone: exactly ``count`` arrivals (however long they take). ``duration_s``
    alone: every arrival in ``[0, duration_s)`` (N is itself Poisson-distributed, mean
    ``rate_per_s * duration_s``). Both: the arrivals in ``[0, duration_s)``, at most
    ``count`` of them. With ``count`` alone the draw consumes exactly ``count``
    exponentials from ``rng``, so a caller that draws more from the same ``rng`` after
    this call stays reproducible.
    """
    require(math.isfinite(rate_per_s) and rate_per_s > 0, "poisson_arrivals.rate_per_s", rate_per_s, "use a positive, finite rate per second")
    if duration_s is None and count is None:
        raise InvalidArgument("poisson_arrivals: give duration_s, count, or both; neither bounds the arrivals")
    if duration_s is not None:
        require(math.isfinite(duration_s) and duration_s >= 0, "poisson_arrivals.duration_s", duration_s, "use a finite duration >= 0 s")
    if count is not None:
        require(count >= 0, "poisson_arrivals.count", count, "use a count >= 0")
    scale = 1.0 / rate_per_s
    if duration_s is None:
        assert count is not None
        return np.cumsum(rng.exponential(scale, size=count))
    # Draw a block that covers duration_s with overwhelming probability (mean + 6 sigma);
    # on the rare shortfall draw another block. Vectorised: no loop per arrival.
    expected = rate_per_s * duration_s
    block = int(expected + 6.0 * math.sqrt(expected) + 16)
    if count is not None:
        block = min(block, count)
    offsets = np.cumsum(rng.exponential(scale, size=block))
    while (count is None or offsets.size < count) and (offsets.size == 0 or offsets[-1] < duration_s) and block > 0:
        start = offsets[-1] if offsets.size else 0.0
        offsets = np.concatenate([offsets, start + np.cumsum(rng.exponential(scale, size=block))])
    offsets = offsets[: np.searchsorted(offsets, duration_s, side="left")]
    return offsets if count is None else offsets[:count]
