"""Load-test requests drawn from the catalog: Zipf users, their real candidates and histories.

A :class:`RequestPool` is drawn once, before the run (nothing here is on the send path):

* **users** follow a Zipf law over the catalog's users (``zipf_a``, default 1.0) in a
  seeded random order, so the popular users are spread over the id space, as real ones
  are, and the cache-friendly skew of real traffic is there;
* **candidates** are the items each user was really shown (the ``train`` impression log
  of the catalog's scrubbed view, in log order), ``candidates`` per request, topped up
  with items drawn by impression count when the user was shown fewer;
* **histories** are the user's real history (its last ``history`` items), sent as the
  ``recent_item_ids`` / ``history_item_ids`` of a request where the target takes them.

Request ``i`` of a run is pool entry ``i % size``: a long run cycles through the pool,
each entry already a Zipf draw. Everything is built with array operations (no loop per
user or per candidate).

Example::

    pool = RequestPool.from_catalog(open_scrubbed(path), size=4096, candidates=32, seed=0)
    pool.user_ids[:3], pool.candidates[0]       # int64 [3], int64 [32]
    pool.history(0)                             # int64 [<= 8], user 0's last items
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from recserve.catalog.zipf import zipf_weights
from recserve.errors import InvalidArgument, require

if TYPE_CHECKING:
    from ranker.scrubbed import ScrubbedCatalog


@dataclasses.dataclass(frozen=True)
class RequestPool:
    """``size`` requests: ``user_ids`` int64 [P], ``candidates`` int64 [P, C], and the
    histories as CSR (``history_values`` int64 [L], ``history_offsets`` int64 [P + 1])."""

    user_ids: np.ndarray
    candidates: np.ndarray
    history_values: np.ndarray
    history_offsets: np.ndarray
    num_items: int
    num_users: int

    def __post_init__(self) -> None:
        p = self.user_ids.shape[0]
        require(p > 0, "RequestPool.size", p, "draw at least one request")
        if self.candidates.shape[0] != p or self.history_offsets.shape[0] != p + 1:
            raise InvalidArgument(f"RequestPool: {p} users but candidates {list(self.candidates.shape)} and history offsets [{self.history_offsets.shape[0]}]; give one row per user")

    @property
    def size(self) -> int:
        return int(self.user_ids.shape[0])

    def entry(self, i: int) -> int:
        """Pool entry of run request ``i``."""
        return i % self.size

    def history(self, i: int) -> np.ndarray:
        """int64 [H_i]: the history of pool entry ``i``."""
        return self.history_values[int(self.history_offsets[i]) : int(self.history_offsets[i + 1])]

    @classmethod
    def from_catalog(cls, view: "ScrubbedCatalog", *, size: int = 4096, candidates: int = 64, history: int = 8, zipf_a: float = 1.0, seed: int = 0) -> RequestPool:
        """Draw ``size`` requests from a catalog's scrubbed view (see the module docstring)."""
        require(size >= 1, "loadtest.pool_size", size, "use at least 1 request")
        require(candidates >= 1, "loadtest.candidates", candidates, "use at least 1 candidate per request")
        require(history >= 0, "loadtest.history", history, "use >= 0 history items")
        rng = np.random.default_rng(seed)
        n_users, n_items = int(view.num_users), int(view.num_items)
        order = rng.permutation(n_users)  # Zipf rank r -> user order[r]
        users = np.take(order, rng.choice(n_users, size=size, p=zipf_weights(n_users, zipf_a))).astype(np.int64)

        log_users = np.asarray(view.train.user, dtype=np.int64)
        log_items = np.asarray(view.train.item, dtype=np.int64)
        by_user = np.argsort(log_users, kind="stable")  # log order kept within a user
        sorted_users = np.take(log_users, by_user)
        starts = np.searchsorted(sorted_users, users, side="left")
        shown = np.minimum(np.searchsorted(sorted_users, users, side="right") - starts, candidates)  # [P]
        # Fill: popular items (by impressions) where the user was shown fewer than C.
        popularity = np.bincount(log_items, minlength=n_items).astype(np.float64) + 1.0
        fill = rng.choice(n_items, size=(size, candidates), p=popularity / popularity.sum()).astype(np.int64)
        col = np.arange(candidates, dtype=np.int64)[None, :]
        real = col < shown[:, None]  # [P, C]
        idx = np.minimum(starts[:, None] + col, max(by_user.size - 1, 0))
        from_log = np.take(log_items, np.take(by_user, idx)) if by_user.size else fill
        cand = np.where(real, from_log, fill)

        offsets = np.asarray(view.user_history.offsets, dtype=np.int64)
        h_end = np.take(offsets, users + 1)
        h_start = np.maximum(np.take(offsets, users), h_end - history)
        lengths = h_end - h_start
        h_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = np.repeat(h_start - h_offsets[:-1], lengths) + np.arange(int(h_offsets[-1]), dtype=np.int64)
        h_values = np.take(np.asarray(view.user_history.values, dtype=np.int64), flat)
        return cls(user_ids=users, candidates=cand, history_values=h_values, history_offsets=h_offsets, num_items=n_items, num_users=n_users)
