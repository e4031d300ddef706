"""Cheap windows (issue 9): the fast reassembly paths give exactly the general answers.

``resolve_callers`` splits one embedding_bag per table into per-caller views, and
builds results with no tensor op for the common single-feature caller. Over random
windows (mixed pooled / unpooled callers, several features on one table, two tables,
sum and mean pooling) with partial arrivals (rows never sent, rows a shard does not own,
rows not found, warm rows with a column slice missing, near-cache rows), every
grouping — the whole window at once, a shuffled subset, one caller at a time — must
give bit-for-bit the same results, and those must equal TorchRec's
``EmbeddingBagCollection`` (pooled) / a plain gather (unpooled) over the table as it
arrived: rows that never completed are the default row (zeros) and counted as missing.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recserve.lookup.reassemble import TableAssembly, resolve_callers
from recserve.lookup.types import CallerLookup, LookupResult
from recserve.lookup.validate import validate_features
from recserve.lookup.window import TableWindow, merge_window

TABLE_OF = {"item_id": "item", "hist": "item", "user_id": "user"}
ROWS = {"item": 60, "user": 9}
DIMS = {"item": 6, "user": 4}
POOLING = {"item": "sum", "user": "mean"}
SPLITS = 2  # warm rows of ``item`` travel as 2 column slices


def _callers(rng: np.random.Generator, n: int, *, pooled: bool | None, keys: list[str] | None = None) -> list[CallerLookup]:
    """``n`` validated callers: 1-3 features (``keys`` fixes them), B = 1..3, bags of
    0..4 ids; ``pooled`` None mixes pooled and unpooled callers."""
    out = []
    for _ in range(n):
        ks = keys if keys is not None else list(rng.choice(list(TABLE_OF), size=int(rng.integers(1, 4)), replace=False))
        b = int(rng.integers(1, 4))
        lengths = rng.integers(0, 5, size=b * len(ks)).tolist()
        values: list[int] = []
        for k, key in enumerate(ks):
            values += rng.integers(0, ROWS[TABLE_OF[key]], size=sum(lengths[k * b : (k + 1) * b])).tolist()
        kjt = KeyedJaggedTensor(keys=ks, values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths, dtype=torch.int64))
        p = bool(rng.integers(0, 2)) if pooled is None else pooled
        out.append(validate_features(kjt, table_of_feature=TABLE_OF, table_rows=ROWS, pooled=p, deadline=math.inf))
    return out


def _arrive(rng: np.random.Generator, w: TableWindow, dim: int, *, partial_arrivals: bool) -> tuple[TableAssembly, np.ndarray, np.ndarray]:
    """A table's assembly after replies like a window's: (assembly, the table as it
    arrived fp32 [rows, D] with incomplete rows zero, bool [rows] ids flagged not found).

    With ``partial_arrivals``: some rows come from the near cache, some never arrive,
    some are answered by a shard that does not own them (not taken, then never sent
    again), some are not found (zeros, counted), and (``item``) some are warm rows cut
    into column slices of which one never arrives."""
    u = w.unique
    values = rng.standard_normal((u, dim)).astype(np.float32)
    need = np.ones(u, np.int16)
    kind = rng.integers(0, 6, size=u) if partial_arrivals else np.zeros(u, np.int64)
    if w.table != "item":
        kind[kind >= 4] = 0  # no column splits on ``user``
    # 0: full row, 1: near cache, 2: never sent, 3: not owned, 4: warm both slices, 5: warm one slice
    need[kind >= 4] = SPLITS
    asm = TableAssembly(w, dim, need)
    pos = np.arange(u, dtype=np.int64)
    found = rng.random(u) > 0.2 if partial_arrivals else np.ones(u, bool)
    values[~found] = 0.0  # a shard's default row
    cached = pos[kind == 1]
    asm.put_cached(cached, values[cached])
    found[kind == 1] = True  # near-cache rows are stored rows
    full = pos[kind == 0]
    asm.put_rows(full, values[full], 0, 0, found[full], np.zeros(full.size, bool))
    not_owned = pos[kind == 3]
    assert asm.put_rows(not_owned, values[not_owned], 0, 0, found[not_owned], np.ones(not_owned.size, bool)) == 0
    half = dim // SPLITS
    for lo, hi, rows in ((0, half, pos[kind >= 4]), (half, dim, pos[kind == 4])):
        asm.put_rows(rows, values[rows, lo:hi], lo, hi, found[rows], np.zeros(rows.size, bool))
    complete = np.isin(kind, (0, 1, 4))
    table = np.zeros((ROWS[w.table], dim), np.float32)
    table[w.unique_ids[complete]] = values[complete]
    not_found = np.zeros(ROWS[w.table], bool)
    taken = kind != 2
    taken &= kind != 3
    not_found[w.unique_ids[taken & ~found]] = True
    return asm, table, not_found


def _ebc(tables: dict[str, np.ndarray]) -> EmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(
            name=t,
            embedding_dim=DIMS[t],
            num_embeddings=ROWS[t],
            feature_names=[f for f, tt in TABLE_OF.items() if tt == t],
            pooling=PoolingType.SUM if POOLING[t] == "sum" else PoolingType.MEAN,
        )
        for t in tables
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    with torch.no_grad():
        for t, weights in tables.items():
            ebc.embedding_bags[t].weight.copy_(torch.from_numpy(weights))
    return ebc


def _features(caller: CallerLookup) -> dict[str, tuple[str, np.ndarray, np.ndarray]]:
    """feature -> (table, ids [L_f], lengths [B]) of a validated caller."""
    out = {}
    b = caller.batch_size
    for table, part in caller.tables.items():
        start = 0
        for k, (f, n) in enumerate(zip(part.features, part.feature_counts.tolist())):
            out[f] = (table, part.ids[start : start + n], part.lengths[k * b : (k + 1) * b])
            start += n
    return out


def _check_oracle(caller: CallerLookup, res: LookupResult, ebc: EmbeddingBagCollection, tables: dict[str, np.ndarray], nf: dict[str, np.ndarray], missing_rows: dict[str, np.ndarray]) -> None:
    """One caller's result against the oracle over the table as it arrived."""
    feats = _features(caller)
    b = caller.batch_size
    want_missing = {f: int(missing_rows[t][ids].sum()) for f, (t, ids, _) in feats.items()}
    assert res.missing_by_feature == {f: want_missing[f] for f in caller.keys}
    assert res.missing == sum(want_missing.values()) and res.degraded == (res.missing > 0)
    assert res.not_found == sum(int(nf[t][ids].sum()) for t, ids, _ in feats.values())
    for f, (t, ids, lengths) in feats.items():
        if want_missing[f]:
            bag_of = np.repeat(np.arange(b), lengths)
            np.testing.assert_array_equal(res.missing_bags[f], np.bincount(bag_of[missing_rows[t][ids]], minlength=b))
        else:
            assert f not in res.missing_bags
    if caller.pooled:
        assert res.pooled is not None and not res.rows and not res.lengths
        every = list(TABLE_OF)
        lengths = np.concatenate([feats[f][2] if f in feats else np.zeros(b, np.int64) for f in every])
        values = np.concatenate([feats[f][1] for f in every if f in feats])
        kjt = KeyedJaggedTensor(keys=every, values=torch.from_numpy(values.astype(np.int64)), lengths=torch.from_numpy(lengths.astype(np.int64)))
        with torch.no_grad():
            want = ebc(kjt).to_dict()
        assert res.pooled.keys() == list(caller.keys)
        assert res.pooled.length_per_key() == [DIMS[TABLE_OF[f]] for f in caller.keys]
        got = res.pooled.to_dict()
        for f in caller.keys:
            # fp32 sums: bit-exact (same rows, order and kernel); means within 1e-6, as
            # the client's TorchRec oracle test allows (EBC divides in its own order).
            torch.testing.assert_close(got[f], want[f], rtol=0, atol=0 if POOLING[TABLE_OF[f]] == "sum" else 1e-6)
    else:
        assert res.pooled is None and set(res.rows) == set(res.lengths) == set(feats)
        for f, (t, ids, lengths) in feats.items():
            torch.testing.assert_close(res.rows[f], torch.from_numpy(tables[t][ids]), rtol=0, atol=0)
            torch.testing.assert_close(res.lengths[f], torch.from_numpy(lengths.copy()), rtol=0, atol=0)


def _same(a: LookupResult, b: LookupResult) -> None:
    """Bit-for-bit equal results."""
    assert (a.missing, a.missing_by_feature, a.not_found) == (b.missing, b.missing_by_feature, b.not_found)
    assert a.missing_bags.keys() == b.missing_bags.keys()
    for f in a.missing_bags:
        np.testing.assert_array_equal(a.missing_bags[f], b.missing_bags[f])
    assert (a.pooled is None) == (b.pooled is None)
    if a.pooled is not None and b.pooled is not None:
        assert a.pooled.keys() == b.pooled.keys() and a.pooled.length_per_key() == b.pooled.length_per_key()
        assert torch.equal(a.pooled.values(), b.pooled.values())
    assert a.rows.keys() == b.rows.keys() and a.lengths.keys() == b.lengths.keys()
    for f in a.rows:
        assert torch.equal(a.rows[f], b.rows[f]) and torch.equal(a.lengths[f], b.lengths[f])


def _arrive_window(
    rng: np.random.Generator, callers: list[CallerLookup], *, partial_arrivals: bool
) -> tuple[dict[str, TableWindow], dict[str, TableAssembly], dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(windows, asm, tables, nf, missing_rows) per table of ``callers``' merged window
    whose rows arrived as :func:`_arrive` makes them; ``missing_rows[t]`` bool [rows]
    marks the rows that never arrived."""
    windows = merge_window(callers, ROWS)
    asm, tables, nf, missing_rows = {}, {}, {}, {}
    for t, w in windows.items():
        asm[t], tables[t], nf[t] = _arrive(rng, w, DIMS[t], partial_arrivals=partial_arrivals)
        missing_rows[t] = np.zeros(ROWS[t], bool)
        missing_rows[t][w.unique_ids[~asm[t].complete()]] = True
    return windows, asm, tables, nf, missing_rows


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pooled", [True, False, None], ids=["pooled", "unpooled", "mixed"])
@pytest.mark.parametrize("partial_arrivals", [False, True], ids=["all-arrived", "partial-arrivals"])
def test_every_grouping_of_a_random_window_equals_the_oracle(seed: int, pooled: bool | None, partial_arrivals: bool) -> None:
    rng = np.random.default_rng(seed)
    # Seeds 0-1: one-feature callers of one table (the fast path's own shape); others mixed.
    keys = ["item_id"] if seed < 2 else None
    callers = _callers(rng, int(rng.integers(1, 13)), pooled=pooled, keys=keys)
    windows, asm, tables, nf, missing_rows = _arrive_window(rng, callers, partial_arrivals=partial_arrivals)
    if partial_arrivals:  # the window really exercises the missing-row paths
        assert any(m.any() for m in missing_rows.values())
    ebc = _ebc({t: tables.get(t, np.zeros((ROWS[t], DIMS[t]), np.float32)) for t in ROWS})
    pooling = {t: POOLING[t] for t in windows}
    n = len(callers)
    whole = resolve_callers(callers, list(range(n)), windows, asm, pooling)
    assert len(whole) == n
    for caller, res in zip(callers, whole):
        _check_oracle(caller, res, ebc, tables, nf, missing_rows)
    subset = [int(c) for c in rng.permutation(n)[: max(1, n // 2)]]
    for c, res in zip(subset, resolve_callers(callers, subset, windows, asm, pooling)):
        _same(res, whole[c])
    for c in range(n):
        _same(resolve_callers(callers, [c], windows, asm, pooling)[0], whole[c])


def test_results_of_a_window_do_not_share_mutable_state() -> None:
    """Per-caller dicts are the caller's own, and pooled values never alias the
    window's row matrix: a later reply into the window leaves resolved results alone."""
    rng = np.random.default_rng(11)
    callers = _callers(rng, 4, pooled=True, keys=["item_id"]) + _callers(rng, 2, pooled=False, keys=["item_id"])
    windows = merge_window(callers, ROWS)
    w = windows["item"]
    asm = TableAssembly(w, DIMS["item"], np.ones(w.unique, np.int16))
    every = np.arange(w.unique)
    asm.put_rows(every, np.ones((w.unique, DIMS["item"]), np.float32), 0, 0, np.ones(w.unique, bool), np.zeros(w.unique, bool))
    results = resolve_callers(callers, list(range(len(callers))), windows, {"item": asm}, {"item": "sum"})
    before = [(r.pooled.values().clone() if r.pooled is not None else None, {f: t.clone() for f, t in r.rows.items()}) for r in results]
    asm.put_rows(every, np.full((w.unique, DIMS["item"]), 7.0, np.float32), 0, 0, np.ones(w.unique, bool), np.zeros(w.unique, bool))
    for r, (pooled, rows) in zip(results, before):
        if pooled is not None:
            assert r.pooled is not None and torch.equal(r.pooled.values(), pooled)
        for f, t in rows.items():
            assert torch.equal(r.rows[f], t)
    results[0].missing_by_feature["item_id"] = 99
    results[0].missing_bags["item_id"] = np.zeros(1, np.int64)
    results[0].rows["x"] = torch.zeros(1)
    assert all(r.missing_by_feature == {"item_id": 0} and not r.missing_bags and "x" not in r.rows for r in results[1:])


def test_a_half_arrived_warm_row_is_the_default_row_in_every_column() -> None:
    """The "full rows only" shortcut of ``rows_for_use`` must not hide a warm row of
    which one column slice arrived: it pools as zeros and counts as missing."""
    kjt = KeyedJaggedTensor(keys=["item_id"], values=torch.tensor([5, 8, 5]), lengths=torch.tensor([2, 0, 1]))
    caller = validate_features(kjt, table_of_feature=TABLE_OF, table_rows=ROWS, pooled=True, deadline=math.inf)
    w = merge_window([caller], ROWS)["item"]
    need = np.full(w.unique, SPLITS, np.int16)
    asm = TableAssembly(w, DIMS["item"], need)
    half = DIMS["item"] // SPLITS
    asm.put_rows(np.arange(w.unique), np.ones((w.unique, half), np.float32), 0, half, np.ones(w.unique, bool), np.zeros(w.unique, bool))
    res = resolve_callers([caller], [0], {"item": w}, {"item": asm}, {"item": "sum"})[0]
    assert res.pooled is not None and res.missing == 3 and res.missing_bags["item_id"].tolist() == [2, 0, 1]
    assert res.pooled.values().shape == (3, DIMS["item"]) and not res.pooled.values().any()
