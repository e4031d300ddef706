"""L0's second candidate source and the merge of both sources (arrays only, no I/O).

The FAISS index (``cascade/index.py``) finds items near the user vector; it misses what a
two-tower model under-scores, such as fresh interest in a category the user just browsed.
The second source is the popular items of the user's recent categories
(:class:`PopularByCategory`, :func:`recent_categories`), or the catalog's global top for a
user with no history (cold start). :func:`merge_candidates` joins both lists, drops
FAISS's -1 padding, dedupes, and removes the request's ``exclude_ids`` and the user's seen
items.

Inputs come from the export's serving arrays (MODELS/serving/*.npy, see
``ranker/export.py``): ``item_category.npy`` [N] int64 and ``item_counts.npy`` [N, 2]
int64 (impressions, clicks), whose column 0 is the popularity used here. Item id i is row
i of both. Example::

    popular = PopularByCategory(item_category, item_counts[:, 0], per_category=200)
    cats = recent_categories(history, item_category, last=50)     # newest interests first
    extra = popular.candidates(cats, 500) if cats.size else popular.global_top(500)
    merged = merge_candidates(faiss_ids[0], faiss_scores[0], extra, exclude, seen, 10_000)
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from recserve.errors import InvalidArgument, require


class Source(enum.IntFlag):
    """Which source produced a merged candidate (bit flags: an item can come from both)."""

    INDEX = 1  # the FAISS retrieval index (primary)
    POPULAR = 2  # popular in the user's recent categories, or globally (secondary)


def _ids_1d(values: np.ndarray, field: str) -> np.ndarray:
    a = np.asarray(values)
    if a.ndim != 1:
        raise InvalidArgument(f"{field} has shape {list(a.shape)}; expected a 1-D int64 array")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise InvalidArgument(f"{field} has dtype {a.dtype}; expected int64")
    return a.astype(np.int64, copy=False)


class PopularByCategory:
    """The ``per_category`` most-shown items of every category, precomputed once.

    ``item_category`` int64 ``[N]`` (category of item i; negative = none, left out) and
    ``item_impressions`` int64 ``[N]`` (logged impressions of item i). Ties in impressions
    go to the smaller item id, so the tables are deterministic. Built with one lexsort over
    the catalog (about 0.2 s for 1M items); lookups are ``np.take`` over a ``[C, P]`` table.

    Items added after the export (``AddItems``) have no impressions and are not here; they
    reach users through the index.
    """

    def __init__(self, item_category: np.ndarray, item_impressions: np.ndarray, *, per_category: int = 100, num_categories: int | None = None) -> None:
        cat = _ids_1d(item_category, "item_category")
        imp = np.asarray(item_impressions)
        require(imp.shape == cat.shape, "item_impressions", list(imp.shape), f"give one count per item ({cat.shape[0]:,}), like item_counts[:, 0]")
        require(per_category >= 1, "per_category", per_category, "use >= 1 item per category")
        c = int(cat.max()) + 1 if cat.size else 0
        if num_categories is not None:
            require(num_categories >= c, "num_categories", num_categories, f"item_category holds category {c - 1}; use >= {c}")
            c = num_categories
        self.num_categories = c
        self.per_category = per_category
        # Category ascending, then impressions descending, then item id ascending
        # (lexsort is stable, so equal keys keep row order).
        order = np.lexsort((-imp.astype(np.int64), cat))
        order = order[np.take(cat, order) >= 0]
        sorted_cat = np.take(cat, order)
        starts = np.searchsorted(sorted_cat, np.arange(c))
        rank = np.arange(order.size) - np.take(starts, sorted_cat)
        keep = rank < per_category
        table = np.full((c, per_category), -1, dtype=np.int64)
        table[sorted_cat[keep], rank[keep]] = order[keep]
        self._table = table  # [C, P] item ids best first, -1 past a category's size
        self._global = np.argsort(-imp.astype(np.int64), kind="stable").astype(np.int64)  # [N] best first

    def table(self) -> np.ndarray:
        """``[C, per_category]`` int64: row c lists category c's items best first, -1 padded."""
        return self._table.copy()

    def candidates(self, categories: np.ndarray, n: int) -> np.ndarray:
        """Up to ``n`` popular items of ``categories`` (int64 ``[K]``, most wanted first).

        Interleaved, not proportional: every category's best item comes before any
        category's second best (then rank-major, in the given category order), so a user
        with five interests sees all five even when ``n`` is small, and the category
        given first wins each round. Repeated or unknown (negative, >= C) categories are
        dropped. Returns int64 ``[≤ n]`` (shorter when the categories hold fewer items).
        """
        cats = _ids_1d(categories, "categories")
        if n < 0:
            raise InvalidArgument(f"n = {n} is invalid: use n >= 0")
        cats = cats[(cats >= 0) & (cats < self.num_categories)]
        _, first = np.unique(cats, return_index=True)
        cats = cats[np.sort(first)]  # deduped, first mention kept in place
        if n == 0 or cats.size == 0:
            return np.empty(0, dtype=np.int64)
        rounds = min(self.per_category, -(-n // cats.size))  # no round past the n-th item
        block = np.take(self._table[:, :rounds], cats, axis=0)  # [K, rounds]
        flat = block.T.reshape(-1)  # rank-major: round r lists every category's r-th item
        return flat[flat >= 0][:n]

    def global_top(self, n: int) -> np.ndarray:
        """The ``n`` most-shown items of the catalog (int64 ``[min(n, N)]``), for a user
        with no history."""
        if n < 0:
            raise InvalidArgument(f"n = {n} is invalid: use n >= 0")
        return self._global[:n].copy()


def recent_categories(history: np.ndarray, item_category: np.ndarray, *, last: int = 50, max_categories: int | None = None) -> np.ndarray:
    """The categories of a user's recent items, most frequent first, ties to the most recent.

    ``history`` int64 ``[H]``, oldest first (the export's ``user_history`` row, with the
    request's ``recent_item_ids`` appended); only its last ``last`` items count. Frequency
    leads because five recent items in one category say more than one newer item elsewhere;
    recency breaks ties. Items outside ``item_category`` (ids >= N, e.g. added since the
    export, or negative) and items without a category (< 0) are skipped. Returns unique
    int64 ``[≤ max_categories]``.

    >>> recent_categories(np.array([0, 1, 2, 3]), np.array([5, 7, 5, 9]))
    array([5, 9, 7])
    """
    h = _ids_1d(history, "history")
    cat = _ids_1d(item_category, "item_category")
    if last < 1:
        raise InvalidArgument(f"last = {last} is invalid: use >= 1 history item")
    window = h[-last:]
    window = window[(window >= 0) & (window < cat.size)]
    cats = np.take(cat, window)
    cats = cats[cats >= 0][::-1]  # newest first, so a first index is a recency rank
    uniq, newest, counts = np.unique(cats, return_index=True, return_counts=True)
    order = np.lexsort((newest, -counts))
    out = uniq[order]
    return out if max_categories is None else out[:max_categories]


@dataclasses.dataclass(frozen=True)
class MergedCandidates:
    """L0's output: ``ids`` int64 ``[M]``, index hits first (in index order), then
    popular-only items; ``sources`` uint8 ``[M]`` :class:`Source` bits; ``scores`` f32
    ``[M]``: the index's inner product, -inf for popular-only items (L1 re-scores all)."""

    ids: np.ndarray
    sources: np.ndarray
    scores: np.ndarray

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def merge_candidates(
    primary_ids: np.ndarray,
    primary_scores: np.ndarray,
    secondary_ids: np.ndarray,
    exclude: np.ndarray,
    seen: np.ndarray,
    limit: int,
    *,
    secondary_min: int = 0,
) -> MergedCandidates:
    """Merge the index's hits with the popular source for one request.

    ``primary_ids`` int64 ``[A]`` / ``primary_scores`` f32 ``[A]``: one row of a FAISS
    search, best first, -1 padded (padding is dropped). ``secondary_ids`` int64 ``[B]``,
    best first. Duplicates keep their first occurrence, the index's first, and an item found
    by both carries both :class:`Source` bits. Items in ``exclude`` ``[E]`` (the request's
    exclude_ids) or ``seen`` ``[S]`` (history, recent items) are removed. The result is
    truncated to ``limit``: index hits first, but ``secondary_min`` slots are kept for
    popular-only items when there are that many (otherwise a full index answer would
    crowd the second source out entirely); unused slots go to the other source.
    """
    p = _ids_1d(primary_ids, "primary_ids")
    ps = np.asarray(primary_scores, dtype=np.float32)
    if ps.shape != p.shape:
        raise InvalidArgument(f"primary_scores has shape {list(ps.shape)}; expected {list(p.shape)} (one per primary id)")
    s = _ids_1d(secondary_ids, "secondary_ids")
    drop = np.concatenate([_ids_1d(exclude, "exclude"), _ids_1d(seen, "seen")])
    if limit < 0 or secondary_min < 0:
        raise InvalidArgument(f"limit = {limit}, secondary_min = {secondary_min} are invalid: use >= 0")
    real = p >= 0
    p, ps = p[real], ps[real]
    s = s[s >= 0]
    ids = np.concatenate([p, s])
    _, first = np.unique(ids, return_index=True)
    first = np.sort(first)  # first occurrences, in list order: the index's hits lead
    keep = first[~np.isin(ids[first], drop)]
    out = ids[keep]
    from_index = keep < p.size
    sources = np.where(from_index, np.uint8(Source.INDEX), np.uint8(Source.POPULAR)).astype(np.uint8)
    sources[from_index & np.isin(out, s)] |= np.uint8(Source.POPULAR)
    scores = np.full(out.size, -np.inf, dtype=np.float32)
    scores[from_index] = np.take(ps, keep[from_index])
    n_index = int(from_index.sum())  # index hits are a prefix of ``out``
    n_pop = out.size - n_index
    take_pop = min(n_pop, secondary_min, limit)
    take_index = min(n_index, limit - take_pop)
    take_pop = min(n_pop, limit - take_index)
    sel = np.concatenate([np.arange(take_index), n_index + np.arange(take_pop)]).astype(np.int64)
    return MergedCandidates(np.take(out, sel), np.take(sources, sel), np.take(scores, sel))
