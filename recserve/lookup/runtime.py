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
    # Per-table facts of the (frozen) config every window reads: built once, not per window.
    dims: dict[str, int] = dataclasses.field(init=False)
    table_rows: dict[str, int] = dataclasses.field(init=False)
    pooling: dict[str, str] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        tables = self.config.tables
        self.dims = {t.name: t.dim for t in tables}
        self.table_rows = {t.name: t.rows for t in tables}
        self.pooling = {t.name: t.pooling for t in tables}

    def shard_state(self, now: float) -> ShardState:
        return ShardState(live=self.breakers.live(now), slow=self.tracker.slow(now), inflight_ids=self.inflight_ids.copy())


