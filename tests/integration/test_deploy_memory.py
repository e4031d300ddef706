"""The shard pod's memory request against a real shard: the planner-based estimate of
:mod:`recserve.deploy.resources` is within 25% of the measured resident set of a shard
server on a small plan, and its peak stays under the pod's limit.

As in the rendered StatefulSet: the export is bulk-loaded first by ``recserve shard
load`` (the init container), then the server starts on the loaded RocksDB with the
lookup path's transport environment and reads its DRAM tier back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recserve.cluster import ShardCluster
from recserve.cluster.group import REPO_ROOT
from recserve.config.spec import LookupConfig, ShardingConfig, ShardServerConfig, TableConfig
from recserve.deploy.resources import shard_memory
from recserve.lookup.transport import transport_env
from recserve.sharding import plan_tables

pytestmark = pytest.mark.integration

ROWS, DIM = 200_000, 64  # a 52.8 MB hot tier: large enough that the tier, not the interpreter, is most of the estimate


def _status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of ``pid`` in bytes (from /proc, the kernel's own account)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def test_shard_rss_matches_the_memory_request_within_25_percent(tmp_path: Path) -> None:
    table = TableConfig(name="item", rows=ROWS, dim=DIM)
    result = plan_tables([table], None, ShardingConfig(num_shards=1, hot_fraction=1.0, warm_fraction=0.0, hot_replicas=1))
    plan_path = tmp_path / "plan.json"
    result.plan.save(plan_path)
    source = tmp_path / "source"
    source.mkdir()
    np.save(source / "item.npy", np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32))
    data_root = tmp_path / "data"
    load = [sys.executable, "-m", "recserve", "shard", "load", "--plan", str(plan_path), "--shard-id", "0", "--data", str(data_root / "shard-0"),
            "--from", str(source), "--json"]  # fmt: skip
    subprocess.run(load, cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    server = ShardServerConfig(row_cache_bytes=1 << 20, block_cache_bytes=4 << 20, threads=1)
    memory = shard_memory(result.plan, server)
    assert int(memory.dram_bytes[0]) >= 50_000_000  # the hot tier holds every row
    with ShardCluster(plan_path, data_root, num_shards=1, server=server, env=transport_env(LookupConfig()), admin_token="test-admin-token") as cluster:
        measured = _status(cluster.pid(0))
    estimate = memory.request_bytes
    ratio = measured["VmRSS"] / estimate
    assert 0.75 <= ratio <= 1.25, f"shard RSS {measured['VmRSS']:,} B vs estimate {estimate:,} B (ratio {ratio:.2f})"
    assert measured["VmHWM"] <= memory.limit_bytes, f"peak RSS {measured['VmHWM']:,} B over the pod limit {memory.limit_bytes:,} B"
