"""The impression/click log, labelled by the ground-truth model.

Impressions are i.i.d.: a user uniformly at random shown an item drawn by popularity (the
exposure a popularity-driven feed gives), clicked with the ground-truth probability. Rows
are in time order; the last ``holdout_fraction`` of them is the test split — a temporal
hold-out, as production evaluation does it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from recserve.catalog.model import GroundTruth
from recserve.catalog.storage import ClickLog
from recserve.catalog.zipf import PopularitySampler

# Impressions per chunk (part of the random stream, like ITEM_CHUNK).
CLICK_CHUNK = 262_144

Progress = Callable[[int], None]


def fill_click_log(
    rng: np.random.Generator,
    truth: GroundTruth,
    user_vectors: np.ndarray,
    item_vectors: np.ndarray,
    item_popularity: np.ndarray,
    sampler: PopularitySampler,
    train: ClickLog,
    test: ClickLog,
    progress: Progress | None = None,
) -> None:
    """Fill the preallocated ``train`` then ``test`` arrays (``[n_train]`` / ``[n_test]``
    int64 user, int64 item, uint8 label) with one continuous impression stream."""
    n_train, n_test = len(train), len(test)
    total = n_train + n_test
    n_users = user_vectors.shape[0]
    for start in range(0, total, CLICK_CHUNK):
        stop = min(total, start + CLICK_CHUNK)
        m = stop - start
        users = rng.integers(0, n_users, m, dtype=np.int64)
        items = sampler.sample(m, rng)
        prob = truth.click_probability(
            np.take(user_vectors, users, axis=0), np.take(item_vectors, items, axis=0), np.take(item_popularity, items)
        )
        labels = (rng.random(m) < prob).astype(np.uint8)
        # Rows [start, stop) of the stream: the part below n_train goes to train.
        cut = min(max(n_train - start, 0), m)
        if cut:
            train.user[start : start + cut] = users[:cut]
            train.item[start : start + cut] = items[:cut]
            train.label[start : start + cut] = labels[:cut]
        if cut < m:
            t0 = start + cut - n_train
            test.user[t0 : t0 + m - cut] = users[cut:]
            test.item[t0 : t0 + m - cut] = items[cut:]
            test.label[t0 : t0 + m - cut] = labels[cut:]
        if progress is not None:
            progress(m)
