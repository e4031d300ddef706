"""What one shard holds of each table, derived from the sharding plan.

:class:`TableLayout` is the shard-local view of a table's placement: the hot ids it
replicates (full rows), the warm column slices it holds (ids + column range per slice
index ``k``), and the cold ids it owns (full rows). It is the only plan-derived input of
the tiers, bulk load and upsert validation, so those never depend on the planner's
internals. Built by :func:`layouts_from_plan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from recserve.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class WarmSlice:
    """Slice ``index`` of the plan's column bounds: ``ids`` (int64 sorted [M]) hold
    columns ``[col_start, col_end)`` on this shard."""

    index: int
    col_start: int
    col_end: int
    ids: np.ndarray

    @property
    def width(self) -> int:
        return self.col_end - self.col_start


@dataclasses.dataclass(frozen=True)
class TableLayout:
    """One table on one shard. Ids are int64, sorted, unique and disjoint across tiers."""

    name: str
    rows: int
    dim: int
    hot_ids: np.ndarray
    warm: tuple[WarmSlice, ...]
    cold_ids: np.ndarray
    dtype: str = "float32"  # the plan's element type for the DRAM tiers

    def __post_init__(self) -> None:
        groups = [("hot", self.hot_ids), ("cold", self.cold_ids)] + [(f"warm slice {w.index}", w.ids) for w in self.warm]
        for label, ids in groups:
            if len(ids) and (int(ids[0]) < 0 or int(ids[-1]) >= self.rows or np.any(np.diff(ids) <= 0)):
                raise ConfigError(f"table {self.name!r}: {label} ids must be sorted, unique and in [0, {self.rows:,})")
        for w in self.warm:
            if not 0 <= w.col_start < w.col_end <= self.dim:
                raise ConfigError(f"table {self.name!r}: warm slice {w.index} columns {w.col_start}..{w.col_end} outside 0..{self.dim}")
        total = sum(len(ids) for _, ids in groups)
        if total and len(np.unique(np.concatenate([ids for _, ids in groups]))) != total:
            raise ConfigError(
                f"table {self.name!r}: an id is placed twice on this shard (hot/warm/cold overlap); "
                "the plan must give each id at most one tier per shard"
            )

    @property
    def warm_rows(self) -> int:
        return sum(len(w.ids) for w in self.warm)

    def owned_ids(self) -> list[tuple[np.ndarray, int, int]]:
        """Every (ids, col_start, col_end) group this shard stores, for bulk load."""
        groups = [(self.hot_ids, 0, self.dim), (self.cold_ids, 0, self.dim)]
        groups += [(w.ids, w.col_start, w.col_end) for w in self.warm]
        return [g for g in groups if len(g[0])]


def _sorted_ids(ids: Any) -> np.ndarray:
    return np.unique(np.asarray(ids, dtype=np.int64))


def layouts_from_plan(plan: Any, shard_id: int) -> dict[str, TableLayout]:
    """Shard ``shard_id``'s view of every table in ``plan``
    (a :class:`recserve.sharding.plan.ShardingPlan`)."""
    if not 0 <= shard_id < plan.num_shards:
        raise ConfigError(f"shard id {shard_id} is outside the plan's {plan.num_shards} shards (0..{plan.num_shards - 1})")
    layouts: dict[str, TableLayout] = {}
    for name, table in plan.tables.items():
        assignment = plan.assignment(shard_id, name)
        bounds = table.col_bounds()
        warm_ids: Mapping[int, Any] = assignment.warm_ids
        warm = tuple(
            WarmSlice(index=int(k), col_start=int(bounds[k][0]), col_end=int(bounds[k][1]), ids=_sorted_ids(ids))
            for k, ids in sorted(warm_ids.items())
            if len(ids)
        )
        layouts[name] = TableLayout(
            name=name,
            rows=int(table.rows),
            dim=int(table.dim),
            hot_ids=_sorted_ids(assignment.hot_ids),
            warm=warm,
            cold_ids=_sorted_ids(assignment.cold_ids),
            dtype=str(getattr(table, "dtype", "float32")),
        )
    return layouts
