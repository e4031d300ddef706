"""Serving-side loading of an export, with the model-version check.

The Ranking service (next issue) opens MODELS with :func:`open_export`, builds each
model's dense part with :func:`load_model` and, before serving, checks every shard
table it reads against the dense weights with :func:`check_table_versions` (the
versions come from the shards' ``ShardInfo`` / ``GetPlan``; :func:`versions_from_shard_info`
reads them). A mismatch is FAILED_PRECONDITION naming both versions: scoring remote rows
of one training run with the dense weights of another gives plausible-looking garbage.

Scoring on looked-up rows: ``DlrmRanker.score_pooled``, ``TwoTower.user_from_pooled``,
``L3Reranker.score_looked_up`` (pooled candidates + unpooled history rows).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recserve.catalog.storage import Csr
from recserve.errors import FailedPrecondition, InvalidArgument, NotFound
from ranker.config import DlrmConfig, L3Config, TwoTowerConfig
from ranker.export import FORMAT, FORMAT_VERSION, MANIFEST, MODELS, SERVING_ARRAYS
from ranker.features import LogCounts, ServingArrays
from ranker.models.dlrm import DlrmRanker
from ranker.models.l3 import L3Reranker
from ranker.models.two_tower import TwoTower
from ranker.scoring import resolve_device, tables_of

Model = DlrmRanker | TwoTower | L3Reranker


@dataclasses.dataclass(frozen=True)
class Export:
    """An opened MODELS directory: its manifest, version and serving arrays."""

    path: Path
    manifest: dict[str, Any]
    model_version: str
    arrays: ServingArrays

    def table_names(self) -> list[str]:
        return sorted(self.manifest["tables"])


def _read_json(path: Path) -> dict[str, Any]:
    try:
        present = path.is_file()
    except OSError as exc:  # a name no filesystem holds (ENAMETOOLONG): Admin.ReloadModels passes the caller's models_dir here
        raise InvalidArgument(f"models_dir {str(path.parent)[:80]!r}{'...' if len(str(path.parent)) > 80 else ''} ({len(str(path.parent)):,} characters) is not a usable path: {exc.strerror}") from exc
    if not present:
        raise NotFound(f"{path} is missing; export the models with `recserve train --catalog DIR --out {path.parent}`")
    try:
        body: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise FailedPrecondition(f"{path} is unreadable ({exc}); re-export the models") from exc
    return body


def open_export(path: Path | str) -> Export:
    """Open MODELS (format checked); serving arrays are memory-mapped."""
    directory = Path(path)
    manifest = _read_json(directory / MANIFEST)
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise FailedPrecondition(
            f"{directory / MANIFEST} is format {manifest.get('format')!r} version {manifest.get('format_version')!r}; this recserve reads {FORMAT!r} version {FORMAT_VERSION}"
        )
    a = {name: np.load(directory / "serving" / f"{name}.npy", mmap_mode="r", allow_pickle=False) for name in SERVING_ARRAYS}
    arrays = ServingArrays(
        item_category=a["item_category"],
        item_tags=Csr(a["item_tags.values"], a["item_tags.offsets"]),
        user_history=Csr(a["user_history.values"], a["user_history.offsets"]),
        counts=LogCounts(item=a["item_counts"], user=a["user_counts"], category=a["category_counts"], total=a["total_counts"]),
    )
    return Export(path=directory, manifest=manifest, model_version=str(manifest["model_version"]), arrays=arrays)


def load_model(export: Export, name: str, *, device: str = "auto", with_tables: bool = False) -> Model:
    """Build model ``name`` (``dlrm``, ``two_tower`` or ``l3``) from its dense checkpoint.

    ``with_tables`` also loads its shard tables from ``embeddings/`` (in-process
    scoring, the oracle); without it those stay zero and scoring goes through the
    looked-up-rows methods. Raises FailedPrecondition when the checkpoint's version is
    not the export's.
    """
    if name not in MODELS:
        raise InvalidArgument(f"model = {name!r} is invalid: use one of {list(MODELS)}")
    meta = _read_json(export.path / "dense" / f"{name}.json")
    if meta.get("model_version") != export.model_version:
        raise FailedPrecondition(
            f"dense checkpoint {export.path / 'dense' / (name + '.pt')} is model_version {meta.get('model_version')!r}; "
            f"the export {export.path} is model_version {export.model_version!r}: re-export the models"
        )
    rows = {k: int(v) for k, v in meta["table_rows"].items()}
    model: Model
    if name == "dlrm":
        model = DlrmRanker(DlrmConfig.from_dict(meta["config"]), rows)
    elif name == "two_tower":
        model = TwoTower(TwoTowerConfig.from_dict(meta["config"]), rows)
    else:
        model = L3Reranker(L3Config.from_dict(meta["config"]), rows)
    state = torch.load(export.path / "dense" / f"{name}.pt", map_location="cpu", weights_only=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    shard = {t for t in tables_of(model) if t in export.manifest["tables"]}
    # The checkpoint holds everything but the shard tables: anything else missing is a
    # truncated or foreign checkpoint.
    shard_ids = {id(w) for t, w in tables_of(model).items() if t in shard}
    not_tables = sorted(k for k, p in model.named_parameters() if k in missing and id(p) not in shard_ids)
    if unexpected or not_tables:
        raise FailedPrecondition(f"dense checkpoint of {name} has unexpected keys {sorted(unexpected)} and lacks {not_tables}; re-export the models")
    with torch.no_grad():
        for table, weight in tables_of(model).items():
            if table in shard:
                if with_tables:
                    # Item tables carry the export's new-item rows past the trained ones.
                    weight.copy_(torch.from_numpy(np.array(np.load(export.path / "embeddings" / f"{table}.npy", mmap_mode="r")[: weight.shape[0]])))
                else:
                    weight.zero_()
    model.eval()
    return model.to(resolve_device(device))


def check_table_versions(dense_version: str, table_versions: Mapping[str, str], tables: Iterable[str]) -> None:
    """Refuse (FailedPrecondition) unless every table in ``tables`` was loaded from
    ``dense_version``. ``table_versions``: table -> the version a shard reports for it
    ('' = loaded from an unversioned source)."""
    for table in sorted(tables):
        got = table_versions.get(table)
        if got is None:
            raise FailedPrecondition(f"no shard reports table {table!r}; the dense weights (model_version {dense_version!r}) need it: load it with `recserve shard load`")
        if got != dense_version:
            raise FailedPrecondition(
                f"shard table {table!r} was loaded from model_version {got or '(none)'!r} but the dense weights are model_version {dense_version!r}: "
                "load the shards from the same export (`recserve shard load --source MODELS`)"
            )


def versions_from_shard_info(responses: Iterable[Any]) -> dict[str, str]:
    """table -> model_version from ``ShardInfoResponse`` messages of every shard.

    Shards disagreeing on one table (a half-finished reload) is itself a mismatch:
    FailedPrecondition naming both versions and the shards.
    """
    seen: dict[str, tuple[str, int]] = {}
    for resp in responses:
        for t in resp.tables:
            prev = seen.get(t.table)
            if prev is not None and prev[0] != t.model_version:
                raise FailedPrecondition(
                    f"shard table {t.table!r} is model_version {prev[0]!r} on shard {prev[1]} but {t.model_version!r} on shard {resp.shard_id}: finish reloading the shards"
                )
            seen[t.table] = (t.model_version, resp.shard_id)
    return {table: v for table, (v, _) in seen.items()}
