"""Shard counters and resource figures reported by ``ShardInfo``.

Counters are plain integers updated by the service after each RPC (the event loop is
the only writer). Service times go into a fixed ring of the last ``LATENCY_WINDOW``
Lookups, from which p50/p99 are computed on demand. CPU seconds come from
``time.process_time`` (all threads of this process: gathers run on the executor), RSS
from ``/proc/self/statm`` (current, not peak) with ``getrusage`` as fallback.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time

import numpy as np

from recserve.sharding.plan import Tier

LATENCY_WINDOW = 8192


@dataclasses.dataclass
class ShardCounters:
    rpcs: int = 0
    ids_requested: int = 0
    rows_served_hot: int = 0
    rows_served_warm: int = 0
    rows_served_cold: int = 0
    rows_missing: int = 0
    rows_not_owned: int = 0
    upserts: int = 0
    errors: int = 0

    def add_served(self, served: dict[Tier, int]) -> None:
        self.rows_served_hot += served.get(Tier.HOT, 0)
        self.rows_served_warm += served.get(Tier.WARM, 0)
        self.rows_served_cold += served.get(Tier.COLD, 0)


class LatencyWindow:
    """Ring buffer of the last ``size`` service times (seconds)."""

    def __init__(self, size: int = LATENCY_WINDOW) -> None:
        self._values = np.zeros(size, dtype=np.float64)
        self._count = 0

    def record(self, seconds: float) -> None:
        self._values[self._count % len(self._values)] = seconds
        self._count += 1

    def percentiles_ms(self, *qs: float) -> list[float]:
        n = min(self._count, len(self._values))
        if n == 0:
            return [0.0 for _ in qs]
        return [float(v) * 1e3 for v in np.percentile(self._values[:n], list(qs))]


def cpu_seconds() -> float:
    return time.process_time()


def rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm", "rb") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
