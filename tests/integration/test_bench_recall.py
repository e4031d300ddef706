"""``recserve bench recall`` end to end on a tiny world: real shards, rankers and cascade
on loopback, the in-process oracles, the JSON report.

The configuration makes the oracles checkable from outside the cascade: L0 and L1 keep
the whole catalog (``l0_out = l1_out = N``), so L2 ranks every unseen item and its top-10
must be exhaustive DLRM's top-10 (``ExhaustiveDlrm``, which also checks itself against
``score_pairs``), and the final top-10 must be the L3 reference over exhaustive DLRM's
top-100. The L0 index is ``IVF16,Flat``: at nprobe = 16 it scans every list, so its
recall against ``IndexFlatIP`` is exactly 1, and less at nprobe = 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from ranker.export import export_models
from ranker.scrubbed import open_scrubbed
from ranker.train import train_all
from recserve.bench import recall
from tests.integration.ranker_world import TINY
from tests.utils_catalog import make_catalog

ITEMS = 1_500


def test_bench_recall_json_report_agrees_with_its_oracles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_catalog(tmp_path / "catalog", items=ITEMS, users=200, impressions=6_000, categories=16, tags=64, history_len=12, candidates=128)
    view = open_scrubbed(tmp_path / "catalog")
    export_models(train_all(view, TINY), view, tmp_path / "models")
    parser = argparse.ArgumentParser()
    recall.add_arguments(parser)
    args = parser.parse_args([
        "--models", str(tmp_path / "models"), "--catalog", str(tmp_path / "catalog"), "--out", str(tmp_path / "out"), "--json",
        "--queries", "8", "--warmup", "2", "--deadline-ms", "5000", "--knobs", "1,16", "--set", "topology.rankers=1",
        "--set", 'index_factory="IVF16,Flat"', "--set", f"l0_out={ITEMS}", "--set", f"l1_out={ITEMS}",
    ])  # fmt: skip
    assert recall.run(args) == 0
    report = json.loads(capsys.readouterr().out)

    assert report["config"]["stage_sizes"] == [ITEMS, ITEMS, 100, 10] and report["config"]["rankers"] == 1
    assert report["exhaustive_check_max_abs_diff"] < 1e-4
    # Every stage ran in full (a generous deadline), served and in-process alike.
    assert report["degraded_responses"] == 0 and report["failed_responses"] == 0, report["degraded_reasons"]
    assert report["served_vs_inprocess_overlap"] >= 0.9
    assert report["served_l3_vs_reference"] >= 0.9  # the in-process L3 reference is what the rankers compute
    # L2 ranked the whole unseen catalog: its top-10 is exhaustive DLRM's (shard rows vs
    # in-process rows may flip a near tie, no more).
    assert report["l2_recall_vs_exhaustive"] >= 0.9, report["lost_at"]
    assert report["final_recall_vs_reference"] >= 0.9, report["lost_at"]
    # Each stage keeps a subset of the previous one's output.
    rec = report["stage_recall"]
    assert rec["L0"] >= rec["L1"] >= rec["L2"] >= rec["L3"]
    assert rec["L0"] == pytest.approx(1.0)  # L0 holds every unseen item, the truth's top-10 included
    sweep = {p["value"]: p for p in report["sweep"] if p["knob"] == "nprobe"}
    assert sweep[16]["recall"] == pytest.approx(1.0) and sweep[16]["default"]
    assert sweep[1]["recall"] < sweep[16]["recall"]
    assert report["l0_recall_vs_exact"] == pytest.approx(1.0)
    assert report["cascade_ms_p50"] > 0 and report["speedup"] == pytest.approx(report["exhaustive_l2_ms_p50"] / report["cascade_ms_p50"])
    assert Path(report["plot"]).stat().st_size > 0
    assert json.loads((tmp_path / "out" / "recall.json").read_text())["goals"] == report["goals"]
