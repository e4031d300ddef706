"""One training run end to end: scrubbed view -> train -> evaluate -> export.

What ``recserve train --catalog DIR --out MODELS`` and ``recserve demo`` call. Writes
MODELS (:mod:`ranker.export`), ``MODELS/metrics.json`` (:data:`ranker.evaluate.METRIC_KEYS`
plus training seconds) and ``MODELS/cluster.toml`` (:mod:`ranker.spec`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from ranker.config import TrainConfig
from ranker.evaluate import evaluate
from ranker.export import export_models
from recserve.catalog.storage import ClickLog
from ranker.scrubbed import open_scrubbed, with_impressions
from ranker.spec import cluster_spec_toml
from ranker.train import train_all

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainReport:
    """What a run produced: metrics (METRIC_KEYS), the export manifest, seconds per
    model (``train_total`` = all three) and where everything went."""

    metrics: dict[str, float]
    manifest: dict[str, Any]
    seconds: dict[str, float]
    device: str
    out: Path
    extra_rows: int = 0  # impressions appended to the train split (a serving log)
    extra_dropped: int = 0  # of those, rows outside the tables (new users / items)


def train_and_export(catalog_dir: Path | str, out: Path | str, config: TrainConfig = TrainConfig(), *, num_shards: int = 2,
                     extra_impressions: ClickLog | None = None) -> TrainReport:  # fmt: skip
    """Train all three models on the scrubbed view of ``catalog_dir``, evaluate them
    against its ground truth, export to ``out``. ``extra_impressions`` (a serving log read
    back, labels from its click records) are appended to the train split."""
    out = Path(out)
    view = open_scrubbed(catalog_dir)  # the only thing training gets
    extra_rows = extra_dropped = 0
    if extra_impressions is not None:
        view, extra_dropped = with_impressions(view, extra_impressions)
        extra_rows = len(extra_impressions) - extra_dropped
        log.info("train split: %d catalog rows + %d logged impressions (%d outside the tables dropped)", len(view.train) - extra_rows, extra_rows, extra_dropped)
    torch.manual_seed(config.seed)
    if config.threads:
        torch.set_num_threads(config.threads)
    started = time.perf_counter()
    models = train_all(view, config)
    seconds = {**models.seconds, "train_total": time.perf_counter() - started}
    t0 = time.perf_counter()
    metrics = evaluate(models, catalog_dir, eval_users=config.eval_users, k=config.recall_k, seed=config.seed)  # ground truth read here only
    seconds["evaluate"] = time.perf_counter() - t0
    manifest = export_models(models, view, out)
    body = {**metrics, "model_version": manifest["model_version"], "train_seconds": seconds, "device": str(models.device)}
    (out / "metrics.json").write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    (out / "cluster.toml").write_text(cluster_spec_toml(manifest, out, num_shards=num_shards))
    log.info("trained model_version %s in %.1f s: %s", manifest["model_version"], seconds["train_total"], metrics)
    return TrainReport(metrics=metrics, manifest=manifest, seconds=seconds, device=str(models.device), out=out, extra_rows=extra_rows, extra_dropped=extra_dropped)
