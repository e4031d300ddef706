"""The planner: table sizes + access frequencies + shard budget -> a ShardingPlan and its
estimates (docs/architecture.md §4; reference §10.10.5, "Archetype B").

Per table: the top ``hot_fraction`` of ids by access frequency are hot (replicated
``hot_replicas`` ways), the next ``warm_fraction`` warm (column-sharded), the rest
cold (ring). Frequencies are a popularity estimate (the catalog's) or counts from a
sample of lookups (:func:`~recserve.sharding.estimates.frequencies_from_lookups`). Ties in frequency go to the lower id, so a plan is a pure function of its
inputs. Column splits multiply fan-out (C RPCs per warm id instead of 1), which pays
only for wide rows: ``column_splits = 0`` resolves to 1 for ``dim <= 128`` and to
``ceil(dim / 128)`` above, capped by the shard count.

With ``sharding.placement = "budget"`` the planner instead fills each shard's
``shard_memory_bytes`` (:func:`budget_fill`): small tables are replicated whole, then
hot, then warm tiers take the most popular ids while the budget lasts, and the rest of
the budget is the shards' row cache (:attr:`PlanResult.row_cache_bytes`). Per-table
``[[tables]]`` overrides (:func:`table_sharding`) apply under either rule.

The benchmark compares three variants built by :func:`plan_variants`:
``row_only`` (everything cold), ``hybrid`` (the config as given) and
``hybrid_no_colsplit`` (the config with ``column_splits = 1``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from recserve.config.spec import ShardingConfig, TableConfig
from recserve.errors import ConfigError, ResourceExhausted
from recserve.sharding.estimates import (
    DEFAULT_WINDOW_LOOKUPS,
    DRAM_INDEX_BYTES_PER_ROW,
    PlanEstimate,
    access_probabilities,
    estimate_plan,
    estimate_table,
    slice_row_bytes,
)
from recserve.sharding.plan import ShardingPlan, TablePlan

COLUMN_SPLIT_WIDTH = 128  # dims per column slice the auto rule aims for
PLAN_VARIANTS = ("row_only", "hybrid", "hybrid_no_colsplit")


def resolve_column_splits(dim: int, sharding: ShardingConfig) -> int:
    """C for a table of width ``dim``: explicit config value, or 1 for dim <= 128 and
    ceil(dim / 128) above; never more than the shard count or the width."""
    c = sharding.column_splits or math.ceil(dim / COLUMN_SPLIT_WIDTH)
    return max(1, min(c, sharding.num_shards, dim))


def table_sharding(table: TableConfig, sharding: ShardingConfig) -> ShardingConfig:
    """The ShardingConfig that applies to ``table``: ``sharding`` with the table's own
    ``[[tables]]`` overrides (never mutates either). A ConfigError from the derived
    config names the table, e.g. ``tables.item.hot_replicas = 3`` with 2 shards."""
    changes = {
        key: getattr(table, key)
        for key in ("hot_fraction", "warm_fraction", "column_splits", "hot_replicas", "cold_replicas")
        if getattr(table, key) is not None
    }
    if not changes:
        return sharding
    try:
        return dataclasses.replace(sharding, **changes)
    except ConfigError as e:
        raise ConfigError(f"tables.{table.name}: its overrides {changes} do not fit [sharding]: {e}") from None


def select_tiers(rows: int, probs: np.ndarray | None, hot_fraction: float, warm_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(hot_ids, warm_ids), both int64 sorted: the top ``round(hot_fraction * rows)`` ids
    by ``probs`` (float [rows]; None = uniform, i.e. the lowest ids) and the next
    ``round(warm_fraction * rows)``."""
    n_hot = min(int(round(hot_fraction * rows)), rows)
    n_warm = min(int(round(warm_fraction * rows)), rows - n_hot)
    if probs is None:
        head = np.arange(n_hot + n_warm, dtype=np.int64)
    else:
        # Stable sort of -p: equal frequencies keep id order (deterministic plans).
        head = np.argsort(-probs, kind="stable")[: n_hot + n_warm].astype(np.int64)
    return np.sort(head[:n_hot]), np.sort(head[n_hot:])


def plan_table(table: TableConfig, probs: np.ndarray | None, sharding: ShardingConfig) -> TablePlan:
    """Today's rule: exactly the (table's or ``[sharding]``'s) hot / warm fractions."""
    cfg = table_sharding(table, sharding)
    hot, warm = select_tiers(table.rows, probs, cfg.hot_fraction, cfg.warm_fraction)
    return _table_plan(table, cfg, hot, warm)


def _table_plan(table: TableConfig, cfg: ShardingConfig, hot: np.ndarray, warm: np.ndarray) -> TablePlan:
    return TablePlan(
        name=table.name,
        rows=table.rows,
        dim=table.dim,
        dtype=table.dtype,
        hot_ids=hot,
        warm_ids=warm,
        hot_replicas=cfg.hot_replicas,
        column_splits=resolve_column_splits(table.dim, cfg),
        cold_replicas=cfg.cold_replicas,
    )


def replicated_whole(table: TableConfig, num_shards: int) -> TablePlan:
    """Every row hot on every shard (data parallel): any shard answers any id, one RPC."""
    return TablePlan(
        name=table.name, rows=table.rows, dim=table.dim, dtype=table.dtype,
        hot_ids=np.arange(table.rows, dtype=np.int64), warm_ids=np.zeros(0, dtype=np.int64),
        hot_replicas=num_shards, column_splits=1, cold_replicas=1,
    )  # fmt: skip


def whole_copy_bytes(table: TableConfig) -> int:
    """DRAM bytes of one whole copy of ``table`` as a hot tier (rows + id index)."""
    return table.rows * (slice_row_bytes(table.dim, table.dtype) + DRAM_INDEX_BYTES_PER_ROW)


def _dram_per_shard(plan_of: TablePlan, num_shards: int, virtual_nodes: int, seed: int) -> np.ndarray:
    """int64 [S] exact DRAM bytes of one table's hot + warm tiers on each shard."""
    one = ShardingPlan(version=1, num_shards=num_shards, tables={plan_of.name: plan_of}, virtual_nodes=virtual_nodes, seed=seed)
    by = estimate_table(one, plan_of.name, np.full(plan_of.rows, 1.0 / plan_of.rows), 1).bytes_per_shard
    return np.asarray(by["dram"], dtype=np.int64)


def _fit_prefix(
    table: TableConfig, cfg: ShardingConfig, order: np.ndarray, fixed_hot: int, want: int, tier: str,
    free: np.ndarray, seed: int,
) -> tuple[int, np.ndarray]:
    """The largest count ``n <= want`` of ids ``order[fixed_hot : fixed_hot + n]`` that
    fits ``free`` (int64 [S] bytes) as ``tier`` ("hot": on top of nothing; "warm": on top
    of ``fixed_hot`` hot ids), and the table's exact DRAM bytes per shard then. Starts
    from the even-spread estimate and shrinks by the measured overflow (the ring spreads
    ids nearly, not exactly, evenly), a few vectorised sweeps at most."""
    s = cfg.num_shards
    c = resolve_column_splits(table.dim, cfg)
    row = slice_row_bytes(table.dim, table.dtype)
    # Expected bytes per shard of one more id: R copies (hot) or C slices (warm) over S shards.
    per_id = (cfg.hot_replicas * (row + DRAM_INDEX_BYTES_PER_ROW) if tier == "hot" else row + c * (DRAM_INDEX_BYTES_PER_ROW + (8 if table.dtype == "int8" else 0))) / s
    base = np.zeros(s, dtype=np.int64)

    def build(n: int) -> TablePlan:
        hot_n = n if tier == "hot" else fixed_hot
        hot = np.sort(order[:hot_n])
        warm = np.sort(order[fixed_hot : fixed_hot + n]) if tier == "warm" else np.zeros(0, dtype=np.int64)
        return _table_plan(table, cfg, hot, warm)

    if tier == "warm" and fixed_hot:
        base = _dram_per_shard(build(0), s, cfg.virtual_nodes, seed)
    room = int((free - base).min())
    n = max(0, min(want, int(room // per_id) if per_id > 0 else want))
    for _ in range(8):
        used = _dram_per_shard(build(n), s, cfg.virtual_nodes, seed)
        over = int((used - free).max())
        if over <= 0 or n == 0:
            return n, used
        n = max(0, n - max(1, math.ceil(1.05 * over / per_id)))
    return 0, base


def budget_fill(
    tables: Sequence[TableConfig], probs: Mapping[str, np.ndarray], sharding: ShardingConfig, *, seed: int = 0,
) -> dict[str, TablePlan]:
    """``placement = "budget"``: fill each shard's ``shard_memory_bytes``.

    1. Tables with their own fractions get exactly those (check_memory judges them).
    2. Tables without their own hot/warm fractions, smallest first, are replicated whole
       while a whole copy fits what is left on every shard.
    3. The other tables' hot tiers take their most popular ids, up to ``hot_fraction``,
       while the budget lasts; then their warm tiers the next ids, up to
       ``warm_fraction``. The budget left over is shared among tables in table order.
    """
    s = sharding.num_shards
    free = np.full(s, sharding.shard_memory_bytes, dtype=np.int64)
    plans: dict[str, TablePlan] = {}
    # Exact demands first: an optional whole copy must not take the room they need.
    for t in tables:
        if t.overrides_tiers:
            plans[t.name] = plan_table(t, probs.get(t.name), sharding)
            free -= _dram_per_shard(plans[t.name], s, sharding.virtual_nodes, seed)
    for t in sorted((t for t in tables if not t.overrides_tiers), key=whole_copy_bytes):
        if whole_copy_bytes(t) <= int(free.min()):
            plans[t.name] = replicated_whole(t, s)
            free -= whole_copy_bytes(t)
    rest = [t for t in tables if t.name not in plans]
    orders = {
        t.name: (np.arange(t.rows, dtype=np.int64) if t.name not in probs else np.argsort(-probs[t.name], kind="stable").astype(np.int64))
        for t in rest
    }
    hot_n: dict[str, int] = {}
    for t in rest:
        cfg = table_sharding(t, sharding)
        want = min(int(round(cfg.hot_fraction * t.rows)), t.rows)
        hot_n[t.name], used = _fit_prefix(t, cfg, orders[t.name], 0, want, "hot", np.maximum(free, 0), seed)
        free -= used
    for t in rest:
        cfg = table_sharding(t, sharding)
        want = min(int(round(cfg.warm_fraction * t.rows)), t.rows - hot_n[t.name])
        hot_dram = _dram_per_shard(_table_plan(t, cfg, np.sort(orders[t.name][: hot_n[t.name]]), np.zeros(0, np.int64)), s, sharding.virtual_nodes, seed)
        n_warm, used = _fit_prefix(t, cfg, orders[t.name], hot_n[t.name], want, "warm", np.maximum(free + hot_dram, 0), seed)
        order = orders[t.name]
        plans[t.name] = _table_plan(t, cfg, np.sort(order[: hot_n[t.name]]), np.sort(order[hot_n[t.name] : hot_n[t.name] + n_warm]))
        free -= used - hot_dram
    return {t.name: plans[t.name] for t in tables}


@dataclasses.dataclass(frozen=True, eq=False)
class PlanResult:
    """The plan and the planner's estimates of what it costs each shard."""

    plan: ShardingPlan
    estimate: PlanEstimate
    shard_memory_bytes: int = 0  # the per-shard DRAM budget it was planned for

    @property
    def row_cache_bytes(self) -> np.ndarray:
        """int64 [S]: each shard's budget left after its DRAM tiers, for its row cache
        (0 where the tiers use it all)."""
        return np.maximum(self.shard_memory_bytes - self.estimate.bytes_per_shard["dram"], 0).astype(np.int64)

    def tier_rows(self) -> list[dict[str, Any]]:
        """One row per table for ``recserve shard plan``'s tier table: ids per tier,
        replicas / slices, and DRAM / RocksDB bytes on the fullest shard."""
        out = []
        for name, t in sorted(self.plan.tables.items()):
            e = self.estimate.tables[name]
            out.append({
                "table": name, "rows": t.rows, "dim": t.dim, "dtype": t.dtype,
                "hot_ids": int(t.hot_ids.size), "hot_replicas": t.hot_replicas,
                "warm_ids": int(t.warm_ids.size), "column_splits": t.column_splits,
                "cold_ids": t.num_cold, "cold_replicas": t.cold_replicas,
                "replicated_whole": t.num_cold == 0 and t.warm_ids.size == 0 and t.hot_replicas == self.plan.num_shards,
                "dram_bytes_max_shard": int(e.bytes_per_shard["dram"].max()),
                "rocksdb_bytes_max_shard": int(e.bytes_per_shard["rocksdb"].max()),
            })  # fmt: skip
        return out

    @property
    def unique_rows_per_shard(self) -> np.ndarray:
        """float64 [S] expected (slice-)rows served per window after dedup."""
        return self.estimate.unique_rows_per_shard

    @property
    def imbalance(self) -> float:
        """max/mean of :attr:`unique_rows_per_shard`."""
        return self.estimate.imbalance

    @property
    def bytes_per_shard(self) -> dict[str, np.ndarray]:
        """"hot" / "warm" (DRAM), "cold" (RocksDB), "dram", "rocksdb": int64 [S]."""
        return self.estimate.bytes_per_shard

    def to_dict(self) -> dict[str, Any]:
        d = self.estimate.to_dict()
        d["plan_version"] = self.plan.version
        d["num_shards"] = self.plan.num_shards
        d["column_splits"] = {n: t.column_splits for n, t in self.plan.tables.items()}
        d["shard_memory_bytes"] = self.shard_memory_bytes
        d["row_cache_bytes"] = self.row_cache_bytes.tolist()
        d["tiers"] = self.tier_rows()
        return d


def check_memory(plan: ShardingPlan, estimate: PlanEstimate, shard_memory_bytes: int) -> None:
    """ResourceExhausted if any shard's DRAM tiers (hot + warm, all tables) exceed the
    budget; the message names the shard, each table's bytes there, and the budget."""
    dram = estimate.bytes_per_shard["dram"]
    worst = int(np.argmax(dram))
    need = int(dram[worst])
    if need <= shard_memory_bytes:
        return
    parts = []
    for name, e in sorted(estimate.tables.items(), key=lambda kv: -int(kv[1].bytes_per_shard["dram"][worst])):
        hot, warm = int(e.bytes_per_shard["hot"][worst]), int(e.bytes_per_shard["warm"][worst])
        parts.append(f"table {name!r}: {hot + warm:,} bytes (hot {hot:,} + warm {warm:,})")
    raise ResourceExhausted(
        f"sharding plan does not fit: shard {worst} needs {need:,} bytes of DRAM for its hot and warm tiers "
        f"but sharding.shard_memory_bytes is {shard_memory_bytes:,} bytes available; "
        + "; ".join(parts)
        + ". Lower hot_fraction / warm_fraction, add shards, raise shard_memory_bytes, or store the table as float16 / int8"
    )


def plan_tables(
    tables: Sequence[TableConfig],
    access_freq: Mapping[str, np.ndarray] | None,
    sharding: ShardingConfig,
    *,
    version: int = 1,
    seed: int = 0,
    window_lookups: int = DEFAULT_WINDOW_LOOKUPS,
) -> PlanResult:
    """Plan every table; ``access_freq[name]`` is a float [rows] frequency estimate
    (missing or None -> uniform). Raises ResourceExhausted when a shard's DRAM tiers
    exceed ``sharding.shard_memory_bytes`` and ConfigError on bad inputs."""
    if not tables:
        raise ConfigError("plan_tables needs at least one table")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ConfigError(f"table names must be unique, got {names}")
    freqs = dict(access_freq or {})
    unknown = sorted(set(freqs) - set(names))
    if unknown:
        raise ConfigError(f"access_freq names tables {unknown} that are not being planned ({names})")
    probs: dict[str, np.ndarray] = {}
    for t in tables:
        f = freqs.get(t.name)
        if f is not None:
            probs[t.name] = access_probabilities(t.name, t.rows, f)
    if sharding.placement == "budget":
        plans = budget_fill(tables, probs, sharding, seed=seed)
    else:
        plans = {t.name: plan_table(t, probs.get(t.name), sharding) for t in tables}
    plan = ShardingPlan(
        version=version, num_shards=sharding.num_shards, tables=plans, virtual_nodes=sharding.virtual_nodes, seed=seed,
        dense_route_max_rows=sharding.dense_route_max_rows,
    )  # fmt: skip
    estimate = estimate_plan(plan, probs, window_lookups)
    check_memory(plan, estimate, sharding.shard_memory_bytes)
    return PlanResult(plan=plan, estimate=estimate, shard_memory_bytes=sharding.shard_memory_bytes)


def variant_config(sharding: ShardingConfig, variant: str) -> ShardingConfig:
    """The ShardingConfig of one benchmark variant (never mutates ``sharding``)."""
    if variant == "row_only":
        return dataclasses.replace(sharding, hot_fraction=0.0, warm_fraction=0.0)
    if variant == "hybrid":
        return sharding
    if variant == "hybrid_no_colsplit":
        return dataclasses.replace(sharding, column_splits=1)
    raise ConfigError(f"plan variant {variant!r} is unknown; use one of {PLAN_VARIANTS}")


def plan_variants(
    tables: Sequence[TableConfig],
    access_freq: Mapping[str, np.ndarray] | None,
    sharding: ShardingConfig,
    *,
    variants: Sequence[str] = PLAN_VARIANTS,
    version: int = 1,
    seed: int = 0,
    window_lookups: int = DEFAULT_WINDOW_LOOKUPS,
) -> dict[str, PlanResult]:
    """One :class:`PlanResult` per variant name, same inputs, same ring (same seed)."""
    return {
        v: plan_tables(tables, access_freq, variant_config(sharding, v), version=version, seed=seed, window_lookups=window_lookups)
        for v in variants
    }
