"""Shard servers as a user runs them: 3 real processes on loopback, RocksDB in a temp dir.

The oracle is the source array each shard bulk-loaded (``shard_world.sources``) and the
plan's own assignment of ids to shards.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from recserve.cluster import ShardCluster
from recserve.rpc.auth import admin_metadata
from recserve.rpc.tensors import pack, unpack
from recserve.sharding.plan import ShardingPlan
from recserve.sharding.upsert import split_upsert
from recserve.v1 import common_pb2, embedding_pb2
from recserve.v1.embedding_pb2_grpc import EmbeddingShardStub as Stub
from tests.integration.conftest import ADMIN_TOKEN, MAX_IDS_PER_RPC, ShardWorld, channel

pytestmark = pytest.mark.integration


def lookup(stub: Stub, table: str, ids: np.ndarray, cols: tuple[int, int] = (0, 0), dtype: int = common_pb2.FLOAT32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (rows, found bool, not_owned bool) of one TableLookup."""
    req = embedding_pb2.LookupRequest(row_dtype=dtype)  # type: ignore[arg-type]
    req.tables.add(table=table, ids=pack(np.asarray(ids, dtype=np.int64)), col_start=cols[0], col_end=cols[1])
    reply = stub.Lookup(req, timeout=10).tables[0]
    return unpack(reply.rows, "rows"), unpack(reply.found, "found").astype(bool), unpack(reply.not_owned, "not_owned").astype(bool)


def upsert_everywhere(stubs: list[Stub], plan: ShardingPlan, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
    """Route an upsert to every owner (recserve.sharding.upsert) and require every ack."""
    for shard, parts in split_upsert(plan, table, ids, rows).items():
        req = embedding_pb2.UpsertRequest()
        for part_ids, part_rows, cs, ce in parts:
            req.tables.add(table=table, ids=pack(part_ids), rows=pack(part_rows), col_start=cs, col_end=ce)
        reply = stubs[shard].Upsert(req, timeout=10, metadata=admin_metadata(ADMIN_TOKEN))
        assert reply.rows_written == sum(len(p[0]) for p in parts) and reply.plan_version == plan.version


def test_every_tier_returns_exactly_the_stored_rows(shard_world: ShardWorld, shard_stubs: list[Stub]) -> None:
    plan = shard_world.plan
    for table, src in shard_world.sources.items():
        bounds = plan.tables[table].col_bounds()
        for k, stub in enumerate(shard_stubs):
            a = plan.assignment(k, table)
            full = np.concatenate([a.hot_ids, a.cold_ids])
            for _ in range(2):  # the second pass reads cold rows through the row cache
                rows, found, not_owned = lookup(stub, table, full)
                assert found.all() and not not_owned.any()
                assert np.array_equal(rows, src[full])
            for s, ids in a.warm_ids.items():
                if len(ids) == 0:
                    continue
                cs, ce = bounds[s]
                rows, found, not_owned = lookup(stub, table, ids, (cs, ce))
                assert found.all() and not not_owned.any() and rows.shape == (len(ids), ce - cs)
                assert np.array_equal(rows, src[ids][:, cs:ce])
    # Column-split warm rows reassemble to the full row from their slice shards.
    t = plan.tables["item"]
    warm = t.warm_ids[:50]
    owners = plan.router("item").warm_shards_of(warm)  # [N, C]
    assembled = np.zeros((len(warm), t.dim), np.float32)
    for s, (cs, ce) in enumerate(t.col_bounds()):
        for k in np.unique(owners[:, s]):
            sel = np.flatnonzero(owners[:, s] == k)
            assembled[sel, cs:ce] = lookup(shard_stubs[int(k)], "item", warm[sel], (cs, ce))[0]
    assert np.array_equal(assembled, shard_world.sources["item"][warm])


def test_foreign_ids_are_flagged_and_the_rest_answered(shard_world: ShardWorld, shard_stubs: list[Stub]) -> None:
    plan, src = shard_world.plan, shard_world.sources["item"]
    a = plan.assignment(0, "item")
    mine = a.cold_ids[:5]
    foreign = plan.assignment(1, "item").cold_ids
    foreign = np.setdiff1d(foreign, np.concatenate([a.hot_ids, a.cold_ids]))[:5]
    rows, found, not_owned = lookup(shard_stubs[0], "item", np.concatenate([foreign, mine]))
    assert not_owned.tolist() == [True] * 5 + [False] * 5
    assert found.tolist() == [False] * 5 + [True] * 5
    assert np.array_equal(rows[5:], src[mine]) and not rows[:5].any()


def test_float16_and_int8_replies(shard_world: ShardWorld, shard_stubs: list[Stub]) -> None:
    a = shard_world.plan.assignment(2, "item")
    ids = np.concatenate([a.hot_ids, a.cold_ids[:30]])
    src = shard_world.sources["item"][ids]
    rows16, found, _ = lookup(shard_stubs[2], "item", ids, dtype=common_pb2.FLOAT16)
    assert found.all() and rows16.dtype == np.float16 and np.array_equal(rows16, src.astype(np.float16))
    fused, found, _ = lookup(shard_stubs[2], "item", ids, dtype=common_pb2.INT8_ROWWISE)
    assert found.all() and fused.shape == (len(ids), 32 + 8)
    scale_bias = np.ascontiguousarray(fused[:, 32:]).view("<f4")
    back = fused[:, :32] * scale_bias[:, :1] + scale_bias[:, 1:]
    step = (src.max(axis=1) - src.min(axis=1)) / 255.0
    assert (np.abs(back - src) <= step[:, None] * 0.5 + 1e-5).all()  # within half a quantisation step


def test_read_after_write_for_hot_warm_and_cold_ids(shard_world: ShardWorld, shard_stubs: list[Stub]) -> None:
    plan = shard_world.plan
    rng = np.random.default_rng(11)
    for table in ("item", "category"):
        t = plan.tables[table]
        ids = np.array([t.hot_ids[1], t.warm_ids[1], np.setdiff1d(np.arange(t.rows), np.concatenate([t.hot_ids, t.warm_ids]))[7]])
        new = rng.standard_normal((3, t.dim)).astype(np.float32)
        upsert_everywhere(shard_stubs, plan, table, ids, new)
        router = plan.router(table)
        for j, replicas in enumerate(router.hot_replicas_of(ids[:1])[0]):
            assert j < t.hot_replicas
            rows, found, _ = lookup(shard_stubs[int(replicas)], table, ids[:1])
            assert found.all() and np.array_equal(rows[0], new[0])
        for s, shard in enumerate(router.warm_shards_of(ids[1:2])[0]):
            cs, ce = t.col_bounds()[s]
            rows, found, _ = lookup(shard_stubs[int(shard)], table, ids[1:2], (cs, ce))
            assert found.all() and np.array_equal(rows[0], new[1, cs:ce])
        for owner in router.cold_owners_of(ids[2:])[0]:
            rows, found, _ = lookup(shard_stubs[int(owner)], table, ids[2:])
            assert found.all() and np.array_equal(rows[0], new[2])
        shard_world.sources[table][ids] = new  # keep the oracle in step for later tests


def test_acknowledged_upserts_survive_sigkill(shard_world: ShardWorld, shard_cluster: ShardCluster, shard_stubs: list[Stub]) -> None:
    plan, victim = shard_world.plan, 0
    a = plan.assignment(victim, "item")
    ids = np.array([a.hot_ids[-1], a.cold_ids[-1]])
    new = np.full((2, 32), 3.25, np.float32) + np.arange(2, dtype=np.float32)[:, None]
    upsert_everywhere(shard_stubs, plan, "item", ids, new)  # acked by every owner
    shard_cluster.kill(victim)
    shard_cluster.restart(victim)  # same port, same data dir, same --load-from (skipped)
    with channel(shard_cluster.address(victim)) as ch:
        rows, found, _ = lookup(Stub(ch), "item", ids)
        info = Stub(ch).ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=10)
    assert found.all() and np.array_equal(rows, new)
    assert info.ready and info.rpcs == 1  # a fresh process answered
    shard_world.sources["item"][ids] = new


def test_bad_inputs_get_clear_statuses_and_the_server_keeps_serving(shard_world: ShardWorld, shard_stubs: list[Stub]) -> None:
    stub, src = shard_stubs[1], shard_world.sources["item"]
    good_ids = shard_world.plan.assignment(1, "item").cold_ids[:4]
    errors_before = stub.ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=10).errors

    def req(table: str = "item", ids: common_pb2.Tensor | None = None) -> embedding_pb2.LookupRequest:
        r = embedding_pb2.LookupRequest()
        r.tables.add(table=table, ids=ids if ids is not None else pack(good_ids))
        return r

    cases = [
        (req(table="nope"), grpc.StatusCode.NOT_FOUND, "table 'nope' is not served"),
        (req(ids=common_pb2.Tensor(dtype=common_pb2.INT64, shape=[2], data=b"\x00" * 12)), grpc.StatusCode.INVALID_ARGUMENT, "multiple of 8"),
        (req(ids=pack(np.arange(3, dtype=np.int32))), grpc.StatusCode.INVALID_ARGUMENT, "dtype is INT32, expected INT64"),
        (req(ids=common_pb2.Tensor(dtype=common_pb2.INT64, shape=[5], data=pack(good_ids).data)), grpc.StatusCode.INVALID_ARGUMENT, "do not match shape"),
        (req(ids=pack(np.array([5, -3]))), grpc.StatusCode.INVALID_ARGUMENT, r"id -3 is out of range [0, 4,000)"),
        (req(ids=pack(np.array([4000]))), grpc.StatusCode.INVALID_ARGUMENT, r"id 4,000 is out of range [0, 4,000)"),
        (req(ids=pack(np.arange(MAX_IDS_PER_RPC + 1) % 4000)), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_ids_per_rpc = 8,192"),
    ]
    for request, code, text in cases:
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(request, timeout=10)
        assert err.value.code() == code and text in str(err.value.details()), (code, err.value.details())
        rows, found, _ = lookup(stub, "item", good_ids)  # and the next good request is answered
        assert found.all() and np.array_equal(rows, src[good_ids])
    upserts = [
        (admin_metadata("wrong"), grpc.StatusCode.PERMISSION_DENIED, "admin token"),
        (admin_metadata(ADMIN_TOKEN), grpc.StatusCode.FAILED_PRECONDITION, "does not own ids"),
    ]
    foreign = np.setdiff1d(shard_world.plan.assignment(0, "item").cold_ids, shard_world.plan.assignment(1, "item").cold_ids)[:2]
    for metadata, code, text in upserts:
        up = embedding_pb2.UpsertRequest()
        up.tables.add(table="item", ids=pack(foreign), rows=pack(np.zeros((2, 32), np.float32)))
        with pytest.raises(grpc.RpcError) as err:
            stub.Upsert(up, timeout=10, metadata=metadata)
        assert err.value.code() == code and text in str(err.value.details())
        assert lookup(stub, "item", good_ids)[1].all()
    assert f"{int(foreign[0]):,}" in str(err.value.details())  # the rejection names the ids
    info = stub.ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=10)
    assert info.errors - errors_before == len(cases) + len(upserts)


def test_shard_info_counts_what_was_served_and_get_plan(shard_world: ShardWorld, shard_stubs: list[Stub]) -> None:
    plan, stub = shard_world.plan, shard_stubs[2]
    a = plan.assignment(2, "item")
    before = stub.ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=10)
    foreign = np.setdiff1d(np.arange(4000), np.concatenate([a.hot_ids, a.cold_ids, *a.warm_ids.values()]))[:7]
    lookup(stub, "item", np.concatenate([a.hot_ids, a.cold_ids[:100], foreign]))
    after = stub.ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=10)
    assert after.rpcs - before.rpcs == 1
    assert after.ids_requested - before.ids_requested == len(a.hot_ids) + 100 + 7
    assert after.rows_served_hot - before.rows_served_hot == len(a.hot_ids)
    assert after.rows_served_cold - before.rows_served_cold == 100
    assert after.rows_not_owned - before.rows_not_owned == 7
    assert (after.row_cache_hits + after.row_cache_misses) - (before.row_cache_hits + before.row_cache_misses) == 100
    assert after.ready and after.p99_ms >= after.p50_ms > 0 and after.cpu_seconds > 0 and after.rss_bytes > 10 << 20
    tiers = {t.table: t for t in after.tables}
    assert tiers["item"].hot_rows == len(a.hot_ids) and tiers["item"].cold_rows == len(a.cold_ids)
    assert tiers["item"].warm_rows == sum(len(v) for v in a.warm_ids.values())
    assert tiers["item"].hot_bytes >= len(a.hot_ids) * 32 * 4
    reply = stub.GetPlan(embedding_pb2.GetPlanRequest(), timeout=10)
    assert reply.plan_version == plan.version and ShardingPlan.from_json(reply.plan_json) == plan


def test_pooled_lookup_returns_partial_sums_and_counts(shard_world: ShardWorld, shard_stubs: list[Stub]) -> None:
    a = shard_world.plan.assignment(1, "category")
    ids = a.cold_ids[:6]
    indices, offsets = np.array([5, 0, 2, 2, 4, 1]), np.array([0, 2, 2, 6])
    req = embedding_pb2.LookupRequest(pooled=True)
    req.tables.add(table="category", ids=pack(ids), bag_indices=pack(indices), bag_offsets=pack(offsets))
    reply = shard_stubs[1].Lookup(req, timeout=10).tables[0]
    src = shard_world.sources["category"]
    expect = np.stack([src[ids[[5, 0]]].sum(0), np.zeros(16, np.float32), src[ids[[2, 2, 4, 1]]].sum(0)])
    assert np.allclose(unpack(reply.pooled, "pooled"), expect, atol=1e-6)
    assert unpack(reply.bag_counts, "bag_counts").tolist() == [2, 0, 4]


def test_fault_hook_injects_latency_and_errors(shard_world: ShardWorld, shard_cluster: ShardCluster, shard_stubs: list[Stub]) -> None:
    ids = shard_world.plan.assignment(2, "item").cold_ids[:3]
    shard_cluster.set_fault(2, delay_ms=150, methods=["Lookup"])
    started = time.monotonic()
    assert lookup(shard_stubs[2], "item", ids)[1].all()
    assert time.monotonic() - started >= 0.15
    shard_cluster.set_fault(2, code="UNAVAILABLE", count=1)
    with pytest.raises(grpc.RpcError) as err:
        lookup(shard_stubs[2], "item", ids)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "injected" in str(err.value.details())
    assert lookup(shard_stubs[2], "item", ids)[1].all()  # count=1: only one RPC failed
    req = embedding_pb2.LookupRequest()
    req.tables.add(table="item", ids=pack(ids))
    with pytest.raises(grpc.RpcError) as err:  # per-RPC fault through metadata
        shard_stubs[2].Lookup(req, timeout=10, metadata=(("x-recserve-fault", "code=DEADLINE_EXCEEDED"),))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert shard_cluster.set_fault(2) == {"delay_ms": 0.0, "code": "", "methods": [], "count": -1}


def test_reflection_lists_the_services(shard_cluster: ShardCluster) -> None:
    with channel(shard_cluster.address(0)) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert {"recserve.v1.EmbeddingShard", "grpc.health.v1.Health"} <= services
