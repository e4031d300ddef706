"""A ranker and a decoder in one process on one device (issue 16, "Shared device").

One real ``recserve ranker serve`` process with ``[generation] co_locate = true`` on two
real shard processes: it serves Ranking and Generation from the same gRPC server, and
both workloads' device work goes through its one bulkhead executor (the
``recserve_device_*`` metrics count both lanes). Oracles: the ranker's own answer to a
request sent alone, and naive full-recompute decoding of the same seeded weights in
this process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from ranker.export import export_models
from ranker.scrubbed import open_scrubbed
from ranker.spec import tables_and_features
from ranker.train import train_all
from recserve.cluster import ShardCluster
from recserve.cluster.rankers import RankerCluster
from recserve.config import load
from recserve.config.spec import ShardingConfig
from recserve.rpc.deadline import make_header
from recserve.rpc.tensors import pack, unpack
from recserve.sharding import plan_tables
from recserve.v1 import generation_pb2, ranking_pb2
from recserve.v1.generation_pb2_grpc import GenerationStub
from recserve.v1.ranking_pb2_grpc import RankingStub
from tests.integration.ranker_world import TINY, spec_text
from tests.utils_catalog import make_catalog

TIMEOUT_S = 60.0
GENERATION = """[generation]
co_locate = true
min_device_share = 0.2
device = "cpu"
n_layers = 1
n_heads = 2
dim = 32
max_seq_len = 128
num_blocks = 64
max_seqs = 8
token_budget = 128
prefill_chunk_tokens = 32
max_new_tokens_cap = 64
stop_token = -1
"""
PROMPTS = ("because you liked", "a short explanation", "items like this one", "people who bought")
NEW_TOKENS = 12


@dataclasses.dataclass
class Colocated:
    spec: Path
    address: str
    metrics_url: str
    num_items: int


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Colocated]:
    root = tmp_path_factory.mktemp("colocated")
    make_catalog(root / "catalog", items=2_000, users=200, impressions=4_000, categories=8, tags=32, history_len=8, candidates=64)
    view = open_scrubbed(root / "catalog")
    manifest = export_models(train_all(view, TINY), view, root / "models")
    tables, _ = tables_and_features(manifest)
    plan_tables(list(tables), None, ShardingConfig(num_shards=2, hot_fraction=0.01, warm_fraction=0.1, hot_replicas=2)).plan.save(root / "plan.json")
    spec = root / "cluster.toml"
    spec.write_text(spec_text(manifest, root / "models", GENERATION))
    assert load(spec).generation.co_locate
    with ShardCluster(root / "plan.json", root / "shards", load_from=root / "models") as shards:
        with RankerCluster(spec, root / "models", shards.addresses, num_rankers=1, data_root=root / "rankers") as rankers:
            url = rankers.metrics_url(0)
            assert url is not None
            yield Colocated(spec, rankers.address(0), url, int(manifest["catalog"]["items"]))  # type: ignore[index]


def scrape(url: str) -> dict[tuple[str, str], float]:
    """(sample name, lane label) -> value of the recserve_device_* samples."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, s.labels.get("lane", "")): s.value for f in text_string_to_metric_families(text) if f.name.startswith("recserve_device") for s in f.samples}


def oracle_tokens(spec: Path, prompt: str) -> np.ndarray:
    """Full-recompute greedy decoding of the served weights (seeded) in this process."""
    from generation.oracle import generate_recompute
    from generation.service import load_model
    from generation.tokenizer import ByteTokenizer
    from generation.types import GenerationRequest

    loaded = load_model(load(spec).generation)
    return generate_recompute(loaded.model, GenerationRequest(ByteTokenizer().encode(prompt, bos=False), NEW_TOKENS))


def test_one_server_reports_ranking_and_generation_serving(colocated: Colocated) -> None:
    with grpc.insecure_channel(colocated.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "recserve.v1.Ranking", "recserve.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


def test_rank_and_generate_at_once_share_the_device_and_stay_exact(colocated: Colocated) -> None:
    rng = np.random.default_rng(0)
    requests = [(int(u), rng.choice(colocated.num_items, size=64, replace=False).astype(np.int64)) for u in rng.integers(0, 200, size=24)]

    def rank_request(user: int, items: np.ndarray) -> ranking_pb2.RankRequest:
        return ranking_pb2.RankRequest(header=make_header(timeout_s=TIMEOUT_S, priority="critical"), user_id=user, candidate_ids=pack(items), model="dlrm")

    with grpc.insecure_channel(colocated.address) as channel:  # each request alone: the reference answers
        alone = [RankingStub(channel).Rank(rank_request(u, c), timeout=TIMEOUT_S) for u, c in requests[:4]]
    before = scrape(colocated.metrics_url)

    async def main() -> tuple[list[ranking_pb2.RankResponse], list[list[generation_pb2.GenerateChunk]]]:
        async with grpc.aio.insecure_channel(colocated.address) as channel:
            rank, gen = RankingStub(channel), GenerationStub(channel)

            async def stream(prompt: str) -> list[generation_pb2.GenerateChunk]:
                call = gen.Generate(generation_pb2.GenerateRequest(header=make_header(timeout_s=TIMEOUT_S, priority="best_effort"), prompt=prompt,
                                                                   max_new_tokens=NEW_TOKENS), timeout=TIMEOUT_S)  # fmt: skip
                return [chunk async for chunk in call]

            streams = [asyncio.ensure_future(stream(p)) for p in PROMPTS]
            ranked = await asyncio.gather(*(rank.Rank(rank_request(u, c), timeout=TIMEOUT_S) for u, c in requests))
            return list(ranked), list(await asyncio.gather(*streams))

    ranked, chunks = asyncio.run(main())
    after = scrape(colocated.metrics_url)

    assert len(ranked) == len(requests)  # every Rank answered (an error would have raised)
    for (user, items), reply in zip(requests, ranked):
        got = unpack(reply.item_ids, "item_ids")
        assert sorted(got.tolist()) == sorted(items.tolist())
        assert np.all(np.diff(unpack(reply.scores, "scores")) <= 0)
    for ref, reply in zip(alone, ranked):  # batched beside decode steps, the same scores as alone
        np.testing.assert_allclose(unpack(reply.scores, "scores"), unpack(ref.scores, "scores"), rtol=1e-5, atol=1e-6)
        assert unpack(reply.item_ids, "item_ids").tolist() == unpack(ref.item_ids, "item_ids").tolist()
    for prompt, stream in zip(PROMPTS, chunks):
        tokens = np.concatenate([unpack(c.tokens, "tokens") for c in stream]).astype(np.int64)
        np.testing.assert_array_equal(tokens, oracle_tokens(colocated.spec, prompt))
        assert stream[-1].finished and stream[-1].finish_reason == "length"

    def grew(name: str, lane: str) -> float:
        return after.get((name, lane), 0.0) - before.get((name, lane), 0.0)

    # Both workloads ran on the one device executor: ranker batches on the critical lane,
    # decode steps (one per generated token at least) on the best-effort lane.
    assert grew("recserve_device_jobs_total", "critical") >= 1
    assert grew("recserve_device_jobs_total", "best_effort") >= NEW_TOKENS
    assert grew("recserve_device_busy_seconds_total", "best_effort") > 0
    assert grew("recserve_device_queue_wait_seconds_count", "critical") == grew("recserve_device_jobs_total", "critical")
