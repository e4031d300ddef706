"""``recserve bench sharding`` as a user runs it, at a tiny size: real shard processes,
one JSON object on stdout with ``--json``, figures that agree with the routing model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recserve.bench.sharding import _table
from recserve.cluster.shards import REPO_ROOT

pytestmark = pytest.mark.integration

TINY = ["--items", "3000", "--dim", "16", "--shards", "2", "--windows", "12", "--window-lookups", "256", "--rate", "200"]


def test_bench_sharding_json_is_one_object_from_the_servers_counters(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    cmd = [sys.executable, "-m", "recserve", "bench", "sharding", *TINY, "--data-dir", str(tmp_path), "--json"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=str(REPO_ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)  # the whole of stdout is one JSON object
    assert isinstance(report, dict) and list(report["plans"]) == ["row_only", "hybrid", "hybrid_no_colsplit"]
    assert report["expected_remap"] == pytest.approx(1 / 3) and abs(report["remap_fraction_on_add"] - 1 / 3) <= 0.02
    for name, p in report["plans"].items():
        served, expected = p["rows_served_per_shard"], p["rows_expected_per_shard"]
        # The servers' own counters against the routing model on the same stream (every
        # id is stored, so every routed (slice-)row is served exactly once).
        assert sum(served) == round(sum(expected)), name
        assert p["imbalance"] == pytest.approx(max(served) / (sum(served) / len(served)))
        assert p["errors"] == 0 and p["rpcs"] > 0 and p["p99_ms"] > 0 and p["rows_per_cpu_s"] > 0
        assert len(p["memory_rss_bytes_per_shard"]) == 2 and min(p["memory_rss_bytes_per_shard"]) > 10 << 20
    row_only, hybrid = report["plans"]["row_only"], report["plans"]["hybrid"]
    assert row_only["rows_served_per_shard"] == [round(e) for e in row_only["rows_expected_per_shard"]]  # cold: one owner
    assert row_only["dram_tier_bytes_per_shard"] == [0, 0]
    assert hybrid["hot_rows"] == 30 and hybrid["warm_rows"] == 300
    for got, est in zip(hybrid["dram_tier_bytes_per_shard"], hybrid["planner_dram_bytes_per_shard"]):
        assert abs(got - est) <= 0.25 * est, (got, est)  # the shard holds what the planner budgeted
    # Without --json the same report is printed as the human table.
    lines = _table(report).splitlines()
    assert lines[0].startswith("sharding benchmark: 3,000 x 16 rows, 2 shards")
    assert [line.split()[0] for line in lines[2:5]] == ["row_only", "hybrid", "hybrid_no_colsplit"]
    assert f"{hybrid['imbalance']:.3f}" in lines[3] and "remap on adding a shard" in lines[-1]
