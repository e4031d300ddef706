"""Online estimators the policies read: arrival rate and service time.

Both are O(1) per observation and take the clock from the caller.
"""

from __future__ import annotations

import math

from recserve.errors import require


class RateEstimator:
    """Exponentially weighted arrival rate (units/s) with time constant ``tau_s``.

    Keeps an accumulator that decays as ``exp(-dt / tau)`` and gains each arrival's
    amount; in steady state its expectation is ``rate * tau``, so ``rate = acc / tau``.
    Decay is applied at read time too, so the rate falls while nothing arrives.
    """

    __slots__ = ("tau_s", "_acc", "_t")

    def __init__(self, tau_s: float) -> None:
        require(tau_s > 0, "RateEstimator.tau_s", tau_s, "use a positive time constant in seconds")
        self.tau_s = tau_s
        self._acc = 0.0
        self._t: float | None = None

    def observe(self, amount: float, now: float) -> None:
        """Record ``amount`` units (items, ids, candidates) arriving at ``now``."""
        if self._t is not None:
            dt = now - self._t
            if dt > 0:
                self._acc *= math.exp(-dt / self.tau_s)
                self._t = now
        else:
            self._t = now
        self._acc += amount

    def last_rate(self) -> float:
        """The rate as of the latest arrival (0.0 before any)."""
        return self._acc / self.tau_s

    def rate(self, now: float) -> float:
        """Units per second at ``now`` (0.0 before any arrival)."""
        if self._t is None:
            return 0.0
        dt = now - self._t
        decay = math.exp(-dt / self.tau_s) if dt > 0 else 1.0
        return self._acc * decay / self.tau_s


class ServiceTimeEstimator:
    """Service time of a batch as a function of its cost: ``a + b * cost``.

    An exponentially weighted least-squares fit over recent batches (weight ``alpha`` per
    new batch), so a fixed per-batch cost (an RPC round trip, a kernel launch) and a
    per-unit cost (rows gathered, candidates scored) are both captured. When recent
    batches all had about the same cost the slope is not identifiable; then the estimate
    is the mean service time, scaled up (never down) for larger batches — erring long,
    which is the safe side for a slack check.
    """

    __slots__ = ("alpha", "initial_s", "_w", "_sx", "_sy", "_sxx", "_sxy", "count")

    def __init__(self, alpha: float = 0.1, initial_s: float = 0.0) -> None:
        require(0.0 < alpha <= 1.0, "ServiceTimeEstimator.alpha", alpha, "use a weight in (0, 1]")
        self.alpha = alpha
        self.initial_s = initial_s
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self.count = 0

    def observe(self, cost: float, service_s: float) -> None:
        """Record one batch of ``cost`` units that took ``service_s`` seconds."""
        k = 1.0 - self.alpha
        a = self.alpha
        self._w = k * self._w + a
        self._sx = k * self._sx + a * cost
        self._sy = k * self._sy + a * service_s
        self._sxx = k * self._sxx + a * cost * cost
        self._sxy = k * self._sxy + a * cost * service_s
        self.count += 1

    def mean_s(self) -> float:
        """Weighted mean service time per batch (``initial_s`` before any batch)."""
        return self._sy / self._w if self.count else self.initial_s

    def estimate_s(self, cost: float) -> float:
        """Expected service time of a batch of ``cost`` units, >= 0."""
        if not self.count:
            return self.initial_s
        mx = self._sx / self._w
        my = self._sy / self._w
        var = self._sxx / self._w - mx * mx
        if var > 1e-6 * (mx * mx + 1.0):
            slope = (self._sxy / self._w - mx * my) / var
            if slope >= 0.0:
                intercept = my - slope * mx
                if intercept >= 0.0:
                    return intercept + slope * cost
        # Degenerate or implausible fit (negative slope / intercept from noise).
        if mx > 0.0 and cost > mx:
            return my * cost / mx
        return my
