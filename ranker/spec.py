"""The cluster spec of an export: tables sized to the catalog, the online features and
the models directory, as TOML that :func:`recserve.config.loads` parses as is.

``recserve train`` writes it to ``MODELS/cluster.toml``; ``recserve serve`` and the
benchmarks can use it unchanged. Sharding, lookup and cascade sections keep the
embedded default's values (only sizes and names come from the export).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from recserve.config import loads
from recserve.config.spec import FeatureConfig, TableConfig


def tables_and_features(manifest: dict[str, Any]) -> tuple[tuple[TableConfig, ...], tuple[FeatureConfig, ...]]:
    """Shard tables and online features of an export manifest, as config objects."""
    tables = tuple(TableConfig(name=n, rows=int(t["rows"]), dim=int(t["dim"]), pooling=str(t["pooling"])) for n, t in sorted(manifest["tables"].items()))
    features = tuple(FeatureConfig(name=str(f["name"]), table=str(f["table"])) for f in manifest["features"])
    return tables, features


def access_frequencies(manifest: dict[str, Any], item_impressions: Any) -> dict[str, np.ndarray]:
    """table -> float [rows] access frequency of every item-keyed table, for the planner:
    the training log's impressions + 1 (what a real system knows of popularity), and 1
    for the rows reserved for items added later (``new_item_rows``)."""
    counts = np.asarray(item_impressions, dtype=np.float64) + 1.0
    spare = np.ones(int(manifest.get("new_item_rows", 0)), dtype=np.float64)
    freq = np.concatenate((counts, spare))
    return {t: freq for t in manifest.get("item_tables", []) if int(manifest["tables"][t]["rows"]) == freq.shape[0]}


def cluster_spec_toml(manifest: dict[str, Any], models_dir: Path | str, *, num_shards: int = 2) -> str:
    """TOML text of the cluster spec for an export (validated by parsing it back)."""
    tables, features = tables_and_features(manifest)
    lines = [f"# Cluster spec written by `recserve train` for model_version {manifest['model_version']}.", ""]
    for t in tables:
        lines += ["[[tables]]", f'name = "{t.name}"', f"rows = {t.rows}", f"dim = {t.dim}", f'pooling = "{t.pooling}"', ""]
    for f in features:
        lines += ["[[features]]", f'name = "{f.name}"', f'table = "{f.table}"', ""]
    lines += [
        "[sharding]",
        f"num_shards = {num_shards}",
        "hot_fraction = 0.01",
        "warm_fraction = 0.10",
        "hot_replicas = 2",
        "",
        "[lookup]",
        "# window_ms: LookupConfig's default (0: an idle client does not wait for company)",
        "",
        "[ranker]",
        'models = ["dlrm", "two_tower", "l3"]',
        f"models_dir = {_toml_string(str(Path(models_dir).resolve()))}",
        "",
        "[cascade]",
        "default_deadline_ms = 100.0",
        "",
        "[[tenants]]",
        'name = "default"',
        "",
    ]
    text = "\n".join(lines)
    loads(text)  # a spec we cannot read back is a bug here, not at `recserve serve`
    return text


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
