"""Re-planning when shards join or leave, and how much data a plan change moves.

Adding a shard inserts its ring tokens only (:func:`recserve.sharding.ring.add_slot_tokens`),
so a cold id moves only if the new shard now owns it: ``1/(n+1)`` of cold ids, since the
balanced ring gives the newcomer exactly that share. Removing a shard deletes its tokens,
so only its own ids move (to each token's successor): ``≈1/n``. Tiers (which ids are
hot / warm) are kept; their replica and slice placements follow the ring.

Movement is counted by physical shard (``ShardingPlan.shard_keys``): removing slot 2
renumbers slots 3.. down by one, but their data stays where it is and is not counted.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from recserve.errors import ConfigError
from recserve.sharding.plan import ShardingPlan, TablePlan, Tier
from recserve.sharding.ring import add_slot_tokens

MOVE_SAMPLE_IDS = 4_000_000  # tables larger than this are measured on a seeded id sample


def replan_add_shard(plan: ShardingPlan) -> tuple[ShardingPlan, float]:
    """(plan with one more shard slot at the end, version + 1; moved cold fraction)."""
    tokens = np.vstack([plan.tokens, add_slot_tokens(plan.tokens, plan.virtual_nodes, plan.seed)[None, :]])
    new = ShardingPlan(
        version=plan.version + 1,
        num_shards=plan.num_shards + 1,
        tables=plan.tables,
        virtual_nodes=plan.virtual_nodes,
        seed=plan.seed,
        ring_tokens=tokens,
        shard_keys=plan.keys + (max(plan.keys) + 1,),
        dense_route_max_rows=plan.dense_route_max_rows,
    )
    return new, moved_fraction(plan, new)


def replan_remove_shard(plan: ShardingPlan, shard_id: int | None = None) -> tuple[ShardingPlan, float]:
    """(plan without slot ``shard_id`` (default: the last), version + 1; moved cold fraction).

    Slots after ``shard_id`` shift down by one (so do their addresses); per-table
    replica / split counts are capped at the new shard count."""
    n = plan.num_shards
    if n < 2:
        raise ConfigError("cannot remove a shard from a 1-shard plan")
    k = n - 1 if shard_id is None else shard_id
    if not 0 <= k < n:
        raise ConfigError(f"shard {k} is not in the plan (shards 0..{n - 1})")
    tables = {name: _cap(t, n - 1) for name, t in plan.tables.items()}
    new = ShardingPlan(
        version=plan.version + 1,
        num_shards=n - 1,
        tables=tables,
        virtual_nodes=plan.virtual_nodes,
        seed=plan.seed,
        ring_tokens=np.delete(plan.tokens, k, axis=0),
        shard_keys=plan.keys[:k] + plan.keys[k + 1 :],
        dense_route_max_rows=plan.dense_route_max_rows,
    )
    return new, moved_fraction(plan, new)


def _cap(t: TablePlan, num_shards: int) -> TablePlan:
    if t.max_fanout <= num_shards:
        return t
    return dataclasses.replace(
        t,
        hot_replicas=min(t.hot_replicas, num_shards),
        column_splits=min(t.column_splits, num_shards),
        cold_replicas=min(t.cold_replicas, num_shards),
    )


def _sample_ids(rows: int, seed: int) -> np.ndarray:
    if rows <= MOVE_SAMPLE_IDS:
        return np.arange(rows, dtype=np.int64)
    return np.sort(np.random.default_rng(seed).integers(0, rows, MOVE_SAMPLE_IDS, dtype=np.int64))


def moved_fraction(old: ShardingPlan, new: ShardingPlan, *, tier: Tier = Tier.COLD) -> float:
    """Fraction of ``tier`` ids (tier in both plans, tables in both with equal rows)
    whose physical placement differs between the plans:

    * COLD: the owner (first ring owner; replicas follow it);
    * HOT: the set of replicas;
    * WARM: the shard of any slice (all of them when the split count changed).

    Exact for tables up to ``MOVE_SAMPLE_IDS`` rows, a seeded sample above."""
    moved = 0.0
    total = 0.0
    old_keys = np.asarray(old.keys, dtype=np.int64)
    new_keys = np.asarray(new.keys, dtype=np.int64)
    for name in sorted(set(old.tables) & set(new.tables)):
        ot, nt = old.table(name), new.table(name)
        if ot.rows != nt.rows:
            continue
        ro, rn = old.router(name), new.router(name)
        ids = _sample_ids(ot.rows, old.seed)
        ids = ids[(ro.tier_of(ids) == tier) & (rn.tier_of(ids) == tier)]
        if ids.size == 0:
            continue
        if tier == Tier.COLD:
            diff = np.take(old_keys, ro.cold_owners_of(ids)[:, 0]) != np.take(new_keys, rn.cold_owners_of(ids)[:, 0])
        elif tier == Tier.HOT:
            a = np.sort(np.take(old_keys, ro.hot_replicas_of(ids)), axis=1)
            b = np.sort(np.take(new_keys, rn.hot_replicas_of(ids)), axis=1)
            diff = (a != b).any(axis=1) if a.shape == b.shape else np.ones(ids.size, dtype=bool)
        else:
            a, b = np.take(old_keys, ro.warm_shards_of(ids)), np.take(new_keys, rn.warm_shards_of(ids))
            diff = (a != b).any(axis=1) if a.shape == b.shape else np.ones(ids.size, dtype=bool)
        # Weight each table by its share of the tier, even when measured on a sample.
        scale = ot.rows / min(ot.rows, MOVE_SAMPLE_IDS)
        moved += float(diff.sum()) * scale
        total += float(ids.size) * scale
    return moved / total if total else 0.0
