"""Recent latency per destination: hedge delays and slow-destination ejection (pure).

Moved here from ``recserve.lookup.health`` (which re-exports it) so that every client
(the lookup client per shard, :class:`~recserve.routing.router.Router` per replica)
shares one implementation. The clock is passed in (``now``, monotonic seconds), so tests
drive it with a fake clock.

* the *hedge delay* of a destination is a high percentile of its recent latencies,
  floored, so a hedge fires only in the tail the percentile predicts (reference
  §10.11.1: hedging lowers the per-leaf tail probability at the price of extra work);
* a destination is *slow* when its latency EWMA is far above the fleet's median, or
  after several calls in a row past their hedge delay (ejected for a while, then
  re-probed by the traffic routing sends it again).

The arrays are indexed by destination (a shard for the lookup client, a replica for the
router); the ``shard`` parameter names are kept from the lookup client, its first user.
"""

from __future__ import annotations

import math

import numpy as np


class LatencyTracker:
    """Ring buffers of the last ``window`` latencies (seconds) per destination
    (``num_shards`` of them: shards for the lookup client, replicas for the router)."""

    def __init__(
        self,
        num_shards: int,
        *,
        percentile: float = 95.0,
        window: int = 128,
        min_delay_s: float = 0.002,
        default_delay_s: float = 0.010,
        slow_factor: float = 4.0,
        ewma_alpha: float = 0.2,
        slow_ttl_s: float = 1.0,
        late_strikes: int = 2,
    ) -> None:
        self.percentile = percentile
        self.min_delay_s = min_delay_s
        self.default_delay_s = default_delay_s
        self.slow_factor = slow_factor
        self.alpha = ewma_alpha
        self.slow_ttl_s = slow_ttl_s
        self.late_strikes = late_strikes
        self._buf = np.zeros((num_shards, window), dtype=np.float64)
        self._count = np.zeros(num_shards, dtype=np.int64)
        self._ewma = np.full(num_shards, math.nan)
        self._delay = np.full(num_shards, default_delay_s)
        self._dirty = np.zeros(num_shards, dtype=bool)
        self._last = np.full(num_shards, -np.inf)  # monotonic s of the latest sample
        self._late_run = np.zeros(num_shards, dtype=np.int64)  # consecutive late calls
        self._ejected_until = np.full(num_shards, -np.inf)
        self.ejections = 0
        self._caps = np.full(num_shards, math.inf)  # fleet_hedge_delay's caps, and whether they are out of date
        self._cap_dirty = True

    @property
    def num_shards(self) -> int:
        return int(self._buf.shape[0])

    def resize(self, num_shards: int) -> None:
        """Follow a plan with a different shard count (new shards start unknown)."""
        old = self.num_shards
        if num_shards == old:
            return
        keep = min(old, num_shards)
        buf = np.zeros((num_shards, self._buf.shape[1]))
        buf[:keep] = self._buf[:keep]
        self._buf = buf
        self._count = np.concatenate((self._count[:keep], np.zeros(max(0, num_shards - old), np.int64)))
        self._ewma = np.concatenate((self._ewma[:keep], np.full(max(0, num_shards - old), math.nan)))
        self._delay = np.concatenate((self._delay[:keep], np.full(max(0, num_shards - old), self.default_delay_s)))
        self._last = np.concatenate((self._last[:keep], np.full(max(0, num_shards - old), -np.inf)))
        self._late_run = np.concatenate((self._late_run[:keep], np.zeros(max(0, num_shards - old), np.int64)))
        self._ejected_until = np.concatenate((self._ejected_until[:keep], np.full(max(0, num_shards - old), -np.inf)))
        self._dirty = np.ones(num_shards, dtype=bool)
        self._caps = np.full(num_shards, math.inf)
        self._cap_dirty = True

    def record(self, shard: int, latency_s: float, now: float) -> None:
        """One observed latency at ``now``. A call cancelled before it answered is
        recorded with the time it had been waiting (a lower bound), so a stuck shard
        looks slow."""
        self._last[shard] = now
        w = self._buf.shape[1]
        self._buf[shard, self._count[shard] % w] = latency_s
        self._count[shard] += 1
        e = self._ewma[shard]
        self._ewma[shard] = latency_s if math.isnan(e) else e + self.alpha * (latency_s - e)
        if self._count[shard] % 8 == 0 or self._count[shard] <= 8:
            self._dirty[shard] = True

    def hedge_delay(self, shard: int) -> float:
        """Seconds to wait for ``shard`` before hedging: the configured percentile of its
        recent latencies (default until 8 samples), floored at ``min_delay_s``.
        Recomputed at most every 8 samples (a partition, not a full percentile)."""
        if self._dirty[shard]:
            n = int(min(self._count[shard], self._buf.shape[1]))
            if n >= 8:
                k = min(n - 1, max(0, int(np.ceil(self.percentile / 100.0 * n)) - 1))
                p = float(np.partition(self._buf[shard, :n], k)[k])
                self._delay[shard] = max(self.min_delay_s, p)
                self._cap_dirty = True
            self._dirty[shard] = False
        return float(self._delay[shard])

    def fleet_hedge_delay(self, shard: int) -> float:
        """``hedge_delay(shard)``, capped at ``slow_factor`` x the median hedge delay of
        the destinations measured: a destination's own percentile, once it is slow, is
        its slowness (200 ms for a shard slow by 200 ms), so a call sent to it (its
        re-probe, once it has been out of routing for ``slow_ttl_s``) would wait that
        long before hedging to a fast replica. Capped, such a call hedges once it is
        slower than "slow" means, and the re-probe still measures it (a hedged call's
        own latency is recorded when it answers or is cancelled)."""
        if self._cap_dirty or bool(self._dirty.any()):  # recomputed only when some destination's delay is (every 8 samples)
            for s in range(self.num_shards):
                self.hedge_delay(s)  # every delay current before the caps read them
            self._caps = self._fleet_caps()
            self._cap_dirty = False
        return min(self.hedge_delay(shard), float(self._caps[shard]))

    def _fleet_caps(self) -> np.ndarray:
        """float [S]: per destination, ``slow_factor`` x the median hedge delay of the
        *other* measured destinations (inf when none): with one of two or three slow,
        the others' median is the fleet's fast latency. One pass per destination, every
        8 samples of some destination (S is a shard or replica count, not an id count)."""
        known = np.flatnonzero(self._count >= 8)
        caps = np.full(self.num_shards, math.inf)
        for s in range(self.num_shards):
            others = self._delay[known[known != s]]
            if others.size:
                caps[s] = max(self.min_delay_s, self.slow_factor * float(np.median(others)))
        return caps

    def on_late(self, shard: int, now: float) -> None:
        """A call to ``shard`` passed its hedge delay unanswered. ``late_strikes`` in a
        row mark the shard slow for ``slow_ttl_s`` (outlier ejection for hot routing):
        one late call is the tail the percentile predicts, several in a row are not."""
        self._late_run[shard] += 1
        if self._late_run[shard] >= self.late_strikes:
            if self._ejected_until[shard] <= now:
                self.ejections += 1
            self._ejected_until[shard] = now + self.slow_ttl_s

    def on_time(self, shard: int) -> None:
        """A call to ``shard`` answered before its hedge delay."""
        self._late_run[shard] = 0

    def slow(self, now: float) -> np.ndarray:
        """bool [S]: shards whose latency EWMA exceeds ``slow_factor`` x the median EWMA
        of the shards measured (and the hedge floor). Unmeasured shards are not slow,
        and neither is one without a sample for ``slow_ttl_s``: routing then sends it
        traffic again, which re-measures it (a slow shard that gets no work would
        otherwise never be seen to recover)."""
        ejected = self._ejected_until > now
        # A handful of destinations, read every window: plain floats beat np.median's
        # and nan_to_num's call overhead (≈ 25 µs a window) by an order of magnitude.
        ewma = self._ewma.tolist()
        known = sorted(e for e in ewma if e == e)  # NaN: not measured yet
        n = len(known)
        if n < 2:
            return ejected
        median = known[n // 2] if n % 2 else 0.5 * (known[n // 2 - 1] + known[n // 2])
        bar = max(self.slow_factor * median, self.min_delay_s)
        fresh = now - self.slow_ttl_s
        last = self._last.tolist()
        over = [e == e and e > bar and t >= fresh for e, t in zip(ewma, last)]
        if not any(over):  # the usual answer: no second array, no OR
            return ejected
        return ejected | np.array(over, dtype=bool)
