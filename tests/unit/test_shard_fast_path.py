"""The shard's lookup fast paths answer byte for byte what a per-id oracle does.

``TableTiers`` answers from a dense id map when the table is small and from the sorted
owned-id index otherwise; a table entry served by one tier skips the per-tier split
and the reply scatter. The oracle here is the source array and the layout, read one id
at a time (no code under test), and the expected reply is packed with ``pack`` into a
``LookupResponse`` whose serialised bytes must equal the shard's. Real RocksDB in a
temp dir; no sockets, no processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import embedding_server.table as table_mod
from embedding_server.bulk_load import bulk_load
from embedding_server.layout import TableLayout, layouts_from_plan
from embedding_server.quant import RowDType
from embedding_server.shard import ShardCore
from embedding_server.store import RowStore
from embedding_server.table import DENSE_INDEX_BYTES_PER_ROW, dense_index_fits
from recserve.errors import InvalidArgument
from recserve.rpc.tensors import pack, unpack
from recserve.sharding.plan import ShardingPlan, TablePlan
from recserve.v1 import common_pb2, embedding_pb2

ROWS, DIM, SHARD, DEFAULT = 1500, 10, 1, 0.25
SRC = np.random.default_rng(11).standard_normal((ROWS, DIM)).astype(np.float32)
WIRE = {RowDType.FLOAT32: common_pb2.FLOAT32, RowDType.FLOAT16: common_pb2.FLOAT16}


def make_plan() -> ShardingPlan:
    table = TablePlan(name="item", rows=ROWS, dim=DIM, hot_ids=np.arange(15), warm_ids=np.arange(15, 165), hot_replicas=2, column_splits=2, cold_replicas=1)
    return ShardingPlan(version=7, num_shards=3, tables={"item": table})


LAYOUT: TableLayout = layouts_from_plan(make_plan(), SHARD)["item"]
# Owned ids RocksDB lacks (deleted after the load): one per tier kind this shard holds.
DELETED = np.array([int(LAYOUT.hot_ids[3]), int(LAYOUT.warm[0].ids[2]), int(LAYOUT.cold_ids[-1]), int(LAYOUT.cold_ids[4])])


def loaded_core(
    path: Path, plan: ShardingPlan, src: np.ndarray, deleted: np.ndarray, tier_dtype: RowDType, *, dense: bool, monkeypatch: pytest.MonkeyPatch, **core: Any
) -> ShardCore:
    """Shard ``SHARD`` of ``plan`` over a RocksDB at ``path`` bulk-loaded with ``src``
    (fp32 [rows, DIM] of table "item"), less the owned ids ``deleted`` (owned but
    missing); ``dense`` False forces the sorted (non-dense) index; ``core``: the rest of
    :class:`ShardCore`'s keywords."""
    layouts = layouts_from_plan(plan, SHARD)
    store = RowStore(path, {"item": DIM})
    bulk_load(store, layouts, {"item": src.copy()}, source_id="s", plan_version=plan.version, shard_id=SHARD, progress=False)
    for i in deleted:
        store._cfs["item"].delete(int(i).to_bytes(8, "big"))  # noqa: SLF001  (owned but missing)
    with monkeypatch.context() as m:
        if not dense:
            m.setattr(table_mod, "DENSE_INDEX_MAX_BYTES", 0)
        return ShardCore(SHARD, plan.version, store, layouts, tier_dtype=tier_dtype, **core)


def make_core(tmp_path: Path, name: str, tier_dtype: RowDType, *, dense: bool, monkeypatch: pytest.MonkeyPatch) -> ShardCore:
    # row cache smaller than the cold ids: requests mix cache hits and RocksDB reads
    return loaded_core(tmp_path / name, make_plan(), SRC, DELETED, tier_dtype, dense=dense, monkeypatch=monkeypatch,
                       row_cache_bytes=40 * DIM * 4, max_ids_per_rpc=100_000, default_value=DEFAULT)  # fmt: skip


@pytest.fixture(params=[RowDType.FLOAT32, RowDType.FLOAT16], ids=lambda d: f"tiers-{d.value}")
def cores(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ShardCore, ShardCore]]:
    dense = make_core(tmp_path, "dense", request.param, dense=True, monkeypatch=monkeypatch)
    sparse = make_core(tmp_path, "sparse", request.param, dense=False, monkeypatch=monkeypatch)
    # The two index kinds are really both under test.
    assert dense.tables["item"].dense_code is not None and sparse.tables["item"].dense_code is None
    yield dense, sparse
    dense.close()
    sparse.close()


def oracle_entry(ids: np.ndarray, cs: int, ce: int, tier_dtype: RowDType, out: RowDType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per id, from the layout and SRC: (rows [N, ce - cs] in ``out``, found u8, not_owned u8)."""
    hot, cold = set(LAYOUT.hot_ids.tolist()), set(LAYOUT.cold_ids.tolist())
    rows = np.full((len(ids), ce - cs), DEFAULT, dtype=np.float32)
    found = np.zeros(len(ids), dtype=np.uint8)
    not_owned = np.ones(len(ids), dtype=np.uint8)
    for n, i in enumerate(ids.tolist()):
        in_dram = i in hot or any(i in set(w.ids.tolist()) and w.col_start <= cs < ce <= w.col_end for w in LAYOUT.warm)
        if not (in_dram or i in cold):
            continue  # not owned for this slice: default row
        not_owned[n] = 0
        if i in set(DELETED.tolist()):
            continue  # owned, missing: default row
        found[n] = 1
        # DRAM tiers store tier_dtype; the cold tier reads fp32 rows from RocksDB.
        stored = SRC[i] if i in cold or tier_dtype is RowDType.FLOAT32 else SRC[i].astype(np.float16).astype(np.float32)
        rows[n] = stored[cs:ce]
    return rows.astype(out.numpy), found, not_owned


def oracle_response(request: embedding_pb2.LookupRequest, tier_dtype: RowDType) -> embedding_pb2.LookupResponse:
    out = RowDType.FLOAT16 if request.row_dtype == common_pb2.FLOAT16 else RowDType.FLOAT32
    response = embedding_pb2.LookupResponse(plan_version=7)
    for tl in request.tables:
        cs, ce = (0, DIM) if (tl.col_start, tl.col_end) == (0, 0) else (tl.col_start, tl.col_end)
        rows, found, not_owned = oracle_entry(unpack(tl.ids, "ids"), cs, ce, tier_dtype, out)
        reply = response.tables.add(table=tl.table, col_start=cs, col_end=ce)
        reply.found.CopyFrom(pack(found))
        reply.not_owned.CopyFrom(pack(not_owned))
        reply.rows.CopyFrom(pack(rows, WIRE[out]))
    return response


def lookup_request(entries: list[tuple[np.ndarray, int, int]], row_dtype: int = common_pb2.FLOAT32) -> embedding_pb2.LookupRequest:
    req = embedding_pb2.LookupRequest(row_dtype=row_dtype)  # type: ignore[arg-type]
    for ids, cs, ce in entries:
        req.tables.add(table="item", ids=pack(np.asarray(ids, dtype=np.int64)), col_start=cs, col_end=ce)
    return req


def requests() -> list[embedding_pb2.LookupRequest]:
    """Entries that take each path: one tier, all found (returned as gathered); one tier
    with missing ids (default rows filled in); several tiers, not-owned ids and shuffled
    order (split and scattered); warm slices and sub-slices; empty; fp16 on the wire."""
    rng = np.random.default_rng(5)
    warm0, warm1 = LAYOUT.warm[0], LAYOUT.warm[-1]
    everything = rng.permutation(ROWS)
    return [
        # hot only (sorted) + cold only incl. missing ones, as the lookup client splits them
        lookup_request([(LAYOUT.hot_ids, 0, 0), (LAYOUT.cold_ids[::7], 0, DIM)]),
        # one shuffled entry over every id of the table: all tiers, not owned, missing
        lookup_request([(everything, 0, 0)]),
        lookup_request([(everything[:700], 0, 0)], common_pb2.FLOAT16),
        # a warm slice exactly (one tier), and a sub-slice of another mixed with foreign ids
        lookup_request([(warm0.ids, warm0.col_start, warm0.col_end), (rng.permutation(np.r_[warm1.ids, np.arange(200, 260)]), warm1.col_start + 1, warm1.col_end - 1)]),
        # a slice straddling the warm split: only full rows (hot, cold) can serve it
        lookup_request([(rng.permutation(ROWS)[:300], 3, 7), (np.array([], dtype=np.int64), 0, 0)]),
        # one id, and an id of each kind, in separate entries of distinct slices
        lookup_request([(np.array([int(LAYOUT.cold_ids[0])]), 0, 0), (np.array([int(LAYOUT.hot_ids[0]), 1499, int(DELETED[0])]), 0, 2)]),
    ]


def test_dense_and_sorted_index_answer_the_oracles_bytes(cores: tuple[ShardCore, ShardCore]) -> None:
    dense, sparse = cores
    tier_dtype = dense.tables["item"].tiers[1].dtype  # type: ignore[attr-defined]
    for n, req in enumerate(requests()):
        want = oracle_response(req, tier_dtype).SerializeToString()
        for core in (dense, sparse, dense):  # dense twice: the second read hits the row cache
            got = core.lookup(req, float("inf")).response.SerializeToString()
            assert got == want, f"request {n} differs from the oracle ({'dense' if core is dense else 'sorted'} index)"


def test_served_missing_and_not_owned_counts_match_the_oracle(cores: tuple[ShardCore, ShardCore]) -> None:
    dense, sparse = cores
    ids = np.random.default_rng(2).permutation(ROWS)
    _, found, not_owned = oracle_entry(ids, 0, DIM, RowDType.FLOAT32, RowDType.FLOAT32)
    for core in (dense, sparse):
        outcome = core.lookup(lookup_request([(ids, 0, 0)]), float("inf"))
        assert sum(outcome.served.values()) == int(found.sum())
        assert outcome.not_owned == int(not_owned.sum())
        assert outcome.missing == len(ids) - int(found.sum()) - int(not_owned.sum()) == 3  # the deleted hot and cold ids


def test_pooled_partial_sums_match_per_bag_sums_on_both_indexes(cores: tuple[ShardCore, ShardCore]) -> None:
    rng = np.random.default_rng(9)
    ids = rng.permutation(ROWS)[:400]
    idx = rng.integers(0, len(ids), 900)
    off = np.r_[0, np.sort(rng.integers(0, 900, 59)), 900]
    req = lookup_request([(ids, 0, 0)])
    req.pooled = True
    req.tables[0].bag_indices.CopyFrom(pack(idx.astype(np.int64)))
    req.tables[0].bag_offsets.CopyFrom(pack(off.astype(np.int64)))
    tier_dtype = cores[0].tables["item"].tiers[1].dtype  # type: ignore[attr-defined]
    rows, _, not_owned = oracle_entry(ids, 0, DIM, tier_dtype, RowDType.FLOAT32)
    want_sums = np.array([rows[idx[a:b]][not_owned[idx[a:b]] == 0].sum(axis=0) if b > a else np.zeros(DIM) for a, b in zip(off[:-1], off[1:])])
    want_counts = np.array([int((not_owned[idx[a:b]] == 0).sum()) for a, b in zip(off[:-1], off[1:])])
    for core in cores:
        reply = core.lookup(req, float("inf")).response.tables[0]
        np.testing.assert_allclose(unpack(reply.pooled, "pooled"), want_sums, rtol=1e-5, atol=1e-5)
        assert unpack(reply.bag_counts, "bag_counts").tolist() == want_counts.tolist()


@pytest.mark.parametrize(
    ("entries", "dup"),
    [
        ([([3, 5, 5, 9], 0, 0)], 5),  # sorted but not strictly: the one-entry skip must not pass it
        ([([9, 3, 7, 3], 0, 0)], 3),  # unsorted
        ([([1, 4, 8], 0, 0), ([2, 8, 11], 0, DIM)], 8),  # two sorted entries, same (full-row) slice
    ],
)
def test_duplicates_are_still_rejected(cores: tuple[ShardCore, ShardCore], entries: list[tuple[list[int], int, int]], dup: int) -> None:
    req = lookup_request([(np.array(i), cs, ce) for i, cs, ce in entries])
    with pytest.raises(InvalidArgument, match=f"id {dup} appears 2 times"):
        cores[0].lookup(req, float("inf"))


def test_same_ids_in_different_slices_are_not_duplicates(cores: tuple[ShardCore, ShardCore]) -> None:
    ids = np.array([1, 4, 8])
    outcome = cores[0].lookup(lookup_request([(ids, 0, 5), (ids, 5, DIM)]), float("inf"))
    assert [t.col_start for t in outcome.response.tables] == [0, 5]


@pytest.mark.parametrize("ids", [[4, 9, 1500], [1500, 4, 9], [-1, 4, 9], [4, -1, 9]], ids=["sorted-high", "unsorted-high", "sorted-low", "unsorted-low"])
def test_out_of_range_ids_are_named_sorted_or_not(cores: tuple[ShardCore, ShardCore], ids: list[int]) -> None:
    bad = 1500 if 1500 in ids else -1
    with pytest.raises(InvalidArgument, match=rf"tables\[0\]\.ids: table 'item' has 1,500 rows; id {bad:,} is out of range"):
        cores[0].lookup(lookup_request([(np.array(ids), 0, 0)]), float("inf"))


def test_dense_index_is_counted_and_bounded() -> None:
    assert dense_index_fits(200_000, 0)  # 1 MB: under the floor
    assert not dense_index_fits(2 * 10**7, 10**9)  # 100 MB: over the cap whatever the tiers hold
    assert not dense_index_fits(10**6, 10**5)  # 5 MB map for 100 kB of DRAM rows
    assert dense_index_fits(10**6, 10**7)


def test_index_bytes_include_the_dense_map(cores: tuple[ShardCore, ShardCore]) -> None:
    dense, sparse = cores
    assert dense.tables["item"].index_bytes - sparse.tables["item"].index_bytes == ROWS * DENSE_INDEX_BYTES_PER_ROW
