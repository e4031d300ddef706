"""Shard-side partial pooling (the optional pooled Lookup mode, docs/architecture.md §5).

After cross-request dedup a bag is not a contiguous run of the ids a shard receives, so
the client sends ``bag_indices`` (positions into the request's ids) and ``bag_offsets``
(CSR offsets over ``bag_indices``). The shard sums the rows it owns per bag in fp32 and
counts them; the client adds the partials of all shards and divides by the summed counts
for mean pooling. Rows this shard does not own contribute nothing (another shard serves
them); missing-but-owned rows contribute the default row and count, as a local
``EmbeddingBag`` over a table holding the default row would.

Example: rows [[1,1],[2,2],[4,4]], owned all, indices [0,2,1], offsets [0,2,2,3]
-> sums [[5,5],[0,0],[2,2]], counts [2,0,1].
"""

from __future__ import annotations

import numpy as np

from recserve.errors import InvalidArgument


def check_bags(n_ids: int, bag_indices: np.ndarray, bag_offsets: np.ndarray, table: str) -> None:
    """Validate CSR bags over ``n_ids`` ids: offsets [B + 1] non-decreasing from 0 to L,
    indices [L] in [0, n_ids)."""
    if len(bag_offsets) == 0:
        raise InvalidArgument(f"table {table!r}: bag_offsets is empty; send B + 1 offsets starting at 0")
    if bag_offsets[0] != 0 or bag_offsets[-1] != len(bag_indices):
        raise InvalidArgument(
            f"table {table!r}: bag_offsets must start at 0 and end at len(bag_indices) = {len(bag_indices)}; "
            f"got {int(bag_offsets[0])}..{int(bag_offsets[-1])}"
        )
    if np.any(np.diff(bag_offsets) < 0):
        raise InvalidArgument(f"table {table!r}: bag_offsets must be non-decreasing")
    if len(bag_indices) and (int(bag_indices.min()) < 0 or int(bag_indices.max()) >= n_ids):
        raise InvalidArgument(f"table {table!r}: bag_indices must lie in [0, {n_ids}) (positions into ids)")


def pool_partial(rows: np.ndarray, owned: np.ndarray, bag_indices: np.ndarray, bag_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 rows [N, W], owned bool [N], indices [L], offsets [B + 1]
    -> (sums fp32 [B, W], counts int64 [B]) over owned rows only."""
    num_bags, width = len(bag_offsets) - 1, rows.shape[1]
    sums = np.zeros((num_bags, width), dtype=np.float32)
    counts = np.zeros(num_bags, dtype=np.int64)
    if len(bag_indices) == 0 or num_bags == 0:
        return sums, counts
    masked = np.where(owned[:, None], rows, np.float32(0.0)).astype(np.float32, copy=False)
    per_item = np.take(masked, bag_indices, axis=0)  # [L, W]
    owned_item = np.take(owned, bag_indices).astype(np.int64)
    sizes = np.diff(bag_offsets)
    nonempty = np.flatnonzero(sizes > 0)
    # reduceat sums each segment [start_i, start_{i+1}); empty bags are skipped by only
    # passing non-empty starts (their segments then end exactly at the next non-empty start).
    starts = bag_offsets[:-1][nonempty]
    sums[nonempty] = np.add.reduceat(per_item, starts, axis=0)
    counts[nonempty] = np.add.reduceat(owned_item, starts)
    return sums, counts
