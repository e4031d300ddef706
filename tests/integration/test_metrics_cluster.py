"""Every process's ``/metrics`` on a real cluster: 2 shards, 1 ranker and the cascade on
loopback (the tiny trained world of tests/integration/ranker_world.py), each serving
Prometheus text on the port its launcher read back from ``--metrics-port-file``.

Each scrape is parsed with ``prometheus_client.parser``. After N Rank calls and N
Recommend calls the request counters of the right processes moved by exactly N; the
other families are checked against oracles outside the metrics code: the shards'
``ShardInfo`` counters, the ranker's ``Admin.ModelStatus`` lookup counts, the stage
reports in the Recommend responses, and the lookup client's ids sent against the rows
the shards served (hedging is off in this spec so that no hedge is cancelled in flight).
A Recommend cancelled by its caller shows as a cancelled item in the ranker's scheduler
(the cascade has none): what the gateway's disconnect test reads.
"""

from __future__ import annotations

import dataclasses
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from recserve.cluster import ShardCluster
from recserve.cluster.cascade import CascadeCluster
from recserve.cluster.rankers import RankerCluster
from recserve.rpc.deadline import make_header
from recserve.rpc.health import DEEP_CHECK_INTERVAL_ENV
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import admin_pb2, embedding_pb2, ranking_pb2, recommender_pb2
from recserve.v1.admin_pb2_grpc import AdminStub
from recserve.v1.embedding_pb2_grpc import EmbeddingShardStub
from recserve.v1.ranking_pb2_grpc import RankingStub
from recserve.v1.recommender_pb2_grpc import RecommenderStub
from tests.integration.ranker_world import RankerWorld, make_ranker_world, spec_text

N = 5
EXTRA = """
[lookup]
hedge_budget = 0.0

[cascade]
l0_out = 400
l1_out = 200
l2_out = 50
l3_out = 10
default_deadline_ms = 5000.0
index_factory = "Flat"
"""
Scrape = dict[str, Any]  # family name -> prometheus_client Metric


@dataclasses.dataclass
class Cluster:
    world: RankerWorld
    shards: ShardCluster
    rankers: RankerCluster
    cascade: CascadeCluster

    def urls(self) -> dict[str, str]:
        urls = {f"shard-{k}": self.shards.metrics_url(k) for k in range(self.shards.num_shards)}
        urls["ranker-0"] = self.rankers.metrics_url(0)
        urls["cascade-0"] = self.cascade.metrics_url
        assert all(urls.values()), urls
        return {name: str(url) for name, url in urls.items()}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    world = make_ranker_world(tmp_path_factory.mktemp("metrics"))
    spec = world.root / "metrics.toml"
    spec.write_text(spec_text(world.export.manifest, world.models, EXTRA))
    # The tests compare counters read twice; the ranker's and the cascade's periodic deep
    # checks (a fixed Rank, a fixed Recommend) would move them in between: none run here.
    with pytest.MonkeyPatch.context() as env:
        env.setenv(DEEP_CHECK_INTERVAL_ENV, "3600")
        with ShardCluster(world.plan_path, world.root / "shards", load_from=world.models, fault_hook=True) as shards:
            with RankerCluster(spec, world.models, shards.addresses, num_rankers=1, data_root=world.root / "rankers") as rankers:
                with CascadeCluster(spec, world.models, rankers.addresses, shards.addresses, data_root=world.root / "cascade") as cascade:
                    yield Cluster(world, shards, rankers, cascade)


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def scrape_all(cluster: Cluster) -> dict[str, Scrape]:
    return {name: scrape(url) for name, url in cluster.urls().items()}


def value(scraped: Scrape, family: str, suffix: str = "", **labels: str) -> float:
    """Sum of ``family``'s samples named ``family + suffix`` whose labels include ``labels``."""
    assert family in scraped, f"{family} missing; have {sorted(n for n in scraped if n.startswith('recserve'))}"
    return sum(s.value for s in scraped[family].samples if s.name == family + suffix and labels.items() <= s.labels.items())


def delta(before: Scrape, after: Scrape, family: str, suffix: str = "", **labels: str) -> float:
    return value(after, family, suffix, **labels) - (value(before, family, suffix, **labels) if family in before else 0.0)


def health_check(address: str) -> None:
    with grpc.insecure_channel(address) as ch:
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING


def test_every_process_serves_metrics_that_parse(cluster: Cluster) -> None:
    scraped = scrape_all(cluster)
    assert set(scraped) == {"shard-0", "shard-1", "ranker-0", "cascade-0"}
    for name in ("shard-0", "shard-1"):
        assert {"recserve_shard_rows", "recserve_shard_row_cache_hits", "recserve_shard_row_cache_evictions", "recserve_shard_rocksdb_reads"} <= set(scraped[name])
        assert "recserve_lookup_windows" not in scraped[name]  # a shard has no lookup client
    assert {"recserve_lookup_windows", "recserve_lookup_rpcs", "recserve_scheduler_queue_depth", "recserve_scheduler_cancelled"} <= set(scraped["ranker-0"])
    assert "recserve_shard_rows" not in scraped["ranker-0"]
    loops = {s.labels["loop"] for s in scraped["ranker-0"]["recserve_scheduler_queue_depth"].samples}
    assert {"lookup", "rank-dlrm"} <= loops


def test_n_rank_calls_move_the_rankers_counters_by_n_and_the_shards_serve_what_was_sent(cluster: Cluster) -> None:
    ranker = cluster.rankers.address(0)
    num_items = cluster.world.export.arrays.num_items
    rng = np.random.default_rng(0)
    for address in [*cluster.shards.addresses, ranker, cluster.cascade.address]:
        health_check(address)  # health is not counted
    before = scrape_all(cluster)
    users = [*range(N - 1), cluster.world.export.arrays.num_users + 5]  # the last one is new: cold_start
    reasons: list[str] = []
    with grpc.insecure_channel(ranker) as ch:
        stub = RankingStub(ch)
        for user in users:
            items = rng.choice(num_items, 20, replace=False)
            req = ranking_pb2.RankRequest(header=make_header(timeout_s=20), user_id=user, candidate_ids=pack(items.astype(np.int64)), model="dlrm")
            resp = stub.Rank(req, timeout=30)
            assert unpack(resp.item_ids, "item_ids").shape == (20,)
            reasons += [r for r in resp.degraded_reason.split(",") if r]
        bad = ranking_pb2.RankRequest(header=make_header(timeout_s=20), user_id=1, candidate_ids=pack(np.array([num_items + 7], np.int64)), model="dlrm")
        with pytest.raises(grpc.RpcError) as err:
            stub.Rank(bad, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:  # bytes that are no RankRequest: answered, and counted, too
            ch.unary_unary("/recserve.v1.Ranking/Rank")(b"\xfe", timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape_all(cluster)
    b, a = before["ranker-0"], after["ranker-0"]
    rpc = "recserve_rpc_requests"
    assert delta(b, a, rpc, "_total", service="Ranking", method="Rank", code="OK") == N
    assert delta(b, a, rpc, "_total", service="Ranking", method="Rank", code="INVALID_ARGUMENT") == 2
    assert delta(b, a, rpc, "_total", service="Ranking") == N + 2  # nothing else reached Ranking
    assert delta(b, a, "recserve_rpc_latency_seconds", "_count", service="Ranking", method="Rank") == N + 2
    assert "cold_start" in reasons
    for reason in set(reasons):
        assert delta(b, a, "recserve_degraded_responses", "_total", service="Ranking", reason=reason) == reasons.count(reason)
    for name, scraped in after.items():
        assert not [s for s in scraped[rpc].samples if s.labels["service"] in ("Health", "ServerReflection")], name
    # The dlrm scheduler took each good request once (the bad one failed validation first).
    assert delta(b, a, "recserve_scheduler_batch_size", "_sum", loop="rank-dlrm") == N
    assert delta(b, a, "recserve_scheduler_queue_wait_seconds", "_count", loop="rank-dlrm") == N
    assert value(a, "recserve_scheduler_queue_depth", loop="rank-dlrm") == 0
    # Lookups: the ranker's client against the shards' own counts.
    sent = delta(b, a, "recserve_lookup_ids_sent", "_total")
    rpcs = delta(b, a, "recserve_lookup_rpcs", "_total")
    assert sent > 0 and rpcs > 0 and delta(b, a, "recserve_lookup_rpcs", "_total", kind="hedge") == 0
    served = sum(delta(before[s], after[s], "recserve_shard_rows", "_total") for s in ("shard-0", "shard-1"))
    assert served == sent  # every id sent was served by a tier (all exist; hedging off)
    lookups = sum(delta(before[s], after[s], rpc, "_total", service="EmbeddingShard", method="Lookup", code="OK") for s in ("shard-0", "shard-1"))
    assert lookups == rpcs
    with grpc.insecure_channel(ranker) as ch:
        status = AdminStub(ch).ModelStatus(admin_pb2.ModelStatusRequest(), timeout=10)
    assert value(a, "recserve_lookup_windows", "_total") == status.lookup_windows > 0
    assert value(a, "recserve_lookup_ids_requested", "_total") == status.lookup_ids
    assert value(a, "recserve_lookup_ids_unique", "_total") == status.lookup_unique_ids


def test_each_shards_metrics_match_its_shard_info(cluster: Cluster) -> None:
    infos = []
    for address in cluster.shards.addresses:
        with grpc.insecure_channel(address) as ch:
            infos.append(EmbeddingShardStub(ch).ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=10))
    scraped = scrape_all(cluster)  # after ShardInfo: no lookups ran in between
    for k, info in enumerate(infos):
        s = scraped[f"shard-{k}"]
        tiers = {t: value(s, "recserve_shard_rows", "_total", tier=t) for t in ("hot", "warm", "cold")}
        assert tiers == {"hot": info.rows_served_hot, "warm": info.rows_served_warm, "cold": info.rows_served_cold}
        assert value(s, "recserve_shard_row_cache_hits", "_total") == info.row_cache_hits
        assert value(s, "recserve_shard_row_cache_misses", "_total") == info.row_cache_misses
        assert value(s, "recserve_shard_rocksdb_reads", "_total") <= info.row_cache_misses  # misses, deduplicated per request
        assert value(s, "recserve_shard_row_cache_evictions", "_total") >= 0


def test_n_recommend_calls_move_the_cascades_counters_by_n_with_the_stage_reports(cluster: Cluster) -> None:
    cold_user = cluster.world.export.arrays.num_users + 3  # a user the models never saw: cold_start
    before = scrape_all(cluster)
    responses = []
    with grpc.insecure_channel(cluster.cascade.address) as ch:
        stub = RecommenderStub(ch)
        for user in [*range(10, 10 + N - 1), cold_user]:
            req = recommender_pb2.RecommendRequest(header=make_header(timeout_s=20), user_id=user, k=10)
            responses.append(stub.Recommend(req, timeout=30))
    after = scrape_all(cluster)
    b, a = before["cascade-0"], after["cascade-0"]
    assert delta(b, a, "recserve_rpc_requests", "_total", service="Recommender", method="Recommend", code="OK") == N
    assert delta(b, a, "recserve_rpc_requests", "_total", service="Recommender") == N
    for stage in ("L0", "L1", "L2", "L3"):
        reports = [r for resp in responses for r in resp.stages if r.stage == stage]
        assert len(reports) == N
        assert delta(b, a, "recserve_cascade_stage_latency_seconds", "_count", stage=stage) == N
        assert delta(b, a, "recserve_cascade_stage_latency_seconds", "_sum", stage=stage) == pytest.approx(sum(r.elapsed_ms for r in reports) / 1e3, rel=1e-6, abs=1e-9)
        for reason in {r.degraded_reason for r in reports if r.degraded}:
            want = sum(1 for r in reports if r.degraded_reason == reason)
            assert delta(b, a, "recserve_cascade_stage_degraded", "_total", stage=stage, reason=reason) == want
    reasons = [resp.degraded_reason for resp in responses if resp.degraded]
    assert "cold_start" in reasons
    for reason in set(reasons):
        assert delta(b, a, "recserve_degraded_responses", "_total", service="Recommender", reason=reason) == reasons.count(reason)
    # The cascade's L2 / L3 reached the ranker through its Rank method.
    assert delta(before["ranker-0"], after["ranker-0"], "recserve_rpc_requests", "_total", service="Ranking", method="Rank") >= 1


def wait_for(what: str, condition: Any, timeout_s: float = 20.0) -> None:
    """Poll ``condition()`` (a scrape) until true; fail naming ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_cancelled_recommend_shows_as_a_cancelled_item_in_the_rankers_scheduler(cluster: Cluster) -> None:
    ranker = cluster.urls()["ranker-0"]
    before = scrape_all(cluster)
    for k in range(cluster.shards.num_shards):  # lookups hang: the ranker's batch stays running
        cluster.shards.set_fault(k, delay_ms=2500, methods=["Lookup"])
    try:
        with grpc.insecure_channel(cluster.cascade.address) as ch:
            req = recommender_pb2.RecommendRequest(header=make_header(timeout_s=20), user_id=12, k=10)
            call = RecommenderStub(ch).Recommend.future(req, timeout=30)
            # L0's EmbedUser is in a ranker batch (waiting on its lookups) ...
            wait_for("a ranker batch", lambda: delta(before["ranker-0"], scrape(ranker), "recserve_scheduler_batch_size", "_count") >= 1)
            assert not call.done()
            call.cancel()  # ... when the caller goes away
            wait_for("the cancellation", lambda: delta(before["ranker-0"], scrape(ranker), "recserve_scheduler_cancelled", "_total") >= 1)
    finally:
        for k in range(cluster.shards.num_shards):
            cluster.shards.set_fault(k)
    after = scrape_all(cluster)
    assert delta(before["ranker-0"], after["ranker-0"], "recserve_scheduler_cancelled", "_total") == 1
    assert delta(before["ranker-0"], after["ranker-0"], "recserve_scheduler_expired", "_total") == 0
    wait_for("the cascade to count the call", lambda: delta(before["cascade-0"], scrape(cluster.urls()["cascade-0"]), "recserve_rpc_requests", "_total", service="Recommender") == 1)
    assert delta(before["cascade-0"], scrape_all(cluster)["cascade-0"], "recserve_rpc_requests", "_total", service="Recommender", code="CANCELLED") == 1
