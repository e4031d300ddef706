"""The planner: table sizes + access frequencies + shard budget -> a ShardingPlan and its
estimates (DESIGN.md §4; reference §10.10.5, "Archetype B").

Per table: the top ``hot_fraction`` of ids by access frequency are hot (replicated
``hot_replicas`` ways), the next ``warm_fraction`` warm (column-sharded), the rest
cold (ring). Frequencies are a popularity estimate (the catalog's) or counts from a
sample of lookups (:func:`~recserve.sharding.estimates.frequencies_from_lookups`). Ties in frequency go to the lower id, so a plan is a pure function of its
inputs. Column splits multiply fan-out (C RPCs per warm id instead of 1), which pays
only for wide rows: ``column_splits = 0`` resolves to 1 for ``dim <= 128`` and to
``ceil(dim / 128)`` above, capped by the shard count.

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
from recserve.sharding.estimates import DEFAULT_WINDOW_LOOKUPS, PlanEstimate, access_probabilities, estimate_plan
from recserve.sharding.plan import ShardingPlan, TablePlan

COLUMN_SPLIT_WIDTH = 128  # dims per column slice the auto rule aims for
PLAN_VARIANTS = ("row_only", "hybrid", "hybrid_no_colsplit")


def resolve_column_splits(dim: int, sharding: ShardingConfig) -> int:
    """C for a table of width ``dim``: explicit config value, or 1 for dim <= 128 and
    ceil(dim / 128) above; never more than the shard count or the width."""
    c = sharding.column_splits or math.ceil(dim / COLUMN_SPLIT_WIDTH)
    return max(1, min(c, sharding.num_shards, dim))


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
    hot, warm = select_tiers(table.rows, probs, sharding.hot_fraction, sharding.warm_fraction)
    return TablePlan(
        name=table.name,
        rows=table.rows,
        dim=table.dim,
        dtype=table.dtype,
        hot_ids=hot,
        warm_ids=warm,
        hot_replicas=sharding.hot_replicas,
        column_splits=resolve_column_splits(table.dim, sharding),
        cold_replicas=sharding.cold_replicas,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class PlanResult:
    """The plan and the planner's estimates of what it costs each shard."""

    plan: ShardingPlan
    estimate: PlanEstimate

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
    plans: dict[str, TablePlan] = {}
    probs: dict[str, np.ndarray] = {}
    for t in tables:
        f = freqs.get(t.name)
        p = None if f is None else access_probabilities(t.name, t.rows, f)
        plans[t.name] = plan_table(t, p, sharding)
        if p is not None:
            probs[t.name] = p
    plan = ShardingPlan(version=version, num_shards=sharding.num_shards, tables=plans, virtual_nodes=sharding.virtual_nodes, seed=seed)
    estimate = estimate_plan(plan, probs, window_lookups)
    check_memory(plan, estimate, sharding.shard_memory_bytes)
    return PlanResult(plan=plan, estimate=estimate)


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
