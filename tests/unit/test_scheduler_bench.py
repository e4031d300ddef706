"""``recserve bench scheduler`` in miniature: ``--json`` prints exactly one JSON object
whose figures are present and whose item accounting adds up. The gRPC round trip is
replaced by a fixed figure (unit tests open no servers); everything else is real —
threads, the serving loop, open-loop Poisson arrivals, np.take gathers."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from recserve.bench import scheduler as bench


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
