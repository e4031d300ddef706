"""Upsert fan-out: which shard gets which ids, rows and column slice (pure; no I/O).

An upsert must reach every owner of each id (docs/architecture.md §4): all hot replicas, every
warm slice shard (each with only its columns), and the cold owner(s). The sender (the
lookup client) sends one ``TableUpsert`` per part and acknowledges the caller only when
every shard has acknowledged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from recserve.errors import InvalidArgument
from recserve.sharding.plan import ShardingPlan

# (ids int64 [n], rows float32 [n, col_end - col_start], col_start, col_end)
UpsertPart = tuple[np.ndarray, np.ndarray, int, int]


def split_upsert(plan: ShardingPlan, table: str, ids: Any, rows: Any) -> dict[int, list[UpsertPart]]:
    """Split ``rows`` (float32 [N, dim]) of ``ids`` (int64 [N]) per destination shard.

    Returns shard id -> parts; full rows (hot, cold, and warm when the table has one
    column slice) come as ``col_start, col_end = 0, dim`` in one part per shard, each
    warm slice k as its ``col_bounds()[k]`` range. Within a part ids keep their input
    order (shard servers reject repeated ids in one upsert with INVALID_ARGUMENT).
    Example: dim 8, C = 2, warm id 5 -> {a: [([5], rows[:, 0:4], 0, 4)], b: [([5], rows[:, 4:8], 4, 8)]}.
    """
    t = plan.table(table)
    router = plan.router(table)
    v = router.validate_ids(ids)
    r = np.asarray(rows, dtype=np.float32)
    if r.shape != (v.size, t.dim):
        raise InvalidArgument(f"table {table!r}: upsert rows have shape {r.shape}; expected ({v.size}, {t.dim}) for {v.size} ids of width {t.dim}")
    if v.size == 0:
        return {}
    c = t.column_splits
    full = c  # slice code for "whole row"; warm slices are 0..C-1
    rt = router.route(v)
    warm_codes = np.tile(np.arange(c), rt.warm_index.size) if c > 1 else np.full(rt.warm_index.size, full)
    dest = np.concatenate([rt.hot_shards.ravel(), rt.warm_shards.ravel(), rt.cold_shards.ravel()])
    index = np.concatenate(
        [np.repeat(rt.hot_index, t.hot_replicas), np.repeat(rt.warm_index, c), np.repeat(rt.cold_index, t.cold_replicas)]
    )
    code = np.concatenate(
        [np.full(rt.hot_index.size * t.hot_replicas, full), warm_codes, np.full(rt.cold_index.size * t.cold_replicas, full)]
    )
    order = np.lexsort((index, code, dest))  # group by (shard, slice), input order within
    dest, index, code = dest[order], index[order], code[order]
    cuts = np.flatnonzero((np.diff(dest) != 0) | (np.diff(code) != 0)) + 1
    bounds = t.col_bounds()
    out: dict[int, list[UpsertPart]] = {}
    # One iteration per (shard, slice) group — at most S * (C + 1) — never per id.
    for sel, shard, k in zip(np.split(index, cuts), dest[np.r_[0, cuts]], code[np.r_[0, cuts]]):
        start, end = (0, t.dim) if k == full else bounds[int(k)]
        part_rows = np.take(r[:, start:end], sel, axis=0)
        out.setdefault(int(shard), []).append((np.take(v, sel), part_rows, start, end))
    return out
