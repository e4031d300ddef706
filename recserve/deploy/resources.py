"""What one shard pod needs: memory from the planner's per-shard estimate, CPU from threads.

A shard process's resident memory is (measured with a real shard server, see
``tests/integration/test_deploy_memory.py``):

* ``SHARD_BASE_RSS_BYTES``: the process with no rows: Python, numpy, gRPC, RocksDB and
  the tier code (the intercept of the two measurements below, ≈ 107 MB; 112 MiB is
  that rounded up);
* ``DRAM_RSS_FACTOR`` × the plan's DRAM tiers (hot + warm rows and their id index,
  :func:`recserve.sharding.estimate_plan`'s ``bytes_per_shard["dram"]``): the tier
  arrays plus what the allocator keeps of the load's chunks (1.23× measured between a
  52.8 MB and a 105.6 MB tier, with the lookup path's malloc thresholds set);
* the cold-row LRU cache and the RocksDB block cache at their configured bounds
  (``[shard_server] row_cache_bytes`` / ``block_cache_bytes``): both fill under traffic,
  so the request must hold them full.

The pod requests that sum and is limited to ``LIMIT_HEADROOM`` (1.5) × it: a restart
reloads the DRAM tiers from RocksDB, and its peak (VmHWM) was 1.18-1.26× the steady
estimate here; the limit leaves that peak a margin, since crossing it is an OOM kill.
The first bulk load of the export runs in a separate init container (``recserve shard
load``), whose source arrays are not the server's to hold.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from recserve.config.spec import ShardServerConfig
from recserve.sharding.estimates import estimate_plan
from recserve.sharding.plan import ShardingPlan

__all__ = ["DRAM_RSS_FACTOR", "LIMIT_HEADROOM", "SHARD_BASE_RSS_BYTES", "ShardMemory", "mebibytes", "shard_memory"]

SHARD_BASE_RSS_BYTES = 112 << 20
DRAM_RSS_FACTOR = 1.25
LIMIT_HEADROOM = 1.5
ROCKSDB_SPACE_FACTOR = 2.0  # SST space amplification + a compaction's temporary copy
MIN_VOLUME_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class ShardMemory:
    """Bytes one shard needs (int64 [S] arrays: one entry per plan shard)."""

    dram_bytes: np.ndarray  # the plan's hot + warm tiers
    row_cache_bytes: int
    block_cache_bytes: int
    base_bytes: int
    rocksdb_bytes: np.ndarray  # every stored row (the source of truth), before amplification

    @property
    def total_bytes(self) -> np.ndarray:
        """int64 [S]: the expected resident memory of each shard (the pod's request)."""
        tiers = np.ceil(self.dram_bytes * DRAM_RSS_FACTOR).astype(np.int64)
        return tiers + self.row_cache_bytes + self.block_cache_bytes + self.base_bytes

    @property
    def request_bytes(self) -> int:
        """One pod template serves every shard: the fullest shard's total."""
        return int(self.total_bytes.max())

    @property
    def limit_bytes(self) -> int:
        return int(math.ceil(self.request_bytes * LIMIT_HEADROOM))

    @property
    def volume_bytes(self) -> int:
        """The PVC size: the fullest shard's RocksDB bytes, amplified, at least 1 GiB."""
        return max(MIN_VOLUME_BYTES, int(self.rocksdb_bytes.max() * ROCKSDB_SPACE_FACTOR))


def shard_memory(plan: ShardingPlan, server: ShardServerConfig) -> ShardMemory:
    """The memory of every shard of ``plan`` served with ``server``'s caches. Only the
    bytes model is used, which does not depend on access frequencies (uniform here)."""
    by = estimate_plan(plan).bytes_per_shard
    return ShardMemory(
        dram_bytes=by["dram"].astype(np.int64), row_cache_bytes=server.row_cache_bytes, block_cache_bytes=server.block_cache_bytes,
        base_bytes=SHARD_BASE_RSS_BYTES, rocksdb_bytes=by["rocksdb"].astype(np.int64),
    )  # fmt: skip


def mebibytes(n: int) -> str:
    """A Kubernetes quantity in whole MiB, rounded up: ``mebibytes(3 << 20) == "3Mi"``."""
    return f"{-(-n // (1 << 20))}Mi"
