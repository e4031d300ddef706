"""Items: categories, multi-hot tags, clustered latent vectors, shuffled Zipf popularity.

All functions are vectorised over items; the only Python loops walk fixed-size chunks
(so a 1M × 64 table is built without a second 256 MB temporary). Each takes its own
``np.random.Generator`` so components stay independent under a fixed seed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from recserve.catalog.storage import Csr
from recserve.catalog.zipf import PopularitySampler, zipf_weights

# Rows per chunk when filling [N, D] tables. A constant: the random stream of a chunked
# fill depends on it, so changing it changes every catalog for a given seed.
ITEM_CHUNK = 65_536
# Category sizes follow a mild Zipf so some categories are big and some niche.
CATEGORY_SIZE_ZIPF = 0.5
# A tag comes from the item's category block with this probability, else from the
# globally Zipf-popular tags ("sale", "new", ...), so tags correlate with categories.
TAG_FROM_CATEGORY = 0.7
GLOBAL_TAG_ZIPF = 1.0

Progress = Callable[[int], None]


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """Scale rows of ``x`` ``[n, D]`` to unit L2 norm in place; returns ``x``."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    np.maximum(norms, np.finfo(x.dtype).tiny, out=norms)
    x /= norms
    return x


def make_centroids(rng: np.random.Generator, categories: int, dim: int) -> np.ndarray:
    """``[C, D]`` float32 unit category centroids (isotropic directions; in 64-D two of
    them have cosine ≈ N(0, 1/64), i.e. they are nearly orthogonal)."""
    return normalize_rows(rng.standard_normal((categories, dim), dtype=np.float32))


def make_category_weights(rng: np.random.Generator, categories: int) -> np.ndarray:
    """``[C]`` float64 category shares summing to 1 (Zipf(0.5) sizes, shuffled over ids)."""
    weights = np.empty(categories, dtype=np.float64)
    weights[rng.permutation(categories)] = zipf_weights(categories, CATEGORY_SIZE_ZIPF)
    return weights


def make_item_categories(rng: np.random.Generator, items: int, category_weights: np.ndarray) -> np.ndarray:
    """``[N]`` int64 category of every item, drawn by ``category_weights`` ``[C]``."""
    return PopularitySampler(category_weights).sample(items, rng)


def fill_item_vectors(
    rng: np.random.Generator,
    centroids: np.ndarray,
    item_category: np.ndarray,
    noise: float,
    out: np.ndarray,
    progress: Progress | None = None,
) -> None:
    """Fill ``out`` ``[N, D]`` float32 with unit vectors ``normalize(c[cat] + noise·z/√D)``.

    ``z`` is standard normal, so the noise vector's norm is ≈ ``noise`` and an item's
    cosine to its own centroid is ≈ 1/√(1 + noise²) (0.86 for the default 0.6): clusters
    an IVF index can find, loose enough that items within a category differ.
    """
    n, dim = out.shape
    scale = np.float32(noise / np.sqrt(dim))
    for start in range(0, n, ITEM_CHUNK):
        stop = min(n, start + ITEM_CHUNK)
        x = rng.standard_normal((stop - start, dim), dtype=np.float32)
        x *= scale
        x += np.take(centroids, item_category[start:stop], axis=0)
        out[start:stop] = normalize_rows(x)
        if progress is not None:
            progress(stop - start)


def make_item_tags(rng: np.random.Generator, item_category: np.ndarray, categories: int, tags: int, tags_per_item: float) -> Csr:
    """Multi-hot tags as CSR over items: every item gets ≥ 1 distinct tag, ≈``tags_per_item``
    on average, sorted ascending within the item. Values int64 in ``[0, tags)``.

    Draws ``1 + Poisson(tags_per_item - 1)`` tags per item (capped), each from the item's
    category block (``tags // categories`` tags per category) or from the global Zipf tags,
    then removes duplicates by one sort over ``item · tags + tag`` keys.
    """
    n = item_category.shape[0]
    cap = int(min(tags, max(1, np.ceil(4 * tags_per_item))))
    counts = np.minimum(1 + rng.poisson(tags_per_item - 1.0, n), cap)
    rows = np.repeat(np.arange(n, dtype=np.int64), counts)
    total = rows.shape[0]
    block = max(1, tags // categories)
    home = (np.take(item_category, rows) * block + rng.integers(0, block, total)) % tags
    # Global tag ranks are shuffled over tag ids like item popularity is over item ids.
    global_order = rng.permutation(tags).astype(np.int64)
    global_tags = PopularitySampler(zipf_weights(tags, GLOBAL_TAG_ZIPF), order=global_order).sample(total, rng)
    tag = np.where(rng.random(total) < TAG_FROM_CATEGORY, home, global_tags)
    keys = rows * tags + tag
    keys.sort()  # by item, then tag
    # Not np.unique: numpy 2.4 routes a plain unique through a hash table that is ≈50×
    # slower here than this sort + neighbour mask (4.5 s vs 0.06 s for 3M int64 keys).
    first = np.ones(total, dtype=bool)
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    keys = keys[first]
    item_of_key = keys // tags
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(item_of_key, minlength=n), out=offsets[1:])
    return Csr(values=(keys - item_of_key * tags).astype(np.int64), offsets=offsets)


def make_popularity(rng: np.random.Generator, items: int, zipf: float) -> tuple[np.ndarray, np.ndarray]:
    """Zipf(``zipf``) popularity with ranks randomly permuted over ids.

    Returns ``(popularity [N] float64 summing to 1, items_by_popularity [N] int64)``:
    ``items_by_popularity[r]`` is the id holding rank r, so an id's number says nothing
    about its popularity (a sharding plan must learn the hot set, not assume ids 0..k).
    """
    order = rng.permutation(items).astype(np.int64)
    popularity = np.empty(items, dtype=np.float64)
    popularity[order] = zipf_weights(items, zipf)
    return popularity, order
