"""Per-shard health the lookup client routes and hedges on: re-exported from
:mod:`recserve.routing`, where the one implementation now lives (docs/architecture.md §9).

* :class:`LatencyTracker` (``routing/latency.py``) — hedge delay per shard (a high
  percentile of its recent latency, floored) and slow-shard ejection;
* :class:`HedgeBudget` (``routing/budget.py``, the same class as ``RetryBudget``) —
  hedges and retries add at most ``ratio`` extra RPCs per primary RPC, plus ``burst``;
* :class:`Breakers` (``routing/breaker.py``) — per-shard circuit breaker; the client
  reads ``live()``: closed, or half-open once the open period is over.
"""

from __future__ import annotations

from recserve.routing.breaker import Breakers
from recserve.routing.budget import HedgeBudget
from recserve.routing.latency import LatencyTracker

__all__ = ["Breakers", "HedgeBudget", "LatencyTracker"]
