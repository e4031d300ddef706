"""Replicated cold rows avoid a slow owner (issue 17's ``shard_slow`` fault): with
``cold_replicas = 2`` a cold id whose owners are a slow shard and a fast one goes to the
fast one, and keeps the slow one as its failover alternative; without a fast live
owner it still goes to the slow one (slow is not dead). Oracle: the plan's own owners."""

from __future__ import annotations

import numpy as np

from recserve.lookup.route import ShardState
from recserve.sharding.plan import Tier
from tests.unit.test_lookup_fakes import make_plan, tier_ids
from tests.unit.test_lookup_route import _route

SLOW = 1


def test_replicated_cold_rows_go_to_a_fast_owner_and_keep_the_slow_one_as_failover() -> None:
    plan, _ = make_plan(num_shards=3, cold_replicas=2)
    cold = tier_ids(plan, "wide", Tier.COLD)
    owners = plan.router("wide").cold_owners_of(np.unique(cold))
    assert owners.shape[1] == 2 and (owners == SLOW).any()
    slow = ShardState(np.ones(3, bool), np.array([False, True, False]), np.zeros(3, np.int64))
    uids, routed = _route(plan, "wide", cold, slow)
    sent = {int(p): u.shard for u in routed.units for p in u.positions.tolist()}
    alts = {int(p): int(a) for u in routed.units for p, a in zip(u.positions.tolist(), u.alternatives[:, 0].tolist())}
    assert sorted(sent) == list(range(uids.size)) and routed.unroutable["wide"].size == 0
    for pos in range(uids.size):
        row = owners[pos].tolist()
        assert sent[pos] in row
        if SLOW in row:  # one owner slow, the other fast: the fast one serves, the slow one is the failover
            assert sent[pos] != SLOW and alts[pos] == SLOW


def test_a_slow_owner_still_serves_when_its_replica_is_dead() -> None:
    plan, _ = make_plan(num_shards=3, cold_replicas=2)
    cold = np.unique(tier_ids(plan, "wide", Tier.COLD))
    owners = plan.router("wide").cold_owners_of(cold)
    pair = (owners == SLOW).any(axis=1) & (owners == 2).any(axis=1)  # owned by the slow shard and shard 2
    assert pair.any()
    state = ShardState(np.array([True, True, False]), np.array([False, True, False]), np.zeros(3, np.int64))
    uids, routed = _route(plan, "wide", cold[pair], state)
    assert {u.shard for u in routed.units} == {SLOW} and routed.unroutable["wide"].size == 0
