"""Model rollout without an outage: Admin.ReloadModels switches a serving ranker from
one export to another under traffic.

Two exports (seeds 0 and 7) are staged into one shard load source
(:func:`ranker.rollout.stage_exports`: the first's tables plain, the second's
version-prefixed), both loaded into two real shard processes. A real ranker starts on
the first; a thread sends Rank calls without pause while ReloadModels switches to the
second. Every call succeeds, the answers' ``model_version`` changes exactly once, and
after the switch the scores equal the second export's in-process model.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch

from ranker.rollout import stage_exports
from ranker.scoring import score_pairs
from ranker.serving import load_model, open_export
from recserve.cluster import ShardCluster
from recserve.cluster.rankers import RankerCluster
from recserve.config.spec import ShardingConfig
from recserve.rpc.auth import admin_metadata
from recserve.rpc.deadline import make_header
from recserve.rpc.tensors import pack, unpack
from recserve.sharding import plan_tables
from recserve.v1 import admin_pb2, ranking_pb2
from recserve.v1.admin_pb2_grpc import AdminStub
from recserve.v1.ranking_pb2_grpc import RankingStub
from tests.integration.ranker_world import RankerWorld, make_ranker_world

TOKEN = "rollout-token"


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RankerWorld, str]]:
    world = make_ranker_world(tmp_path_factory.mktemp("rollout"))
    staged = stage_exports([world.models, world.other_models], world.root / "staged")
    plan = plan_tables(list(staged.tables), None, ShardingConfig(num_shards=2, hot_fraction=0.01, warm_fraction=0.1, hot_replicas=2, column_splits=2)).plan
    plan.save(world.root / "staged-plan.json")
    with ShardCluster(world.root / "staged-plan.json", world.root / "shards", load_from=staged.path) as shards:
        with RankerCluster(world.spec_path, world.models, shards.addresses, num_rankers=1, data_root=world.root / "rankers", admin_token=TOKEN) as rankers:
            yield world, rankers.addresses[0]


def test_reload_models_switches_versions_under_traffic_without_failing_a_call(rollout: tuple[RankerWorld, str]) -> None:
    world, address = rollout
    old, new = world.export.model_version, world.other_version
    items = np.arange(0, 400, 5, dtype=np.int64)
    versions: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def traffic() -> None:
        with grpc.insecure_channel(address) as ch:
            stub = RankingStub(ch)
            while not stop.is_set():
                try:
                    r = stub.Rank(ranking_pb2.RankRequest(header=make_header(timeout_s=10), user_id=3, candidate_ids=pack(items)), timeout=10)
                    versions.append(r.model_version)
                except grpc.RpcError as exc:
                    errors.append(exc)

    with grpc.insecure_channel(address) as channel:
        admin = AdminStub(channel)
        # Without the admin token: refused, nothing changes.
        with pytest.raises(grpc.RpcError) as denied:
            admin.ReloadModels(admin_pb2.ReloadModelsRequest(models_dir=str(world.other_models)), timeout=60)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # A version the directory does not hold: refused, naming both.
        with pytest.raises(grpc.RpcError) as wrong:
            admin.ReloadModels(admin_pb2.ReloadModelsRequest(models_dir=str(world.other_models), model_version="m-000000000000"), timeout=60, metadata=admin_metadata(TOKEN))
        assert wrong.value.code() == grpc.StatusCode.FAILED_PRECONDITION and new in str(wrong.value.details())

        thread = threading.Thread(target=traffic)
        thread.start()
        try:
            while len(versions) < 5 and not errors:
                threading.Event().wait(0.01)
            reply = admin.ReloadModels(admin_pb2.ReloadModelsRequest(models_dir=str(world.other_models), model_version=new), timeout=120, metadata=admin_metadata(TOKEN))
            n_at_switch = len(versions)
            while len(versions) < n_at_switch + 5 and not errors:
                threading.Event().wait(0.01)
        finally:
            stop.set()
            thread.join()
        status = admin.ModelStatus(admin_pb2.ModelStatusRequest(), timeout=10)

    assert not errors, errors[:3]
    assert reply.model_version == new and reply.previous_version == old
    assert all(t.startswith(new.replace("-", "_") + "__") for t in reply.tables)  # the prefixed tables
    assert status.model_version == new and status.reloads == 1
    # The version changed once, mid-traffic: old answers, then only new ones.
    first_new = versions.index(new)
    assert 0 < first_new and set(versions[:first_new]) == {old} and set(versions[first_new:]) == {new}

    export = open_export(world.other_models)
    with grpc.insecure_channel(address) as ch:
        resp = RankingStub(ch).Rank(ranking_pb2.RankRequest(header=make_header(timeout_s=10), user_id=3, candidate_ids=pack(items)), timeout=10)
    got = dict(zip(unpack(resp.item_ids, "i").tolist(), unpack(resp.scores, "s").tolist()))
    dlrm = load_model(export, "dlrm", device="cpu", with_tables=True)
    with torch.no_grad():
        want = score_pairs(dlrm, export.arrays, np.full(items.shape, 3), items)  # type: ignore[arg-type]
    np.testing.assert_allclose([got[i] for i in items.tolist()], want, rtol=1e-5, atol=1e-5)


