"""``recserve train`` as a user runs it: train, evaluate, export, write the spec."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ranker.evaluate import METRIC_KEYS
from ranker.export import NEW_ITEM_ROWS
from recserve.config import load
from tests.utils_catalog import make_catalog

ROOT = Path(__file__).resolve().parents[2]


def test_train_writes_metrics_export_and_a_spec_sized_to_the_catalog(tmp_path: Path) -> None:
    make_catalog(tmp_path / "catalog", items=5_000, users=400, impressions=10_000, categories=16, tags=64, history_len=12, candidates=128)
    cmd = [sys.executable, "-m", "recserve", "train", "--catalog", str(tmp_path / "catalog"), "--out", str(tmp_path / "models"), "--device", "cpu", "--no-progress", "--json"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    metrics = json.loads((tmp_path / "models" / "metrics.json").read_text())
    assert set(METRIC_KEYS) <= set(metrics) and metrics["model_version"] == doc["model_version"]
    assert all(0.0 <= metrics[k] <= 1.0 for k in METRIC_KEYS)
    # The ground truth scores the log it generated: well above chance, unlike a broken join.
    assert metrics["ground_truth_auc"] > 0.7
    spec = load(tmp_path / "models" / "cluster.toml")
    rows = {t.name: t.rows for t in spec.tables}
    # Item-keyed tables hold the catalog plus the rows reserved for items added later.
    assert rows["dlrm_item"] == rows["tt_item"] == rows["l3_item"] == 5_000 + NEW_ITEM_ROWS and rows["dlrm_user"] == 400 and rows["dlrm_category"] == 16 and rows["dlrm_tag"] == 64
    assert "item" not in rows and spec.ranker.models_dir == str((tmp_path / "models").resolve())
    assert {f.name for f in spec.features} >= {"dlrm_history_items", "tt_history_items", "l3_history_items"}
    assert (tmp_path / "models" / "embeddings" / "dlrm_item.npy").is_file() and (tmp_path / "models" / "index" / "item_vectors.npy").is_file()


def test_train_without_a_catalog_is_a_clear_error(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "recserve", "train", "--out", str(tmp_path / "m")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--catalog" in out.stderr
