"""Sharding plan, consistent-hash ring, router and planner (docs/architecture.md §4).

Shared by shard servers (what do I store?) and lookup clients (where is id X?).
Depends on nothing else in the repo but ``recserve.config`` and ``recserve.errors``;
numpy only (no torch), so it is cheap to import.
"""

from recserve.sharding.estimates import PlanEstimate, TableEstimate, estimate_plan, expected_owner_counts, frequencies_from_lookups
from recserve.sharding.plan import ShardAssignment, ShardingPlan, TablePlan, Tier
from recserve.sharding.planner import PLAN_VARIANTS, PlanResult, plan_tables, plan_variants, resolve_column_splits
from recserve.sharding.replan import moved_fraction, replan_add_shard, replan_remove_shard
from recserve.sharding.router import Routes, TableRouter
from recserve.sharding.upsert import UpsertPart, split_upsert

__all__ = [
    "PLAN_VARIANTS",
    "PlanEstimate",
    "PlanResult",
    "Routes",
    "ShardAssignment",
    "ShardingPlan",
    "TableEstimate",
    "TablePlan",
    "TableRouter",
    "Tier",
    "UpsertPart",
    "estimate_plan",
    "expected_owner_counts",
    "frequencies_from_lookups",
    "moved_fraction",
    "plan_tables",
    "plan_variants",
    "replan_add_shard",
    "replan_remove_shard",
    "resolve_column_splits",
    "split_upsert",
]
