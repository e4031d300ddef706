"""``recserve bench lookup``'s tiered run reports what bounds it (issue 9, "the tiered run
within 2x of the equal-memory run"): the RocksDB reads its windows cost, the disk's
direct-read rate and the rows/s floor they imply. Real shard processes, toy scale."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from recserve.bench import lookup as bench


def test_tiered_run_reports_its_reads_and_the_disk_floor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        ["--items", "4000", "--dim", "16", "--shards", "2", "--concurrency", "8", "--ids-per-request", "16", "--bags", "4",
         "--seconds", "0.3", "--open-loop-seconds", "0.2", "--rate", "50", "--stream-requests", "2000", "--prebuilt-kjts", "100",
         "--check-requests", "20", "--no-redis", "--no-knees", "--concurrency-high", "0", "--unloaded-seconds", "0.2",
         "--workdir", str(tmp_path), "--json"]
    )  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert bench.run(args) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(capsys.readouterr().out)
    t = report["tiered"]
    assert t["tiers"][0]["cold_ids"] > 0 and report["tiered_rows_per_s"] > 0
    # 90% of the ids are cold and the row cache is a sliver: the windows really read RocksDB.
    assert t["cold_reads_per_window"] > 0 and 0 < t["cold_reads_per_row"] <= 1
    assert t["shard_p50_ms"] > 0 and 0.0 <= t["row_cache_hit_rate"] <= 1.0
    disk = t["disk_direct_reads_per_s"]
    if disk is None:  # a file system without O_DIRECT (tmpfs): no floor, never a page-cache one
        assert t["io_floor_rows_per_s"] is None and t["equal_memory_vs_io_floor"] is None
    else:
        assert disk > 0
        assert t["io_floor_rows_per_s"] == pytest.approx(disk / t["cold_reads_per_row"])
        fp = report["rows_per_s"]["feature_parallel"]
        assert t["equal_memory_vs_io_floor"] == pytest.approx(fp / t["io_floor_rows_per_s"])
