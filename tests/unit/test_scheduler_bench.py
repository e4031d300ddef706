"""``recserve bench scheduler`` in miniature: ``--json`` prints exactly one JSON object
whose figures are present and whose item accounting adds up, with and without an
offered-rate sweep (``--sweep-rates``, ``--plot``). The gRPC round trip is
replaced by a fixed figure (unit tests open no servers); everything else is real —
threads, the serving loop, open-loop Poisson arrivals, np.take gathers."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from recserve.bench import scheduler as bench
from recserve.bench.sweep import POINT_KEYS


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_json_mode_prints_one_object_with_every_figure(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    async def fake_rtt_s(calls: int = 300) -> float:
        return 0.0005

    monkeypatch.setattr(bench, "measure_grpc_rtt_s", fake_rtt_s)
    args = parse("--json", "--rate", "1000", "--duration-s", "0.2", "--table-rows", "4096", "--core-items", "2048",
                 "--loop-items", "256", "--deadline-ms", "200")
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out)  # raises if there is anything but one JSON document
    assert isinstance(result, dict) and out.count("\n") == 1
    for key in ("core_us_per_item", "core_us_per_item_dynamic_slo", "reject_us_per_item", "loop_us_per_item",
                "batched_items_per_s", "unbatched_items_per_s", "batched_over_unbatched", "gather_rows_per_s"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["grpc_loopback_rtt_ms"] == pytest.approx(0.5)
    assert result["arrivals"] == "open-loop Poisson" and result["arrival_rate_per_s"] == 1000
    for name in ("batched", "unbatched"):
        c = result[name]
        accounted = c["completed"] + c["dropped_deadline"] + c["late_at_submit"] + c["rejected"] + c["failed"]
        assert c["offered"] == 200 and accounted == c["offered"], (name, c)
    assert result["unbatched"]["mean_batch_items"] == 1.0  # max batch 1


def test_bad_flags_are_refused_naming_flag_and_value() -> None:
    with pytest.raises(SystemExit, match="--rate = 0.0"):
        bench.run(parse("--rate", "0"))
    with pytest.raises(SystemExit, match="--window-ms = -1.0"):
        bench.run(parse("--window-ms", "-1"))


def test_nan_figures_become_null_in_json() -> None:
    assert bench._json_safe({"a": math.nan, "b": {"c": 1.5, "d": math.inf}}) == {"a": None, "b": {"c": 1.5, "d": None}}


def test_sweep_runs_both_contenders_per_rate_and_plots(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    async def fake_rtt_s(calls: int = 300) -> float:
        return 0.0005

    monkeypatch.setattr(bench, "measure_grpc_rtt_s", fake_rtt_s)
    plot = tmp_path / "sched.png"
    args = parse("--json", "--rate", "1000", "--duration-s", "0.1", "--table-rows", "4096", "--core-items", "2048",
                 "--loop-items", "256", "--deadline-ms", "200", "--sweep-rates", "2000,500", "--sweep-seconds", "0.2",
                 "--plot", str(plot))
    assert bench.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["batched"]["offered"] == 100  # the main run is unchanged by the sweep
    points = result["sweep"]
    assert [p["offered_per_s"] for p in points] == [500.0, 2000.0]
    for p in points:
        for name in ("batched", "unbatched"):
            c = p[name]
            assert set(POINT_KEYS) <= set(c), (name, c)
            assert c["requests"] == int(p["offered_per_s"] * 0.2), (name, c)  # rate x sweep seconds arrivals
            assert c["completed"] + c["failures"] == c["requests"], (name, c)
            assert 0 < c["achieved_per_s"] <= c["arrived_per_s"], (name, c)
            assert c["goodput_per_s"] <= c["achieved_per_s"], (name, c)
            assert 0 < c["p50_ms"] <= c["p99_ms"], (name, c)
        assert p["unbatched"]["mean_batch_items"] == 1.0 and p["batched"]["mean_batch_items"] >= 1.0
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) > 10_000
    bench._print_table(result)  # the human form of the same run: one sweep row per rate and contender
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("open-loop sweep"))
    assert [row.split()[0] for row in lines[start + 2:]] == ["500", "500", "2,000", "2,000"]


def test_plot_needs_sweep_rates() -> None:
    with pytest.raises(SystemExit, match="--plot needs --sweep-rates"):
        bench.run(parse("--plot", "x.png"))
