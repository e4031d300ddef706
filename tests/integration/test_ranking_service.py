"""The Ranking service over gRPC on real shards: batched, exact, degraded, and strict.

A tiny model set is trained on a 5k-item catalog and exported; two real shard processes
(RocksDB in a temp dir) serve its tables, and one real ``recserve ranker serve`` process
serves Rank / EmbedUser / Admin. Oracles: the in-process models holding the exported
tables (``with_tables=True``), scoring the same pairs without any shard or batch; for
batching, each request's own answer when sent alone.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from ranker.features import ServingArrays
from ranker.models.two_tower import TwoTower
from ranker.scoring import score_pairs, user_vectors
from ranker.serving import Export, load_model
from recserve.catalog.storage import Csr
from recserve.cluster import ShardCluster
from recserve.cluster.rankers import RankerCluster
from recserve.rpc.deadline import make_header
from recserve.rpc.health import DEEP_CHECK_INTERVAL_ENV
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import admin_pb2, ranking_pb2
from recserve.v1.admin_pb2_grpc import AdminStub
from recserve.v1.ranking_pb2_grpc import RankingStub
from tests.grpc_fuzz import fuzz_server
from tests.integration.ranker_world import RankerWorld, make_ranker_world

TIMEOUT_S = 30.0


@dataclasses.dataclass
class Served:
    world: RankerWorld
    shards: ShardCluster
    rankers: RankerCluster
    channel: grpc.Channel

    @property
    def export(self) -> Export:
        return self.world.export

    @property
    def stub(self) -> RankingStub:
        return RankingStub(self.channel)

    @property
    def admin(self) -> AdminStub:
        return AdminStub(self.channel)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    world = make_ranker_world(tmp_path_factory.mktemp("ranking-service"))
    # Tests here count the ranker's forwards and lookup windows between two reads; its
    # periodic deep check (a fixed Rank per model every 5 s) would add some: none run.
    with pytest.MonkeyPatch.context() as env:
        env.setenv(DEEP_CHECK_INTERVAL_ENV, "3600")
        with ShardCluster(world.plan_path, world.root / "shards", load_from=world.models) as shards:
            with RankerCluster(world.spec_path, world.models, shards.addresses, num_rankers=1, data_root=world.root / "rankers") as rankers:
                with grpc.insecure_channel(rankers.addresses[0]) as channel:
                    yield Served(world, shards, rankers, channel)


def rank_request(user: int, items: np.ndarray, model: str = "dlrm", history: np.ndarray | None = None, timeout_s: float = TIMEOUT_S) -> ranking_pb2.RankRequest:
    req = ranking_pb2.RankRequest(header=make_header(timeout_s=timeout_s), user_id=user, candidate_ids=pack(np.asarray(items, np.int64)), model=model)
    if history is not None:
        req.history_item_ids.CopyFrom(pack(np.asarray(history, np.int64)))
    return req


def scores_by_item(resp: ranking_pb2.RankResponse) -> dict[int, float]:
    items = unpack(resp.item_ids, "item_ids")
    scores = unpack(resp.scores, "scores")
    assert np.all(np.diff(scores) <= 0), "answers come sorted by score descending"
    return dict(zip(items.tolist(), scores.tolist()))


def in_process(export: Export, model: str, arrays: ServingArrays, users: np.ndarray, items: np.ndarray) -> np.ndarray:
    """The oracle: [P] scores of the pairs by the in-process model with the exported tables."""
    m = load_model(export, model, device="cpu", with_tables=True)
    with torch.no_grad():
        if isinstance(m, TwoTower):
            vectors = np.load(export.path / "index" / "item_vectors.npy")
            return np.asarray((user_vectors(m, arrays, users).numpy() * vectors[items]).sum(axis=1), dtype=np.float32)
        return score_pairs(m, arrays, users, items)


@pytest.mark.parametrize("model", ["dlrm", "l3", "two_tower"])
def test_rank_equals_the_in_process_model(served: Served, model: str) -> None:
    export = served.export
    rng = np.random.default_rng(11)
    user = int(rng.integers(0, export.arrays.num_users))
    items = rng.choice(export.arrays.num_items, 300, replace=False)
    resp = served.stub.Rank(rank_request(user, items, model), timeout=TIMEOUT_S)
    assert resp.model == model and resp.model_version == export.model_version
    assert not resp.degraded and resp.missing_rows == 0 and resp.degraded_reason == ""
    got = scores_by_item(resp)
    assert sorted(got) == sorted(items.tolist())
    want = in_process(export, model, export.arrays, np.full(items.shape, user), items)
    np.testing.assert_allclose([got[i] for i in items.tolist()], want, rtol=1e-5, atol=1e-5)
    assert np.std(want) > 0


def test_embed_user_equals_the_in_process_user_tower(served: Served) -> None:
    export = served.export
    tt = load_model(export, "two_tower", device="cpu", with_tables=True)
    assert isinstance(tt, TwoTower)
    users = np.array([0, 7, export.arrays.num_users - 1])
    with torch.no_grad():
        want = user_vectors(tt, export.arrays, users).numpy()
    for u, w in zip(users.tolist(), want):
        resp = served.stub.EmbedUser(ranking_pb2.EmbedUserRequest(header=make_header(timeout_s=TIMEOUT_S), user_id=u), timeout=TIMEOUT_S)
        v = unpack(resp.vector, "vector")
        assert v.shape == w.shape and resp.model_version == export.model_version and not resp.degraded
        np.testing.assert_allclose(v, w, rtol=1e-5, atol=1e-5)
        assert math.isclose(float(np.linalg.norm(v)), 1.0, rel_tol=1e-4)


def with_history(arrays: ServingArrays, user: int, extra: np.ndarray) -> ServingArrays:
    """``arrays`` with ``extra`` appended to ``user``'s history (built by hand: the oracle)."""
    h = arrays.user_history
    values, offsets = np.asarray(h.values), np.asarray(h.offsets)
    end = int(offsets[user + 1])
    new_values = np.concatenate((values[:end], extra, values[end:]))
    new_offsets = offsets.copy()
    new_offsets[user + 1 :] += extra.shape[0]
    return dataclasses.replace(arrays, user_history=Csr(new_values, new_offsets))


@pytest.mark.parametrize("model", ["dlrm", "l3"])
def test_history_item_ids_are_appended_to_the_users_history(served: Served, model: str) -> None:
    export = served.export
    rng = np.random.default_rng(5)
    user = 3
    items = rng.choice(export.arrays.num_items, 64, replace=False)
    extra = rng.choice(export.arrays.num_items, 4, replace=False)
    got = scores_by_item(served.stub.Rank(rank_request(user, items, model, history=extra), timeout=TIMEOUT_S))
    want = in_process(export, model, with_history(export.arrays, user, extra), np.full(items.shape, user), items)
    np.testing.assert_allclose([got[i] for i in items.tolist()], want, rtol=1e-5, atol=1e-5)
    plain = scores_by_item(served.stub.Rank(rank_request(user, items, model), timeout=TIMEOUT_S))
    assert not np.allclose([plain[i] for i in items.tolist()], want, atol=1e-5)  # the history changed the scores


def test_a_new_user_is_a_cold_start_not_an_error(served: Served) -> None:
    export = served.export
    new_user = export.arrays.num_users + 5
    items = np.arange(50)
    hist_a, hist_b = np.array([1, 2, 3]), np.array([40, 41, 42])
    a = served.stub.Rank(rank_request(new_user, items, history=hist_a), timeout=TIMEOUT_S)
    b = served.stub.Rank(rank_request(new_user, items, history=hist_b), timeout=TIMEOUT_S)
    for resp in (a, b):
        assert resp.degraded and resp.degraded_reason == "cold_start" and resp.missing_rows == 0
    sa, sb = scores_by_item(a), scores_by_item(b)
    assert not np.allclose([sa[i] for i in range(50)], [sb[i] for i in range(50)])  # its history is used
    e = served.stub.EmbedUser(ranking_pb2.EmbedUserRequest(header=make_header(timeout_s=TIMEOUT_S), user_id=new_user), timeout=TIMEOUT_S)
    assert e.degraded_reason == "cold_start" and np.isfinite(unpack(e.vector, "vector")).all()


def _status(served: Served) -> admin_pb2.ModelStatusResponse:
    return served.admin.ModelStatus(admin_pb2.ModelStatusRequest(), timeout=TIMEOUT_S)


def test_50_concurrent_calls_run_as_at_most_8_forwards_and_8_lookup_windows(served: Served) -> None:
    export = served.export
    rng = np.random.default_rng(2)
    reqs = [rank_request(int(rng.integers(0, export.arrays.num_users)), rng.choice(export.arrays.num_items, 40, replace=False)) for _ in range(50)]
    before = _status(served)
    futures = [served.stub.Rank.future(r, timeout=TIMEOUT_S) for r in reqs]
    batched = [f.result() for f in futures]
    after = _status(served)
    forwards = after.forwards - before.forwards
    windows = after.lookup_windows - before.lookup_windows
    assert after.requests - before.requests == 50
    assert 1 <= forwards <= 8, forwards
    assert 1 <= windows <= 8, windows
    assert after.lookup_unique_ids - before.lookup_unique_ids < after.lookup_ids - before.lookup_ids  # deduplicated across requests
    for req, resp in zip(reqs, batched):  # each one alone: its unbatched answer
        alone = scores_by_item(served.stub.Rank(req, timeout=TIMEOUT_S))
        together = scores_by_item(resp)
        assert alone.keys() == together.keys()
        np.testing.assert_allclose([together[i] for i in alone], list(alone.values()), rtol=1e-5, atol=1e-6)


def test_a_request_within_the_reply_margin_of_its_deadline_is_still_answered(served: Served, tmp_path: Path) -> None:
    """The lookups stop ``ranker.reply_margin_ms`` (+ 2x forward) before the batch's
    deadline; a request with less time left than that still gets its answer (the
    lookups take the deadline itself), not DEADLINE_EXCEEDED for the whole batch."""
    text = served.world.spec_path.read_text()
    assert "[ranker]\n" in text
    spec = tmp_path / "spec.toml"
    spec.write_text(text.replace("[ranker]\n", "[ranker]\nreply_margin_ms = 900.0\n", 1))
    items = np.arange(0, 60, 3, dtype=np.int64)
    with RankerCluster(spec, served.world.models, served.shards.addresses, num_rankers=1, data_root=tmp_path / "rankers") as rankers:
        with grpc.insecure_channel(rankers.addresses[0]) as channel:
            stub = RankingStub(channel)
            scores_by_item(stub.Rank(rank_request(2, items), timeout=TIMEOUT_S))  # warm: channels, first forward
            resp = stub.Rank(rank_request(2, items, timeout_s=0.8), timeout=0.8)  # 800 ms < the 900 ms margin
    assert sorted(unpack(resp.item_ids, "item_ids").tolist()) == items.tolist()
    assert np.isfinite(unpack(resp.scores, "scores")).all()


def _code(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), str(info.value.details())


def test_bad_requests_get_statuses_naming_the_field_and_the_server_keeps_serving(served: Served) -> None:
    stub = served.stub
    n_items = served.export.arrays.num_items
    cases = [
        (rank_request(1, np.arange(5), model="gbdt"), grpc.StatusCode.INVALID_ARGUMENT, "model = 'gbdt'"),
        (rank_request(1, np.zeros(0, np.int64)), grpc.StatusCode.INVALID_ARGUMENT, "candidate_ids is empty"),
        (rank_request(1, np.array([3, n_items])), grpc.StatusCode.INVALID_ARGUMENT, f"candidate_ids[1] = {n_items}"),
        (rank_request(1, np.array([-4])), grpc.StatusCode.INVALID_ARGUMENT, "candidate_ids[0] = -4"),
        (rank_request(1, np.arange(5), history=np.array([n_items + 9])), grpc.StatusCode.INVALID_ARGUMENT, f"history_item_ids[0] = {n_items + 9}"),
        (rank_request(-1, np.arange(5)), grpc.StatusCode.INVALID_ARGUMENT, "user_id = -1"),
        (rank_request(1, np.arange(served.world.max_candidates + 1) % n_items), grpc.StatusCode.INVALID_ARGUMENT, "ranker.max_candidates"),
    ]
    for req, code, text in cases:
        got, details = _code(lambda: stub.Rank(req, timeout=TIMEOUT_S))
        assert got == code and text in details, (got, details)
    wrong_dtype = rank_request(1, np.arange(5))
    wrong_dtype.candidate_ids.CopyFrom(pack(np.arange(5, dtype=np.float32)))
    got, details = _code(lambda: stub.Rank(wrong_dtype, timeout=TIMEOUT_S))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "candidate_ids" in details
    past = rank_request(1, np.arange(5))
    past.header.deadline_unix_ms = int((time.time() - 1) * 1000)
    before = _status(served)
    got, _ = _code(lambda: stub.Rank(past, timeout=TIMEOUT_S))
    assert got == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _status(served).forwards == before.forwards  # no work done
    ok = stub.Rank(rank_request(1, np.arange(5)), timeout=TIMEOUT_S)
    assert len(scores_by_item(ok)) == 5


def test_fuzzing_both_rpcs_leaves_the_ranker_serving(served: Served) -> None:
    good = rank_request(1, np.arange(8))
    embed = ranking_pb2.EmbedUserRequest(header=make_header(timeout_s=TIMEOUT_S), user_id=2)

    def check(channel: grpc.Channel) -> None:
        assert len(scores_by_item(RankingStub(channel).Rank(rank_request(1, np.arange(8)), timeout=TIMEOUT_S))) == 8

    report = fuzz_server(
        served.rankers.addresses[0], cases_per_method=16, check=check,
        examples={"/recserve.v1.Ranking/Rank": [good], "/recserve.v1.Ranking/EmbedUser": [embed]},
    )  # fmt: skip
    assert {"/recserve.v1.Ranking/Rank", "/recserve.v1.Ranking/EmbedUser", "/recserve.v1.Admin/ReloadModels"} <= set(report.methods)


def test_a_ranker_refuses_shard_tables_of_another_model_version(served: Served, tmp_path: Path) -> None:
    from tests.integration.ranker_world import start_ranker_expecting_failure

    log = start_ranker_expecting_failure(served.world.spec_path, served.world.other_models, served.shards.addresses, tmp_path)
    assert "FAILED_PRECONDITION" in log or "model_version" in log
    assert served.world.other_version in log and served.export.model_version in log


def test_with_a_shard_killed_rank_answers_degraded_with_missing_rows(served: Served) -> None:
    """Last in the module: it kills a shard (and restarts it)."""
    export = served.export
    rng = np.random.default_rng(9)
    items = rng.choice(export.arrays.num_items, 200, replace=False)
    served.shards.kill(1)
    try:
        for model in ("dlrm", "l3"):
            resp = served.stub.Rank(rank_request(4, items, model, timeout_s=5.0), timeout=10.0)
            assert resp.degraded and "lookup_missing" in resp.degraded_reason.split(",") and resp.missing_rows > 0
            assert len(scores_by_item(resp)) == 200
    finally:
        served.shards.restart(1)
    # The lookup client's breaker re-probes the restarted shard after its open period.
    end = time.monotonic() + 20.0
    while (healthy := served.stub.Rank(rank_request(4, items, timeout_s=10.0), timeout=TIMEOUT_S)).degraded and time.monotonic() < end:
        time.sleep(0.1)
    assert not healthy.degraded




def test_a_ranker_is_serving_only_once_its_shards_are(tmp_path: Path) -> None:
    """Started beside shards still loading their tiers: health NOT_SERVING and Rank
    UNAVAILABLE (with a retry hint) until the shards serve; then SERVING and answering."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    world = make_ranker_world(tmp_path / "world")
    gate = tmp_path / "gate"
    shards = ShardCluster(world.plan_path, tmp_path / "shards", load_from=world.models, fault_hook=True, extra_args=["--load-gate", str(gate)])
    shards.start(wait=False)
    rankers = RankerCluster(world.spec_path, world.models, shards.addresses, data_root=tmp_path / "rankers")
    try:
        rankers.start(wait=False)
        with grpc.insecure_channel(rankers.addresses[0]) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", "recserve.v1.Ranking"):
                assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == health_pb2.HealthCheckResponse.NOT_SERVING
            code, details = _code(lambda: RankingStub(ch).Rank(rank_request(1, np.arange(4)), timeout=10))
            assert code == grpc.StatusCode.UNAVAILABLE and "still loading" in details and "retry after" in details
            gate.touch()
            rankers.wait_serving(0)
            assert health.Check(health_pb2.HealthCheckRequest(service="recserve.v1.Ranking"), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
            assert len(scores_by_item(RankingStub(ch).Rank(rank_request(1, np.arange(4)), timeout=10))) == 4
    finally:
        rankers.stop()
        shards.stop()
