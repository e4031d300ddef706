"""ShardCore rejects what a correct client never sends — duplicate ids within one
Lookup, more bags than ``shard_server.max_bags_per_rpc`` — and takes its clock from
the caller (real RocksDB in a temp dir; no sockets, no processes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from embedding_server.bulk_load import bulk_load
from embedding_server.layout import layouts_from_plan
from embedding_server.quant import RowDType
from embedding_server.shard import ShardCore
from embedding_server.store import RowStore
from recserve.config.spec import ShardServerConfig
from recserve.errors import ConfigError, DeadlineExceeded, InvalidArgument
from recserve.lookup.route import ShardState, route_window
from recserve.lookup.wire import build_request
from recserve.lookup.window import TableWindow
from recserve.rpc.deadline import make_header
from recserve.rpc.tensors import pack, unpack
from recserve.sharding.plan import ShardingPlan, TablePlan
from recserve.v1 import embedding_pb2

ROWS, DIM, SHARD = 1500, 10, 1
SRC = np.random.default_rng(5).standard_normal((ROWS, DIM)).astype(np.float32)


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_plan() -> ShardingPlan:
    table = TablePlan(name="item", rows=ROWS, dim=DIM, hot_ids=np.arange(15), warm_ids=np.arange(15, 165), hot_replicas=2, column_splits=2, cold_replicas=1)
    return ShardingPlan(version=2, num_shards=3, tables={"item": table})


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_core(path: Path, clock: FakeClock, max_bags_per_rpc: int) -> ShardCore:
    plan = make_plan()
    layouts = layouts_from_plan(plan, SHARD)
    store = RowStore(path, {"item": DIM})
    bulk_load(store, layouts, {"item": SRC}, source_id="s", plan_version=plan.version, shard_id=SHARD, progress=False)
    return ShardCore(
        SHARD, plan.version, store, layouts, tier_dtype=RowDType.FLOAT32, row_cache_bytes=1 << 20, max_ids_per_rpc=10_000, max_bags_per_rpc=max_bags_per_rpc, clock=clock
    )


@pytest.fixture
def core(tmp_path: Path, clock: FakeClock) -> Iterator[ShardCore]:
    c = make_core(tmp_path / "db", clock, max_bags_per_rpc=8)
    yield c
    c.close()


def lookup_request(*entries: tuple[list[int], int, int], pooled: bool = False) -> embedding_pb2.LookupRequest:
    """One TableLookup of 'item' per (ids, col_start, col_end); pooled: one bag per id."""
    req = embedding_pb2.LookupRequest(pooled=pooled)
    for ids, cs, ce in entries:
        tl = req.tables.add(table="item", ids=pack(np.asarray(ids, np.int64)), col_start=cs, col_end=ce)
        if pooled:
            tl.bag_indices.CopyFrom(pack(np.arange(len(ids), dtype=np.int64)))
            tl.bag_offsets.CopyFrom(pack(np.arange(len(ids) + 1, dtype=np.int64)))
    return req


def owned(core: ShardCore) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(hot ids, cold ids, ids of this shard's first warm slice) of 'item'."""
    layout = core.tables["item"].layout
    return layout.hot_ids, layout.cold_ids, layout.warm[0].ids


def test_a_duplicate_id_in_one_entry_is_rejected_naming_table_and_id(core: ShardCore) -> None:
    _, cold, _ = owned(core)
    a, b = int(cold[3]), int(cold[4])
    with pytest.raises(InvalidArgument) as err:
        core.lookup(lookup_request(([b, a, b], 0, 0)), float("inf"))
    assert "tables[0] ('item', columns 0..10)" in err.value.message and f"id {b:,} appears 2 times" in err.value.message
    assert core.tables["item"].cold_cache.misses == 0  # rejected before any gather


def test_a_duplicate_across_entries_of_one_slice_is_rejected(core: ShardCore) -> None:
    """The client sends a table's cold and hot ids to one shard as two full-row entries,
    so uniqueness holds over entries; 0/0 and 0..dim are the same slice."""
    hot, cold, _ = owned(core)
    dup = int(cold[0])
    with pytest.raises(InvalidArgument) as err:
        core.lookup(lookup_request(([int(hot[0]), dup], 0, 0), ([dup, int(cold[1])], 0, DIM)), float("inf"))
    assert "tables[0, 1] ('item', columns 0..10)" in err.value.message and f"id {dup:,} appears 2 times" in err.value.message
    with pytest.raises(InvalidArgument, match=f"id {int(hot[1]):,} appears 2 times"):  # pooled mode too
        core.lookup(lookup_request(([int(hot[1])], 0, 0), ([int(hot[1])], 0, 0), pooled=True), float("inf"))


def test_one_id_in_entries_for_different_slices_is_not_a_duplicate(core: ShardCore) -> None:
    _, cold, warm = owned(core)
    w, c = int(warm[0]), int(cold[0])
    lo = core.tables["item"].layout.warm[0]
    other = (lo.col_end, DIM) if lo.col_start == 0 else (0, lo.col_start)
    outcome = core.lookup(lookup_request(([w, c], lo.col_start, lo.col_end), ([w], *other), ([c], 0, 0)), float("inf"))
    first, second, third = outcome.response.tables
    assert np.array_equal(unpack(first.rows, "rows")[0], SRC[w, lo.col_start : lo.col_end])
    assert unpack(second.not_owned, "not_owned").tolist() == [1]  # the other slice lives elsewhere
    assert np.array_equal(unpack(third.rows, "rows")[0], SRC[c])
    assert outcome.ids == 4


def test_pooled_bags_are_bounded_by_max_bags_per_rpc(core: ShardCore) -> None:
    _, cold, _ = owned(core)
    at_limit = lookup_request((cold[:5].tolist(), 0, 0), (cold[5:8].tolist(), 0, 0), pooled=True)  # 5 + 3 = 8 bags
    sums = unpack(core.lookup(at_limit, float("inf")).response.tables[1].pooled, "pooled")
    assert np.allclose(sums, SRC[cold[5:8]])
    over = lookup_request((cold[:5].tolist(), 0, 0), (cold[5:9].tolist(), 0, 0), pooled=True)  # 9 bags
    with pytest.raises(InvalidArgument) as err:
        core.lookup(over, float("inf"))
    assert "carries 9 bags" in err.value.message and "shard_server.max_bags_per_rpc = 8" in err.value.message
    # Millions of empty bags: rejected from byte lengths, before any [B, W] allocation.
    empty = embedding_pb2.LookupRequest(pooled=True)
    empty.tables.add(table="item", ids=pack(cold[:1]), bag_indices=pack(np.zeros(0, np.int64)), bag_offsets=pack(np.zeros(2_000_001, np.int64)))
    with pytest.raises(InvalidArgument, match="carries 2,000,000 bags"):
        core.lookup(empty, float("inf"))
    # Unpooled lookups ignore bag fields, so they are not counted.
    empty.pooled = False
    assert core.lookup(empty, float("inf")).ids == 1


def test_max_bags_per_rpc_is_validated_and_defaults_well_above_max_ids() -> None:
    with pytest.raises(ConfigError, match="shard_server.max_bags_per_rpc"):
        ShardServerConfig(max_bags_per_rpc=0)
    default = ShardServerConfig()
    assert default.max_bags_per_rpc >= 4 * default.max_ids_per_rpc


def test_the_lookup_deadline_is_checked_on_the_injected_clock(core: ShardCore, clock: FakeClock) -> None:
    _, cold, _ = owned(core)
    req = lookup_request((cold[:2].tolist(), 0, 0))
    assert core.lookup(req, deadline=100.5).ids == 2  # fake now = 100.0 (real monotonic time is far past)
    clock.now = 101.0
    with pytest.raises(DeadlineExceeded):
        core.lookup(req, deadline=100.5)


def test_the_lookup_client_never_sends_a_duplicate(tmp_path: Path, clock: FakeClock) -> None:
    """Requests the client builds for one window (hot, warm and cold units; a shard gets
    a table's hot and cold rows as two full-row entries) pass the shard's check. A
    hedge re-sends a subset of one unit's unique positions, so it cannot add one."""
    # Every entry carries all of the window's bags: the default bag limit, not 8.
    core = make_core(tmp_path / "db", clock, max_bags_per_rpc=ShardServerConfig.max_bags_per_rpc)
    plan = make_plan()
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.integers(0, ROWS, size=2000), np.arange(165)])  # repeats; every hot and warm id
    unique, inverse = np.unique(ids, return_inverse=True)
    n = np.array([0, ids.size])
    window = TableWindow("item", unique, inverse.astype(np.int64), n, np.ones(ids.size, np.int64), n)  # one caller, one id per bag
    routed = route_window({"item": unique}, {"item": np.arange(unique.size)}, plan.tables, {"item": plan.router("item")}, ShardState.healthy(3))
    units = routed.by_shard()[SHARD]
    for bags in (None, {"item": window.occurrence_bags()}):
        request = build_request(units, {"item": window}, row_dtype="float32", header=make_header(), plan_version=plan.version, occurrence_bags=bags)
        assert len(request.tables) >= 3  # hot, cold and a warm slice travel as separate entries
        outcome = core.lookup(request, float("inf"))
        assert outcome.ids == sum(len(u) for u in units) and outcome.not_owned == 0
    core.close()


def test_the_duplicate_check_at_its_edges() -> None:
    """Empty entries, one id, runs that are each sorted but overlap, a repeat inside a
    run (what np.unique per entry can never produce, a hostile caller can)."""
    from embedding_server.shard import check_unique_ids

    def arrays(*entries: list[int]) -> list[np.ndarray]:
        return [np.asarray(e, dtype=np.int64) for e in entries]

    for ok in (arrays([]), arrays([], []), arrays([7]), arrays([], [7]), arrays([1, 5], [2, 6]), arrays([9, 3, 4])):
        check_unique_ids("item", (0, DIM), ok, list(range(len(ok))))
    for bad, dup, times in ((arrays([], [4, 4]), 4, 2), (arrays([1, 5], [0, 5, 8]), 5, 2), (arrays([3], [3], [3]), 3, 3)):
        with pytest.raises(InvalidArgument) as err:
            check_unique_ids("item", (0, DIM), bad, list(range(len(bad))))
        assert f"id {dup:,} appears {times} times" in err.value.message, err.value.message
