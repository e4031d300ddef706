"""The oracles of ``recserve bench recall``: what the cascade's stages are judged against.

* :func:`truth_top_k`: each user's ground-truth top-k unseen items under the catalog's
  click model (``affinity_weight · <u, v> + popularity_weight · log(N · pop)``, the same
  logits ``ranker.evaluate.recall_at_k`` ranks by), history items excluded. Only this
  module and ``ranker.evaluate`` read the catalog's ground truth.
* :class:`ExhaustiveDlrm`: DLRM over the whole catalog for one user, in process, the
  fastest honest way: every item-side input (the candidate's item, category and tag
  rows, its dense counts) is computed once for all N items; per user only the user-side
  rows (user id, pooled history items and categories, a ``[C, D]`` block of crossed
  category rows, ``[C]`` history-category shares) are built, then gathered by the
  items' categories, and DLRM's dense, interaction and over arch run on ``[N, ·]``
  blocks (``DlrmRanker.score_pooled``). Mean pooling makes the pooled rows exactly what
  the model's EmbeddingBagCollection computes; :meth:`ExhaustiveDlrm.check` measures the
  difference against ``ranker.scoring.score_pairs``.
* :func:`rerank_l3`: the in-process L3 over given candidates (the reference of the final
  stage: L3 over exhaustive DLRM's top-100).
* :func:`overlap_fraction`: ``|a ∩ b| / |b|`` per row of two id matrices.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ranker.features import ServingArrays, dense_features, gather_jagged, history_category_log_share
from ranker.models.dlrm import DlrmRanker
from ranker.models.l3 import L3Reranker
from ranker.scoring import score_pairs
from recserve.catalog.storage import Catalog

USER_CHUNK = 64  # users per [chunk, N] ground-truth score block
# Items per score_pooled call: blocks that stay in cache. On 200k items, 1 thread: 187 ms
# per user at 2,048, 200 ms at 4,096, 357 ms at 65,536, 501 ms at 262,144.
SCORE_CHUNK = 2_048


def mask_seen(scores: np.ndarray, arrays: ServingArrays, users: np.ndarray) -> None:
    """``scores[i, h] = -inf`` for every exported history item h of ``users[i]`` (in place;
    ``scores`` ``[B, N]``)."""
    values, lengths = gather_jagged(arrays.user_history, users)
    scores[np.repeat(np.arange(users.shape[0]), lengths), values] = -np.inf


def top_k_sorted(scores: np.ndarray, k: int) -> np.ndarray:
    """``[B, k]`` int64 ids of each row's k largest ``scores`` ``[B, N]``, best first."""
    k = min(k, scores.shape[1])
    part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, part, axis=1), axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1).astype(np.int64)


def truth_top_k(catalog: Catalog, arrays: ServingArrays, users: np.ndarray, k: int) -> np.ndarray:
    """``[B, k]`` int64: each user's ground-truth top-k items, history excluded, best first."""
    truth = catalog.truth
    n = catalog.num_items
    items = np.asarray(catalog.item_vectors, dtype=np.float32)
    pop = (truth.popularity_weight * np.log(np.maximum(np.asarray(catalog.item_popularity, dtype=np.float64) * n, 1e-300))).astype(np.float32)
    out = np.empty((users.shape[0], min(k, n)), dtype=np.int64)
    for lo in range(0, users.shape[0], USER_CHUNK):  # chunks of users bound the [chunk, N] block
        chunk = users[lo : lo + USER_CHUNK]
        scores = np.float32(truth.affinity_weight) * (np.take(np.asarray(catalog.user_vectors), chunk, axis=0) @ items.T) + pop[None, :]
        mask_seen(scores, arrays, chunk)
        out[lo : lo + chunk.shape[0]] = top_k_sorted(scores, k)
    return out


def contains(found: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """``[B, k]`` bool: whether ``wanted[b, j]`` (ids >= 0) occurs in row b of ``found``
    ``[B, m]`` (-1 entries of ``found`` never match). Rows are keyed apart
    (``b · (max id + 2) + id``) so one sort-based ``np.isin`` answers every row: no
    ``[B, m, k]`` comparison block (10,000 × 10,000 × B at 1M items)."""
    b = found.shape[0]
    if found.size == 0 or wanted.size == 0:
        return np.zeros(wanted.shape, dtype=bool)
    stride = int(max(found.max(), wanted.max())) + 2
    rows = np.arange(b, dtype=np.int64)[:, None] * stride
    keys = np.where(found >= 0, found.astype(np.int64) + rows, -1)
    return np.isin(wanted.astype(np.int64) + rows, keys).reshape(wanted.shape)


def overlap_fraction(found: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """``[B]`` float: the fraction of each row of ``wanted`` ``[B, k]`` that occurs in the
    same row of ``found`` ``[B, m]`` (see :func:`contains`)."""
    return np.asarray(contains(found, wanted).mean(axis=1), dtype=np.float64)


class ExhaustiveDlrm:
    """DLRM over every item for one user at a time (see the module docstring).

    ``model``: an in-process :class:`DlrmRanker` with its tables loaded
    (``ranker.serving.load_model(..., with_tables=True)``); ``arrays``: the export's
    serving arrays. Building precomputes the item side (``[N, D]`` rows of the item,
    category and tag tables, ``[N, 3]`` item dense columns) once.
    """

    def __init__(self, model: DlrmRanker, arrays: ServingArrays) -> None:
        self.model = model.eval()
        self.arrays = arrays
        w = {k: v.detach().float().cpu() for k, v in model.table_weights().items()}
        self._w = w
        n = arrays.num_items
        self.num_items = n
        self.num_categories = arrays.num_categories
        self._item_cat = np.array(arrays.item_category, dtype=np.int64)  # a writable copy: torch.from_numpy shares it
        cat_t = torch.from_numpy(self._item_cat)
        tag_values, tag_lengths = gather_jagged(arrays.item_tags, np.arange(n, dtype=np.int64))
        tag_offsets = torch.from_numpy(np.concatenate(([0], np.cumsum(tag_lengths)[:-1])).astype(np.int64))
        self._item_side = {
            "dlrm_candidate_item": w["dlrm_item"],
            "dlrm_candidate_category": w["dlrm_category"].index_select(0, cat_t),
            # Mean over each item's tags; an item without tags pools to zeros, as EmbeddingBag does.
            "dlrm_candidate_tags": torch.nn.functional.embedding_bag(torch.from_numpy(tag_values), w["dlrm_tag"], tag_offsets, mode="mean"),
        }
        self._cat_t = cat_t
        # Item columns of the dense row (0, 1: item counts; 5: its category's counts) do not
        # depend on the user: computed once with a placeholder user 0.
        self._item_dense = torch.from_numpy(dense_features(arrays, np.zeros(n, np.int64), np.arange(n, dtype=np.int64)))
        # One representative item per category, for the per-user category share column.
        cats, first = np.unique(self._item_cat, return_index=True)
        self._rep_cats, self._rep_items = cats.astype(np.int64), first.astype(np.int64)

    @torch.no_grad()
    def scores(self, user: int) -> np.ndarray:
        """``[N]`` float32 DLRM logits of ``user`` against every item (history not masked)."""
        a, w, c = self.arrays, self._w, self.num_categories
        u = np.array([user], dtype=np.int64)
        hist, _ = gather_jagged(a.user_history, u)
        hist_t = torch.from_numpy(hist)
        hist_cats = torch.from_numpy(np.take(self._item_cat, hist))
        d = w["dlrm_item"].shape[1]

        def mean_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return table.index_select(0, ids).mean(0, keepdim=True) if ids.numel() else torch.zeros(1, d)

        user_side = {
            "dlrm_user_id": w["dlrm_user"][user : user + 1],
            "dlrm_history_items": mean_rows(w["dlrm_item"], hist_t),
            "dlrm_history_categories": mean_rows(w["dlrm_category"], hist_cats),
        }
        # Crossed bag: mean over history items h of row c_h · C + c_cand, for every c_cand.
        cross = w["dlrm_category_cross"].view(c, c, d)
        cross_by_cat = cross.index_select(0, hist_cats).mean(0) if hist.size else torch.zeros(c, d)  # [C, D]
        share = np.zeros(c, dtype=np.float32)
        share[self._rep_cats] = history_category_log_share(a, np.full(self._rep_items.shape[0], user, np.int64), self._rep_items)
        user_dense = dense_features(a, u, np.zeros(1, np.int64))[0]
        out = np.empty(self.num_items, dtype=np.float32)
        for lo in range(0, self.num_items, SCORE_CHUNK):  # a few chunks of items, not a loop per item
            hi = min(self.num_items, lo + SCORE_CHUNK)
            cat = self._cat_t[lo:hi]
            dense = self._item_dense[lo:hi].clone()
            dense[:, 2:5] = torch.from_numpy(user_dense[2:5])
            dense[:, 6] = torch.from_numpy(share).index_select(0, cat)
            pooled = {name: rows[lo:hi] for name, rows in self._item_side.items()}
            pooled.update({name: row.expand(hi - lo, d) for name, row in user_side.items()})
            pooled["dlrm_category_cross"] = cross_by_cat.index_select(0, cat)
            out[lo:hi] = self.model.score_pooled(dense, pooled).float().numpy()
        return out

    def top_k(self, users: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(``[B, k]`` int64 each user's DLRM top-k unseen items, best first; ``[B]`` float
        seconds per user: scoring all N, masking the history, selecting the top k)."""
        ids = np.empty((users.shape[0], min(k, self.num_items)), dtype=np.int64)
        seconds = np.empty(users.shape[0])
        for i, user in enumerate(users.tolist()):  # per benchmark user: each is one timed request
            t0 = time.perf_counter()
            s = self.scores(int(user))[None, :]
            mask_seen(s, self.arrays, np.array([user], dtype=np.int64))
            ids[i] = top_k_sorted(s, k)[0]
            seconds[i] = time.perf_counter() - t0
        return ids, seconds

    def check(self, users: np.ndarray, items_per_user: int = 64, seed: int = 0) -> float:
        """Max |exhaustive - ``score_pairs``| over ``items_per_user`` random items of each
        of ``users`` (float32 rounding only: ~1e-5)."""
        rng = np.random.default_rng(seed)
        worst = 0.0
        for user in users.tolist():  # a handful of users, once
            items = rng.choice(self.num_items, size=min(items_per_user, self.num_items), replace=False).astype(np.int64)
            ref = score_pairs(self.model, self.arrays, np.full(items.shape[0], user, np.int64), items)
            worst = max(worst, float(np.abs(self.scores(int(user))[items] - ref).max()))
        return worst


def rerank_l3(model: L3Reranker, arrays: ServingArrays, users: np.ndarray, candidates: np.ndarray, k: int) -> np.ndarray:
    """``[B, k]`` int64: the top k of each row of ``candidates`` ``[B, M]`` by the
    in-process L3, best first (one batched pass over all B·M pairs)."""
    b, m = candidates.shape
    logits = score_pairs(model, arrays, np.repeat(users.astype(np.int64), m), candidates.reshape(-1)).reshape(b, m)
    order = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(candidates, order, axis=1)
