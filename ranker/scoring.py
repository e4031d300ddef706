"""In-process batch scoring: features -> tensors -> model, a batch at a time.

Used by training (the loss), evaluation (held-out AUC, recall) and the in-process
oracle that remote-lookup scoring is checked against. Every function takes arrays of
pairs and runs whole batches: no Python loop per candidate.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ranker.features import (
    JaggedBatch,
    ServingArrays,
    SparseFeature,
    dense_features,
    item_dense_features,
    sparse_features,
    user_dense_features,
)
from ranker.models.common import to_tensor
from ranker.models.dlrm import DLRM_FEATURES, DlrmRanker
from ranker.models.l3 import L3Reranker
from ranker.models.two_tower import ITEM_TOWER_FEATURES, USER_TOWER_FEATURES, TwoTower

SCORE_BATCH = 8192


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def jagged_tensors(batch: JaggedBatch, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Feature -> (values [L_f] int64, lengths [B] int64) tensors on ``device``."""
    return {k: (to_tensor(v, device), to_tensor(n, device)) for k, v, n in ((k, *batch.feature(k)) for k in batch.keys)}


def dlrm_logits(model: DlrmRanker, arrays: ServingArrays, users: np.ndarray, items: np.ndarray, labels: np.ndarray | None = None) -> torch.Tensor:
    """``[B]`` DLRM logits of the pairs; ``labels`` marks training rows (leave-one-out
    counts, see :mod:`ranker.features`)."""
    device = next(model.parameters()).device
    dense = to_tensor(dense_features(arrays, users, items, labels), device)
    kjt = sparse_features(arrays, DLRM_FEATURES, users, items).kjt().to(device)
    out: torch.Tensor = model(dense, kjt)
    return out


def l3_logits(model: L3Reranker, arrays: ServingArrays, users: np.ndarray, items: np.ndarray, labels: np.ndarray | None = None) -> torch.Tensor:
    """``[B]`` L3 logits of the pairs (see :func:`dlrm_logits`)."""
    device = next(model.parameters()).device
    dense = to_tensor(dense_features(arrays, users, items, labels), device)
    feats: tuple[SparseFeature, ...] = model.pooled_features + model.unpooled_features
    out: torch.Tensor = model(jagged_tensors(sparse_features(arrays, feats, users, items), device), dense)
    return out


def user_vectors(model: TwoTower, arrays: ServingArrays, users: np.ndarray) -> torch.Tensor:
    """``[B, out_dim]`` user-tower vectors of ``users`` [B]."""
    device = next(model.parameters()).device
    jag = jagged_tensors(sparse_features(arrays, USER_TOWER_FEATURES, users, users), device)
    return model.user_from_pooled(model.pool(jag, USER_TOWER_FEATURES), to_tensor(user_dense_features(arrays, users), device))


def item_vectors(model: TwoTower, arrays: ServingArrays, items: np.ndarray) -> torch.Tensor:
    """``[B, out_dim]`` item-tower vectors of ``items`` [B]."""
    device = next(model.parameters()).device
    jag = jagged_tensors(sparse_features(arrays, ITEM_TOWER_FEATURES, items, items), device)
    return model.item_vectors(jag, to_tensor(item_dense_features(arrays, items), device))


@torch.no_grad()
def all_item_vectors(model: TwoTower, arrays: ServingArrays, batch: int = 65_536) -> np.ndarray:
    """``[N, out_dim]`` float32 item-tower vectors of the whole catalog (the offline
    pass whose output the FAISS index holds)."""
    model.eval()
    n = arrays.num_items
    parts = [item_vectors(model, arrays, np.arange(lo, min(n, lo + batch), dtype=np.int64)).cpu().numpy() for lo in range(0, n, batch)]
    return np.concatenate(parts).astype(np.float32)


@torch.no_grad()
def score_pairs(model: DlrmRanker | L3Reranker, arrays: ServingArrays, users: np.ndarray, items: np.ndarray, batch: int = SCORE_BATCH) -> np.ndarray:
    """``[n]`` float32 logits of DLRM or L3 for n pairs, ``batch`` pairs per forward."""
    model.eval()
    fn = dlrm_logits if isinstance(model, DlrmRanker) else l3_logits
    parts = [fn(model, arrays, users[lo : lo + batch], items[lo : lo + batch]).float().cpu().numpy() for lo in range(0, len(users), batch)]  # type: ignore[arg-type]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def tables_of(model: DlrmRanker | TwoTower | L3Reranker) -> Mapping[str, torch.Tensor]:
    """Table name -> ``[rows, D]`` weight of any of the three models."""
    if isinstance(model, DlrmRanker):
        return model.table_weights()
    return dict(model.tables.items())
