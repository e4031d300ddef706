"""What a plan will cost each shard: rows served per window after dedup, and bytes stored.

**Traffic model.** Each table's lookup stream is i.i.d. draws from its access
distribution ``p`` (the planner's ``access_freq`` normalised; uniform when absent). The
lookup client deduplicates per window of ``window_lookups`` draws (docs/architecture.md §5), so id
``i`` is requested at most once per window, with probability
``q_i = 1 - (1 - p_i) ** window_lookups``. Each requested id then costs:

* hot: one row on one replica; the client spreads hot ids evenly over the R replicas,
  so each replica serves ``q_i / R``;
* warm: one slice-row on each of the C slice shards (``q_i`` each);
* cold: one row on the ring owner (``q_i``); cold replicas are for failover only.

So ``unique_rows_per_shard[s]`` is the expected number of (slice-)rows shard ``s``
serves per window, and ``imbalance`` is its max/mean, the figure the benchmark
measures from the servers' ``ShardInfo`` counters. ``lookups_per_shard`` is the same
before dedup (``window_lookups * p_i``), showing how much skew dedup absorbs.

**Bytes model.** DRAM per stored (slice-)row: ``width * dtype bytes`` (+8 for int8
rowwise scale/bias, fbgemm's fused layout) + 8 bytes of id index. RocksDB per stored
row: row bytes + 24 (8-byte key, 16-byte value header), before compression or space
amplification. ``bytes_per_shard["cold"]`` counts cold rows (owner and replicas) in
RocksDB; hot and warm rows are also in RocksDB (it is the source of truth), see
``rocksdb``. The cold LRU row cache is sized by the server config, not counted here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from recserve.errors import ConfigError
from recserve.sharding.plan import ShardingPlan

DTYPE_BYTES = {"float32": 4, "float16": 2, "int8": 1}
INT8_ROWWISE_OVERHEAD_BYTES = 8
DRAM_INDEX_BYTES_PER_ROW = 8
ROCKSDB_OVERHEAD_BYTES_PER_ROW = 24
DEFAULT_WINDOW_LOOKUPS = 8192
BYTE_TIERS = ("hot", "warm", "cold", "dram", "rocksdb")
_SWEEP = 1 << 22  # ids per chunk when sweeping a table


def slice_row_bytes(width: int, dtype: str) -> int:
    """Bytes of one stored (slice-)row of ``width`` columns in ``dtype``."""
    return width * DTYPE_BYTES[dtype] + (INT8_ROWWISE_OVERHEAD_BYTES if dtype == "int8" else 0)


def access_probabilities(table: str, rows: int, freq: np.ndarray | None) -> np.ndarray:
    """float64 [rows] summing to 1; ``None`` -> uniform. ConfigError on a bad estimate."""
    if freq is None:
        return np.full(rows, 1.0 / rows)
    f = np.asarray(freq, dtype=np.float64)
    if f.shape != (rows,):
        raise ConfigError(f"access_freq[{table!r}] has shape {f.shape}; expected ({rows},), one frequency per row")
    if not np.isfinite(f).all() or (f < 0).any() or f.sum() <= 0:
        raise ConfigError(f"access_freq[{table!r}] must be finite, non-negative and not all zero")
    return f / f.sum()


def frequencies_from_lookups(table: str, rows: int, lookup_ids: np.ndarray) -> np.ndarray:
    """A sample of lookups (int ids [N], repeats counted) -> float64 [rows] access counts,
    the planner's ``access_freq`` when no popularity estimate exists. One ``bincount``.

    Example: rows=4, lookups [2, 0, 2] -> [1, 0, 2, 0]. ConfigError naming the first id
    outside ``[0, rows)``."""
    ids = np.asarray(lookup_ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ConfigError(f"lookup sample for table {table!r} must be a 1-D integer id array; got shape {ids.shape}, dtype {ids.dtype}")
    if ids.size == 0:
        raise ConfigError(f"lookup sample for table {table!r} is empty; pass at least one looked-up id")
    bad = (ids < 0) | (ids >= rows)
    if bad.any():
        raise ConfigError(f"lookup sample for table {table!r}: id {int(ids[np.flatnonzero(bad)[0]]):,} is out of range [0, {rows:,})")
    return np.bincount(ids.astype(np.intp), minlength=rows).astype(np.float64)


def imbalance(per_shard: np.ndarray) -> float:
    """max / mean (1.0 = perfectly even; 1.0 for an all-zero load)."""
    mean = float(np.mean(per_shard))
    return float(np.max(per_shard)) / mean if mean > 0 else 1.0


@dataclasses.dataclass(frozen=True, eq=False)
class TableEstimate:
    table: str
    unique_rows_per_shard: np.ndarray  # float64 [S] expected (slice-)rows served per window
    lookups_per_shard: np.ndarray  # float64 [S] expected lookups per window before dedup
    rows_per_shard: dict[str, np.ndarray]  # "hot" / "warm" (slice-rows) / "cold": int64 [S] stored
    bytes_per_shard: dict[str, np.ndarray]  # BYTE_TIERS -> int64 [S]


@dataclasses.dataclass(frozen=True, eq=False)
class PlanEstimate:
    """Per-shard estimates summed over tables; ``tables`` keeps the per-table parts."""

    window_lookups: int
    tables: dict[str, TableEstimate]
    unique_rows_per_shard: np.ndarray  # float64 [S]
    lookups_per_shard: np.ndarray  # float64 [S]
    imbalance: float  # max/mean of unique_rows_per_shard
    lookup_imbalance: float  # max/mean of lookups_per_shard (no dedup)
    bytes_per_shard: dict[str, np.ndarray]  # BYTE_TIERS -> int64 [S]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (lists, not arrays)."""
        return {
            "window_lookups": self.window_lookups,
            "imbalance": self.imbalance,
            "lookup_imbalance": self.lookup_imbalance,
            "unique_rows_per_shard": self.unique_rows_per_shard.tolist(),
            "lookups_per_shard": self.lookups_per_shard.tolist(),
            "bytes_per_shard": {k: v.tolist() for k, v in self.bytes_per_shard.items()},
            "tables": {
                name: {
                    "imbalance": imbalance(t.unique_rows_per_shard),
                    "rows_per_shard": {k: v.tolist() for k, v in t.rows_per_shard.items()},
                    "bytes_per_shard": {k: v.tolist() for k, v in t.bytes_per_shard.items()},
                }
                for name, t in self.tables.items()
            },
        }


def estimate_table(plan: ShardingPlan, table: str, probs: np.ndarray, window_lookups: int) -> TableEstimate:
    """Sweep every id of ``table`` (chunked, vectorised; O(rows)). ``probs``: float64 [rows]."""
    t = plan.table(table)
    router = plan.router(table)
    s = plan.num_shards
    uniq = np.zeros(s)
    looks = np.zeros(s)
    stored = {k: np.zeros(s, dtype=np.int64) for k in ("hot", "warm", "cold")}
    warm_slices = np.zeros((t.column_splits, s), dtype=np.int64)

    def add(acc: np.ndarray, shards: np.ndarray, weights: np.ndarray | None = None) -> None:
        acc += np.bincount(shards, weights=weights, minlength=s)[:s].astype(acc.dtype)

    for start in range(0, t.rows, _SWEEP):
        ids = np.arange(start, min(start + _SWEEP, t.rows), dtype=np.int64)
        p = probs[start : start + ids.size]
        q = -np.expm1(window_lookups * np.log1p(-np.minimum(p, 1.0 - 1e-16)))
        rt = router.route(ids)
        for r in range(t.hot_replicas):
            col = rt.hot_shards[:, r]
            add(uniq, col, np.take(q, rt.hot_index) / t.hot_replicas)
            add(looks, col, window_lookups * np.take(p, rt.hot_index) / t.hot_replicas)
            add(stored["hot"], col)
        for k in range(t.column_splits):
            col = rt.warm_shards[:, k]
            add(uniq, col, np.take(q, rt.warm_index))
            add(looks, col, window_lookups * np.take(p, rt.warm_index))
            add(warm_slices[k], col)
        add(uniq, rt.cold_shards[:, 0], np.take(q, rt.cold_index))
        add(looks, rt.cold_shards[:, 0], window_lookups * np.take(p, rt.cold_index))
        for r in range(t.cold_replicas):
            add(stored["cold"], rt.cold_shards[:, r])
    stored["warm"] = warm_slices.sum(axis=0)
    widths = [end - begin for begin, end in t.col_bounds()]
    warm_dram_row = np.array([slice_row_bytes(w, t.dtype) + DRAM_INDEX_BYTES_PER_ROW for w in widths], dtype=np.int64)
    warm_rocks_row = np.array([slice_row_bytes(w, t.dtype) + ROCKSDB_OVERHEAD_BYTES_PER_ROW for w in widths], dtype=np.int64)
    rocks_row = slice_row_bytes(t.dim, t.dtype) + ROCKSDB_OVERHEAD_BYTES_PER_ROW
    hot_b = stored["hot"] * (slice_row_bytes(t.dim, t.dtype) + DRAM_INDEX_BYTES_PER_ROW)
    warm_b = warm_slices.T @ warm_dram_row  # [S]
    cold_b = stored["cold"] * rocks_row
    by = {
        "hot": hot_b,
        "warm": warm_b,
        "cold": cold_b,
        "dram": hot_b + warm_b,
        # RocksDB holds every row the shard serves from any tier (it is the source of truth).
        "rocksdb": cold_b + stored["hot"] * rocks_row + warm_slices.T @ warm_rocks_row,
    }
    return TableEstimate(table=table, unique_rows_per_shard=uniq, lookups_per_shard=looks, rows_per_shard=stored, bytes_per_shard=by)


def estimate_plan(
    plan: ShardingPlan,
    access_freq: Mapping[str, np.ndarray] | None = None,
    window_lookups: int = DEFAULT_WINDOW_LOOKUPS,
) -> PlanEstimate:
    """Estimates for every table of ``plan`` (missing frequencies -> uniform)."""
    if window_lookups < 1:
        raise ConfigError(f"window_lookups = {window_lookups} must be >= 1")
    freqs = access_freq or {}
    tables = {
        name: estimate_table(plan, name, access_probabilities(name, t.rows, freqs.get(name)), window_lookups)
        for name, t in sorted(plan.tables.items())
    }
    s = plan.num_shards
    uniq = sum((e.unique_rows_per_shard for e in tables.values()), np.zeros(s))
    looks = sum((e.lookups_per_shard for e in tables.values()), np.zeros(s))
    by = {k: sum((e.bytes_per_shard[k] for e in tables.values()), np.zeros(s, dtype=np.int64)) for k in BYTE_TIERS}
    return PlanEstimate(
        window_lookups=window_lookups,
        tables=tables,
        unique_rows_per_shard=uniq,
        lookups_per_shard=looks,
        imbalance=imbalance(uniq),
        lookup_imbalance=imbalance(looks),
        bytes_per_shard=by,
    )


def expected_owner_counts(plan: ShardingPlan, table: str, window_ids: np.ndarray) -> np.ndarray:
    """float64 [S]: (slice-)rows each shard serves for one concrete window of ids after
    dedup, under the client policy of the model above (hot ids split 1/R per replica).
    For checking the estimate, or a benchmark's "expected" column, on a real stream."""
    router = plan.router(table)
    t = plan.table(table)
    s = plan.num_shards
    rt = router.route(np.unique(router.validate_ids(window_ids)))
    out = np.bincount(rt.hot_shards.ravel(), minlength=s)[:s] / t.hot_replicas
    out += np.bincount(rt.warm_shards.ravel(), minlength=s)[:s]
    out += np.bincount(rt.cold_shards[:, 0], minlength=s)[:s]
    return out.astype(np.float64)
