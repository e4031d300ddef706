"""Stopping a shard ends its health Watch streams with NOT_SERVING and OK, instead of
holding the stop for the whole grace period and cutting them off (a real process)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recserve.cluster import ShardCluster
from tests.integration.conftest import ShardWorld, server_config

pytestmark = pytest.mark.integration


def test_stop_ends_health_watch_streams_cleanly(shard_world: ShardWorld) -> None:
    cluster = ShardCluster(shard_world.plan_path, shard_world.root / "health", num_shards=1, server=server_config(), load_from=shard_world.source_dir)
    with cluster, grpc.insecure_channel(cluster.address(0)) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        cluster.stop(0)
        # Before the fix the stream was cut off after the 2 s grace: UNAVAILABLE here.
        rest = [reply.status for reply in watch]
        assert rest == [health_pb2.HealthCheckResponse.NOT_SERVING]
        assert watch.code() == grpc.StatusCode.OK
