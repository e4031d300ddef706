"""A real shard server process answers hostile input with clear statuses and keeps
serving: malformed request bytes (every method, found by reflection and fuzzed),
duplicate ids within one Lookup, too many bags in a pooled Lookup."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from recserve.cluster import ShardCluster
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import embedding_pb2
from recserve.v1.embedding_pb2_grpc import EmbeddingShardStub as Stub
from tests.grpc_fuzz import fuzz_server
from tests.integration.conftest import ADMIN_TOKEN, ShardWorld, channel, server_config

pytestmark = pytest.mark.integration

SHARD = 0
MAX_BAGS = 64
SHARD_METHODS = [f"/recserve.v1.EmbeddingShard/{m}" for m in ("Lookup", "Upsert", "ShardInfo", "GetPlan")]


@pytest.fixture(scope="module")
def cluster(shard_world: ShardWorld) -> Iterator[ShardCluster]:
    with ShardCluster(
        shard_world.plan_path, shard_world.root / "badinput", num_shards=1, server=server_config(max_bags_per_rpc=MAX_BAGS), load_from=shard_world.source_dir, admin_token=ADMIN_TOKEN
    ) as c:
        yield c


@pytest.fixture(scope="module")
def stub(cluster: ShardCluster) -> Iterator[Stub]:
    with channel(cluster.address(SHARD)) as ch:
        yield Stub(ch)


def cold_ids(world: ShardWorld, n: int) -> np.ndarray:
    return world.plan.assignment(SHARD, "item").cold_ids[:n]


def lookup_request(ids: np.ndarray, *, bags: int | None = None) -> embedding_pb2.LookupRequest:
    """One 'item' TableLookup; ``bags``: pooled, the ids in the first bag, the rest empty."""
    req = embedding_pb2.LookupRequest(pooled=bags is not None)
    tl = req.tables.add(table="item", ids=pack(np.asarray(ids, np.int64)))
    if bags is not None:
        offsets = np.full(bags + 1, len(ids), np.int64)
        offsets[0] = 0
        tl.bag_indices.CopyFrom(pack(np.arange(len(ids), dtype=np.int64)))
        tl.bag_offsets.CopyFrom(pack(offsets))
    return req


def assert_serves(stub: Stub, world: ShardWorld) -> None:
    ids = cold_ids(world, 4)
    reply = stub.Lookup(lookup_request(ids), timeout=10).tables[0]
    assert np.array_equal(unpack(reply.rows, "rows"), world.sources["item"][ids])


def test_bytes_that_are_not_protobuf_are_invalid_argument_naming_the_method(cluster: ShardCluster, stub: Stub, shard_world: ShardWorld) -> None:
    with grpc.insecure_channel(cluster.address(SHARD)) as ch:
        for method in SHARD_METHODS:
            with pytest.raises(grpc.RpcError) as err:
                ch.unary_unary(method, request_serializer=None, response_deserializer=None)(b"\xfe", timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.value.details())
            assert str(err.value.details()).startswith(f"{method}: the request body (1 byte) is not a valid recserve.v1.")
            assert_serves(stub, shard_world)


def test_fuzzing_every_method_leaves_the_shard_serving(cluster: ShardCluster, stub: Stub, shard_world: ShardWorld) -> None:
    ids = cold_ids(shard_world, 6)
    examples = {SHARD_METHODS[0]: [lookup_request(ids), lookup_request(ids, bags=3)]}
    report = fuzz_server(cluster.address(SHARD), seed=0, cases_per_method=30, examples=examples, check=lambda ch: assert_serves(Stub(ch), shard_world))
    reflection = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"  # bidi streaming
    expected = {*SHARD_METHODS, *(f"/grpc.health.v1.Health/{m}" for m in ("Check", "List", "Watch")), reflection}
    assert set(report.methods) == expected
    for method in expected:
        stats = report.methods[method]
        assert stats.cases == 30 and 0 < stats.malformed < stats.cases, (method, stats)
        assert stats.codes["INVALID_ARGUMENT"] >= stats.malformed, (method, stats)


def test_a_duplicate_id_is_rejected_naming_table_and_id_and_not_counted(stub: Stub, shard_world: ShardWorld) -> None:
    a, b = (int(i) for i in cold_ids(shard_world, 2))
    before = stub.ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        stub.Lookup(lookup_request(np.array([a, b, a])), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'item'" in str(err.value.details()) and f"id {a:,} appears 2 times" in str(err.value.details())
    after = stub.ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=10)
    assert after.ids_requested == before.ids_requested and after.rows_served_cold == before.rows_served_cold
    assert after.errors == before.errors + 1
    assert_serves(stub, shard_world)


def test_a_pooled_lookup_with_more_than_max_bags_per_rpc_is_invalid_argument(stub: Stub, shard_world: ShardWorld) -> None:
    ids = cold_ids(shard_world, 3)
    reply = stub.Lookup(lookup_request(ids, bags=MAX_BAGS), timeout=10).tables[0]
    assert unpack(reply.bag_counts, "bag_counts").tolist() == [3] + [0] * (MAX_BAGS - 1)
    with pytest.raises(grpc.RpcError) as err:
        stub.Lookup(lookup_request(ids, bags=MAX_BAGS + 1), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"carries {MAX_BAGS + 1} bags" in str(err.value.details()) and f"shard_server.max_bags_per_rpc = {MAX_BAGS}" in str(err.value.details())
    assert_serves(stub, shard_world)
