"""Three real shard processes serving the lookup fakes' plan and weights
(tests/unit/test_lookup_fakes.py), for the lookup cluster and no-crossing suites."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from recserve.cluster.shards import ShardCluster
from recserve.config.spec import ShardServerConfig
from recserve.sharding.plan import ShardingPlan
from tests.unit.test_lookup_fakes import make_plan, make_weights


@dataclasses.dataclass
class Env:
    cluster: ShardCluster
    plan: ShardingPlan
    freq: dict[str, np.ndarray]
    weights: dict[str, np.ndarray]  # table -> fp32 [rows, dim]: the oracle's tables


@contextlib.contextmanager
def lookup_env(root: Path) -> Iterator[Env]:
    """The plan and weights under ``root``, served by 3 shards (fault hook on, admin open)."""
    plan, freq = make_plan()
    plan.save(root / "plan.json")
    weights = make_weights()
    np.savez(root / "weights.npz", **weights)  # type: ignore[arg-type]
    server = ShardServerConfig(threads=1, row_cache_bytes=1 << 20)
    with ShardCluster(root / "plan.json", root / "data", load_from=root / "weights.npz", fault_hook=True, server=server, insecure_admin=True) as cluster:
        yield Env(cluster, plan, freq, weights)
