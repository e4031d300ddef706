"""Export of trained models into a MODELS directory, under one ``model_version``.

Layout (every ``.npy`` plain, memory-mappable)::

    MODELS/manifest.json            format, model_version, catalog sizes, tables, features
    MODELS/embeddings/<table>.npy   [rows, D] f32 shard tables, model-prefixed (dlrm_item…);
                                    item-keyed ones carry NEW_ITEM_ROWS zero rows past the catalog;
                                    `recserve shard load --source MODELS` reads this folder
    MODELS/embeddings/manifest.json model_version + tables (what each shard records)
    MODELS/dense/<model>.pt         state dict of everything but the shard tables
    MODELS/dense/<model>.json       model config, table rows, model_version
    MODELS/index/item_vectors.npy   [N, d] f32 unit item-tower vectors (the FAISS index)
    MODELS/index/manifest.json      model_version, rows, dim, metric
    MODELS/serving/*.npy            item categories, item tags, user histories, log counts
    MODELS/metrics.json, MODELS/cluster.toml  (written by ``recserve train``)

``model_version`` is a hash of every exported weight, so it is the same for a rerun with
the same seed and different for anything else; serving refuses shard tables whose
recorded version differs from its dense weights' (:mod:`ranker.serving`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ranker.features import DENSE_FEATURES, ServingArrays, Source, SparseFeature
from ranker.models.dlrm import DLRM_FEATURES, DlrmRanker
from ranker.models.l3 import L3Reranker
from ranker.models.two_tower import USER_TOWER_FEATURES, TwoTower
from ranker.scoring import all_item_vectors, tables_of
from ranker.scrubbed import ScrubbedCatalog
from ranker.train import TrainedModels

FORMAT = "recserve.models"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODELS = ("dlrm", "two_tower", "l3")
# Tables that only the offline item tower reads stay in its dense checkpoint.
OFFLINE_TABLES = frozenset({"tt_tag"})
# Rows beyond the catalog in every item-keyed shard table (zeros until Admin.AddItems
# upserts a new item's rows): items added after training get the next ids without
# re-planning the shards. ``manifest["new_item_rows"]`` says how many.
NEW_ITEM_ROWS = 1024
SERVING_ARRAYS = (
    "item_category",
    "item_tags.values",
    "item_tags.offsets",
    "user_history.values",
    "user_history.offsets",
    "item_counts",
    "user_counts",
    "category_counts",
    "total_counts",
)


def online_features(models: TrainedModels) -> tuple[SparseFeature, ...]:
    """Every feature a serving ranker looks up remotely, over the shard tables."""
    return DLRM_FEATURES + USER_TOWER_FEATURES + models.l3.pooled_features + models.l3.unpooled_features


def _modules(models: TrainedModels) -> dict[str, DlrmRanker | TwoTower | L3Reranker]:
    return {"dlrm": models.dlrm, "two_tower": models.two_tower, "l3": models.l3}


def item_tables(models: TrainedModels) -> frozenset[str]:
    """Shard tables keyed by item id: looked up by a candidate item or a history item
    (a new item can be either once it is added)."""
    return frozenset(f.table for f in online_features(models) if f.source in (Source.CANDIDATE_ITEM, Source.HISTORY_ITEMS))


def _shard_tables(models: TrainedModels, new_item_rows: int) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    items = item_tables(models)
    for module in _modules(models).values():
        for name, w in tables_of(module).items():
            if name not in OFFLINE_TABLES:
                rows = w.detach().float().cpu().numpy()
                if name in items and new_item_rows:
                    rows = np.concatenate((rows, np.zeros((new_item_rows, rows.shape[1]), np.float32)))
                out[name] = rows
    return out


def _dense_state(module: DlrmRanker | TwoTower | L3Reranker) -> dict[str, torch.Tensor]:
    """The module's state dict minus its shard tables (those live in the shards)."""
    shard_params = {id(w) for t, w in tables_of(module).items() if t not in OFFLINE_TABLES}
    params = dict(module.named_parameters())
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if not (k in params and id(params[k]) in shard_params)}


def compute_model_version(models: TrainedModels) -> str:
    """``m-<12 hex>``: sha256 over every exported weight in a fixed order."""
    h = hashlib.sha256()
    for name, module in _modules(models).items():
        for key, value in sorted(module.state_dict().items()):
            h.update(f"{name}.{key}:{list(value.shape)};".encode())
            h.update(value.detach().float().cpu().contiguous().numpy().tobytes())
    return "m-" + h.hexdigest()[:12]


def _save(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)
    os.replace(tmp, path)


def _write_json(path: Path, body: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def serving_array_dict(arrays: ServingArrays) -> dict[str, np.ndarray]:
    c = arrays.counts
    return {
        "item_category": arrays.item_category,
        "item_tags.values": arrays.item_tags.values,
        "item_tags.offsets": arrays.item_tags.offsets,
        "user_history.values": arrays.user_history.values,
        "user_history.offsets": arrays.user_history.offsets,
        "item_counts": c.item,
        "user_counts": c.user,
        "category_counts": c.category,
        "total_counts": c.total,
    }


def export_models(models: TrainedModels, catalog: ScrubbedCatalog, out: Path | str, *, new_item_rows: int = NEW_ITEM_ROWS) -> dict[str, Any]:
    """Write ``models`` to ``out`` (see the module docstring); returns the manifest.

    The top-level manifest is written last: a directory without one is an unfinished
    export (an old one is removed first, so a crash never leaves it vouching for a mix).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # Every manifest that vouches for a version goes first, not only the top-level one:
    # `recserve shard load` reads `embeddings/manifest.json` alone, and an old one left
    # beside half-rewritten tables would stamp new rows with the old version.
    for manifest_path in (out / MANIFEST, out / "embeddings" / MANIFEST, out / "index" / MANIFEST):
        manifest_path.unlink(missing_ok=True)
    version = compute_model_version(models)
    tables = _shard_tables(models, new_item_rows)
    for name, w in tables.items():
        _save(out / "embeddings" / f"{name}.npy", w)
    table_specs = {name: {"file": f"{name}.npy", "rows": int(w.shape[0]), "dim": int(w.shape[1]), "pooling": "mean"} for name, w in sorted(tables.items())}
    _write_json(out / "embeddings" / MANIFEST, {"format": "recserve.embeddings", "model_version": version, "tables": table_specs})
    for name, module in _modules(models).items():
        (out / "dense").mkdir(exist_ok=True)
        torch.save(_dense_state(module), out / "dense" / f"{name}.pt")
        _write_json(
            out / "dense" / f"{name}.json",
            {"model": name, "model_version": version, "config": dataclasses.asdict(module.config), "table_rows": module.table_rows, "dense_features": list(DENSE_FEATURES)},
        )
    vectors = all_item_vectors(models.two_tower, models.arrays)
    _save(out / "index" / "item_vectors.npy", vectors)
    _write_json(out / "index" / MANIFEST, {"model_version": version, "rows": int(vectors.shape[0]), "dim": int(vectors.shape[1]), "metric": "inner_product", "normalized": True})
    for name, array in serving_array_dict(models.arrays).items():
        _save(out / "serving" / f"{name}.npy", array)
    features = [{"name": f.name, "table": f.table, "source": f.source.value, "last": f.last} for f in online_features(models)]
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model_version": version,
        "catalog": {"items": catalog.num_items, "users": catalog.num_users, "categories": catalog.num_categories, "tags": catalog.num_tags, "fingerprint": catalog.fingerprint()},
        "models": list(MODELS),
        "new_item_rows": new_item_rows,
        "item_tables": sorted(item_tables(models)),
        "tables": table_specs,
        "features": features,
        "train_seconds": models.seconds,
        "train_losses": models.losses,
    }
    _write_json(out / MANIFEST, manifest)
    return manifest
