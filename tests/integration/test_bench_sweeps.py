"""Open-loop offered-rate sweeps (``--sweep-rates``, ``--plot``): the shared summary and
plot helpers by hand-computed figures, and ``recserve bench lookup`` with a two-rate
sweep at toy scale on real shard processes."""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from recserve.bench import sweep

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", data[:16]
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def test_parse_rates_sorts_and_refuses_bad_lists() -> None:
    assert sweep.parse_rates("500,250, 1e3") == (250.0, 500.0, 1000.0)
    for bad in ("", "0,100", "-5", "abc", "100,inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="--sweep-rates"):
            sweep.parse_rates(bad)


def test_summarise_counts_only_full_answers_within_the_slo() -> None:
    # 5 arrivals over 1 s; 2 got no answer; answers at 10, 20 (degraded) and 100 ms.
    p = sweep.summarise(np.array([0.010, 0.020, 0.100]), np.array([True, False, True]), requests=5, failures=2, arrival_s=1.0, span_s=2.0, slo_ms=50.0)
    assert p["completed"] == 3 and p["degraded"] == 1 and p["failures"] == 2
    assert p["arrived_per_s"] == 5.0 and p["achieved_per_s"] == 1.5
    assert p["goodput_per_s"] == 0.5  # only the 10 ms answer: full and within 50 ms
    assert p["p50_ms"] == pytest.approx(20.0) and p["p99_ms"] == pytest.approx(20.0 + 0.98 * 80.0)
    empty = sweep.summarise(np.array([]), np.array([], dtype=bool), requests=4, failures=4, arrival_s=1.0, span_s=1.0, slo_ms=50.0)
    assert empty["p50_ms"] is None and empty["p99_ms"] is None and empty["goodput_per_s"] == 0.0


def test_table_and_plot_handle_a_point_with_no_answers(tmp_path: Path) -> None:
    ok = sweep.summarise(np.array([0.005, 0.007]), np.array([True, True]), requests=2, failures=0, arrival_s=1.0, span_s=1.0, slo_ms=50.0)
    none = sweep.summarise(np.array([]), np.array([], dtype=bool), requests=2, failures=2, arrival_s=1.0, span_s=1.0, slo_ms=50.0)
    points = [{"offered_per_s": 2.0, "a": ok, "b": none}, {"offered_per_s": 4.0, "a": ok, "b": ok}]
    modes = (("a", "mode A"), ("b", "mode B"))
    table = sweep.format_sweep(points, modes, slo_ms=50.0).splitlines()
    assert len(table) == 2 + 4 and "n/a" in table[3] and "mode B" in table[3]
    sweep.plot_sweep(tmp_path / "s.png", points, modes, title="t", slo_ms=50.0)
    width, height = png_size(tmp_path / "s.png")
    assert width > 500 and height > 300


@pytest.mark.integration
def test_bench_lookup_sweep_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two offered rates, both modes, PNG written; every arrival is accounted for and
    both modes saw the same arrivals at each rate."""
    from recserve.bench import lookup as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    plot = tmp_path / "sweep.png"
    args = parser.parse_args(
        ["--items", "4000", "--dim", "16", "--shards", "2", "--concurrency", "8", "--ids-per-request", "16", "--bags", "4",
         "--seconds", "0.2", "--open-loop-seconds", "0.2", "--rate", "100", "--stream-requests", "3000", "--prebuilt-kjts", "200",
         "--check-requests", "20", "--no-redis", "--workdir", str(tmp_path / "work"), "--json",
         "--sweep-rates", "300,100", "--sweep-seconds", "0.3", "--slo-ms", "500", "--plot", str(plot),
         "--no-knees", "--no-tiered", "--concurrency-high", "0", "--unloaded-seconds", "0.2"]
    )  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert bench.run(args) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(capsys.readouterr().out)
    assert report["p50_ms"] is not None and report["rows_per_s"]["naive"] > 0  # the default run still ran
    points = report["sweep"]
    assert [p["offered_per_s"] for p in points] == [100.0, 300.0]
    for p in points:
        expected = p["offered_per_s"] * 0.3  # Poisson arrivals in the 0.3 s period (seeded)
        assert p["feature_parallel"]["requests"] == p["naive"]["requests"]  # the same arrivals
        for mode in ("feature_parallel", "naive"):
            m: dict[str, Any] = p[mode]
            assert set(sweep.POINT_KEYS) <= set(m), (mode, m)
            assert 0.5 * expected < m["requests"] < 1.5 * expected, (mode, m)
            assert m["completed"] + m["failures"] == m["requests"], (mode, m)
            assert 0 <= m["achieved_per_s"] <= m["arrived_per_s"], (mode, m)
            assert m["goodput_per_s"] <= m["achieved_per_s"], (mode, m)
            assert (m["p50_ms"] is None) == (m["completed"] == 0), (mode, m)
            if m["completed"]:
                assert 0 < m["p50_ms"] <= m["p99_ms"], (mode, m)
    low = points[0]
    for mode in ("feature_parallel", "naive"):  # 100 requests/s is far below either mode's capacity
        m = low[mode]
        assert m["failures"] == 0 and m["completed"] == m["requests"] and m["goodput_per_s"] > 0, (mode, m)
    width, height = png_size(plot)
    assert width > 500 and height > 300
    table = bench.format_report(report)
    assert "open-loop sweep" in table and table.count("feature-parallel") == 2 and table.count("  naive") == 2
