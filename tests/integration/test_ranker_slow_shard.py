"""A ranker whose shard is slow answers in time, degraded, instead of late (issue 17's
fault suite, ``shard_slow``): a batch's lookups stop waiting ``ranker.reply_margin_ms``
plus twice the measured forward time before the batch's deadline and score what has
arrived, so the caller gets ``lookup_missing`` with ``missing_rows > 0`` rather than
DEADLINE_EXCEEDED. Real shards (one delayed 2 s by the test-only fault hook), a real
ranker process, the gRPC deadline equal to the header's, as a production caller sends."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from recserve.cluster import ShardCluster
from recserve.cluster.rankers import RankerCluster
from recserve.rpc.deadline import make_header
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import ranking_pb2
from recserve.v1.ranking_pb2_grpc import RankingStub
from tests.integration.ranker_world import make_ranker_world

pytestmark = pytest.mark.integration

# Generous for a loaded CI box: the mechanism is under test, not the margin's size.
MARGIN_MS = 80.0
DEADLINE_S = 0.6


def rank(stub: RankingStub, items: np.ndarray, timeout_s: float) -> ranking_pb2.RankResponse:
    req = ranking_pb2.RankRequest(header=make_header(timeout_s=timeout_s), user_id=3, candidate_ids=pack(items), model="dlrm")
    return stub.Rank(req, timeout=timeout_s)


def test_a_slow_shard_gets_a_degraded_answer_by_the_deadline_not_a_late_one(tmp_path: Path) -> None:
    world = make_ranker_world(tmp_path / "world")
    text = world.spec_path.read_text()
    assert "[ranker]\n" in text
    spec = tmp_path / "spec.toml"
    spec.write_text(text.replace("[ranker]\n", f"[ranker]\nreply_margin_ms = {MARGIN_MS}\n", 1))
    items = np.arange(0, 400, 2, dtype=np.int64)  # 200 candidates: rows on every shard, cold ones too
    with ShardCluster(world.plan_path, tmp_path / "shards", load_from=world.models, fault_hook=True) as shards:
        with RankerCluster(spec, world.models, shards.addresses, num_rankers=1, data_root=tmp_path / "rankers") as rankers:
            with grpc.insecure_channel(rankers.addresses[0]) as channel:
                stub = RankingStub(channel)
                for _ in range(5):  # warm: the forward time is measured
                    healthy = rank(stub, items, 30.0)
                assert not healthy.degraded and healthy.missing_rows == 0
                shards.set_fault(1, delay_ms=2000.0)  # far past the deadline
                try:
                    resp = rank(stub, items, DEADLINE_S)  # DEADLINE_EXCEEDED here before the margin existed
                finally:
                    shards.set_fault(1)
                assert resp.degraded and "lookup_missing" in resp.degraded_reason.split(",") and resp.missing_rows > 0
                assert sorted(unpack(resp.item_ids, "item_ids").tolist()) == items.tolist()  # every candidate still scored
                assert np.isfinite(unpack(resp.scores, "scores")).all()
