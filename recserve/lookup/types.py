"""Typed messages of the lookup client: a caller's validated input and its result.

A caller hands :meth:`LookupClient.lookup` a ``KeyedJaggedTensor`` keyed by feature.
It is validated and regrouped per *table* (two features may read one table) into a
:class:`CallerLookup` before it joins a window; the window merges many of them, and
each caller gets back a :class:`LookupResult`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
    from torchrec.sparse.jagged_tensor import KeyedTensor


@dataclasses.dataclass(slots=True)
class TableInput:
    """One caller's ids for one table.

    ``ids``: int64 [L], the ids of ``features`` concatenated in that order.
    ``lengths``: int64 [F * B], bag lengths feature-major (all bags of ``features[0]``,
    then ``features[1]``...), exactly as a KeyedJaggedTensor lays out its lengths.
    Both are numpy arrays, or the caller's own dense CPU int64 tensors for a caller
    whose id range its window checks (``validate_features(defer_range_check=True)``):
    the window concatenates them in one ``torch.cat``, without a ``.numpy()`` per caller.
    ``feature_counts``: int64 [F], how many of ``ids`` each feature contributed
    (read-only: it may be shared).
    """

    features: tuple[str, ...]
    ids: "np.ndarray | torch.Tensor"
    lengths: "np.ndarray | torch.Tensor"
    feature_counts: np.ndarray


@dataclasses.dataclass(slots=True)
class CallerLookup:
    """A validated caller: what joins a window.

    ``keys``: the caller's features in KJT order (the result follows it); ``batch_size``:
    B, the KJT stride; ``tables``: table name -> :class:`TableInput`; ``deadline``:
    monotonic seconds (``math.inf`` = none); ``n_ids``: total ids (the window cost).
    """

    keys: tuple[str, ...]
    batch_size: int
    tables: dict[str, TableInput]
    pooled: bool
    deadline: float
    n_ids: int


@dataclasses.dataclass(slots=True)
class LookupResult:
    """What one caller gets back.

    Pooled callers get ``pooled``: a KeyedTensor with one ``[B, D_f]`` block per
    feature (sum or mean per the table's config), in the caller's key order.
    Unpooled callers get ``rows[f]``: fp32 ``[L_f, D_f]`` (the rows of feature ``f``'s
    ids in input order) and ``lengths[f]``: int64 ``[B]`` (how many of those rows
    belong to each example).

    ``missing`` counts the caller's id lookups (with repeats, as given) answered with
    the table's default row because no owner's reply arrived in time (dead or late
    shard, id with no live owner, a column slice missing); ``degraded`` is
    ``missing > 0``. ``not_found`` counts ids a shard answered but does not store (a
    default row by contract, never an error, not degraded). ``missing_bags[f]``: int64
    ``[B]``, the missing ids of each of feature ``f``'s bags, for the features with any
    (so a caller batching several requests into one lookup can attribute them).

    Slotted: a window builds one per caller, and a slotted instance is cheaper to make.
    """

    pooled: "KeyedTensor | None"
    rows: "dict[str, torch.Tensor]"
    lengths: "dict[str, torch.Tensor]"
    missing: int
    missing_by_feature: dict[str, int]
    not_found: int
    missing_bags: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def degraded(self) -> bool:
        return self.missing > 0
