"""DRAM/cold tiers, table routing, upsert validation, pooling and the shard core
(real RocksDB in a temp dir; no sockets, no processes). The oracle is the source array."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from embedding_server.bulk_load import bulk_load
from embedding_server.fault import Fault, FaultInjector
from embedding_server.layout import layouts_from_plan
from embedding_server.quant import RowDType
from embedding_server.shard import ShardCore
from embedding_server.store import RowStore
from recserve.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from recserve.rpc.tensors import pack, unpack
from recserve.sharding.plan import ShardingPlan, TablePlan, Tier
from recserve.v1 import common_pb2, embedding_pb2

ROWS, DIM, SHARD = 1500, 10, 1
SRC = np.random.default_rng(3).standard_normal((ROWS, DIM)).astype(np.float32)


def make_plan() -> ShardingPlan:
    table = TablePlan(name="item", rows=ROWS, dim=DIM, hot_ids=np.arange(15), warm_ids=np.arange(15, 165), hot_replicas=2, column_splits=2, cold_replicas=1)
    return ShardingPlan(version=5, num_shards=3, tables={"item": table})


UNLOADED = int(layouts_from_plan(make_plan(), SHARD)["item"].cold_ids[-1])  # owned, but deleted after the load


def make_core(tmp_path: Path, dtype: RowDType = RowDType.FLOAT32, default_value: float = 0.0, max_ids: int = 10_000) -> ShardCore:
    plan = make_plan()
    layouts = layouts_from_plan(plan, SHARD)
    store = RowStore(tmp_path / f"db-{dtype.value}", {"item": DIM})
    src = SRC.copy()
    bulk_load(store, layouts, {"item": src}, source_id="s", plan_version=plan.version, shard_id=SHARD, progress=False)
    store._cfs["item"].delete(int(UNLOADED).to_bytes(8, "big"))  # noqa: SLF001  (make one owned id missing)
    return ShardCore(SHARD, plan.version, store, layouts, tier_dtype=dtype, row_cache_bytes=1 << 20, max_ids_per_rpc=max_ids, default_value=default_value)


@pytest.fixture
def core(tmp_path: Path) -> Iterator[ShardCore]:
    c = make_core(tmp_path)
    yield c
    c.close()


def request(ids: np.ndarray | list[int], col_start: int = 0, col_end: int = 0, dtype: int = common_pb2.FLOAT32, table: str = "item") -> embedding_pb2.LookupRequest:
    req = embedding_pb2.LookupRequest(row_dtype=dtype)  # type: ignore[arg-type]
    req.tables.add(table=table, ids=pack(np.asarray(ids, dtype=np.int64)), col_start=col_start, col_end=col_end)
    return req


def answer(core: ShardCore, req: embedding_pb2.LookupRequest) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    reply = core.lookup(req, float("inf")).response.tables[0]
    return unpack(reply.rows, "rows"), unpack(reply.found, "found").astype(bool), unpack(reply.not_owned, "not_owned").astype(bool)


def test_full_row_lookup_serves_hot_and_cold_exactly(core: ShardCore) -> None:
    layout = core.tables["item"].layout
    ids = np.arange(ROWS)
    outcome = core.lookup(request(ids), float("inf"))
    rows = unpack(outcome.response.tables[0].rows, "rows")
    found = unpack(outcome.response.tables[0].found, "found").astype(bool)
    not_owned = unpack(outcome.response.tables[0].not_owned, "not_owned").astype(bool)
    full = np.union1d(layout.hot_ids, layout.cold_ids)
    assert assert_subset_equal(found, np.setdiff1d(full, [UNLOADED]))
    assert np.array_equal(rows[found], SRC[found])
    # Warm ids hold only a slice here: a full-row request cannot be served by this shard.
    assert assert_subset_equal(not_owned, np.setdiff1d(ids, full))
    assert not rows[not_owned].any() and not rows[UNLOADED].any()
    assert outcome.served == {Tier.HOT: len(layout.hot_ids), Tier.WARM: 0, Tier.COLD: len(layout.cold_ids) - 1}
    assert outcome.missing == 1 and outcome.not_owned == ROWS - len(full)


def assert_subset_equal(mask: np.ndarray, ids: np.ndarray) -> bool:
    """mask is exactly the indicator of ids."""
    return bool(np.array_equal(np.flatnonzero(mask), np.sort(ids)))


def test_warm_slice_lookup_and_slicing_of_full_rows(core: ShardCore) -> None:
    layout = core.tables["item"].layout
    for warm in layout.warm:
        ids = np.concatenate([warm.ids, layout.hot_ids[:3], layout.cold_ids[:3]])
        rows, found, not_owned = answer(core, request(ids, warm.col_start, warm.col_end))
        assert rows.shape == (len(ids), warm.width) and found.all() and not not_owned.any()
        assert np.array_equal(rows, SRC[ids][:, warm.col_start : warm.col_end])


def test_float16_tier_and_output(tmp_path: Path) -> None:
    core = make_core(tmp_path, RowDType.FLOAT16)
    hot = core.tables["item"].layout.hot_ids
    rows16, found, _ = answer(core, request(hot, dtype=common_pb2.FLOAT16))
    assert rows16.dtype == np.float16 and found.all()
    assert np.array_equal(rows16, SRC[hot].astype(np.float16))
    rows32, _, _ = answer(core, request(hot))
    assert np.array_equal(rows32, SRC[hot].astype(np.float16).astype(np.float32))
    core.close()


def test_int8_rowwise_matches_fbgemm(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import fbgemm_gpu  # noqa: F401

    core = make_core(tmp_path, RowDType.INT8)
    layout = core.tables["item"].layout
    ids = np.concatenate([layout.hot_ids, layout.cold_ids[:20]])
    fused, found, _ = answer(core, request(ids, dtype=common_pb2.INT8_ROWWISE))
    oracle = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(torch.from_numpy(SRC[ids])).numpy()
    assert fused.shape == (len(ids), DIM + 8) and found.all()
    assert np.array_equal(fused, oracle)  # hot from the int8 tier, cold quantised on the fly
    deq, _, _ = answer(core, request(layout.hot_ids))
    expect = torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(torch.from_numpy(oracle[: len(layout.hot_ids)])).numpy()
    assert np.allclose(deq, expect, rtol=0, atol=1e-6)
    core.close()


def test_missing_id_gets_the_configured_default_row(tmp_path: Path) -> None:
    core = make_core(tmp_path, default_value=-1.5)
    rows, found, not_owned = answer(core, request([UNLOADED, int(core.tables["item"].layout.cold_ids[0])]))
    assert found.tolist() == [False, True] and not not_owned.any()
    assert (rows[0] == -1.5).all()
    core.close()


def test_bad_requests_raise_the_right_errors(core: ShardCore) -> None:
    with pytest.raises(NotFound, match="table 'user' is not served by shard 1"):
        core.lookup(request([1], table="user"), float("inf"))
    with pytest.raises(InvalidArgument, match=r"id 1,500 is out of range \[0, 1,500\)"):
        core.lookup(request([3, 1500]), float("inf"))
    with pytest.raises(InvalidArgument, match=r"id -2 is out of range"):
        core.lookup(request([-2]), float("inf"))
    bad = request([1, 2])
    bad.tables[0].ids.data = bad.tables[0].ids.data[:-3]
    with pytest.raises(InvalidArgument, match="multiple of 8"):
        core.lookup(bad, float("inf"))
    with pytest.raises(InvalidArgument, match="column slice 4..11 is invalid"):
        core.lookup(request([1], 4, 11), float("inf"))
    with pytest.raises(ResourceExhausted, match="max_ids_per_rpc = 10,000"):
        core.lookup(request(np.arange(10_001) % ROWS), float("inf"))
    with pytest.raises(DeadlineExceeded):
        core.lookup(request([1]), deadline=0.0)
    with pytest.raises(InvalidArgument, match="not a row type"):
        core.lookup(request([1], dtype=common_pb2.INT64), float("inf"))


def upsert(core: ShardCore, ids: list[int], rows: np.ndarray, col_start: int = 0, col_end: int = 0) -> int:
    req = embedding_pb2.UpsertRequest()
    req.tables.add(table="item", ids=pack(np.array(ids, dtype=np.int64)), rows=pack(rows.astype(np.float32)), col_start=col_start, col_end=col_end)
    return core.upsert(req)


def test_upsert_is_visible_in_every_tier_and_after_reopen(tmp_path: Path) -> None:
    core = make_core(tmp_path)
    layout = core.tables["item"].layout
    hot, cold, warm = int(layout.hot_ids[0]), int(layout.cold_ids[5]), layout.warm[0]
    assert upsert(core, [hot, cold, UNLOADED], np.full((3, DIM), 9.0)) == 3
    w_id = int(warm.ids[0])
    assert upsert(core, [w_id], np.full((1, warm.width), 4.0), warm.col_start, warm.col_end) == 1
    rows, found, _ = answer(core, request([hot, cold, UNLOADED]))
    assert found.all() and (rows == 9.0).all()
    rows, found, _ = answer(core, request([w_id], warm.col_start, warm.col_end))
    assert found.all() and (rows == 4.0).all()
    core.store.close()
    # A fresh core builds its tiers from RocksDB: the upserts are there.
    plan = make_plan()
    again = ShardCore(SHARD, 5, RowStore(tmp_path / "db-float32", {"item": DIM}), layouts_from_plan(plan, SHARD), tier_dtype=RowDType.FLOAT32, row_cache_bytes=0, max_ids_per_rpc=100)
    rows, found, _ = answer(again, request([hot, cold]))
    assert found.all() and (rows == 9.0).all()
    again.close()


def test_upsert_rejects_foreign_ids_and_bad_rows(core: ShardCore) -> None:
    layout = core.tables["item"].layout
    owned = set(np.concatenate([layout.hot_ids, layout.cold_ids]).tolist())
    foreign = [i for i in range(165, ROWS) if i not in owned][:2]
    mine = int(layout.cold_ids[0])
    with pytest.raises(FailedPrecondition, match=rf"does not own ids \[{foreign[0]:,}, {foreign[1]:,}\]"):
        upsert(core, [mine, *foreign], np.zeros((3, DIM)))
    rows, _, _ = answer(core, request([mine]))
    assert np.array_equal(rows[0], SRC[mine])  # nothing of the rejected upsert was applied
    with pytest.raises(InvalidArgument, match="unique"):
        upsert(core, [mine, mine], np.zeros((2, DIM)))
    with pytest.raises(InvalidArgument, match=r"shape \[1, 9\] does not match 1 ids"):
        upsert(core, [mine], np.zeros((1, DIM - 1)))
    with pytest.raises(InvalidArgument, match="finite"):
        upsert(core, [mine], np.full((1, DIM), np.nan))
    warm = layout.warm[0]
    with pytest.raises(FailedPrecondition):  # a half row for a full-row (cold) id
        upsert(core, [mine], np.zeros((1, warm.width)), warm.col_start, warm.col_end)


def test_pooled_partial_sums_match_embedding_bag(core: ShardCore) -> None:
    torch = pytest.importorskip("torch")
    layout = core.tables["item"].layout
    owned = np.concatenate([layout.hot_ids[:4], layout.cold_ids[:6]])
    foreign = np.setdiff1d(np.arange(165, 300), np.concatenate([layout.hot_ids, layout.cold_ids]))[:3]
    ids = np.concatenate([owned, foreign])  # positions 10..12 are not owned here
    indices = np.array([0, 11, 3, 3, 5, 12, 9, 1, 2], dtype=np.int64)
    offsets = np.array([0, 3, 3, 6, 9], dtype=np.int64)  # bag 1 is empty
    req = request(ids)
    req.pooled = True
    req.tables[0].bag_indices.CopyFrom(pack(indices))
    req.tables[0].bag_offsets.CopyFrom(pack(offsets))
    reply = core.lookup(req, float("inf")).response.tables[0]
    sums, counts = unpack(reply.pooled, "pooled"), unpack(reply.bag_counts, "bag_counts")
    # Oracle: EmbeddingBag(sum) over the source with foreign ids' contributions removed.
    keep = indices < len(owned)
    lengths = np.diff(offsets)
    bag_of = np.repeat(np.arange(4), lengths)
    new_offsets = np.concatenate([[0], np.cumsum(np.bincount(bag_of[keep], minlength=4))])
    expect = torch.nn.functional.embedding_bag(
        torch.from_numpy(ids[indices[keep]]), torch.from_numpy(SRC), torch.from_numpy(new_offsets[:-1]), mode="sum"
    ).numpy()
    assert np.allclose(sums, expect, rtol=1e-6, atol=1e-6)
    assert counts.tolist() == np.bincount(bag_of[keep], minlength=4).tolist() == [2, 0, 2, 3]


def test_pooled_rejects_bad_bags(core: ShardCore) -> None:
    req = request([int(core.tables["item"].layout.cold_ids[0])])
    req.pooled = True
    req.tables[0].bag_indices.CopyFrom(pack(np.array([0, 1], dtype=np.int64)))
    req.tables[0].bag_offsets.CopyFrom(pack(np.array([0, 2], dtype=np.int64)))
    with pytest.raises(InvalidArgument, match=r"bag_indices must lie in \[0, 1\)"):
        core.lookup(req, float("inf"))


def test_fault_parsing_and_counting() -> None:
    assert Fault.from_metadata("delay_ms=20; code=UNAVAILABLE") == Fault(delay_ms=20.0, code="UNAVAILABLE", count=1)
    with pytest.raises(InvalidArgument, match="not an error grpc.StatusCode"):
        Fault(code="NOPE")
    with pytest.raises(InvalidArgument, match="not faultable"):
        Fault(delay_ms=1, methods=("ShardInfo",))
    injector = FaultInjector(enabled=True)
    injector.set(Fault(code="UNAVAILABLE", count=2, methods=("Lookup",)))
    assert injector._take("Upsert", ()) is None  # noqa: SLF001
    taken = [injector._take("Lookup", ()) for _ in range(3)]  # noqa: SLF001
    assert [t is not None for t in taken] == [True, True, False]


def test_repeated_cold_ids_are_served_and_cached_once(core: ShardCore) -> None:
    """The wire contract asks for unique ids (ShardCore.lookup rejects repeats: see
    test_shard_badinput.py), but a repeat reaching the tiers must not corrupt the row
    cache (one slot per id) nor change any answer."""
    table = core.tables["item"]
    cold = table.layout.cold_ids
    a, b = int(cold[10]), int(cold[11])
    ids = np.array([b, a, b, UNLOADED, b, a, UNLOADED])
    cache = table.cold_cache
    for _ in range(2):  # cold misses, then row-cache hits
        result = table.lookup(ids, 0, DIM, RowDType.FLOAT32)
        rows, found, not_owned = result.rows, result.found.astype(bool), result.not_owned.astype(bool)
        assert found.tolist() == [True, True, True, False, True, True, False] and not not_owned.any()
        assert np.array_equal(rows[found], SRC[ids[found]]) and not rows[~found].any()
        assert cache.size == 2
    assert (cache.hits, cache.misses) == (5, 7 + 2)
    rows, _ = cache.get(table.residence(np.array([a, b]))[1])  # keyed by cold ordinal
    assert np.array_equal(rows, SRC[[a, b]])
