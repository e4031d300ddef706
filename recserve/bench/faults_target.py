"""The fault suite's load target (``recserve bench faults``): Recommend over gRPC with
one record per request. Its own module because it loads grpc: ``recserve bench``
imports every benchmark's module to build its parser, and ``bench lookup`` must set
``GRPC_EXPERIMENTS`` before grpc's core starts."""

from __future__ import annotations

import asyncio
import collections
import time

from recserve.bench.faults_report import OK_STATUS, Records
from recserve.loadtest.requests import RequestPool
from recserve.loadtest.targets import GrpcRecommendTarget, _remaining, status_name


class RecordingTarget(GrpcRecommendTarget):
    """``Recommend`` over gRPC that also keeps one record per request (scheduled time =
    deadline - timeout, finish time, status, degraded, coverage) while ``recording``."""

    def __init__(self, addresses: list[str], pool: RequestPool, *, timeout_s: float, tenant: str = "default", api_key: str = "") -> None:
        super().__init__(addresses, pool)
        self.timeout_s = timeout_s
        self.tenant = tenant
        self.metadata = (("x-api-key", api_key),) if api_key else ()
        self.reasons: collections.Counter[str] = collections.Counter()  # degraded answers by reason, while recording
        self.recording = False
        self.cols: tuple[list[float], list[float], list[str], list[bool], list[float]] = ([], [], [], [], [])

    def take(self) -> Records:
        """The records so far (and start a fresh set)."""
        rec = Records.from_lists(*self.cols)
        self.cols = ([], [], [], [], [])
        self.reasons = collections.Counter()
        return rec

    async def call(self, i: int, deadline_s: float) -> bool:
        from recserve.rpc.deadline import make_header
        from recserve.v1 import recommender_pb2

        sched = deadline_s - self.timeout_s
        e = self.pool.entry(i)
        request = recommender_pb2.RecommendRequest(header=make_header(timeout_s=_remaining(deadline_s), tenant=self.tenant), user_id=int(self.pool.user_ids[e]), k=self.k)
        try:
            reply = await self._channels.pick().Recommend(request, timeout=_remaining(deadline_s), metadata=self.metadata)
        except asyncio.CancelledError:  # the driver gave up on it after the drain: still one request, counted
            self._record(sched, "CANCELLED", False, float("nan"))
            raise
        except Exception as exc:
            self._record(sched, status_name(exc), False, float("nan"))
            raise
        self._record(sched, OK_STATUS, bool(reply.degraded), float(reply.coverage))
        if reply.degraded and self.recording:
            self.reasons[reply.degraded_reason or "?"] += 1
        return bool(reply.degraded)

    def _record(self, sched: float, status: str, degraded: bool, coverage: float) -> None:
        if self.recording:
            for col, v in zip(self.cols, (sched, time.monotonic(), status, degraded, coverage)):
                col.append(v)  # type: ignore[attr-defined]
