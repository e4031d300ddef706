"""The lookup client against TorchRec's EmbeddingBagCollection (the oracle), through the
in-process fake fleet.

Weights are random and come straight from the source arrays the fake serves; the EBC
is built on the same arrays and fed the same KeyedJaggedTensors. Tolerances:

* fp32 sum, rows on the wire: exact (``torch.equal``): same rows, same order, same kernel;
* mean pooling: atol 1e-6 (the same kernel too, but the contract only promises closeness);
* fp16 on the wire: |err| <= bag_len * max|w| * 2^-11 (half-precision rounding per row);
* int8 rowwise on the wire: |err| <= bag_len * (row max - row min) / 255 (one code step per element);
* shard-side partial pooling: rtol 1e-5, atol 1e-5 (summation order changes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recserve.config.spec import FeatureConfig, TableConfig
from recserve.lookup.client import LookupClient
from recserve.lookup.types import LookupResult
from recserve.sharding.plan import ShardingPlan, Tier
from tests.unit.test_lookup_fakes import FEATURES, TABLES, FakeShards, make_config, make_plan, make_weights, tier_ids


def make_ebc(tables: Sequence[TableConfig], features: Sequence[FeatureConfig], weights: dict[str, np.ndarray]) -> EmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.dim,
            num_embeddings=t.rows,
            feature_names=[f.name for f in features if f.table == t.name],
            pooling=PoolingType.SUM if t.pooling == "sum" else PoolingType.MEAN,
        )
        for t in tables
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    with torch.no_grad():
        for t in tables:
            ebc.embedding_bags[t.name].weight.copy_(torch.from_numpy(weights[t.name]))
    return ebc


def random_kjt(rng: np.random.Generator, plan: ShardingPlan, freq: dict[str, np.ndarray], keys: Sequence[str], *, max_len: int = 6) -> KeyedJaggedTensor:
    """Random jagged input: B in 1..4, bag lengths 0..max_len (empty bags included), ids
    drawn from the Zipf frequencies (hot ids repeat within and across callers) mixed
    with uniform ids (every tier)."""
    table_of = {f.name: f.table for f in FEATURES}
    b = int(rng.integers(1, 5))
    lengths = rng.integers(0, max_len + 1, size=len(keys) * b)
    values = []
    for k, key in enumerate(keys):
        t = plan.table(table_of[key])
        n = int(lengths[k * b : (k + 1) * b].sum())
        p = freq[t.name] / freq[t.name].sum()
        zipf = rng.choice(t.rows, size=n, p=p)
        uniform = rng.integers(0, t.rows, size=n)
        values.append(np.where(rng.random(n) < 0.6, zipf, uniform))
    return KeyedJaggedTensor(
        keys=list(keys),
        values=torch.from_numpy(np.concatenate(values).astype(np.int64)),
        lengths=torch.from_numpy(lengths.astype(np.int64)),
    )


def ebc_pooled(ebc: EmbeddingBagCollection, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
    """EBC output for ``kjt``; features the caller did not send are given empty bags
    (an EBC needs every feature it was configured with) and left out of the answer."""
    missing = [f.name for f in FEATURES if f.name not in kjt.keys()]
    full = kjt
    if missing:
        b = kjt.stride()
        full = KeyedJaggedTensor(
            keys=kjt.keys() + missing,
            values=kjt.values(),
            lengths=torch.cat([kjt.lengths(), torch.zeros(len(missing) * b, dtype=torch.int64)]),
        )
    with torch.no_grad():
        out = ebc(full).to_dict()
    return {k: out[k] for k in kjt.keys()}


async def run_callers(client: LookupClient, kjts: Sequence[KeyedJaggedTensor], *, pooled: bool) -> list[LookupResult]:
    await client.start()
    try:
        return list(await asyncio.gather(*(client.lookup(k, pooled=pooled, timeout_s=5.0) for k in kjts)))
    finally:
        await client.aclose()


def _inputs(seed: int, n_callers: int = 12) -> tuple[ShardingPlan, dict[str, np.ndarray], list[KeyedJaggedTensor]]:
    plan, freq = make_plan()
    rng = np.random.default_rng(seed)
    all_keys = [f.name for f in FEATURES]
    kjts = []
    for c in range(n_callers):
        keys = all_keys if c % 3 else all_keys[:2]  # some callers use a subset of features
        kjts.append(random_kjt(rng, plan, freq, keys))
    return plan, freq, kjts


def _assert_inputs_cover_tiers(plan: ShardingPlan, kjts: Sequence[KeyedJaggedTensor]) -> None:
    table_of = {f.name: f.table for f in FEATURES}
    seen: dict[str, list[np.ndarray]] = {}
    for k in kjts:
        for key, jt in k.to_dict().items():
            seen.setdefault(table_of[key], []).append(jt.values().numpy())
    for table in ("item", "wide"):
        ids = np.concatenate(seen[table])
        tiers = plan.router(table).tier_of(ids)
        assert set(np.unique(tiers).tolist()) == {Tier.HOT, Tier.WARM, Tier.COLD}, table


def test_pooled_fp32_sum_equals_torchrec_exactly() -> None:
    plan, _, kjts = _inputs(seed=3)
    _assert_inputs_cover_tiers(plan, kjts)
    weights = make_weights()
    fake = FakeShards(plan, weights)
    client = LookupClient(make_config(), plan, fake)
    results = asyncio.run(run_callers(client, kjts, pooled=True))
    ebc = make_ebc(TABLES, FEATURES, weights)
    sum_features = {"item_id", "hist_items", "wide_tag"}
    for kjt, res in zip(kjts, results):
        assert res.pooled is not None and not res.degraded
        want = ebc_pooled(ebc, kjt)
        got = res.pooled.to_dict()
        assert list(got) == kjt.keys()
        for key in kjt.keys():
            assert got[key].shape == want[key].shape
            if key in sum_features:
                assert torch.equal(got[key], want[key]), key
            else:
                torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6)
    assert client.stats.dedup_ratio > 1.0  # repeated ids within and across callers were merged
    assert len({c.shard for c in fake.calls}) >= 2


def test_unpooled_rows_are_the_source_rows() -> None:
    plan, _, kjts = _inputs(seed=4, n_callers=6)
    weights = make_weights()
    fake = FakeShards(plan, weights)
    client = LookupClient(make_config(), plan, fake)
    results = asyncio.run(run_callers(client, kjts, pooled=False))
    table_of = {f.name: f.table for f in FEATURES}
    for kjt, res in zip(kjts, results):
        assert res.pooled is None
        for key, jt in kjt.to_dict().items():
            ids = jt.values().numpy()
            assert torch.equal(res.rows[key], torch.from_numpy(weights[table_of[key]][ids]))
            assert torch.equal(res.lengths[key], jt.lengths())


def test_mixed_pooled_and_unpooled_callers_in_one_window() -> None:
    plan, _, kjts = _inputs(seed=5, n_callers=8)
    weights = make_weights()
    client = LookupClient(make_config(), plan, FakeShards(plan, weights))
    ebc = make_ebc(TABLES, FEATURES, weights)

    async def go() -> list[LookupResult]:
        await client.start()
        try:
            return list(await asyncio.gather(*(client.lookup(k, pooled=i % 2 == 0, timeout_s=5.0) for i, k in enumerate(kjts))))
        finally:
            await client.aclose()

    results = asyncio.run(go())
    assert client.stats.windows == 1
    table_of = {f.name: f.table for f in FEATURES}
    for i, (kjt, res) in enumerate(zip(kjts, results)):
        if i % 2 == 0:
            assert res.pooled is not None
            want = ebc_pooled(ebc, kjt)
            for key in ("item_id", "hist_items", "wide_tag"):
                if key in want:
                    assert torch.equal(res.pooled.to_dict()[key], want[key])
        else:
            for key, jt in kjt.to_dict().items():
                assert torch.equal(res.rows[key], torch.from_numpy(weights[table_of[key]][jt.values().numpy()]))


def _tolerance(kjt: KeyedJaggedTensor, weights: dict[str, np.ndarray], per_row: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Per feature [B, 1] bound: sum over the bag of the per-row error bound."""
    table_of = {f.name: f.table for f in FEATURES}
    out = {}
    for key, jt in kjt.to_dict().items():
        bound = torch.from_numpy(per_row[table_of[key]][jt.values().numpy()])
        out[key] = torch.zeros(jt.lengths().shape[0], 1, dtype=torch.float32).index_add_(
            0, torch.repeat_interleave(torch.arange(jt.lengths().shape[0]), jt.lengths()), bound[:, None]
        )
    return out


def test_fp16_and_int8_wire_within_stated_tolerance() -> None:
    plan, _, kjts = _inputs(seed=6, n_callers=6)
    weights = make_weights()
    ebc = make_ebc(TABLES, FEATURES, weights)
    bounds = {
        "float16": {t: np.abs(w).max(axis=1) * 2.0**-11 for t, w in weights.items()},
        "int8": {t: (w.max(axis=1) - w.min(axis=1)) / 255.0 + 1e-6 for t, w in weights.items()},
    }
    for dtype, per_row in bounds.items():
        client = LookupClient(make_config(row_dtype=dtype), plan, FakeShards(plan, weights))
        results = asyncio.run(run_callers(client, kjts, pooled=True))
        for kjt, res in zip(kjts, results):
            assert res.pooled is not None
            want = ebc_pooled(ebc, kjt)
            tol = _tolerance(kjt, weights, per_row)
            for key in kjt.keys():
                err = (res.pooled.to_dict()[key] - want[key]).abs()
                if key == "user_id":  # mean pooling: the bound divides by the bag length
                    lens = kjt.to_dict()[key].lengths().clamp(min=1)[:, None].float()
                    assert bool((err <= tol[key] / lens + 1e-6).all()), (dtype, key)
                else:
                    assert bool((err <= tol[key] + 1e-6).all()), (dtype, key)
                assert float(err.max()) > 0 or dtype == "float16"  # int8 really was lossy


def test_shard_side_partial_pooling_within_tolerance() -> None:
    plan, _, kjts = _inputs(seed=7, n_callers=8)
    weights = make_weights()
    fake = FakeShards(plan, weights)
    client = LookupClient(make_config(partial_pooling=True), plan, fake)
    results = asyncio.run(run_callers(client, kjts, pooled=True))
    assert all(c.request.pooled for c in fake.calls)
    ebc = make_ebc(TABLES, FEATURES, weights)
    for kjt, res in zip(kjts, results):
        assert res.pooled is not None and not res.degraded
        want = ebc_pooled(ebc, kjt)
        for key in kjt.keys():
            torch.testing.assert_close(res.pooled.to_dict()[key], want[key], rtol=1e-5, atol=1e-5)


def test_ids_in_every_tier_reach_owning_shards_only() -> None:
    plan, _, kjts = _inputs(seed=8, n_callers=6)
    fake = FakeShards(plan, make_weights())
    client = LookupClient(make_config(), plan, fake)
    asyncio.run(run_callers(client, kjts, pooled=True))
    for call in fake.calls:
        for t in call.request.tables:
            from recserve.rpc.tensors import unpack

            ids = unpack(t.ids, "ids")
            k = plan.table(t.table).slice_of(t.col_start, t.col_end)
            assert plan.router(t.table).owns(call.shard, ids, k).all()
    hot = tier_ids(plan, "item", Tier.HOT)
    sent_hot = np.concatenate([c.ids("item") for c in fake.calls])
    assert np.isin(hot, sent_hot).any()
