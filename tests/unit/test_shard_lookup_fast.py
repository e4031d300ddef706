"""The shard's Lookup fast path (``ShardCore.plan_fast`` / ``lookup_fast``) answers
exactly what the general path (``ShardCore.lookup_general``) answers: the same response
bytes, the same served / missing / not-owned counts, the same row-cache and RocksDB
accounting, and for anything it does not take, the same error.

Two cores are built from the same rows in two RocksDB dirs and fed the same request
sequence, one through ``lookup`` (fast where it applies) and one through
``lookup_general`` only, so their row caches evolve alike and every counter can be
compared after every call. Real RocksDB in temp dirs; no sockets, no processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from embedding_server.layout import TableLayout, layouts_from_plan
from embedding_server.quant import RowDType
from embedding_server.shard import LookupOutcome, ShardCore
from recserve.errors import DeadlineExceeded, RecserveError
from recserve.lookup.route import ShardState, route_window
from recserve.lookup.wire import build_request
from recserve.lookup.window import TableWindow
from recserve.rpc.deadline import make_header
from recserve.rpc.tensors import pack, unpack
from recserve.sharding.plan import Tier
from recserve.v1 import common_pb2, embedding_pb2
from tests.unit.test_shard_badinput import DIM, ROWS, SHARD, FakeClock, make_plan
from tests.unit.test_shard_fast_path import loaded_core

# The bad-input tests' world (DIM, ROWS, SHARD, make_plan): 1,500 x 10 rows, 15 hot ids on
# 2 replicas, 150 warm ids in 2 column slices, the rest cold; this is shard 1 of 3.
DEFAULT = -0.5
SRC = np.random.default_rng(17).standard_normal((ROWS, DIM)).astype(np.float32)


LAYOUT: TableLayout = layouts_from_plan(make_plan(), SHARD)["item"]
# Owned ids RocksDB lacks (deleted after the load): a hot, a warm and two cold ones.
DELETED = np.array([int(LAYOUT.hot_ids[2]), int(LAYOUT.warm[0].ids[1]), int(LAYOUT.cold_ids[3]), int(LAYOUT.cold_ids[-2])])


def make_core(path: Path, tier_dtype: RowDType, *, dense: bool, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> ShardCore:
    # A row cache smaller than the cold ids: requests mix hits, misses and evictions.
    return loaded_core(path, make_plan(), SRC, DELETED, tier_dtype, dense=dense, monkeypatch=monkeypatch,
                       row_cache_bytes=60 * DIM * 4, max_ids_per_rpc=2_000, default_value=DEFAULT, clock=clock)  # fmt: skip


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(
    params=[(RowDType.FLOAT32, True), (RowDType.FLOAT16, True), (RowDType.INT8, True), (RowDType.FLOAT32, False)],
    ids=["fp32-dense", "fp16-dense", "int8-dense", "fp32-sorted-index"],
)
def pair(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ShardCore, ShardCore]]:
    """(fast, general): identical cores; the first serves through ``lookup``, the second
    is only ever asked through ``lookup_general``."""
    tier_dtype, dense = request.param
    fast = make_core(tmp_path / "fast", tier_dtype, dense=dense, clock=clock, monkeypatch=monkeypatch)
    general = make_core(tmp_path / "general", tier_dtype, dense=dense, clock=clock, monkeypatch=monkeypatch)
    assert (fast.tables["item"].dense_code is not None) is dense  # the index kind is really under test
    yield fast, general
    fast.close()
    general.close()


def entry(req: embedding_pb2.LookupRequest, ids: np.ndarray | list[int], cs: int = 0, ce: int = 0, table: str = "item") -> embedding_pb2.TableLookup:
    return req.tables.add(table=table, ids=pack(np.asarray(ids, dtype=np.int64)), col_start=cs, col_end=ce)


def pick(rng: np.random.Generator, ids: np.ndarray, low: int = 1) -> np.ndarray:
    """A random non-empty sorted subset of ``ids`` (what np.unique hands the client)."""
    k = int(rng.integers(low, len(ids) + 1))
    return np.sort(rng.choice(ids, size=k, replace=False))


def client_shaped(rng: np.random.Generator) -> embedding_pb2.LookupRequest:
    """A request the lookup client sends: per tier of one column slice one entry of
    sorted unique ids, entries in random order, sometimes with the owned-but-missing ids."""
    req = embedding_pb2.LookupRequest(row_dtype=common_pb2.FLOAT32 if rng.random() < 0.5 else common_pb2.DTYPE_UNSPECIFIED)
    if rng.random() < 0.3:  # one warm slice, the whole slice or a sub-slice of it
        warm = LAYOUT.warm[int(rng.integers(len(LAYOUT.warm)))]
        cs, ce = (warm.col_start, warm.col_end) if rng.random() < 0.5 else (warm.col_start + 1, warm.col_end - 1)
        entry(req, pick(rng, warm.ids), cs, ce)
        return req
    cols = [(0, 0), (0, 0), (0, DIM), (2, 7)][int(rng.integers(4))]
    parts = [pick(rng, LAYOUT.hot_ids), pick(rng, LAYOUT.cold_ids[:400])]
    for k in rng.permutation(2)[: int(rng.integers(1, 3))]:
        # 0/0 and 0/DIM name the same (full-row) slice; the client may send either.
        cs, ce = cols if cols != (0, DIM) or k == 0 else (0, 0)
        entry(req, parts[k], cs, ce)
    return req


def outcome_key(outcome: LookupOutcome) -> tuple[bytes, int, dict[Tier, int], int, int]:
    return outcome.response.SerializeToString(), outcome.ids, outcome.served, outcome.missing, outcome.not_owned


def store_key(core: ShardCore) -> tuple[dict[str, float], int]:
    """Row-cache hits / misses / evictions, RocksDB reads, and the cached rows' count."""
    return core.storage_counts(), core.tables["item"].cold_cache.size


def answer_both(fast: ShardCore, general: ShardCore, req: embedding_pb2.LookupRequest, deadline: float = float("inf")) -> tuple[object, object]:
    """Each core's outcome key, or (type, message) of what it raised."""
    got: list[object] = []
    for serve in (fast.lookup, general.lookup_general):
        try:
            got.append(outcome_key(serve(req, deadline)))
        except RecserveError as exc:
            got.append((type(exc), str(exc)))
    return got[0], got[1]


def test_client_shaped_requests_take_the_fast_path_and_answer_the_general_paths_bytes(pair: tuple[ShardCore, ShardCore]) -> None:
    fast, general = pair
    rng = np.random.default_rng(3)
    missing, served = 0, dict.fromkeys(Tier, 0)
    for n in range(120):
        req = client_shaped(rng)
        assert fast.plan_fast(req) is not None, f"request {n} missed the fast path: {req}"
        got, want = answer_both(fast, general, req)
        assert got == want, f"request {n} answered differently"
        assert store_key(fast) == store_key(general), f"request {n}: row cache / RocksDB accounting differs"
        missing += want[3]  # type: ignore[index]
        for tier, count in want[2].items():  # type: ignore[index]
            served[tier] += count
    assert missing > 0 and min(served.values()) > 0  # default rows, and every tier kind, were in the mix
    assert store_key(general)[0]["row_cache_evictions"] > 0 and store_key(general)[0]["rocksdb_reads"] > 0


def test_fast_rows_are_the_source_rows_and_the_default_row(pair: tuple[ShardCore, ShardCore]) -> None:
    """Not only equal to the general path: right (an oracle from SRC, outside the code)."""
    fast, _ = pair  # cold rows: RocksDB's fp32 whatever the DRAM tiers' dtype
    ids = np.unique(np.r_[LAYOUT.cold_ids[:30], DELETED[2:]])  # both deleted cold ids among them
    req = embedding_pb2.LookupRequest()
    entry(req, ids, 2, 7)
    assert fast.plan_fast(req) is not None
    reply = fast.lookup(req, float("inf")).response.tables[0]
    want = np.where(np.isin(ids, DELETED)[:, None], np.float32(DEFAULT), SRC[ids, 2:7])
    np.testing.assert_array_equal(unpack(reply.rows, "rows"), want)
    assert unpack(reply.found, "found").tolist() == (~np.isin(ids, DELETED)).astype(int).tolist()
    assert unpack(reply.not_owned, "not_owned").tolist() == [0] * len(ids)
    assert (reply.col_start, reply.col_end) == (2, 7)


def test_the_lookup_clients_own_request_takes_the_fast_path(pair: tuple[ShardCore, ShardCore]) -> None:
    fast, general = pair
    plan = make_plan()
    ids = np.r_[np.random.default_rng(8).integers(0, ROWS, 600), np.arange(165)]  # repeats; every hot and warm id
    unique, inverse = np.unique(ids, return_inverse=True)
    n = np.array([0, ids.size])
    window = TableWindow("item", unique, inverse.astype(np.int64), n, np.ones(ids.size, np.int64), n)  # one caller, one id per bag
    routed = route_window({"item": unique}, {"item": np.arange(unique.size)}, plan.tables, {"item": plan.router("item")}, ShardState.healthy(3))
    units = routed.by_shard()[SHARD]
    request = build_request(units, {"item": window}, row_dtype="float32", header=make_header(), plan_version=plan.version)
    assert len(request.tables) >= 3  # hot, cold and a warm slice travel as separate entries
    assert fast.plan_fast(request) is None  # several slices: the general path (one slice per fast request)
    one_slice = embedding_pb2.LookupRequest(header=request.header, row_dtype=request.row_dtype)
    for tl in request.tables:
        if (tl.col_start, tl.col_end) == (0, 0):
            one_slice.tables.add().CopyFrom(tl)
    assert len(one_slice.tables) == 2 and fast.plan_fast(one_slice) is not None  # its hot + cold entries
    for req in (request, one_slice):
        got, want = answer_both(fast, general, req)
        assert got == want


def _irregular() -> list[tuple[str, embedding_pb2.LookupRequest]]:
    hot, cold, warm = LAYOUT.hot_ids, LAYOUT.cold_ids, LAYOUT.warm[0]
    foreign = int(np.setdiff1d(np.arange(ROWS), np.r_[hot, cold, *[w.ids for w in LAYOUT.warm]])[0])
    cases: list[tuple[str, embedding_pb2.LookupRequest]] = []

    def case(name: str, *entries: tuple[object, int, int], **fields: object) -> embedding_pb2.LookupRequest:
        req = embedding_pb2.LookupRequest(**fields)  # type: ignore[arg-type]
        for ids, cs, ce in entries:
            entry(req, ids, cs, ce)  # type: ignore[arg-type]
        cases.append((name, req))
        return req

    sorted_cold = np.sort(cold[:20])
    case("no entries")
    case("pooled", (sorted_cold, 0, 0), pooled=True).tables[0].bag_offsets.CopyFrom(pack(np.array([0], dtype=np.int64)))
    case("fp16 rows", (sorted_cold, 0, 0), row_dtype=common_pb2.FLOAT16)
    case("int8 rows", (sorted_cold, 0, 0), row_dtype=common_pb2.INT8_ROWWISE)
    case("row dtype not a row type", (sorted_cold, 0, 0), row_dtype=common_pb2.INT64)
    case("unsorted", (sorted_cold[::-1], 0, 0))
    case("sorted with a repeat", (np.sort(np.r_[sorted_cold, sorted_cold[4]]), 0, 0))
    case("repeat across two entries of one tier", (sorted_cold[:10], 0, 0), (sorted_cold[9:], 0, DIM))
    case("two entries of one tier, disjoint", (sorted_cold[:10], 0, 0), (sorted_cold[10:], 0, 0))
    case("one entry over two tiers", (np.sort(np.r_[hot[:3], sorted_cold]), 0, 0))
    case("not owned", (np.sort(np.r_[sorted_cold, foreign]), 0, 0))
    case("only not owned", ([foreign], 0, 0))
    case("slice no tier covers", (np.sort(warm.ids[:5]), 0, 0))
    case("two slices", (sorted_cold, 0, 0), (np.sort(warm.ids[:5]), warm.col_start, warm.col_end))
    case("id too high, sorted", (np.r_[sorted_cold, ROWS], 0, 0))
    case("id too high, inside", (np.r_[sorted_cold[:3], ROWS, sorted_cold[3:]], 0, 0))
    case("negative id, sorted", (np.r_[-1, sorted_cold], 0, 0))
    case("negative id, inside", (np.r_[sorted_cold[:3], -7, sorted_cold[3:]], 0, 0))
    case("empty entry", (np.zeros(0, dtype=np.int64), 0, 0))
    case("empty entry after one", (sorted_cold, 0, 0), (np.zeros(0, dtype=np.int64), 0, 0))
    case("bad column slice", (sorted_cold, 4, 2))
    case("column slice past the row", (sorted_cold, 3, DIM + 1))
    case("too many ids", (np.arange(2_001), 0, 0))
    req = case("unknown table")
    entry(req, sorted_cold, table="nope")
    req = case("second table unknown", (sorted_cold, 0, 0))
    entry(req, hot[:2], table="nope")
    req = case("int32 ids", (sorted_cold, 0, 0))
    req.tables[0].ids.CopyFrom(pack(sorted_cold.astype(np.int32)))
    req = case("rank-2 ids", (sorted_cold, 0, 0))
    req.tables[0].ids.CopyFrom(pack(sorted_cold.reshape(4, 5)))
    req = case("shape disagrees with bytes", (sorted_cold, 0, 0))
    req.tables[0].ids.shape[:] = [len(sorted_cold) + 1]
    req = case("bytes not a multiple of 8", (sorted_cold, 0, 0))
    req.tables[0].ids.data = req.tables[0].ids.data[:-3]
    return cases


IRREGULAR = _irregular()


def test_irregular_requests_take_the_general_path_with_its_answer_or_error(pair: tuple[ShardCore, ShardCore]) -> None:
    """Bad requests (each rejected naming its field), and regular ones the fast path
    does not serve (pooled, fp16 / int8 rows, several tiers or slices, not-owned ids)."""
    fast, general = pair
    errors = 0
    for name, req in IRREGULAR:
        before = store_key(fast)
        assert fast.plan_fast(req) is None, name
        assert store_key(fast) == before, name  # deciding has no side effects
        got, want = answer_both(fast, general, req)
        assert got == want, name
        assert store_key(fast) == store_key(general), name
        errors += isinstance(want[0], type)  # type: ignore[index]
    assert errors >= 15  # the bad ones really were rejected (and the same way)


def test_fast_path_honours_the_deadline_before_any_gather(pair: tuple[ShardCore, ShardCore], clock: FakeClock) -> None:
    fast, general = pair
    req = embedding_pb2.LookupRequest()
    entry(req, np.sort(LAYOUT.cold_ids[:50]))
    assert fast.plan_fast(req) is not None
    before = store_key(fast)
    got, want = answer_both(fast, general, req, deadline=clock.now - 0.001)
    assert got == want and got[0] is DeadlineExceeded  # type: ignore[index]
    assert store_key(fast) == before  # no row cache lookup, no RocksDB read
    got, want = answer_both(fast, general, req, deadline=clock.now + 1.0)
    assert got == want and got[3] == 1  # type: ignore[index]  # served now; DELETED[2] is among them


def test_a_read_after_an_acknowledged_upsert_sees_the_new_row_on_the_fast_path(pair: tuple[ShardCore, ShardCore]) -> None:
    fast, general = pair
    hot, cold, deleted = int(LAYOUT.hot_ids[0]), int(LAYOUT.cold_ids[7]), int(DELETED[2])
    req = embedding_pb2.LookupRequest()
    entry(req, [hot])
    entry(req, sorted([cold, deleted]))
    fast.lookup(req, float("inf"))  # the cold rows are now in the row cache
    general.lookup_general(req, float("inf"))
    up = embedding_pb2.UpsertRequest()
    up.tables.add(table="item", ids=pack(np.array([hot, cold, deleted], dtype=np.int64)), rows=pack(np.full((3, DIM), 3.0, dtype=np.float32)))
    assert fast.upsert(up) == general.upsert(up) == 3
    got, want = answer_both(fast, general, req)
    assert got == want
    outcome = fast.lookup(req, float("inf"))
    assert outcome.missing == 0  # the once-missing id is stored now
    for reply in outcome.response.tables:
        assert (unpack(reply.rows, "rows") == 3.0).all() and unpack(reply.found, "found").all()
