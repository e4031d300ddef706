"""A batch of ranking requests as arrays: its pairs, per-request histories, and the
sparse features one lookup fetches for all of it (no I/O, no torch).

The Ranking service (:mod:`ranker.service`) batches concurrent requests; each request is
one user and C candidates. :func:`layout` turns R requests into P = ΣC (user, candidate)
*pairs* over R *virtual users* 0..R-1: virtual user r's history is the exported history
of the request's user (none for a new user) with the request's ``history_item_ids``
appended, and its log counts are the user's (zeros for a new user). Every feature
function of :mod:`ranker.features` then runs unchanged on the virtual
:class:`~ranker.features.ServingArrays`, so serving computes exactly what training and
the in-process oracle compute.

User-side features (the user id and the history bags) are the same for every candidate of
a request, so :func:`pooled_features` puts each request's bag once, at its first pair, and
leaves the other pairs' bags empty; :func:`expand_user_side` copies the pooled row to
the request's other pairs afterwards. A request of 500 candidates and a 20-item history
then looks up 20 history ids, not 10,000 (the lookup client would deduplicate those, at a
cost per id).
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from recserve.catalog.storage import Csr
from ranker.features import LogCounts, ServingArrays, Source, SparseFeature, sparse_features

USER_SIDE = frozenset({Source.USER_ID, Source.HISTORY_ITEMS, Source.HISTORY_CATEGORIES})


class QueryKind(enum.Enum):
    RANK = "rank"
    EMBED = "embed"  # the two-tower user vector only


@dataclasses.dataclass(frozen=True, slots=True)
class Query:
    """One validated request. ``candidates`` int64 [C] (empty for EMBED); ``history``
    int64 [H] items appended to the user's history; ``cold``: the user is not among the
    exported users (``user_id`` >= their count), so it has no row and no history."""

    kind: QueryKind
    model: str
    user_id: int
    cold: bool
    candidates: np.ndarray
    history: np.ndarray


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """R requests as P pairs over R virtual users (see the module docstring).

    ``pair_request`` int64 [P]: the request of each pair; ``pair_items`` int64 [P]: its
    candidate; ``request_offsets`` int64 [R + 1]: request r's pairs are
    ``request_offsets[r]:request_offsets[r + 1]``; ``user_ids`` int64 [R]; ``cold`` bool
    [R]; ``arrays``: the virtual users' serving arrays (items as exported).
    """

    pair_request: np.ndarray
    pair_items: np.ndarray
    request_offsets: np.ndarray
    user_ids: np.ndarray
    cold: np.ndarray
    arrays: ServingArrays

    @property
    def num_requests(self) -> int:
        return int(self.user_ids.shape[0])

    @property
    def num_pairs(self) -> int:
        return int(self.pair_items.shape[0])

    @property
    def first_pair(self) -> np.ndarray:
        """int64 [R]: each request's first pair (where its user-side bags live)."""
        return self.request_offsets[:-1]


def interleave_jagged(a_values: np.ndarray, a_lengths: np.ndarray, b_values: np.ndarray, b_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row r = row r of a, then row r of b: (values [La + Lb], lengths [R]), int64.

    Example: a = [[1, 2], []], b = [[7], [8, 9]] -> values [1, 2, 7, 8, 9], lengths [3, 2].
    Two scatters, no loop over rows.
    """
    lengths = (a_lengths + b_lengths).astype(np.int64)
    start = np.cumsum(lengths) - lengths
    out = np.empty(int(lengths.sum()), dtype=np.int64)
    for values, own, before in ((a_values, a_lengths, 0), (b_values, b_lengths, a_lengths)):
        within = np.arange(values.shape[0], dtype=np.int64) - np.repeat(np.cumsum(own) - own, own)
        out[np.repeat(start + before, own) + within] = values
    return out, lengths


def layout(arrays: ServingArrays, queries: list[Query]) -> BatchLayout:
    """The pairs and virtual users of ``queries`` (a loop per request, none per id)."""
    r = len(queries)
    user_ids = np.fromiter((q.user_id for q in queries), dtype=np.int64, count=r)
    cold = np.fromiter((q.cold for q in queries), dtype=bool, count=r)
    n_cand = np.fromiter((q.candidates.shape[0] for q in queries), dtype=np.int64, count=r)
    request_offsets = np.concatenate(([0], np.cumsum(n_cand))).astype(np.int64)
    pair_items = np.concatenate([q.candidates for q in queries]).astype(np.int64, copy=False) if r else np.zeros(0, np.int64)
    pair_request = np.repeat(np.arange(r, dtype=np.int64), n_cand)

    known = user_ids[~cold]
    offsets = np.asarray(arrays.user_history.offsets)
    base_lengths = np.zeros(r, dtype=np.int64)
    base_lengths[~cold] = offsets[known + 1] - offsets[known]
    base_values = np.take(np.asarray(arrays.user_history.values), _segments(offsets[known], offsets[known + 1]))
    extra_lengths = np.fromiter((q.history.shape[0] for q in queries), dtype=np.int64, count=r)
    extra_values = np.concatenate([q.history for q in queries]).astype(np.int64, copy=False) if r else np.zeros(0, np.int64)
    values, lengths = interleave_jagged(base_values.astype(np.int64, copy=False), base_lengths, extra_values, extra_lengths)
    history = Csr(values, np.concatenate(([0], np.cumsum(lengths))).astype(np.int64))

    user_counts = np.zeros((r, 2), dtype=np.int64)
    user_counts[~cold] = np.take(arrays.counts.user, known, axis=0)
    c = arrays.counts
    virtual = ServingArrays(
        item_category=arrays.item_category,
        item_tags=arrays.item_tags,
        user_history=history,
        counts=LogCounts(item=c.item, user=user_counts, category=c.category, total=c.total),
    )
    return BatchLayout(pair_request=pair_request, pair_items=pair_items, request_offsets=request_offsets, user_ids=user_ids, cold=cold, arrays=virtual)


def _segments(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """int64 indices of the ranges [starts[i], ends[i]) concatenated."""
    lengths = (ends - starts).astype(np.int64)
    return np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def user_bags(lay: BatchLayout, feature: SparseFeature) -> tuple[np.ndarray, np.ndarray]:
    """One bag per request of a user-side feature: (values [L], lengths [R]) int64. A new
    user's id bag is empty (its default row: zeros, as an empty bag pools)."""
    r = lay.num_requests
    if feature.source is Source.USER_ID:
        return lay.user_ids[~lay.cold], (~lay.cold).astype(np.int64)
    users = np.arange(r, dtype=np.int64)
    batch = sparse_features(lay.arrays, (feature,), users, np.zeros(r, dtype=np.int64))
    return batch.values, batch.lengths


def pooled_features(lay: BatchLayout, features: tuple[SparseFeature, ...], names: dict[str, str]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The KJT (keys, values [L], lengths [F * P]) of ``features`` over the pairs,
    user-side bags at each request's first pair only; keys are the served names
    ``names[feature.name]``."""
    p = lay.num_pairs
    values: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    for f in features:  # per feature (a handful), never per id
        if f.source is Source.CATEGORY_CROSS:
            raise ValueError(f"feature {f.name!r} is a crossed feature: look it up with cross_bags (one bag per request), not per pair")
        if f.source in USER_SIDE:
            v, n_r = user_bags(lay, f)
            n = np.zeros(p, dtype=np.int64)
            n[lay.first_pair] = n_r
        else:
            batch = sparse_features(lay.arrays, (f,), lay.pair_request, lay.pair_items)
            v, n = batch.values, batch.lengths
        values.append(v)
        lengths.append(n)
    return [names[f.name] for f in features], _cat(values), _cat(lengths)


def request_features(lay: BatchLayout, features: tuple[SparseFeature, ...], names: dict[str, str]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The KJT (keys, values, lengths [F * R]) of user-side ``features``, one bag per request."""
    parts = [user_bags(lay, f) for f in features]
    return [names[f.name] for f in features], _cat([v for v, _ in parts]), _cat([n for _, n in parts])


def expand_user_side(lay: BatchLayout) -> np.ndarray:
    """int64 [P]: for each pair, the row holding its request's user-side bag."""
    return np.take(lay.first_pair, lay.pair_request)


def expand_rows(lengths: np.ndarray, pair_request: np.ndarray) -> np.ndarray:
    """Unpooled per-request rows -> per-pair rows: int64 indices into the requests' rows
    ``[L, E]`` (request r's ``lengths[r]`` rows, requests in order), one copy of its
    request's rows per pair."""
    starts = np.cumsum(lengths) - lengths
    per_pair = np.take(lengths, pair_request)
    s = np.take(starts, pair_request)
    return np.repeat(s - (np.cumsum(per_pair) - per_pair), per_pair) + np.arange(int(per_pair.sum()), dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class CrossBags:
    """A crossed-category feature (``Source.CATEGORY_CROSS``) without repeating each
    history for each candidate.

    Pair p's bag is ``{c(h) · C + c(p) : h in its user's history}``, a multiset whose mean
    row is ``Σ_k n_k / H · row[k · C + c(p)]`` over the history's distinct categories k
    (n_k of the H items). So the lookup fetches, per request r, only its distinct crossed
    ids (``ids``, ``id_lengths`` [R]: one unpooled bag per request, deduplicated across
    requests by the lookup client), and the pooling runs here as one weighted
    ``embedding_bag``: ``index`` [M] (into the concatenated returned rows), ``weights``
    [M] f32 (n_k / H) and ``bag_lengths`` [P] (distinct history categories per pair).
    A 500-candidate request with a 50-item history over 10 categories looks up at most
    10 · (its distinct candidate categories) ids instead of 25,000.
    """

    ids: np.ndarray
    id_lengths: np.ndarray
    index: np.ndarray
    weights: np.ndarray
    bag_lengths: np.ndarray


def cross_bags(lay: BatchLayout, feature: SparseFeature) -> CrossBags:
    """:class:`CrossBags` of ``feature`` over the batch's pairs (arrays only).

    Request r's distinct crossed ids are the product ``K_r × Q_r`` of its distinct
    history categories and its distinct candidate categories, so they are built as that
    product (k-major, each sorted) and each entry's index into them is computed, not
    searched: the only sorts are over the history ([H]) and the pairs ([P]), never over
    the P · |K_r| entries (a sort there was 0.4 ms of a 500-candidate request).
    """
    r, p = lay.num_requests, lay.num_pairs
    cat = np.asarray(lay.arrays.item_category)
    c = lay.arrays.num_categories
    hist = sparse_features(lay.arrays, (dataclasses.replace(feature, source=Source.HISTORY_CATEGORIES),), np.arange(r, dtype=np.int64), np.zeros(r, dtype=np.int64))
    hist_len = hist.lengths
    keys, counts = np.unique(np.repeat(np.arange(r, dtype=np.int64), hist_len) * c + hist.values, return_counts=True)  # (request, category), sorted
    key_category = keys % c
    per_request = np.bincount(keys // c, minlength=r).astype(np.int64)  # |K_r|: distinct history categories
    first_key = np.cumsum(per_request) - per_request
    cands, cand_index = np.unique(lay.pair_request * c + np.take(cat, lay.pair_items), return_inverse=True)  # (request, candidate category), sorted
    per_request_cands = np.bincount(cands // c, minlength=r).astype(np.int64)  # |Q_r|
    first_cand = np.cumsum(per_request_cands) - per_request_cands
    # The ids: request r's block of |K_r| · |Q_r| ids, id (j, m) = K_r[j] · C + Q_r[m].
    sizes = per_request * per_request_cands
    block_start = np.cumsum(sizes) - sizes
    id_request = np.repeat(np.arange(r, dtype=np.int64), sizes)
    within = np.arange(id_request.shape[0], dtype=np.int64) - np.take(block_start, id_request)
    width = np.take(per_request_cands, id_request)  # > 0 wherever a block has ids
    ids = np.take(key_category, np.take(first_key, id_request) + within // width) * c + np.take(cands % c, np.take(first_cand, id_request) + within % width)
    # The entries: pair p's bag holds one entry per k in K_r (of its request r), weight n_k / H.
    bag_lengths = np.take(per_request, lay.pair_request)
    entry_pair = np.repeat(np.arange(p, dtype=np.int64), bag_lengths)
    entry_request = np.take(lay.pair_request, entry_pair)
    local_key = np.arange(entry_pair.shape[0], dtype=np.int64) - np.repeat(np.cumsum(bag_lengths) - bag_lengths, bag_lengths)
    cand_pos = cand_index.reshape(-1) - np.take(first_cand, lay.pair_request)  # [P]: the pair's category within Q_r
    index = np.take(block_start, entry_request) + local_key * np.take(per_request_cands, entry_request) + np.take(cand_pos, entry_pair)
    weights = (np.take(counts, np.take(first_key, entry_request) + local_key) / np.take(hist_len, entry_request)).astype(np.float32)
    return CrossBags(ids=ids.astype(np.int64, copy=False), id_lengths=sizes, index=index.astype(np.int64, copy=False), weights=weights, bag_lengths=bag_lengths)


def missing_per_request(lay: BatchLayout, missing_bags: dict[str, np.ndarray], *, per_pair: bool) -> np.ndarray:
    """int64 [R]: missing ids per request from a lookup's per-bag counts (``per_pair``:
    the lookup's bags are pairs [P]; else requests [R])."""
    out = np.zeros(lay.num_requests, dtype=np.int64)
    for bags in missing_bags.values():
        if not per_pair:
            out += bags
        else:
            out += np.bincount(lay.pair_request, weights=bags, minlength=lay.num_requests).astype(np.int64)
    return out


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, np.int64)
