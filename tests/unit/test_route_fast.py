"""Issue 9, cheap windows: the per-window shortcuts of routing and the near cache give
exactly what the general code gives.

* ``route_window`` on a healthy fleet (every shard live, none slow) skips the per-row
  preference passes; the general path runs whenever any shard is dead or slow. A state
  with one extra shard, dead and slow, that the plan never names forces the general path
  with the same answer to give, so the two are compared unit by unit.
* ``TableRouter.route`` skips tiers the plan leaves empty.
* ``NearCache`` finds slots through a dense id -> slot map where the ids allow one, by
  ``searchsorted`` otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest

from recserve.lookup import near_cache as near_cache_mod
from recserve.lookup.near_cache import NearCache
from recserve.lookup.route import RoutePlan, ShardState, route_window
from recserve.sharding.plan import ShardingPlan
from tests.unit.test_lookup_fakes import make_plan


def _window(plan: ShardingPlan, rng: np.random.Generator, n: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Unique ids per table (Zipf-ish: many hot ones) and a random subset as fetches."""
    uids, fetch = {}, {}
    for t in plan.tables.values():
        hot = rng.choice(t.hot_ids, size=min(n // 2, t.hot_ids.size), replace=False) if t.hot_ids.size else np.zeros(0, np.int64)
        u = np.unique(np.concatenate((hot, rng.integers(0, t.rows, size=n))))
        uids[t.name] = u
        fetch[t.name] = np.flatnonzero(rng.random(u.size) < 0.8)
    return uids, fetch


def _route(plan: ShardingPlan, uids: dict[str, np.ndarray], fetch: dict[str, np.ndarray], state: ShardState, **kw: int) -> RoutePlan:
    return route_window(uids, fetch, {t: plan.table(t) for t in uids}, {t: plan.router(t) for t in uids}, state, **kw)


def _assert_same(a: RoutePlan, b: RoutePlan) -> None:
    assert [(u.shard, u.table, u.col_start, u.col_end, len(u)) for u in a.units] == [(u.shard, u.table, u.col_start, u.col_end, len(u)) for u in b.units]
    for x, y in zip(a.units, b.units):
        np.testing.assert_array_equal(x.positions, y.positions)
        assert x.alternatives.shape == y.alternatives.shape and x.alternatives.dtype == y.alternatives.dtype
        np.testing.assert_array_equal(x.alternatives, y.alternatives)
    assert a.unroutable.keys() == b.unroutable.keys()
    for t in a.unroutable:
        np.testing.assert_array_equal(np.sort(a.unroutable[t]), np.sort(b.unroutable[t]))


def _with_phantom(state: ShardState) -> ShardState:
    """``state`` plus one shard no plan routes to, dead and slow: every shortcut is off,
    and the answer must not change."""
    return ShardState(np.append(state.live, False), np.append(state.slow, True), np.append(state.inflight_ids, 0))


PLANS: list[dict[str, object]] = [
    dict(num_shards=1, hot_replicas=1, column_splits=1),
    dict(num_shards=2),
    dict(num_shards=3, cold_replicas=2),
    dict(num_shards=3, hot_replicas=3, column_splits=2),
    dict(num_shards=5, cold_replicas=3, hot_fraction=0.2),
    dict(num_shards=9, hot_replicas=3, hot_fraction=0.3, warm_fraction=0.0),
]


@pytest.mark.parametrize("params", PLANS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_healthy_shortcuts_match_the_general_path(params: dict[str, object]) -> None:
    """Random windows, rotations, in-flight loads (some levelling, some not) and
    extra-RPC thresholds (small hot groups moved or not) on a healthy fleet."""
    plan, _ = make_plan(**params)  # type: ignore[arg-type]
    rng = np.random.default_rng(len(str(params)))
    s = plan.num_shards
    moved_any = False
    for trial in range(12):
        uids, fetch = _window(plan, rng, int(rng.choice([3, 40, 400])))
        inflight = rng.integers(0, 300, size=s) * (trial % 3 > 0)
        healthy = ShardState(np.ones(s, bool), np.zeros(s, bool), inflight.astype(np.int64))
        kw = dict(rotation=int(rng.integers(0, 10**6)), min_ids_per_extra_rpc=int(rng.choice([0, 8, 64, 10**6])))
        fast = _route(plan, uids, fetch, healthy, **kw)
        _assert_same(fast, _route(plan, uids, fetch, _with_phantom(healthy), **kw))
        # Every fetch is routed exactly once per slice, to a live shard.
        assert all(v.size == 0 for v in fast.unroutable.values())
        for t, pos in fetch.items():
            got = np.concatenate([u.positions for u in fast.units if u.table == t and u.col_start == 0]) if pos.size else np.zeros(0, np.int64)
            np.testing.assert_array_equal(np.sort(got), pos)
        moved_any |= any(u.alternatives.shape[1] > 0 for u in fast.units)
    assert moved_any or params.get("hot_replicas") == 1


@pytest.mark.parametrize("params", PLANS[1:], ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_dead_and_slow_shards_route_around_and_flag_what_is_lost(params: dict[str, object]) -> None:
    """The general path (any shard dead or slow): no unit goes to a dead shard; every
    fetch is either routed (once per slice) or unroutable; a slow shard gets hot ids only
    when no fast live replica exists; alternatives are live copies of the row."""
    plan, _ = make_plan(**params)  # type: ignore[arg-type]
    rng = np.random.default_rng(7 + len(str(params)))
    s = plan.num_shards
    for _ in range(8):
        uids, fetch = _window(plan, rng, 300)
        live = rng.random(s) < 0.7
        slow = (rng.random(s) < 0.4) & live
        state = ShardState(live, slow, rng.integers(0, 200, size=s).astype(np.int64))
        routed = _route(plan, uids, fetch, state, rotation=int(rng.integers(0, 100)), min_ids_per_extra_rpc=int(rng.choice([0, 64])))
        for u in routed.units:
            assert live[u.shard]
            alt = u.alternatives[u.alternatives >= 0]
            assert live[alt].all()
            assert not (alt == u.shard).any()
        for t, pos in fetch.items():
            router = plan.router(t)
            ids = uids[t]
            full = [u for u in routed.units if u.table == t and u.col_start == 0]
            got = np.concatenate([u.positions for u in full] + [routed.unroutable[t]])
            np.testing.assert_array_equal(np.sort(got), pos)  # each fetch once: routed or lost
            hot_tier = plan.table(t).hot_ids
            for u in full:
                is_hot = np.isin(ids[u.positions], hot_tier)
                if not is_hot.any() or not slow[u.shard]:
                    continue
                reps = router.hot_replicas_of(ids[u.positions[is_hot]])
                fast_live = live[reps] & ~slow[reps]
                assert not fast_live.any(axis=1).any()  # sent to a slow shard only without a fast one


def test_a_shard_state_change_takes_the_general_path_with_the_same_units_for_unaffected_rows() -> None:
    """One plan, one window: with a dead shard the rows it did not hold keep their
    destinations (warm, unreplicated cold), and with everything healthy again the fast
    path returns to the first answer."""
    plan, _ = make_plan(num_shards=4)
    rng = np.random.default_rng(3)
    uids, fetch = _window(plan, rng, 400)
    healthy = ShardState.healthy(4)
    first = _route(plan, uids, fetch, healthy, rotation=5)
    dead = ShardState(np.array([True, True, False, True]), np.zeros(4, bool), np.zeros(4, np.int64))
    degraded = _route(plan, uids, fetch, dead, rotation=5)
    assert all(u.shard != 2 for u in degraded.units)
    assert sum(v.size for v in degraded.unroutable.values()) > 0
    _assert_same(_route(plan, uids, fetch, healthy, rotation=5), first)


def test_router_route_with_empty_tiers_matches_tier_of() -> None:
    """Tables whose plan has no cold ids, or only hot ones (replicated whole), or no hot
    ones: the tier indices skip the empty tiers and still equal a full pass."""
    cases: list[dict[str, object]] = [dict(hot_fraction=0.05, warm_fraction=0.95), dict(hot_fraction=1.0, warm_fraction=0.0), dict(hot_fraction=0.0, warm_fraction=0.3)]
    for params in cases:
        plan, _ = make_plan(num_shards=3, **params)  # type: ignore[arg-type]
        for t in plan.tables:
            router = plan.router(t)
            ids = np.random.default_rng(1).integers(0, plan.table(t).rows, size=333)
            tiers = router.tier_of(ids)
            routes = router.route(ids)
            for idx, tier in ((routes.hot_index, 0), (routes.warm_index, 1), (routes.cold_index, 2)):
                np.testing.assert_array_equal(idx, np.flatnonzero(tiers == tier))
            np.testing.assert_array_equal(routes.hot_shards, router.hot_replicas_of(ids[routes.hot_index]))
            np.testing.assert_array_equal(routes.warm_shards, router.warm_shards_of(ids[routes.warm_index]))
            np.testing.assert_array_equal(routes.cold_shards, router.cold_owners_of(ids[routes.cold_index]))
        assert any(np.unique(plan.router(t).tier_of(np.arange(plan.table(t).rows))).size < 3 for t in plan.tables)


def _reference_slots(cached: np.ndarray, ids: np.ndarray) -> np.ndarray:
    where = {int(v): k for k, v in enumerate(cached)}
    return np.array([where.get(int(i), -1) for i in ids], dtype=np.int64)


def test_dense_and_searched_slots_agree_on_any_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative, zero, the last cached id, past it, and huge ids: both lookups give the
    slot of cached ids and -1 for everything else."""
    rng = np.random.default_rng(11)
    cached = np.unique(np.concatenate(([0], rng.integers(1, 5000, size=300), [4999])))
    probe = np.concatenate(([-(2**62), -2, -1, 0, 1, 4998, 4999, 5000, 5001, 2**40, 2**63 - 1], rng.integers(-10, 6000, size=500))).astype(np.int64)
    dense = NearCache({"t": (cached, 4)}, staleness_s=1.0)
    monkeypatch.setattr(near_cache_mod, "DENSE_SLOT_MAX_ID", 100)  # ids past it: searched
    searched = NearCache({"t": (cached, 4)}, staleness_s=1.0)
    assert dense._tables["t"].slot_of is not None and searched._tables["t"].slot_of is None
    want = _reference_slots(cached, probe)
    for cache in (dense, searched):
        got = cache.slots("t", probe)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(cache.slots("other", probe), -1)


@pytest.mark.parametrize("dense", [True, False])
def test_near_cache_get_serves_only_fresh_rows_and_counts_occurrences(dense: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows filled at different times, some invalidated: ``get`` returns exactly the rows
    fetched within the bound and not invalidated since, in id order, and the hit counters
    weigh each id by its occurrences."""
    if not dense:
        monkeypatch.setattr(near_cache_mod, "DENSE_SLOT_MAX_ID", 0)
    rng = np.random.default_rng(2 + dense)
    cached = np.unique(rng.integers(0, 10_000, size=500))
    cache = NearCache({"t": (cached, 3)}, staleness_s=0.5)
    assert (cache._tables["t"].slot_of is not None) == dense
    rows = rng.standard_normal((cached.size, 3)).astype(np.float32)
    filled_at = rng.uniform(0.0, 2.0, size=cached.size)
    for when in np.unique(np.round(filled_at, 1)):
        pick = np.flatnonzero(np.round(filled_at, 1) == when)
        slot = cache.slots("t", cached[pick])
        assert cache.fill("t", slot, cache.versions("t", slot), rows[pick], now=float(when)) == pick.size
    gone = rng.choice(cached, size=50, replace=False)
    cache.invalidate("t", gone)
    ids = np.unique(np.concatenate((rng.choice(cached, size=300), rng.integers(0, 12_000, size=300))))
    occ = rng.integers(1, 6, size=ids.size)
    now = 2.2
    before = (cache.hits, cache.lookups, cache.occurrence_hits, cache.occurrence_lookups)
    hit, got, slot = cache.get("t", ids, now, occ)
    slot_ref = _reference_slots(cached, ids)
    np.testing.assert_array_equal(slot, slot_ref)
    fresh = (slot_ref >= 0) & (np.round(filled_at, 1)[np.maximum(slot_ref, 0)] >= now - 0.5) & ~np.isin(ids, gone)
    assert fresh.any() and (~fresh & (slot_ref >= 0)).any()  # both kinds of cached rows
    np.testing.assert_array_equal(hit, fresh)
    np.testing.assert_array_equal(got, rows[slot_ref[fresh]])
    after = (cache.hits, cache.lookups, cache.occurrence_hits, cache.occurrence_lookups)
    assert [a - b for a, b in zip(after, before)] == [int(fresh.sum()), ids.size, int(occ[fresh].sum()), int(occ.sum())]
    cache.get("t", ids, now, (occ * 2000).astype(np.int16))  # narrow counts must not wrap
    assert cache.occurrence_hits - after[2] == 2000 * int(occ[fresh].sum()) > np.iinfo(np.int16).max
    # No hits at all (everything stale): an empty [0, D] block, counters still move.
    hit, got, _ = cache.get("t", ids, now=100.0)
    assert not hit.any() and got.shape == (0, 3) and got.dtype == np.float32

