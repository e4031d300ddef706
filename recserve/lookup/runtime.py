"""State the lookup client shares across windows."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np

from recserve.lookup.config import LookupClientConfig
from recserve.routing import Breakers, HedgeBudget, LatencyTracker
from recserve.lookup.near_cache import NearCache
from recserve.lookup.route import ShardState
from recserve.lookup.stats import LookupStats
from recserve.lookup.transport import ShardTransport
from recserve.sharding.plan import ShardingPlan


@dataclasses.dataclass
class Runtime:
    """State the client shares across windows (owned by :class:`LookupClient`)."""

    config: LookupClientConfig
    transport: ShardTransport
    plan: ShardingPlan
    tracker: LatencyTracker
    budget: HedgeBudget
    breakers: Breakers
    inflight_ids: np.ndarray  # int64 [S]
    near_cache: NearCache | None
    stats: LookupStats
    on_plan_version: Callable[[int, int], None]  # (version seen, shard) -> refresh
    clock: Callable[[], float] = time.monotonic
    executor: Executor | None = None
    windows_started: int = 0

    def shard_state(self, now: float) -> ShardState:
        return ShardState(live=self.breakers.live(now), slow=self.tracker.slow(now), inflight_ids=self.inflight_ids.copy())


