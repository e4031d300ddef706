"""A tiny trained world for Ranking-service tests: catalog, two exports, plan and spec.

``make_ranker_world`` trains the tiny model set twice (seeds 0 and 7: the second is
"another training run", whose dense weights must not be served with the first's shard
tables), plans the first export's tables over 2 shards and writes a cluster spec whose
``[ranker]`` batches generously (``max_wait_ms`` 25) and caps requests at
``MAX_CANDIDATES``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ranker.config import DlrmConfig, L3Config, TrainConfig, TwoTowerConfig
from ranker.export import export_models
from ranker.scrubbed import open_scrubbed
from ranker.serving import Export, open_export
from ranker.spec import cluster_spec_toml, tables_and_features
from ranker.train import train_all
from recserve.config.spec import ShardingConfig
from recserve.sharding import plan_tables
from tests.utils_catalog import make_catalog

TINY = TrainConfig(
    dlrm=DlrmConfig(embedding_dim=8, dense_arch=(16, 8), over_arch=(16, 1)),
    two_tower=TwoTowerConfig(embedding_dim=8, hidden=16, out_dim=8),
    l3=L3Config(embedding_dim=8, history=6, hidden=16),
    device="cpu",
    batch_size=512,
    tt_batch_size=256,
    epochs=1,
    tt_epochs=1,
    max_rows=2048,
    progress=False,
)
MAX_CANDIDATES = 2048  # >= the default cascade.l1_out (2,000) and max_k (1,000): L2 sends that many
RANKER_SECTION = f"""[ranker]
device = "cpu"
threads = 1
max_wait_ms = 25.0
max_candidates = {MAX_CANDIDATES}
max_batch_candidates = 4096
"""


@dataclasses.dataclass(frozen=True)
class RankerWorld:
    root: Path
    export: Export
    models: Path
    other_models: Path
    other_version: str
    plan_path: Path
    spec_path: Path
    max_candidates: int = MAX_CANDIDATES


def spec_text(manifest: dict[str, object], models: Path, extra: str = "") -> str:
    """The export's cluster spec with the test's [ranker] settings, plus ``extra`` TOML
    whose sections replace the generated ones of the same name."""
    text = cluster_spec_toml(manifest, models, num_shards=2)  # type: ignore[arg-type]
    text = text.replace("[ranker]\n", RANKER_SECTION, 1)
    for line in extra.splitlines():
        if line.startswith("[") and not line.startswith("[[") and line in text:
            start = text.index(line + "\n")
            end = text.find("\n\n", start)
            text = text[:start] + text[end + 2 if end >= 0 else len(text) :]
    return text + extra


def make_ranker_world(root: Path) -> RankerWorld:
    make_catalog(root / "catalog", items=5_000, users=400, impressions=8_000, categories=16, tags=64, history_len=12, candidates=128)
    view = open_scrubbed(root / "catalog")
    manifest = export_models(train_all(view, TINY), view, root / "models")
    other = export_models(train_all(view, dataclasses.replace(TINY, seed=7)), view, root / "other")
    tables, _ = tables_and_features(manifest)
    plan = plan_tables(list(tables), None, ShardingConfig(num_shards=2, hot_fraction=0.01, warm_fraction=0.1, hot_replicas=2, column_splits=2)).plan
    plan.save(root / "plan.json")
    (root / "cluster.toml").write_text(spec_text(manifest, root / "models"))
    return RankerWorld(root, open_export(root / "models"), root / "models", root / "other", str(other["model_version"]), root / "plan.json", root / "cluster.toml")


def start_ranker_expecting_failure(spec: Path, models: Path, shards: Sequence[str], workdir: Path, timeout_s: float = 120.0) -> str:
    """Run ``recserve ranker serve`` that must fail at start-up; returns its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "recserve", "ranker", "serve", "--config", str(spec), "--models", str(models), "--shards", ",".join(shards),
         "--port", "0", "--port-file", str(workdir / "port")],
        capture_output=True, text=True, timeout=timeout_s, env=env,
    )  # fmt: skip
    assert proc.returncode != 0, "the ranker started although it must refuse"
    return proc.stdout + proc.stderr
