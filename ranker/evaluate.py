"""Honest evaluation: the only ranker module that reads the catalog's ground truth.

On the held-out split, side by side: the AUC of DLRM, of L3, of the ground-truth
click model (the best any model can do on the log) and of a popularity baseline
(train-split impression counts). For ``eval_users`` sampled users: two-tower
recall@K against each user's true top-K (ground-truth logits over the whole catalog,
the user's history items excluded) and the popularity baseline's recall@K.

Keys of :func:`evaluate`'s result (written to ``metrics.json``): :data:`METRIC_KEYS`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from recserve.catalog import load_catalog
from recserve.catalog.storage import Catalog
from ranker.features import ServingArrays, gather_jagged
from ranker.scoring import all_item_vectors, score_pairs, user_vectors
from ranker.train import TrainedModels

METRIC_KEYS: tuple[str, ...] = ("dlrm_auc", "l3_auc", "ground_truth_auc", "popularity_auc", "two_tower_recall_at_100", "popularity_recall_at_100")
USER_CHUNK = 128  # users per [chunk, N] score matrix in the recall pass


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC of ``scores`` [n] for 0/1 ``labels`` [n] (Mann-Whitney, ties counted
    half). NaN when one class is absent."""
    labels = np.asarray(labels).astype(bool)
    n_pos = int(labels.sum())
    n_neg = int(labels.shape[0]) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(np.asarray(scores, dtype=np.float64), return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    average_rank = ends - (counts - 1) / 2.0  # 1-based mean rank of each tie group
    rank_sum = float(average_rank[inverse][labels].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def _mask_history(scores: np.ndarray, arrays: ServingArrays, users: np.ndarray) -> None:
    """Set ``scores[i, h] = -inf`` for every history item h of ``users[i]`` (in place)."""
    values, lengths = gather_jagged(arrays.user_history, users)
    scores[np.repeat(np.arange(len(users)), lengths), values] = -np.inf


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """``[B, k]`` ids of each row's k largest scores (any order)."""
    return np.argpartition(-scores, k - 1, axis=1)[:, :k]


def _overlap(a: np.ndarray, b: np.ndarray, n_items: int) -> np.ndarray:
    """``[B]`` size of each row's intersection of id sets ``a`` [B, k] and ``b`` [B, k]."""
    rows = np.arange(a.shape[0])[:, None]
    hit = np.zeros((a.shape[0], n_items), dtype=bool)
    hit[rows, a] = True
    return np.asarray(hit[rows, b].sum(axis=1))


def recall_at_k(models: TrainedModels, catalog: Catalog, users: np.ndarray, k: int) -> tuple[float, float]:
    """(two-tower recall@k, popularity recall@k) over ``users`` against the ground
    truth's top-k unseen items."""
    arrays = models.arrays
    n = catalog.num_items
    truth = catalog.truth
    item_vecs = np.asarray(catalog.item_vectors, dtype=np.float32)
    # float32 score matrices: [chunk, N] passes dominate evaluation, and top-100 sets
    # do not depend on the last bits.
    pop_term = (truth.popularity_weight * np.log(np.maximum(np.asarray(catalog.item_popularity, dtype=np.float64) * n, 1e-300))).astype(np.float32)
    tt_items = all_item_vectors(models.two_tower, arrays)
    # Score = minus the popularity rank (most impressions first, ties by id), so the
    # baseline is one fixed list rather than argpartition's choice among ties.
    rank = np.empty(n, dtype=np.float32)
    rank[np.lexsort((np.arange(n), -arrays.counts.item[:, 0]))] = np.arange(n, dtype=np.float32)
    popularity = -rank
    tt_hits = pop_hits = 0
    for lo in range(0, len(users), USER_CHUNK):  # chunks of users bound the [chunk, N] matrices
        chunk = users[lo : lo + USER_CHUNK]
        true_scores = np.float32(truth.affinity_weight) * (np.take(np.asarray(catalog.user_vectors), chunk, axis=0) @ item_vecs.T) + pop_term[None, :]
        _mask_history(true_scores, arrays, chunk)
        true_top = _top_k(true_scores, k)
        with torch.no_grad():
            u = user_vectors(models.two_tower, arrays, chunk).float().cpu().numpy()
        tt_scores = u @ tt_items.T
        _mask_history(tt_scores, arrays, chunk)
        pop_scores = np.broadcast_to(popularity, (len(chunk), n)).copy()
        _mask_history(pop_scores, arrays, chunk)
        tt_hits += int(_overlap(true_top, _top_k(tt_scores, k), n).sum())
        pop_hits += int(_overlap(true_top, _top_k(pop_scores, k), n).sum())
    total = k * len(users)
    return tt_hits / total, pop_hits / total


def evaluate(models: TrainedModels, catalog_dir: Path | str, *, eval_users: int = 1000, k: int = 100, seed: int = 0) -> dict[str, float]:
    """All of :data:`METRIC_KEYS` for ``models`` on the catalog at ``catalog_dir``."""
    catalog = load_catalog(catalog_dir)
    test = catalog.test
    users, items, labels = (np.asarray(a) for a in (test.user, test.item, test.label))
    truth_logits = catalog.truth.logits(
        np.take(np.asarray(catalog.user_vectors), users, axis=0), np.take(np.asarray(catalog.item_vectors), items, axis=0), np.take(np.asarray(catalog.item_popularity), items)
    )
    k = min(k, catalog.num_items - 1)
    sample = np.sort(np.random.default_rng(seed).choice(catalog.num_users, size=min(eval_users, catalog.num_users), replace=False))
    tt_recall, pop_recall = recall_at_k(models, catalog, sample, k)
    return {
        "dlrm_auc": auc(score_pairs(models.dlrm, models.arrays, users, items), labels),
        "l3_auc": auc(score_pairs(models.l3, models.arrays, users, items), labels),
        "ground_truth_auc": auc(truth_logits, labels),
        "popularity_auc": auc(np.take(models.arrays.counts.item[:, 0], items).astype(np.float64), labels),
        "two_tower_recall_at_100": tt_recall,
        "popularity_recall_at_100": pop_recall,
    }


def format_metrics(metrics: dict[str, float], seconds: dict[str, float] | None = None) -> str:
    """The metrics as an aligned two-column table (plus training seconds if given)."""
    lines = [f"{'metric':<28} {'value':>8}"]
    lines += [f"{key:<28} {metrics[key]:>8.4f}" for key in METRIC_KEYS if key in metrics]
    for name, s in (seconds or {}).items():
        lines.append(f"{'train_seconds_' + name:<28} {s:>8.1f}")
    return "\n".join(lines)
