"""Recommend through the L0-L3 cascade on a real cluster: 2 shards, 2 rankers and the
cascade process on loopback, a tiny trained world (tests/integration/ranker_world.py).

Oracles from outside the cascade: FAISS ``IndexFlatIP`` over the exported item vectors
for what L0 can retrieve, the in-process DLRM for L2's order, and the client's own
clock for "answers by its deadline".
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

import torch

from ranker.models.two_tower import TwoTower
from ranker.scoring import user_vectors
from ranker.serving import Export, load_model
from recserve.cluster import ShardCluster
from recserve.cluster.cascade import CascadeCluster
from recserve.cluster.rankers import RankerCluster
from recserve.rpc.auth import admin_metadata
from recserve.rpc.deadline import make_header
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import admin_pb2, ranking_pb2, recommender_pb2
from recserve.v1.ranking_pb2_grpc import RankingStub
from recserve.v1.admin_pb2_grpc import AdminStub
from recserve.v1.recommender_pb2_grpc import RecommenderStub
from tests.grpc_fuzz import fuzz_server
from tests.integration.ranker_world import RankerWorld, make_ranker_world, spec_text

TOKEN = "cascade-token"
CASCADE = """
[cascade]
l0_out = 400
l1_out = 200
l2_out = 50
l3_out = 10
default_deadline_ms = 2000.0
index_factory = "IVF16,Flat"
nprobe = 16
"""


@dataclasses.dataclass
class Stack:
    world: RankerWorld
    shards: ShardCluster
    rankers: RankerCluster
    cascade: CascadeCluster

    @property
    def address(self) -> str:
        return self.cascade.address


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    world = make_ranker_world(tmp_path_factory.mktemp("cascade"))
    spec = world.root / "cascade.toml"
    spec.write_text(spec_text(world.export.manifest, world.models, CASCADE))
    # One token everywhere: the cascade's AddItems sends it on to the rankers and the shards.
    with ShardCluster(world.plan_path, world.root / "shards", load_from=world.models, admin_token=TOKEN) as shards:
        with RankerCluster(spec, world.models, shards.addresses, num_rankers=2, data_root=world.root / "rankers", admin_token=TOKEN) as rankers:
            with CascadeCluster(spec, world.models, rankers.addresses, shards.addresses, data_root=world.root / "cascade", admin_token=TOKEN) as cascade:
                yield Stack(world, shards, rankers, cascade)


def recommend(address: str, user: int, k: int = 10, timeout_s: float = 10.0, **tensors: np.ndarray) -> recommender_pb2.RecommendResponse:
    req = recommender_pb2.RecommendRequest(header=make_header(timeout_s=timeout_s), user_id=user, k=k)
    for field, value in tensors.items():
        getattr(req, field).CopyFrom(pack(np.asarray(value, np.int64)))
    with grpc.insecure_channel(address) as ch:
        return RecommenderStub(ch).Recommend(req, timeout=timeout_s + 5)


def test_a_normal_recommend_returns_k_items_with_no_stage_degraded(stack: Stack) -> None:
    view = stack.world.export
    user = 5
    resp = recommend(stack.address, user, k=10)
    items = unpack(resp.item_ids, "item_ids")
    assert items.shape == (10,) and len(set(items.tolist())) == 10
    assert [s.stage for s in resp.stages] == ["L0", "L1", "L2", "L3"]
    assert not resp.degraded and all(not s.degraded for s in resp.stages), [(s.stage, s.degraded_reason) for s in resp.stages]
    assert [s.out_count for s in resp.stages] == [400, 200, 50, 10]
    assert resp.coverage == pytest.approx(1.0)
    assert resp.model_version == view.model_version and resp.index_version
    seen = set(np.asarray(view.arrays.user_history.values)[view.arrays.user_history.offsets[user] : view.arrays.user_history.offsets[user + 1]].tolist())
    assert not seen & set(items.tolist())  # already-seen items are never recommended


def test_exclude_and_recent_items_are_never_returned(stack: Stack) -> None:
    first = unpack(recommend(stack.address, 7, k=20).item_ids, "item_ids")
    exclude, recent = first[:5], first[5:8]
    again = unpack(recommend(stack.address, 7, k=20, exclude_ids=exclude, recent_item_ids=recent).item_ids, "item_ids")
    assert not set(again.tolist()) & set(first[:8].tolist())


def test_bad_requests_get_statuses_and_a_past_deadline_runs_no_stage(stack: Stack) -> None:
    n = stack.world.export.arrays.num_items
    with grpc.insecure_channel(stack.address) as ch:
        stub = RecommenderStub(ch)
        cases = [
            (recommender_pb2.RecommendRequest(header=make_header(timeout_s=5), user_id=-3, k=5), "user_id = -3"),
            (recommender_pb2.RecommendRequest(header=make_header(timeout_s=5), user_id=1, k=-1), "k = -1"),
            (recommender_pb2.RecommendRequest(header=make_header(timeout_s=5), user_id=1, k=n + 1), "k = "),
        ]
        bad_ids = recommender_pb2.RecommendRequest(header=make_header(timeout_s=5), user_id=1, k=5)
        bad_ids.exclude_ids.CopyFrom(pack(np.array([n + 4], np.int64)))
        cases.append((bad_ids, f"exclude_ids[0] = {n + 4}"))
        for req, text in cases:
            with pytest.raises(grpc.RpcError) as err:
                stub.Recommend(req, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in str(err.value.details()), err.value.details()
        past = recommender_pb2.RecommendRequest(header=make_header(timeout_s=5), user_id=1, k=5)
        past.header.deadline_unix_ms = int((time.time() - 1) * 1000)
        before = AdminStub(ch).ModelStatus(admin_pb2.ModelStatusRequest(), timeout=5).requests
        with pytest.raises(grpc.RpcError) as err:
            stub.Recommend(past, timeout=10)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert AdminStub(ch).ModelStatus(admin_pb2.ModelStatusRequest(), timeout=5).requests == before
    assert len(unpack(recommend(stack.address, 1, k=5).item_ids, "ids")) == 5  # still serving


def test_a_new_user_gets_a_cold_start_answer(stack: Stack) -> None:
    new_user = stack.world.export.arrays.num_users + 10
    resp = recommend(stack.address, new_user, k=10)
    assert resp.degraded and resp.degraded_reason == "cold_start" and len(unpack(resp.item_ids, "i")) == 10
    with_history = recommend(stack.address, new_user, k=10, recent_item_ids=np.array([3, 4, 5]))
    assert with_history.degraded_reason == "cold_start" and len(unpack(with_history.item_ids, "i")) == 10


def test_a_tight_deadline_shrinks_or_skips_stages_and_answers_in_time(stack: Stack) -> None:
    deadline_s = 0.015
    t0 = time.monotonic()
    resp = recommend(stack.address, 9, k=10, timeout_s=deadline_s)
    elapsed = time.monotonic() - t0
    assert resp.degraded and any(s.degraded_reason in ("shrunk_input", "skipped_budget", "timeout") for s in resp.stages)
    assert len(unpack(resp.item_ids, "i")) == 10
    assert elapsed < deadline_s + 0.25  # answered near its deadline (the loaded 2-core box adds scheduling noise)


def test_fuzzing_leaves_the_cascade_serving(stack: Stack) -> None:
    def check(channel: grpc.Channel) -> None:
        assert len(unpack(RecommenderStub(channel).Recommend(recommender_pb2.RecommendRequest(header=make_header(timeout_s=5), user_id=2, k=3), timeout=10).item_ids, "i")) == 3

    good = recommender_pb2.RecommendRequest(header=make_header(timeout_s=5), user_id=2, k=3)
    report = fuzz_server(stack.address, cases_per_method=12, check=check, examples={"/recserve.v1.Recommender/Recommend": [good]})
    assert "/recserve.v1.Recommender/Recommend" in report.methods


def test_an_index_refresh_under_traffic_drops_no_request_and_changes_the_version(stack: Stack) -> None:
    versions: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            try:
                versions.append(recommend(stack.address, 11, k=5).index_version)
            except grpc.RpcError as exc:
                errors.append(exc)

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        while len(versions) < 3 and not errors:
            time.sleep(0.01)
        with grpc.insecure_channel(stack.address) as ch:
            reply = AdminStub(ch).RefreshIndex(admin_pb2.RefreshIndexRequest(), timeout=60, metadata=admin_metadata(TOKEN))
        n = len(versions)
        while len(versions) < n + 3 and not errors:
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors[:2]
    assert reply.previous_version != reply.index_version and reply.items == stack.world.export.arrays.num_items
    first_new = versions.index(reply.index_version)
    assert first_new > 0 and set(versions[:first_new]) == {reply.previous_version} and set(versions[first_new:]) == {reply.index_version}


def test_an_index_built_and_saved_offline_is_loaded_by_refresh(stack: Stack, tmp_path: Path) -> None:
    out = tmp_path / "index"
    cmd = [sys.executable, "-m", "recserve", "cascade", "build-index", "--models", str(stack.world.models), "--out", str(out), "--factory", "IVF8,Flat"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    saved = json.loads((out / "manifest.json").read_text())
    assert saved["model_version"] == stack.world.export.model_version
    with grpc.insecure_channel(stack.address) as ch:
        reply = AdminStub(ch).RefreshIndex(admin_pb2.RefreshIndexRequest(index_path=str(out)), timeout=60, metadata=admin_metadata(TOKEN))
        assert reply.index_version == saved["index_version"]
        with pytest.raises(grpc.RpcError) as err:  # a directory without an index: refused, the old one keeps serving
            AdminStub(ch).RefreshIndex(admin_pb2.RefreshIndexRequest(index_path=str(tmp_path)), timeout=60, metadata=admin_metadata(TOKEN))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert recommend(stack.address, 3, k=5).index_version == saved["index_version"]


def new_item_vector(export: Export, category: int, tags: np.ndarray) -> np.ndarray:
    """The oracle: the item tower in process on what AddItems documents (the category's mean
    ``tt_item`` row, the category and tag rows, zero log counts): f32 [d]."""
    tt = load_model(export, "two_tower", device="cpu", with_tables=True)
    assert isinstance(tt, TwoTower)
    cat = torch.from_numpy(np.asarray(export.arrays.item_category) == category)
    with torch.no_grad():
        pooled = {
            "tt_item_id": tt.tables["tt_item"][cat].mean(0, keepdim=True),
            "tt_item_category": tt.tables["tt_category"][category : category + 1],
            "tt_item_tags": tt.tables["tt_tag"][torch.from_numpy(tags)].mean(0, keepdim=True),
        }
        return tt.item_from_pooled(pooled, torch.zeros(1, 2)).numpy()[0]


def test_an_added_item_is_retrievable_at_once_for_a_user_whose_history_matches_it(stack: Stack) -> None:
    export = stack.world.export
    arrays = export.arrays
    tags = np.asarray(arrays.item_tags.values)[arrays.item_tags.offsets[1] : arrays.item_tags.offsets[2]].astype(np.int64)
    # The (category, user) pair the new item matches best, by the in-process towers (the
    # oracle): the tiny test models score everything in a narrow band, so pick the pair
    # where the new item ranks highest among the user's exact scores.
    tt = load_model(export, "two_tower", device="cpu", with_tables=True)
    assert isinstance(tt, TwoTower)
    with torch.no_grad():
        users = user_vectors(tt, arrays, np.arange(arrays.num_users)).numpy()
    exact = users @ np.load(export.path / "index" / "item_vectors.npy").T  # [U, N]
    best = []
    for category in range(int(np.asarray(arrays.item_category).max()) + 1):  # 16 categories
        rank = (exact > (users @ new_item_vector(export, category, tags))[:, None]).sum(axis=1)
        best.append((int(rank.min()), int(rank.argmin()), category))
    item_rank, user, favourite = min(best)
    assert item_rank < 300  # precondition: L0 (exact here, 400 wide) should retrieve it
    new_id = arrays.num_items
    request = admin_pb2.AddItemsRequest(item_ids=pack(np.array([new_id], np.int64)), categories=pack(np.array([favourite], np.int64)),
                                        tag_ids=pack(tags), tag_lengths=pack(np.array([tags.size], np.int64)))  # fmt: skip
    before = recommend(stack.address, user, k=400)  # k = L0's size: everything L0 retrieves comes back
    assert new_id not in unpack(before.item_ids, "i").tolist()
    with grpc.insecure_channel(stack.address) as ch:
        reply = AdminStub(ch).AddItems(request, timeout=60, metadata=admin_metadata(TOKEN))
        with pytest.raises(grpc.RpcError) as again:  # the same id twice: it is not the next id any more
            AdminStub(ch).AddItems(request, timeout=60, metadata=admin_metadata(TOKEN))
    assert again.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"{new_id + 1}" in str(again.value.details())
    assert reply.added == 1 and reply.upserted_rows > 0 and reply.num_items == new_id + 1 and reply.index_version != before.index_version
    after = recommend(stack.address, user, k=400)
    assert after.index_version == reply.index_version and not after.degraded
    assert new_id in unpack(after.item_ids, "i").tolist()  # retrieved at once, no rebuild
    for address in stack.rankers.addresses:  # every ranker learned it
        with grpc.insecure_channel(address) as ch:
            r = RankingStub(ch).Rank(ranking_pb2.RankRequest(header=make_header(timeout_s=10), user_id=user, candidate_ids=pack(np.array([new_id, 1], np.int64))), timeout=10)
            assert sorted(unpack(r.item_ids, "i").tolist()) == [1, new_id]


def test_with_one_of_two_rankers_killed_calls_keep_succeeding(stack: Stack) -> None:
    stack.rankers.kill(1)
    try:
        for user in range(20, 32):
            resp = recommend(stack.address, user, k=10)
            assert len(unpack(resp.item_ids, "i")) == 10
            assert not any(s.degraded_reason == "timeout" for s in resp.stages[2:]), [(s.stage, s.degraded_reason) for s in resp.stages]
    finally:
        stack.rankers.restart(1)


def test_with_a_shard_killed_the_call_answers_with_lookup_missing(stack: Stack) -> None:
    """Last: it kills a shard (and restarts it)."""
    stack.shards.kill(1)
    try:
        resp = recommend(stack.address, 13, k=10)
        assert len(unpack(resp.item_ids, "i")) == 10
        missing = [s for s in resp.stages if s.degraded_reason == "lookup_missing"]
        assert missing and all(s.coverage < 1.0 for s in missing) and resp.coverage < 1.0
    finally:
        stack.shards.restart(1)
