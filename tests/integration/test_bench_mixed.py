"""``recserve bench mixed`` at toy scale on real shard processes and one real co-located
ranker + decoder process: the issue's JSON keys, every Rank arrival accounted for, both
bulkhead lanes busy in the mixed window, and the ratios derived from the reported
figures (issue 16, "Bulkhead benchmark")."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from recserve.bench import mixed


@pytest.mark.integration
def test_bench_mixed_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    mixed.add_arguments(parser)
    args = parser.parse_args(
        ["--items", "3000", "--users", "300", "--impressions", "6000", "--train-rows", "2000", "--candidates", "100", "--request-pool", "64",
         "--device", "cpu", "--knee-rps", "40", "--measure-seconds", "0.5", "--gen-streams", "2", "--gen-tokens", "8", "--gen-prompt-tokens", "8",
         "--gen-layers", "1", "--gen-dim", "32", "--warmup-requests", "8", "--repeats", "1", "--slo-ms", "500", "--timeout-ms", "1000", "--workdir", str(tmp_path / "work"), "--json"]
    )  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert mixed.run(args) == 0
    finally:
        torch.set_num_threads(threads)
    r = json.loads(capsys.readouterr().out)
    for key in ("rank_p99_ms_alone", "rank_p99_ms_mixed", "decode_tokens_per_s", "decode_tokens_per_s_alone"):
        assert isinstance(r[key], float) and r[key] > 0, key
    assert r["knee_per_s"] == 40.0 and not r["knee_searched"] and r["rank_rate_per_s"] == pytest.approx(0.7 * 40.0)
    assert r["rank_p99_ratio"] == pytest.approx(r["rank_p99_ms_mixed"] / r["rank_p99_ms_alone"])
    assert r["decode_fraction"] == pytest.approx(r["decode_tokens_per_s"] / r["decode_tokens_per_s_alone"])
    assert r["goals"]["rank_p99_met"] == (r["rank_p99_ratio"] <= 1.2) and r["goals"]["decode_met"] == (r["decode_fraction"] >= 0.3)
    (run,) = r["runs"]
    for window in ("rank_alone", "rank_mixed"):
        w = run[window]
        assert w["requests"] > 0 and w["ok"] + w["late"] + w["degraded"] + w["shed"] + w["failed"] == w["requests"], w
    # The mixed window ran both lanes on the process's one device executor.
    busy, share = run["device_busy_s_mixed"], run["device_share_mixed"]
    assert busy["critical"] > 0 and busy["best_effort"] > 0
    assert share["critical"] + share["best_effort"] == pytest.approx(1.0)
    assert run["streams_finished"] > 0 and run["generation_errors"] == {}
    assert r["device_share_best_effort_mixed"] == pytest.approx(share["best_effort"])
    table = mixed.format_report(r)
    assert "Rank p99" in table and "decode tokens/s" in table
