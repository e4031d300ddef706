"""``recserve bench rank``: the forward-cost fit and the batching cap by hand-computed
figures, the request pool's shape, and the whole benchmark at toy scale on real shard
and ranker processes (every arrival accounted for, the unbatched ranker at exactly one
request per forward, the ratios and the cap derived from the reported figures)."""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from recserve.bench import rank as bench
from recserve.bench import rank_report
from recserve.bench.rank_costs import ForwardCost, batching_cap, fit_line, measure_forward_cost
from recserve.errors import ConfigError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cost(fixed_ms: float, per_candidate_us: float) -> ForwardCost:
    return ForwardCost(fixed_ms=fixed_ms, per_candidate_us=per_candidate_us, device="cpu", batch_sizes=(1, 2), times_ms=(1.0, 2.0), max_rel_error=0.0)


def test_fit_line_recovers_fixed_and_slope() -> None:
    sizes = [1, 10, 100, 1000]
    fixed, slope = fit_line(sizes, [0.2 + 0.003 * s for s in sizes])
    assert fixed == pytest.approx(0.2, rel=1e-9) and slope == pytest.approx(0.003, rel=1e-9)
    # Relative weighting: a 10% miss at the largest size must not swamp the intercept
    # that the small sizes pin (plain least squares would put it near 0.2 + 1000 * 0.0003).
    fixed, _ = fit_line(sizes, [0.2 + 0.003 * s for s in sizes[:-1]] + [1.1 * (0.2 + 3.0)])
    assert 0.15 < fixed < 0.25
    with pytest.raises(ConfigError, match="fit_line.sizes"):
        fit_line([5, 5], [1.0, 1.1])


def test_batching_cap_is_the_documented_formula() -> None:
    # fixed 1 ms, 2 us/candidate, 500 candidates: 1 ms + 1 ms unbatched; batches of 4
    # requests pay 0.25 + 1 ms each -> cap 2 / 1.25 = 1.6.
    assert batching_cap(cost(1.0, 2.0), candidates=500, mean_batch_requests=4.0) == pytest.approx(1.6)
    assert batching_cap(cost(1.0, 2.0), candidates=500, mean_batch_requests=1.0) == pytest.approx(1.0)
    assert batching_cap(cost(-0.01, 2.0), candidates=500, mean_batch_requests=8.0) == pytest.approx(1.0)  # fitted noise below 0


def test_system_cost_solves_the_two_closed_loop_points() -> None:
    # 50 req/s unbatched (20 ms each), 200 req/s in batches of 5 (5 ms each):
    # F + v = 20 and F / 5 + v = 5 -> F = 18.75 ms per batch, v = 1.25 ms per request.
    sc = rank_report.system_cost(50.0, 200.0, 5.0)
    assert sc is not None and sc["per_batch_ms"] == pytest.approx(18.75) and sc["per_request_ms"] == pytest.approx(1.25)
    assert rank_report.system_cost(50.0, 200.0, 1.0) is None and rank_report.system_cost(None, 200.0, 5.0) is None


def test_forward_cost_of_a_real_dlrm_grows_with_the_batch() -> None:
    from ranker.config import DlrmConfig
    from ranker.models.dlrm import DlrmRanker

    model = DlrmRanker(DlrmConfig(embedding_dim=8, dense_arch=(16, 8), over_arch=(16, 1)), {"dlrm_user": 4, "dlrm_item": 8, "dlrm_category": 2, "dlrm_tag": 3, "dlrm_category_cross": 4})
    c = measure_forward_cost(model, sizes=(1, 256, 2048), repeats=2)
    assert c.device == "cpu" and c.batch_sizes == (1, 256, 2048) and len(c.times_ms) == 3
    assert c.times_ms[2] > c.times_ms[0] and c.per_candidate_us > 0
    assert c.predict_ms(0) == pytest.approx(c.fixed_ms)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_forward_cost_on_cuda() -> None:
    from ranker.config import DlrmConfig
    from ranker.models.dlrm import DlrmRanker

    model = DlrmRanker(DlrmConfig(), {"dlrm_user": 4, "dlrm_item": 8, "dlrm_category": 2, "dlrm_tag": 3, "dlrm_category_cross": 4})
    c = measure_forward_cost(model, sizes=(1, 1024, 16384), device="cuda", repeats=5)
    assert c.device.startswith("cuda") and c.times_ms[2] > 0 and c.per_candidate_us > 0


def test_request_pool_rows_are_distinct_in_range_and_follow_popularity() -> None:
    popularity = np.linspace(1.0, 0.0, 1000) ** 2 + 1e-6  # item 0 the most popular
    users, cands = bench.request_pool(popularity / popularity.sum(), 50, 400, 100, user_zipf=1.05, seed=3)
    assert users.shape == (400,) and cands.shape == (400, 100) and cands.dtype == np.int64
    assert users.min() >= 0 and users.max() < 50 and cands.min() >= 0 and cands.max() < 1000
    assert np.all(np.diff(np.sort(cands, axis=1), axis=1) > 0), "a request's candidates are distinct"
    seen = np.bincount(cands.ravel(), minlength=1000)
    assert seen[:50].mean() > 5 * seen[-500:].mean(), "popular items are drawn more often"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", data[:16]
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


@pytest.mark.integration
def test_bench_rank_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    plot = tmp_path / "rank.png"
    args = parser.parse_args(
        ["--items", "3000", "--users", "300", "--impressions", "6000", "--train-rows", "2000", "--candidates", "100", "--request-pool", "64",
         "--probe-seconds", "0.3", "--min-probe-requests", "10", "--max-probe-seconds", "0.5", "--warmup-requests", "8",
         "--lo-rps", "8", "--hi-rps", "16", "--tolerance", "0.9", "--slo-ms", "500", "--timeout-ms", "1000",
         "--saturation-seconds", "0.4", "--saturation-concurrency", "8",
         "--cost-sizes", "1,100,400", "--cost-repeats", "2", "--keep-rankers", "--workdir", str(tmp_path / "work"), "--plot", str(plot), "--json"]
    )  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert bench.run(args) == 0
    finally:
        torch.set_num_threads(threads)
    r = json.loads(capsys.readouterr().out)
    assert set(r["configs"]) == set(rank_report.CONFIGS)
    for name, k in r["configs"].items():
        assert k["probes"], name
        assert k["rankers"] == rank_report.CONFIGS[name][1]
        for p in k["probes"]:
            assert p["requests"] > 0 and p["ok"] + p["late"] + p["degraded"] + p["shed"] + p["failed"] == p["requests"], p
            assert p["forwards"] > 0 and len(p["requests_by_ranker"]) == k["rankers"]
            assert p["dedup_ratio"] >= 1.0  # the bench candidates repeat across a request's features
        if k["knee_per_s"] is not None:
            assert k["candidates_per_s_at_knee"] == pytest.approx(k["knee_per_s"] * 100)
    unbatched = r["configs"]["unbatched"]
    assert all(p["mean_batch_requests"] == 1.0 for p in unbatched["probes"] + [unbatched["saturation"]]), "batching = false: one request per forward"
    # 8 in flight and at most 2 batches running: the batched ranker must batch the rest.
    assert r["configs"]["batched"]["saturation"]["mean_batch_requests"] > 1.5
    assert min(r["configs"]["batched_2_rankers"]["saturation"]["requests_by_ranker"]) > 0, "two choices used both rankers"
    sat = r["saturation_requests_per_s"]
    assert sat["unbatched"] > 0 and r["saturation_gain"] == pytest.approx(sat["batched"] / sat["unbatched"])
    assert r["knee_batched"] == r["configs"]["batched"]["knee_per_s"] and r["knee_unbatched"] == r["configs"]["unbatched"]["knee_per_s"]
    if r["knee_batched"] and r["knee_unbatched"]:
        assert r["batching_gain"] == pytest.approx(r["knee_batched"] / r["knee_unbatched"])
    if r["knee_batched_2_rankers"] and r["knee_batched"]:
        assert r["scaling_2_rankers"] == pytest.approx(r["knee_batched_2_rankers"] / r["knee_batched"])
    fc = r["forward_cost"]
    assert fc["device"] == "cpu" and fc["per_candidate_us"] > 0
    b = r["mean_batch_requests_at_knee"]
    if b is not None:
        per = fc["per_candidate_us"] * 1e-3 * 100
        assert r["theoretical_batching_cap"] == pytest.approx((max(fc["fixed_ms"], 0) + per) / (max(fc["fixed_ms"], 0) / b + per))
    table = rank_report.format_report(r)
    assert all(label in table for label in rank_report.LABELS.values()) and "batching gain" in table
    assert r["plot"] == str(plot)
    width, height = png_size(plot)
    assert width > 500 and height > 300
