"""Users: latent vectors mixing a few category centroids, and interaction histories.

Histories follow "sample by popularity, then reweight by affinity": a pool of
``candidates`` ids is drawn by popularity (duplicates removed), every user scores the
pool with its latent vector, and keeps the top of ``sharpness · <u, v> + Gumbel`` — the
Gumbel top-k trick, i.e. a draw without replacement ∝ exp(sharpness · affinity) from the
pool. No user ever scores the whole catalog.

Cost is what shapes the pools. Gathering a 64-wide row costs ≈0.2 µs here, so an
independent 1,024-item pool per user means 100M gathers (≈25 s) for 100k users.
``users_per_pool`` users therefore share one pool: each user's pool is still an honest
popularity sample (its marginal is unchanged), the gather cost drops by that factor, and
scoring becomes one batched matmul. The price is that users of one pool (consecutive
ids, whose vectors are independent) can only pick from the same tail items; set
``users_per_pool = 1`` for fully independent pools.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from recserve.catalog.items import ITEM_CHUNK, normalize_rows
from recserve.catalog.storage import Csr
from recserve.catalog.zipf import PopularitySampler

# Users per chunk of the history pass: bounds the [chunk, candidates] score matrix
# (4,096 × 1,024 float32 = 16 MB). Like ITEM_CHUNK it is part of the random stream.
HISTORY_CHUNK_USERS = 4096

Progress = Callable[[int], None]


def fill_user_vectors(
    rng: np.random.Generator,
    centroids: np.ndarray,
    category_weights: np.ndarray,
    mixture: int,
    noise: float,
    out: np.ndarray,
    progress: Progress | None = None,
) -> None:
    """Fill ``out`` ``[U, D]`` float32 with unit user vectors.

    Each user draws ``mixture`` categories by size and Dirichlet(1) weights over them:
    ``u = normalize(Σ_k w_k · c[cat_k] + noise·z/√D)``. A user thus likes a few categories
    unequally, which is what lets histories and clicks reveal structure.
    """
    n, dim = out.shape
    sampler = PopularitySampler(category_weights)
    scale = np.float32(noise / np.sqrt(dim))
    for start in range(0, n, ITEM_CHUNK):
        m = min(n, start + ITEM_CHUNK) - start
        cats = sampler.sample(m * mixture, rng).reshape(m, mixture)
        weights = rng.dirichlet(np.ones(mixture), size=m).astype(np.float32)  # [m, k]
        mix = np.einsum("mk,mkd->md", weights, np.take(centroids, cats, axis=0))
        x = rng.standard_normal((m, dim), dtype=np.float32)
        x *= scale
        x += mix
        out[start : start + m] = normalize_rows(x)
        if progress is not None:
            progress(m)


def _gumbel(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Standard Gumbel noise in float32 as ``-log(E)``, ``E ~ Exp(1)``: one log per value
    (numpy's ziggurat exponential needs none), ≈4× cheaper than ``rng.gumbel``."""
    e = rng.standard_exponential(shape, dtype=np.float32)
    # E is 0 with negligible but non-zero probability; keep -log(E) finite.
    np.maximum(e, np.finfo(np.float32).tiny, out=e)
    np.log(e, out=e)
    np.negative(e, out=e)
    return e


def make_histories(
    rng: np.random.Generator,
    user_vectors: np.ndarray,
    item_vectors: np.ndarray,
    sampler: PopularitySampler,
    history_len: int,
    candidates: int,
    users_per_pool: int,
    sharpness: float,
    progress: Progress | None = None,
) -> Csr:
    """Histories as CSR over users: distinct item ids, ``ceil(h/2)..h`` per user (fewer
    only if a pool has fewer distinct items), in a random ("chronological") order.

    ``user_vectors`` ``[U, D]``, ``item_vectors`` ``[N, D]`` (unit rows), ``sampler`` draws
    ids by popularity. Values int64 in ``[0, N)``, offsets ``[U + 1]`` int64.
    """
    n_users, dim = user_vectors.shape
    h, p, g = history_len, candidates, users_per_pool
    chunk_users = max(g, (HISTORY_CHUNK_USERS // g) * g)
    chunk_values: list[np.ndarray] = []
    lengths = np.empty(n_users, dtype=np.int64)
    for start in range(0, n_users, chunk_users):
        m = min(n_users, start + chunk_users) - start
        n_pools = -(-m // g)
        pools = sampler.sample(n_pools * p, rng).reshape(n_pools, p)
        pools.sort(axis=1)
        # -inf on repeats of an id within a pool, so each distinct item competes once.
        penalty = np.zeros((n_pools, p), dtype=np.float32)
        penalty[:, 1:][pools[:, 1:] == pools[:, :-1]] = -np.inf
        pool_vecs = np.take(item_vectors, pools.reshape(-1), axis=0).reshape(n_pools, p, dim)
        # Users padded to whole pools; sharpness folded into the [m, D] side of the matmul.
        users = np.zeros((n_pools * g, dim), dtype=np.float32)
        np.multiply(user_vectors[start : start + m], np.float32(sharpness), out=users[:m])
        keys = np.matmul(users.reshape(n_pools, g, dim), pool_vecs.transpose(0, 2, 1))  # [pools, g, p]
        keys += penalty[:, None, :]
        keys = keys.reshape(n_pools * g, p)[:m]
        keys += _gumbel(rng, (m, p))
        # Top h by key, sorted descending, so truncating to a user's length keeps the best.
        top = np.argpartition(keys, p - h, axis=1)[:, p - h :]
        top_keys = np.take_along_axis(keys, top, axis=1)
        top = np.take_along_axis(top, np.argsort(-top_keys, axis=1), axis=1)
        pool_of_user = np.arange(m, dtype=np.int64) // g
        picked = np.take(pools, top + (pool_of_user * p)[:, None])  # [m, h] item ids
        distinct = p - np.isinf(penalty).sum(axis=1)
        n_keep = np.minimum(rng.integers(-(-h // 2), h + 1, m), np.take(distinct, pool_of_user))
        keep = np.arange(h)[None, :] < n_keep[:, None]
        # Shuffle the kept items within each row (dropped ones sort last) so position in
        # a history says nothing about affinity.
        shuffle_keys = rng.random((m, h))
        shuffle_keys[~keep] = np.inf
        picked = np.take_along_axis(picked, np.argsort(shuffle_keys, axis=1), axis=1)
        chunk_values.append(picked[keep])
        lengths[start : start + m] = n_keep
        if progress is not None:
            progress(m)
    offsets = np.zeros(n_users + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Csr(values=np.concatenate(chunk_values).astype(np.int64, copy=False), offsets=offsets)
