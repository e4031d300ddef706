"""Shard-side partial pooling when rows go missing or arrive twice (issue 8).

* A warm row cut into column slices counts only if every slice arrives: with one
  slice's shard down, pooled output must leave the whole row out (its default row, 0),
  exactly as unpooled mode does — checked against TorchRec's EmbeddingBagCollection on
  weights whose lost rows are zeroed (the default row), within partial pooling's stated
  tolerance (rtol 1e-5, atol 1e-5).
* A late primary's partial sum and a hedge's rows may both deliver a row: every row must
  be counted once, and the primary's other rows kept.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recserve.lookup.client import LookupClient
from recserve.lookup.reassemble import TableAssembly, resolve_callers
from recserve.lookup.types import CallerLookup, LookupResult, TableInput
from recserve.lookup.window import merge_window
from recserve.sharding.plan import Tier
from tests.unit.test_lookup_client import lost_count, lost_mask, run
from tests.unit.test_lookup_fakes import FEATURES, TABLES, FakeShards, make_config, make_plan, make_weights, tier_ids
from tests.unit.test_lookup_oracle import ebc_pooled, make_ebc, random_kjt


def test_partial_pooling_leaves_a_half_arrived_warm_row_out_of_every_column() -> None:
    plan, freq = make_plan()
    weights = make_weights()
    dead = 1
    rng = np.random.default_rng(31)
    keys = [f.name for f in FEATURES]
    kjts = [random_kjt(rng, plan, freq, keys, max_len=8) for _ in range(10)]
    table_of = {f.name: f.table for f in FEATURES}
    wide_ids = np.concatenate([k.to_dict()["wide_tag"].values().numpy() for k in kjts])
    r = plan.router("wide")
    half = (r.tier_of(wide_ids) == Tier.WARM) & lost_mask(plan, "wide", wide_ids, {dead})
    assert half.sum() >= 3  # warm rows with one slice on the dead shard and one on a live one
    assert (np.isin(r.warm_shards_of(wide_ids[half]), [dead]).sum(axis=1) == 1).all()

    # The oracle: the source weights with every row that cannot arrive set to the default row.
    lost_weights = {t.name: np.where(lost_mask(plan, t.name, np.arange(t.rows), {dead})[:, None], np.float32(0), weights[t.name]) for t in TABLES}
    ebc = make_ebc(TABLES, FEATURES, lost_weights)
    outputs: dict[bool, list[LookupResult]] = {}
    for partial in (True, False):
        fake = FakeShards(plan, weights)
        fake.set_down(dead)  # fails in the first window: every breaker is still closed
        client = LookupClient(make_config(partial_pooling=partial), plan, fake)

        async def body(client: LookupClient = client) -> list[LookupResult]:
            return list(await asyncio.gather(*(client.lookup(k, pooled=True, timeout_s=5.0) for k in kjts)))

        outputs[partial] = run(client, body)
        assert client.stats.windows == 1 and fake.rpcs(dead) >= 1
        assert all(c.request.pooled == partial for c in fake.calls if c.shard == dead)

    for kjt, res, unsplit in zip(kjts, outputs[True], outputs[False]):
        assert res.pooled is not None and unsplit.pooled is not None
        want = ebc_pooled(ebc, kjt)
        expect_missing = sum(lost_count(plan, table_of[key], jt.values().numpy(), {dead}) for key, jt in kjt.to_dict().items())
        assert res.missing == expect_missing == unsplit.missing
        for key in kjt.keys():
            torch.testing.assert_close(res.pooled.to_dict()[key], want[key], rtol=1e-5, atol=1e-5)
            # and the same as without shard-side pooling
            torch.testing.assert_close(res.pooled.to_dict()[key], unsplit.pooled.to_dict()[key], rtol=1e-5, atol=1e-5)


def test_a_late_primary_keeps_the_rows_its_hedge_did_not_bring() -> None:
    """Primary RPC to shard A: hot rows h1 (other replica B) and h2 (other replica C) in
    one unit, and cold row c (only on A). A is late, so its hot rows are hedged — but the
    budget pays one hedge RPC only, so one hot row comes back through a hedge and the other
    does not. Then A answers with partial sums over all three: the rows the hedge did not
    bring must be kept from it, and the hedged row counted once."""
    plan, _ = make_plan()
    weights = make_weights()
    fake = FakeShards(plan, weights)
    client = LookupClient(make_config(partial_pooling=True, hedge_burst=1.0), plan, fake)
    router = plan.router("item")
    hot = tier_ids(plan, "item", Tier.HOT)
    cold = tier_ids(plan, "item", Tier.COLD)
    a = 0
    replicas = np.sort(router.hot_replicas_of(hot), axis=1)
    h1 = int(hot[(replicas == [0, 1]).all(axis=1)][0])
    h2 = int(hot[(replicas == [0, 2]).all(axis=1)][0])
    c = int(cold[router.cold_owners_of(cold)[:, 0] == a][0])
    # Only c's shard is contacted, so both hot rows join it (too few to open an RPC to
    # another shard). Two bags; h1 and h2 repeat, so a double count would show.
    kjt = KeyedJaggedTensor(keys=["item_id"], values=torch.tensor([h1, c, h2, h1, h2]), lengths=torch.tensor([4, 1]))

    async def body() -> LookupResult:
        fake.set_blocked(a)
        pending = asyncio.ensure_future(client.lookup(kjt, pooled=True, timeout_s=5.0))
        rt = client.runtime
        # Until the one hedge was sent and its reply taken (only A's ids still in flight).
        while not (client.stats.rpcs_hedge == 1 and int(rt.inflight_ids.sum()) == int(rt.inflight_ids[a])):
            await asyncio.sleep(0)
        fake.release(a)
        return await pending

    result = run(client, body)
    assert [c_.shard for c_ in fake.calls][0] == a and len(fake.calls) == 2  # one primary (to A), one hedge
    assert client.stats.hedges_denied == 1  # the other hot row was not hedged
    assert not result.degraded and result.missing == 0  # kept from A's reply
    assert result.pooled is not None
    w = weights["item"]
    want = torch.from_numpy(np.stack([w[h1] + w[c] + w[h2] + w[h1], w[h2]]))
    torch.testing.assert_close(result.pooled["item_id"], want, rtol=1e-5, atol=1e-5)  # each row once per occurrence
    assert fake.calls[0].request.pooled and not fake.calls[1].request.pooled  # how: the hedge asked for rows


def _one_caller(ids: list[int], lengths: list[int]) -> CallerLookup:
    arr = np.array(ids, dtype=np.int64)
    part = TableInput(features=("f",), ids=arr, lengths=np.array(lengths, dtype=np.int64), feature_counts=np.array([arr.size], dtype=np.int64))
    return CallerLookup(keys=("f",), batch_size=len(lengths), tables={"t": part}, pooled=True, deadline=math.inf, n_ids=arr.size)


def test_a_partial_sum_and_hedged_rows_count_each_row_once_in_either_order() -> None:
    rng = np.random.default_rng(5)
    table = rng.standard_normal((10, 4)).astype(np.float32)
    caller = _one_caller([7, 1, 7, 3, 5, 1], [3, 0, 2, 1])
    w = merge_window([caller])["t"]  # unique ids [1, 3, 5, 7]
    every = np.arange(w.unique)
    offsets = torch.from_numpy(np.concatenate(([0], np.cumsum(w.bag_lengths)[:-1])))
    # The primary's partial sums over every row, as a shard computes them.
    primary = F.embedding_bag(torch.from_numpy(w.inverse), torch.from_numpy(table[w.unique_ids]), offsets, mode="sum").numpy()
    want = torch.from_numpy(primary)
    hedged = np.array([1, 3])  # a hedge brought unique rows 3 and 7 as rows
    yes, no = np.ones(every.size, bool), np.zeros(every.size, bool)
    for order in ("hedge first", "primary first"):
        asm = TableAssembly(w, 4, np.ones(w.unique, np.int16), partial=True)
        steps = [
            lambda: asm.put_rows(hedged, table[w.unique_ids[hedged]], 0, 0, yes[: hedged.size], no[: hedged.size]),
            lambda: asm.put_partial(every, primary, yes, no),
        ]
        for step in steps if order == "hedge first" else steps[::-1]:
            step()
        assert asm.complete().all(), order
        res = resolve_callers([caller], [0], {"t": w}, {"t": asm}, {"t": "sum"})[0]
        assert res.pooled is not None and res.missing == 0
        torch.testing.assert_close(res.pooled["f"], want, rtol=1e-6, atol=1e-6, msg=order)
