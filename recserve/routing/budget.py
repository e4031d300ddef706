"""One retry budget for retries and hedges together (pure; no clock needed).

Retries are how a brief outage becomes a retry storm: when every call fails and every
caller retries, a replica set that was at capacity receives ``1 + retries`` times its
load exactly when it can serve least (reference §10.11.10: "rerouting must respect
admission limits and retry budgets"). ``tenacity`` and gRPC's own retry policy bound
the attempts *per call*; neither bounds them *across* calls, which is what keeps the
extra load a fixed fraction of the real traffic. So this is a token bucket fed by
primary calls:

* each primary call earns ``ratio`` tokens (10 % by default), up to ``burst`` tokens;
* each retry or hedge spends one token, and is refused when fewer than one is left;
* the bucket starts full, so ``burst`` extra calls cover a short outage at once.

Over any run, extra calls <= ``ratio`` x primary calls + ``burst``, whatever the
failure pattern. Only retryable statuses (:data:`recserve.rpc.status.RETRYABLE_CODES`:
UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) may be retried at all: retrying
INVALID_ARGUMENT or NOT_FOUND cannot change the answer, it only doubles the work.
"""

from __future__ import annotations

import grpc

from recserve.errors import require
# The one retryable-status rule lives with the status mapping; re-exported here so
# routing callers need one import.
from recserve.rpc.status import RETRYABLE_CODES, is_retryable

__all__ = ["RETRYABLE_CODES", "HedgeBudget", "RetryBudget", "is_retryable"]


class RetryBudget:
    """Token bucket that keeps retries + hedges within ``ratio`` of primary calls.

    Example::

        budget = RetryBudget(0.1, burst=10)
        budget.on_primary()                   # every first attempt
        if budget.try_retry(grpc.StatusCode.UNAVAILABLE):
            ...                               # send the retry
        if budget.try_spend():                # a hedge: no status yet
            ...

    Counters: ``primaries`` (calls earned on), ``spent`` (retries + hedges allowed),
    ``denied`` (refused for lack of tokens), ``not_retryable`` (refused for the status).
    """

    def __init__(self, ratio: float = 0.1, burst: float = 10.0) -> None:
        require(0.0 <= ratio <= 1.0, "retry_budget.ratio", ratio, "use a fraction of primary calls in [0, 1] (0.1 = at most 10 % extra calls)")
        require(burst >= 0.0, "retry_budget.burst", burst, "use >= 0 tokens")
        self.ratio = ratio
        self.burst = burst
        self.tokens = burst
        self.primaries = 0
        self.spent = 0
        self.denied = 0
        self.not_retryable = 0

    def on_primary(self, n: int = 1) -> None:
        """``n`` first attempts were sent: each earns ``ratio`` tokens (capped at burst)."""
        self.primaries += n
        self.tokens = min(self.burst, self.tokens + self.ratio * n)

    def try_spend(self) -> bool:
        """Take one token for a hedge / retry call; False (and counted) when empty."""
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            self.spent += 1
            return True
        self.denied += 1
        return False

    def try_retry(self, code: grpc.StatusCode | None) -> bool:
        """A token for retrying a call that failed with ``code``: never for a status
        that is not retryable (no token is taken then), else as :meth:`try_spend`."""
        if not is_retryable(code):
            self.not_retryable += 1
            return False
        return self.try_spend()

    @property
    def extra_ratio(self) -> float:
        """Retries + hedges sent per primary call so far (0 before any primary)."""
        return self.spent / self.primaries if self.primaries else 0.0


# The lookup client's name for the same bucket (it hedges, and retries only as hedges).
HedgeBudget = RetryBudget
