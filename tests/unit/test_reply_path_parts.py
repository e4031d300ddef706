"""Cheap windows (issue 9): the reply path's lean parts give exactly the general answers.

- ``WindowRun._settled_callers`` reads which rows are still on the wire from the
  unfinished calls' units (no per-row in-flight counter scattered at every send and
  reply); on random windows with overlapping hedges and finished calls it must settle
  exactly the callers the counter rule settles (an oracle written per caller here).
- ``NearCache.fill`` takes every row at once when no row was invalidated since the
  send; with invalidated and uncached slots mixed in it must store exactly the rows
  whose version is unchanged, as the masked path does.
- ``_pool_rows`` calls embedding_bag's ATen op directly; it must equal
  ``F.embedding_bag`` bit for bit (sum, mean, empty bags, caller selections).
- The reply path's near-cache fill skips its masks for the common reply; a reply with
  rows not found must still leave those rows out of the cache (client over the fake
  fleet: the next lookup fetches exactly them again).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recserve.config.spec import LookupConfig
from recserve.lookup.client import LookupClient
from recserve.lookup.fanout import WindowRun, _Call
from recserve.lookup.near_cache import NearCache
from recserve.lookup.reassemble import TableAssembly, _pool_rows, _segments
from recserve.lookup.route import FetchUnit
from recserve.lookup.window import TableWindow, merge_window
from recserve.sharding.plan import Tier
from tests.unit.test_lookup_fakes import FakeShards, make_config, make_plan, make_weights, tier_ids
from tests.unit.test_reassemble_fast import DIMS, _callers


def _random_calls(rng: np.random.Generator, windows: dict[str, TableWindow]) -> dict[Any, _Call]:
    """1-5 calls over random subsets of each table's rows (hedges overlap primaries),
    each finished or not."""
    calls: dict[Any, _Call] = {}  # keyed like WindowRun.calls (tasks); any key will do
    for _ in range(int(rng.integers(1, 6))):
        units = []
        for table, w in windows.items():
            if rng.random() < 0.3:
                continue
            pos = np.flatnonzero(rng.random(w.unique) < rng.random()).astype(np.int64)
            units.append(FetchUnit(0, table, pos))
        calls[object()] = _Call(0, units, sum(len(u) for u in units), 0.0, math.inf, False, finished=bool(rng.random() < 0.4))
    return calls


def _settled_oracle(run: WindowRun) -> np.ndarray:
    """The counter rule, per caller: a row is open while incomplete with an in-flight
    count > 0 (every unfinished call's units counted); a caller is settled when none of
    its occurrences is open."""
    out = np.ones(len(run.callers), dtype=bool)
    for table, w in run.windows.items():
        inflight = np.zeros(w.unique, dtype=np.int64)
        for call in run.calls.values():
            for u in call.units:
                if not call.finished and u.table == table:
                    np.add.at(inflight, u.positions, 1)
        asm = run.asm[table]
        open_rows = (asm.got < asm.need) & (inflight > 0)
        for c in range(len(run.callers)):
            if open_rows[w.inverse[w.id_offsets[c] : w.id_offsets[c + 1]]].any():
                out[c] = False
    return out


@pytest.mark.parametrize("seed", range(40))
def test_settled_callers_from_unfinished_calls_match_the_in_flight_counter_rule(seed: int) -> None:
    rng = np.random.default_rng(seed)
    callers = _callers(rng, int(rng.integers(1, 12)), pooled=None)
    windows = merge_window(callers)
    run = WindowRun.__new__(WindowRun)  # only the state _settled_callers reads
    run.callers, run.windows, run.asm = callers, windows, {}
    for table, w in windows.items():
        need = rng.integers(1, 3, size=w.unique).astype(np.int16)
        asm = TableAssembly(w, DIMS[table], need)
        asm.got[:] = rng.integers(0, 3, size=w.unique).clip(max=need)
        run.asm[table] = asm
    run.calls = _random_calls(rng, windows)
    np.testing.assert_array_equal(run._settled_callers(), _settled_oracle(run))
    for call in run.calls.values():  # every reply in: nobody waits for anything
        call.finished = True
    assert run._settled_callers().all()


def test_settled_callers_oracle_sees_open_rows() -> None:
    """The random cases above include unsettled callers (the comparison is not vacuous)."""
    unsettled = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        callers = _callers(rng, int(rng.integers(1, 12)), pooled=None)
        windows = merge_window(callers)
        run = WindowRun.__new__(WindowRun)
        run.callers, run.windows = callers, windows
        run.asm = {t: TableAssembly(w, DIMS[t], np.ones(w.unique, np.int16)) for t, w in windows.items()}
        run.calls = _random_calls(rng, windows)
        unsettled += int((~_settled_oracle(run)).sum())
    assert unsettled > 20


@pytest.mark.parametrize("invalidate", [False, True])
def test_near_cache_fill_stores_exactly_the_rows_not_invalidated_since_the_send(invalidate: bool) -> None:
    rng = np.random.default_rng(3 + invalidate)
    ids = np.sort(rng.choice(1000, size=50, replace=False)).astype(np.int64)
    cache = NearCache({"t": (ids, 4)}, staleness_s=10.0)
    asked = np.concatenate((rng.choice(ids, size=30, replace=False), [1001, 1002] if invalidate else []))
    asked = asked.astype(np.int64)
    slot = cache.slots("t", asked)
    version = cache.versions("t", slot)
    gone = asked[: 10] if invalidate else asked[:0]
    cache.invalidate("t", gone)  # an upsert between the send and the reply
    rows = rng.standard_normal((asked.shape[0], 4)).astype(np.float32)
    stored = cache.fill("t", slot, version, rows, now=5.0)
    keep = (slot >= 0) & ~np.isin(asked, gone)
    assert stored == int(keep.sum())
    hit, got_rows, _ = cache.get("t", asked, now=5.0)
    np.testing.assert_array_equal(hit, keep)
    np.testing.assert_array_equal(got_rows, rows[keep])


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("seed", range(6))
def test_pool_rows_is_f_embedding_bag_bit_for_bit(mode: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    callers = _callers(rng, 9, pooled=True, keys=["item_id", "hist"])  # empty bags among them
    w = merge_window(callers)["item"]
    rows = rng.standard_normal((w.unique, DIMS["item"])).astype(np.float32)
    whole = F.embedding_bag(torch.from_numpy(w.inverse), torch.from_numpy(rows), torch.from_numpy(w.bag_starts()), mode=mode)
    assert torch.equal(_pool_rows(w, None, None, rows, mode), whole)
    assert (w.bag_lengths == 0).any()
    sel = np.array([4, 1, 7], dtype=np.int64)
    bag_sel = _segments(w.bag_offsets[sel], w.bag_offsets[sel + 1])
    inv = w.inverse[_segments(w.id_offsets[sel], w.id_offsets[sel + 1])]
    lens = w.bag_lengths[bag_sel]
    offsets = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
    want = F.embedding_bag(torch.from_numpy(inv), torch.from_numpy(rows), torch.from_numpy(offsets), mode=mode)
    assert torch.equal(_pool_rows(w, sel, bag_sel, rows, mode), want)


def test_rows_a_shard_did_not_find_are_not_filled_into_the_near_cache() -> None:
    plan, _ = make_plan()
    weights = make_weights()
    fake = FakeShards(plan, weights)
    hot = tier_ids(plan, "item", Tier.HOT)[:12]
    missing = hot[[2, 5, 9]]
    fake.set_missing("item", missing)
    client = LookupClient(make_config(lookup=LookupConfig(near_cache_rows=1000, near_cache_staleness_ms=60_000)), plan, fake)
    kjt = KeyedJaggedTensor(keys=["item_id"], values=torch.tensor(hot), lengths=torch.tensor([hot.shape[0]]))

    async def body() -> tuple[np.ndarray, torch.Tensor]:
        await client.start()
        try:
            await client.lookup(kjt, pooled=False, timeout_s=1)
            fake.reset_calls()
            second = await client.lookup(kjt, pooled=False, timeout_s=1)
            refetched = np.unique(np.concatenate([c.ids("item") for c in fake.calls])) if fake.calls else np.zeros(0, np.int64)
            return refetched, second.rows["item_id"]
        finally:
            await client.aclose()

    refetched, rows = asyncio.run(body())
    np.testing.assert_array_equal(refetched, np.sort(missing))  # found rows came from the cache
    want = weights["item"][hot].copy()
    want[np.isin(hot, missing)] = 0.0
    assert torch.equal(rows, torch.from_numpy(want))
