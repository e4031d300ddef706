"""What the cascade reads from a MODELS export, as memory-mapped arrays.

The cascade is a server package and never imports ``ranker`` (docs/architecture.md §2):
it reads the export's files by their documented layout (``ranker/export.py``'s module
docstring) — the item-tower vectors its L0 index and L1 scores use, the item
categories and log counts behind the popularity source and prior, and the user
histories that define "already seen". Rankers are reached over gRPC only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from recserve.catalog.storage import Csr
from recserve.errors import FailedPrecondition, NotFound

FORMAT = "recserve.models"


@dataclasses.dataclass(frozen=True)
class ExportView:
    """``item_vectors`` [N, d] f32 unit rows (item tower); ``item_category`` [N] int64;
    ``item_impressions`` [N] int64 (train log); ``user_history`` CSR over U users."""

    path: Path
    model_version: str
    manifest: dict[str, Any]
    item_vectors: np.ndarray
    item_category: np.ndarray
    item_impressions: np.ndarray
    user_history: Csr

    @property
    def num_items(self) -> int:
        return int(self.item_category.shape[0])

    @property
    def num_users(self) -> int:
        return self.user_history.num_rows

    def history(self, user_id: int) -> np.ndarray:
        """int64 [H]: the exported history of a user (empty for a new user)."""
        if 0 <= user_id < self.num_users:
            return np.asarray(self.user_history.row(user_id), dtype=np.int64)
        return np.zeros(0, dtype=np.int64)


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise NotFound(f"{path} is missing; export the models with `recserve train --catalog DIR --out {path.parent}`")
    body: dict[str, Any] = json.loads(path.read_text())
    return body


def open_export_view(path: Path | str) -> ExportView:
    """Open MODELS for the cascade (format and index version checked)."""
    root = Path(path)
    manifest = _json(root / "manifest.json")
    if manifest.get("format") != FORMAT:
        raise FailedPrecondition(f"{root / 'manifest.json'} is format {manifest.get('format')!r}, not {FORMAT!r}")
    version = str(manifest["model_version"])
    index_manifest = _json(root / "index" / "manifest.json")
    if index_manifest.get("model_version") != version:
        raise FailedPrecondition(f"{root / 'index'} holds item vectors of model_version {index_manifest.get('model_version')!r}, the export is {version!r}: re-export")

    def load(name: str) -> np.ndarray:
        return np.load(root / "serving" / f"{name}.npy", mmap_mode="r", allow_pickle=False)

    return ExportView(
        path=root,
        model_version=version,
        manifest=manifest,
        item_vectors=np.load(root / "index" / "item_vectors.npy", mmap_mode="r", allow_pickle=False),
        item_category=load("item_category"),
        item_impressions=np.asarray(load("item_counts")[:, 0]),
        user_history=Csr(load("user_history.values"), load("user_history.offsets")),
    )
