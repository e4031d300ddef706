"""A deliberately stalled fake Recommender over real gRPC on loopback: the open-loop
generator keeps sending through a 200 ms stall and its p99, measured from each
request's scheduled send time, shows the stall; a closed loop sends nothing while its
one request waits (the server counts the arrivals itself), so the stall hides from it.
The virtual-time twin of this test (tests/unit/test_loadtest.py) pins the closed loop's
p99 exactly."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from recserve.loadtest.driver import run_closed_loop, run_open_loop
from recserve.loadtest.record import LoadSummary
from recserve.loadtest.requests import RequestPool
from recserve.loadtest.targets import GrpcRecommendTarget
from recserve.rpc.tensors import pack
from recserve.v1 import recommender_pb2, recommender_pb2_grpc

pytestmark = pytest.mark.integration

STALL_S = 0.200
STALL_AT_REQUEST = 100  # the stall begins when this request arrives (0.5 s into a 200/s run)


class StalledRecommender(recommender_pb2_grpc.RecommenderServicer):
    """Answers at once, except that the ``STALL_AT_REQUEST``-th request starts a
    ``STALL_S`` stall: it and every request arriving before the stall ends are answered
    when it ends (a GC pause, a compaction, a lock)."""

    def __init__(self) -> None:
        self.seen = 0
        self.arrived_in_stall = 0
        self.stall_end: float | None = None

    async def Recommend(self, request: recommender_pb2.RecommendRequest, context: grpc.aio.ServicerContext) -> recommender_pb2.RecommendResponse:
        loop = asyncio.get_running_loop()
        self.seen += 1
        now = loop.time()
        if self.seen == STALL_AT_REQUEST:
            self.stall_end = now + STALL_S
        if self.stall_end is not None and now < self.stall_end:
            self.arrived_in_stall += 1
            await asyncio.sleep(self.stall_end - now)
        return recommender_pb2.RecommendResponse(item_ids=pack(np.array([1, 2], dtype=np.int64)), scores=pack(np.array([0.5, 0.25], dtype=np.float32)))


def _pool() -> RequestPool:
    return RequestPool(user_ids=np.arange(16, dtype=np.int64), candidates=np.zeros((16, 1), dtype=np.int64), history_values=np.zeros(0, dtype=np.int64),
                       history_offsets=np.zeros(17, dtype=np.int64), num_items=1, num_users=16)  # fmt: skip


async def _serve_and(run: str) -> tuple[LoadSummary, StalledRecommender]:
    servicer = StalledRecommender()
    server = grpc.aio.server()
    recommender_pb2_grpc.add_RecommenderServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    target = GrpcRecommendTarget([f"127.0.0.1:{port}"], _pool())
    await target.start()
    try:
        if run == "open":
            summary = await run_open_loop(target, rate_rps=200.0, duration_s=1.5, slo_s=0.050, timeout_s=5.0, seed=1)
        else:
            summary = await run_closed_loop(target, concurrency=1, requests=300, slo_s=0.050, timeout_s=5.0)
    finally:
        await target.aclose()
        await server.stop(None)
    return summary, servicer


def test_a_200ms_stall_shows_in_the_open_loop_p99() -> None:
    s, server = asyncio.run(_serve_and("open"))
    assert server.stall_end is not None, "the run ended before the stall began"
    # The generator kept its schedule through the stall: ~40 requests arrived in it.
    assert server.arrived_in_stall >= 20
    assert s.errors == {} and s.answered == s.requests == server.seen
    # Those requests waited up to 200 ms from their scheduled send: ~2-3% of the run >= 150 ms.
    assert s.p99_ms is not None and s.p99_ms >= 150.0
    assert s.late >= 10


def test_a_closed_loop_sends_nothing_during_the_stall() -> None:
    summary, server = asyncio.run(_serve_and("closed"))
    assert server.stall_end is not None
    # One request was out when the stall began; the closed loop waited with it, so the
    # stall is one sample in 300 (below its p99) where the open loop had ~40.
    assert server.arrived_in_stall == 1
    assert summary.max_ms is not None and summary.max_ms >= 150.0
