"""Circuit breakers per destination: closed, open, half-open (pure; clock passed in).

Reference §10.11.10: a destination that keeps failing gets no traffic for a while
(*open*), so its failures stop costing callers a timeout each and stop feeding the
retry budget; after the open period a few probe calls test it (*half-open*); a success
closes the breaker, a failure re-opens it for another open period::

    CLOSED --(``failures`` retryable failures in a row)--> OPEN
    OPEN   --(``open_s`` elapsed)--------------------------> HALF_OPEN
    HALF_OPEN --(success)--> CLOSED      HALF_OPEN --(failure)--> OPEN

One :class:`Breakers` holds N destinations in numpy arrays, so a caller routing over
many shards reads every state at once (:meth:`Breakers.live`, :meth:`Breakers.states`:
``[N]``) instead of looping per destination.

Two ways to use a half-open destination:

* :meth:`Breakers.live` — closed or half-open, without counting probes. The lookup
  client uses this view (its first user, whose behaviour is unchanged): a hedge window
  that finds the open period over simply tries the shard, and the first answer decides.
* :meth:`Breakers.available` + :meth:`Breakers.acquire` — at most ``half_open_probes``
  calls in flight to a half-open destination. The replica router uses this view: after
  an outage it sends one probe to the recovering replica, not a full share of traffic.
  A probe permit that gets no result within ``open_s`` (its caller went away) is given
  back, so a lost probe cannot wedge a breaker half-open forever.

Which failures count is the caller's decision: the lookup client counts the retryable
statuses (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED); the replica router counts
UNAVAILABLE and DEADLINE_EXCEEDED only, since a replica shedding load with
RESOURCE_EXHAUSTED is alive. A replica that answers INVALID_ARGUMENT is healthy.
"""

from __future__ import annotations

import enum

import numpy as np

from recserve.errors import require

__all__ = ["BreakerState", "Breakers"]


class BreakerState(enum.IntEnum):
    """A destination's breaker state (int values: :meth:`Breakers.states` is int8 [N])."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class Breakers:
    """Circuit breaker per destination on consecutive failures.

    Args:
        num_shards: destinations N (shards or replicas; indices ``0..N-1``).
        failures: consecutive failures that open a closed breaker.
        open_s: seconds an opened breaker stays open before it half-opens.
        half_open_probes: calls :meth:`acquire` lets through to a half-open destination
            at a time (:meth:`live` ignores this limit).
    """

    def __init__(self, num_shards: int, *, failures: int, open_s: float, half_open_probes: int = 1) -> None:
        require(num_shards >= 0, "breakers.num_destinations", num_shards, "use >= 0 destinations")
        require(failures >= 1, "breakers.failures", failures, "use at least 1 failure")
        require(open_s > 0, "breakers.open_s", open_s, "use a positive open period in seconds")
        require(half_open_probes >= 1, "breakers.half_open_probes", half_open_probes, "let at least 1 probe through")
        self.threshold = failures
        self.open_s = open_s
        self.half_open_probes = half_open_probes
        self._failures = np.zeros(num_shards, dtype=np.int64)  # consecutive failures
        # Open until this monotonic time; once it has passed, failures >= threshold
        # means half-open. 0 for a breaker that never opened.
        self._open_until = np.zeros(num_shards, dtype=np.float64)
        self._probes = np.zeros(num_shards, dtype=np.int64)  # permits out (half-open)
        self._probe_at = np.full(num_shards, -np.inf)  # when the latest permit was given
        self.opened = 0  # closed/half-open -> open transitions

    @property
    def num_destinations(self) -> int:
        return int(self._failures.shape[0])

    def resize(self, num_shards: int) -> None:
        """Follow a destination set of a new size (new destinations start closed)."""
        keep = min(num_shards, self._failures.shape[0])
        extra = max(0, num_shards - self._failures.shape[0])
        self._failures = np.concatenate((self._failures[:keep], np.zeros(extra, np.int64)))
        self._open_until = np.concatenate((self._open_until[:keep], np.zeros(extra)))
        self._probes = np.concatenate((self._probes[:keep], np.zeros(extra, np.int64)))
        self._probe_at = np.concatenate((self._probe_at[:keep], np.full(extra, -np.inf)))

    # ---- reading ------------------------------------------------------------------

    def states(self, now: float) -> np.ndarray:
        """int8 [N]: each destination's :class:`BreakerState` value at ``now``."""
        tripped = self._failures >= self.threshold
        out = np.zeros(self._failures.shape[0], dtype=np.int8)
        out[tripped & (self._open_until > now)] = BreakerState.OPEN
        out[tripped & (self._open_until <= now)] = BreakerState.HALF_OPEN
        return out

    def state(self, shard: int, now: float) -> BreakerState:
        return BreakerState(int(self.states(now)[shard]))

    def live(self, now: float) -> np.ndarray:
        """bool [N]: breaker closed or half-open (open period over); probes not counted."""
        return self._open_until <= now

    def available(self, now: float) -> np.ndarray:
        """bool [N]: closed, or half-open with a probe permit free (or the latest permit
        unanswered for ``open_s``: presumed lost)."""
        probe_free = (self._probes < self.half_open_probes) | (self._probe_at <= now - self.open_s)
        half_open = (self._failures >= self.threshold) & (self._open_until <= now)
        closed = self._failures < self.threshold
        return closed | (half_open & probe_free)

    def available_at(self, now: float) -> np.ndarray:
        """float [N]: the latest time each destination becomes :meth:`available`:
        ``now`` if it is, the end of the open period if open, the expiry of its latest
        probe permit if half-open with every permit out (an answer may come sooner)."""
        out = np.where(self.available(now), now, np.maximum(self._open_until, now))
        half_full = (self._failures >= self.threshold) & (self._open_until <= now) & ~self.available(now)
        return np.where(half_full, self._probe_at + self.open_s, out)

    # ---- transitions --------------------------------------------------------------

    def acquire(self, shard: int, now: float) -> bool:
        """Take a call slot on ``shard``: always granted when closed; one of the
        ``half_open_probes`` permits when half-open; refused when open (or when every
        probe permit is out). Every granted call must end in :meth:`on_success`,
        :meth:`on_failure` or :meth:`release`."""
        if self._failures[shard] < self.threshold:
            return True
        if self._open_until[shard] > now:
            return False
        if self._probe_at[shard] <= now - self.open_s:
            self._probes[shard] = 0  # the earlier permits got no result: presumed lost
        if self._probes[shard] >= self.half_open_probes:
            return False
        self._probes[shard] += 1
        self._probe_at[shard] = now
        return True

    def on_success(self, shard: int, now: float | None = None) -> None:
        """A call answered: the destination serves, so the breaker closes whatever its
        state (``now`` unused; accepted so every transition takes the clock)."""
        self._failures[shard] = 0
        self._open_until[shard] = 0.0
        self._probes[shard] = 0

    def release(self, shard: int) -> None:
        """A granted call ended without a verdict (the caller cancelled it, e.g. a hedge
        that lost the race): its probe permit, if it held one, is free again and the
        state does not change."""
        self._probes[shard] = max(0, int(self._probes[shard]) - 1)

    def on_failure(self, shard: int, now: float) -> None:
        """A call failed (a status the caller counts). ``failures`` in a row open the
        breaker for ``open_s``; a half-open destination has already reached the
        threshold, so its failure re-opens it at once; a failure while open (a call
        sent before it opened) extends the open period."""
        self._failures[shard] += 1
        if self._failures[shard] >= self.threshold:
            if self._open_until[shard] <= now:
                self.opened += 1
            self._open_until[shard] = now + self.open_s
            self._probes[shard] = 0
