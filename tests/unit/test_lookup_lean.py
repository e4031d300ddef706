"""The lean window path (issue 9): its shortcuts give the same answers as the general
path, the near cache never serves a row it never fetched, and one slow first window
does not make the client shed tight-deadline callers.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recserve.config.spec import LookupConfig
from recserve.errors import ResourceExhausted
from recserve.lookup.client import LookupClient
from recserve.lookup.near_cache import NearCache
from recserve.lookup.reassemble import TableAssembly, resolve_callers
from recserve.lookup.route import _group, rotate_replicas
from recserve.lookup.types import CallerLookup
from recserve.lookup.validate import validate_features
from recserve.lookup.window import merge_window
from recserve.scheduling.admission import AdmissionConfig
from recserve.sharding.plan import Tier
from tests.unit.test_lookup_client import item_kjt
from tests.unit.test_lookup_fakes import FakeShards, make_config, make_plan, make_weights, tier_ids

TABLE_OF = {"item_id": "item", "hist": "item", "user_id": "user"}
ROWS = {"item": 50, "user": 7}
DIMS = {"item": 4, "user": 3}


def _kjt(keys: list[str], lengths: list[int], values: list[int]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=keys, values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths, dtype=torch.int64))


def _callers(rng: np.random.Generator, n: int) -> list[CallerLookup]:
    """``n`` callers with 1-3 features over two tables, B = 1..3, some empty bags."""
    out = []
    for _ in range(n):
        keys = list(rng.choice(["item_id", "hist", "user_id"], size=int(rng.integers(1, 4)), replace=False))
        b = int(rng.integers(1, 4))
        lengths = rng.integers(0, 4, size=b * len(keys)).tolist()
        values = []
        for k, key in enumerate(keys):
            values += rng.integers(0, ROWS[TABLE_OF[key]], size=sum(lengths[k * b : (k + 1) * b])).tolist()
        out.append(validate_features(_kjt(keys, lengths, values), table_of_feature=TABLE_OF, table_rows=ROWS, pooled=True, deadline=math.inf))
    return out


@pytest.mark.parametrize("partial", [False, True])
def test_resolving_the_whole_window_at_once_equals_resolving_each_caller_alone(partial: bool) -> None:
    """The whole-window shortcut (no index arithmetic, one split) against one caller at
    a time (the general path), with a missing row, sum and mean tables, and (partial)
    shard-side partial sums plus rows that arrived as rows."""
    rng = np.random.default_rng(3)
    callers = _callers(rng, 9)
    windows = merge_window(callers, ROWS)
    pooling = {"item": "sum", "user": "mean"}
    asm = {}
    for t, w in windows.items():
        a = TableAssembly(w, DIMS[t], np.ones(w.unique, np.int16), partial=partial)
        rows = rng.standard_normal((w.unique, DIMS[t])).astype(np.float32)
        arrived = np.arange(w.unique)[1:]  # row 0 never arrives: missing
        if partial:
            assert a.pooled is not None
            a.pooled += rng.standard_normal(a.pooled.shape).astype(np.float32)
        a.put_rows(arrived, rows[arrived], 0, 0, np.ones(arrived.size, bool), np.zeros(arrived.size, bool))
        asm[t] = a
    together = resolve_callers(callers, list(range(len(callers))), windows, asm, pooling)
    alone = [resolve_callers(callers, [c], windows, asm, pooling)[0] for c in range(len(callers))]
    assert sum(r.missing for r in together) > 0  # the missing row is in some caller's bags
    for a_res, b_res in zip(together, alone):
        assert a_res.pooled is not None and b_res.pooled is not None
        assert a_res.pooled.keys() == b_res.pooled.keys()
        assert a_res.pooled.length_per_key() == b_res.pooled.length_per_key()
        torch.testing.assert_close(a_res.pooled.values(), b_res.pooled.values(), rtol=0, atol=0)
        assert (a_res.missing, a_res.missing_by_feature, a_res.not_found) == (b_res.missing, b_res.missing_by_feature, b_res.not_found)
        assert a_res.missing_bags.keys() == b_res.missing_bags.keys()
        for f in a_res.missing_bags:
            np.testing.assert_array_equal(a_res.missing_bags[f], b_res.missing_bags[f])


@pytest.mark.parametrize("num_shards", [1, 2, 4, 5, 9])
def test_grouping_by_masks_matches_grouping_by_a_stable_sort(num_shards: int) -> None:
    rng = np.random.default_rng(num_shards)
    shards = rng.integers(0, num_shards, size=300).astype(np.int32)
    positions = rng.permutation(1000)[:300].astype(np.int64)
    alts = rng.integers(-1, num_shards, size=(300, 2)).astype(np.int32)
    units = _group(shards, positions, alts, "t", (0, 0))
    order = np.argsort(shards, kind="stable")
    want = {int(s): (positions[order][shards[order] == s], alts[order][shards[order] == s]) for s in np.unique(shards)}
    assert [u.shard for u in units] == sorted(want)
    for u in units:
        np.testing.assert_array_equal(u.positions, want[u.shard][0])
        np.testing.assert_array_equal(u.alternatives, want[u.shard][1])


def test_an_infinite_staleness_bound_never_serves_a_row_that_was_never_fetched() -> None:
    cache = NearCache({"t": (np.array([2, 5, 9], dtype=np.int64), 4)}, staleness_s=math.inf)
    ids = np.array([2, 3, 5, 9], dtype=np.int64)  # 3 is not cached; none fetched yet
    hit, rows, slot = cache.get("t", ids, now=10.0)
    assert not hit.any() and rows.shape == (0, 4)
    np.testing.assert_array_equal(slot, [0, -1, 1, 2])
    np.testing.assert_array_equal(cache.versions("t", slot), [0, -1, 0, 0])
    assert cache.fill("t", slot, cache.versions("t", slot), np.ones((4, 4), np.float32), now=11.0) == 3
    hit, rows, _ = cache.get("t", ids, now=1e9)
    np.testing.assert_array_equal(hit, [True, False, True, True])  # fetched once: fresh forever
    np.testing.assert_array_equal(rows, np.ones((3, 4), np.float32))
    assert cache.invalidate("t", np.array([5, 3])) == 1
    hit, _, _ = cache.get("t", ids, now=1e9)
    np.testing.assert_array_equal(hit, [True, False, False, True])


@pytest.mark.parametrize("shed_after_batches", [AdmissionConfig().shed_after_batches, 1])
def test_one_slow_first_window_does_not_shed_tight_deadline_callers(shed_after_batches: int) -> None:
    """The client's admission is the scheduler core's: a first window that takes 1 s
    (cold start) leaves a 1 s service estimate, and a burst of callers with 50 ms of
    slack would all be shed against it. ``admission.shed_after_batches`` keeps the
    estimate out of admission until it has that many measured windows: with the default,
    every caller is served; with 1 (no guard) the burst is shed, so the test can fail."""
    plan, _ = make_plan()
    fake = FakeShards(plan, make_weights())
    now = [0.0]
    lookup = LookupConfig(max_inflight_batches=1)
    client = LookupClient(make_config(lookup=lookup), plan, fake, clock=lambda: now[0], admission=AdmissionConfig(shed_after_batches=shed_after_batches))
    cold = tier_ids(plan, "item", Tier.COLD)

    async def body() -> tuple[int, int]:
        for shard in range(plan.num_shards):
            fake.set_blocked(shard)
        first = asyncio.ensure_future(client.lookup(item_kjt(cold[:2]), pooled=False, timeout_s=5.0))
        for _ in range(100):  # event-loop turns until its RPCs reach the blocked shards
            if fake.rpcs() > 0:
                break
            await asyncio.sleep(0)
        now[0] += 1.0  # the first window takes 1 s (fake clock)
        for shard in range(plan.num_shards):
            fake.release(shard)
        assert not (await first).degraded
        burst = await asyncio.gather(*(client.lookup(item_kjt(cold[2 + i : 3 + i]), pooled=False, timeout_s=0.05) for i in range(12)), return_exceptions=True)
        shed = sum(isinstance(r, ResourceExhausted) for r in burst)
        served = sum(not isinstance(r, BaseException) and not r.degraded for r in burst)
        return shed, served

    async def run() -> tuple[int, int]:
        await client.start()
        try:
            return await body()
        finally:
            await client.aclose()

    shed, served = asyncio.run(run())
    if shed_after_batches > 1:
        assert (shed, served) == (0, 12)
    else:
        assert shed > 0


@pytest.mark.parametrize("rotation", [0, 1, 7, 10**9 + 1])
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_replica_rotation_shortcut_matches_the_general_formula(rotation: int, replicas: int) -> None:
    """Column j of row i is ``cands[i, (i + rotation + j) % R]`` (two replicas take a
    shortcut without the 2-D modulo)."""
    cands = np.random.default_rng(rotation % 97).integers(0, 9, size=(41, replicas)).astype(np.int32)
    rot = (np.arange(41)[:, None] + rotation + np.arange(replicas)[None, :]) % replicas
    got = rotate_replicas(cands, rotation)
    np.testing.assert_array_equal(got, np.take_along_axis(cands, rot, axis=1))
    assert got.dtype == cands.dtype


def test_a_group_out_of_window_order_gets_its_own_bags() -> None:
    """Every caller of the window, listed out of order: each still gets its own bags."""
    rng = np.random.default_rng(5)
    callers = _callers(rng, 6)
    windows = merge_window(callers, ROWS)
    asm = {}
    for t, w in windows.items():
        a = TableAssembly(w, DIMS[t], np.ones(w.unique, np.int16))
        rows = rng.standard_normal((w.unique, DIMS[t])).astype(np.float32)
        a.put_rows(np.arange(w.unique), rows, 0, 0, np.ones(w.unique, bool), np.zeros(w.unique, bool))
        asm[t] = a
    pooling = {"item": "sum", "user": "mean"}
    order = [4, 0, 5, 2, 1, 3]
    shuffled = resolve_callers(callers, order, windows, asm, pooling)
    for c, res in zip(order, shuffled):
        alone = resolve_callers(callers, [c], windows, asm, pooling)[0]
        assert res.pooled is not None and alone.pooled is not None
        torch.testing.assert_close(res.pooled.values(), alone.pooled.values(), rtol=0, atol=0)
