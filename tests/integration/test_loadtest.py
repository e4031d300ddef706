"""``recserve loadtest`` as a user runs it, against a real small cluster: 2 shards, a
ranker, the cascade and the HTTP gateway on loopback (tests/integration/gateway_world.py),
laid out as ``recserve serve --data DIR`` lays out its children, so the load test finds
them from ``--data``. Each run is brief; its counts are checked against the servers' own
counters, read by the test: the cascade's and the rankers' ``Admin.ModelStatus.requests``
and the shards' ``ShardInfo.rpcs`` — requests sent = requests the servers saw (nothing
is left in flight once the run has drained). The cascade's count is exact; the rankers
and the shards also serve a trickle of requests at idle that the load test did not send
(:data:`BACKGROUND_PER_S`), so theirs is bounded by it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from recserve.cluster.group import REPO_ROOT
from recserve.rpc.deadline import make_header
from recserve.rpc.health import DEEP_CHECK_INTERVAL_ENV
from recserve.v1 import admin_pb2, embedding_pb2
from recserve.v1.admin_pb2_grpc import AdminStub
from recserve.v1.embedding_pb2_grpc import EmbeddingShardStub
from tests.integration.gateway_world import GatewayWorld, gateway_world

pytestmark = pytest.mark.integration

KEYS = ("offered_rps", "completed_rps", "goodput_rps", "shed", "late", "degraded_fraction", "errors", "p50_ms", "p99_ms", "p999_ms", "generator_lag_ms")


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayWorld, Path]]:
    root = tmp_path_factory.mktemp("loadtest")
    # The counts are compared with the servers' own: the rankers' and the cascade's
    # periodic deep checks (a fixed Rank per model, a fixed Recommend, every 5 s) would
    # add requests nobody sent, so none run here.
    with pytest.MonkeyPatch.context() as env:
        env.setenv(DEEP_CHECK_INTERVAL_ENV, "3600")
        with gateway_world(root) as world:
            yield world, root


#: Requests the rankers (and through them the shards) serve with no load at all (not
#: from the load test; the deep checks are off here), so their counts are checked as
#: sent <= seen <= sent + this many per second of the load test's wall time.
BACKGROUND_PER_S = 3.0


def _loadtest(world: GatewayWorld, *args: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "recserve", "loadtest", "--config", str(world.spec_path), "--catalog", str(world.world.root / "catalog"),
            "--rate", "30", "--duration", "1", "--timeout-ms", "8000", "--slo-ms", "5000", "--candidates", "16", "--pool-size", "256", "--no-progress", "--json", *args]  # fmt: skip
    started = time.monotonic()
    out = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    wall_s = time.monotonic() - started
    assert out.returncode == 0, out.stderr[-3000:]
    assert "recserve loadtest:" in out.stderr  # the table, on stderr beside --json
    report: dict[str, Any] = json.loads(out.stdout)
    for key in KEYS:
        assert key in report, key
    assert report["requests"] > 0 and report["sent"] == report["requests"] and report["in_flight"] == 0
    assert report["errors"] == {}, report["error_samples"]
    report["_background"] = int(BACKGROUND_PER_S * wall_s) + 1
    return report


def _model_status_requests(addresses: Sequence[str]) -> int:
    total = 0
    for a in addresses:
        with grpc.insecure_channel(a) as ch:
            total += AdminStub(ch).ModelStatus(admin_pb2.ModelStatusRequest(header=make_header(timeout_s=30.0)), timeout=30.0).requests
    return total


def _shard_rpcs(addresses: Sequence[str]) -> int:
    total = 0
    for a in addresses:
        with grpc.insecure_channel(a) as ch:
            total += EmbeddingShardStub(ch).ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=30.0).rpcs
    return total


def test_rank_over_grpc_matches_the_rankers_count(gw: tuple[GatewayWorld, Path]) -> None:
    world, _ = gw
    before = _model_status_requests(world.ranker_addresses)
    report = _loadtest(world, "--target", "rank", "--grpc", ",".join(world.ranker_addresses))
    seen = _model_status_requests(world.ranker_addresses) - before
    # One Rank per request, plus any retry the client's router made (counted in attempts).
    assert report["attempts"] >= report["sent"] == report["answered"]
    assert report["attempts"] <= seen <= report["attempts"] + report["_background"]


def test_lookup_over_grpc_matches_the_shards_rpc_count(gw: tuple[GatewayWorld, Path]) -> None:
    world, root = gw
    before = _shard_rpcs(world.shard_addresses)
    report = _loadtest(world, "--target", "lookup", "--data", str(root))
    seen = _shard_rpcs(world.shard_addresses) - before
    assert report["lookup"]["callers"] == report["sent"] == report["answered"]  # the run's, its warm-up apart
    lk = report["lookup_total"]
    # The shards count Lookup RPCs only: every primary the client sent (warm-up included),
    # those of its hedges that reached a shard before the primary's answer cancelled them,
    # and the rankers' background lookups.
    assert lk["rpcs_primary"] > 0
    assert lk["rpcs_primary"] <= seen <= lk["rpcs_primary"] + lk["rpcs_hedge"] + len(world.shard_addresses) * report["_background"]


def test_recommend_over_grpc_from_the_data_dir_matches_the_cascades_count(gw: tuple[GatewayWorld, Path]) -> None:
    world, root = gw
    before = _model_status_requests(world.recommenders)
    report = _loadtest(world, "--target", "recommend", "--data", str(root))
    seen = _model_status_requests(world.recommenders) - before
    assert report["target"]["via"] == "grpc" and world.cascade.address in report["target"]["label"]
    assert seen == report["sent"] == report["answered"]
    assert report["server_requests"] == seen
    assert report["p50_ms"] is not None and report["p50_ms"] <= report["p99_ms"] <= report["p999_ms"]


def test_recommend_and_rank_over_http_match_the_servers_counts(gw: tuple[GatewayWorld, Path]) -> None:
    world, _ = gw
    before = _model_status_requests(world.ranker_addresses)
    report = _loadtest(world, "--target", "rank", "--http", world.url)
    assert report["target"]["via"] == "http"
    assert report["sent"] == report["answered"] <= _model_status_requests(world.ranker_addresses) - before <= report["sent"] + report["_background"]

    before = _model_status_requests(world.recommenders)
    report = _loadtest(world, "--target", "recommend", "--http", world.url)
    assert _model_status_requests(world.recommenders) - before == report["sent"] == report["answered"]
