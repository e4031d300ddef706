"""Liveness, readiness and the deep check (issue 17, recserve/rpc/health.py) on real
in-process grpc.aio servers hosting the shard servicer over a fake core:

- a wedged executor: the deep check's fixed lookup gets no answer in time, readiness
  turns NOT_SERVING (liveness stays SERVING), calls answer UNAVAILABLE, and a router
  over two replicas stops sending to it; unwedged, it is SERVING again;
- an unloaded table (the lookup fails) or other rows than before (no upsert since)
  fail the check; an upsert re-takes the baseline."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedding_server.fault import FaultInjector
from embedding_server.server import SERVICE_NAME
from embedding_server.service import EmbeddingShardService
from embedding_server.shard import LookupOutcome
from recserve.errors import InvalidArgument
from recserve.routing import Router, RoutingConfig
from recserve.rpc.deadline import make_header
from recserve.rpc.health import LIVENESS_SERVICE, DeepCheck, DeepCheckConfig
from recserve.rpc.server import add_health_and_reflection, make_server
from recserve.rpc.tensors import pack
from recserve.v1 import embedding_pb2, embedding_pb2_grpc

pytestmark = pytest.mark.integration

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
FAST = DeepCheckConfig(interval_s=0.05, timeout_s=0.3)


class FakeCore:
    """The slice of ShardCore a Lookup and the deep check use: rows = id * 1.0 (dim 4)."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.loaded = True

    def check_size(self, n_ids: int, what: str) -> None:
        pass

    def lookup(self, request: embedding_pb2.LookupRequest, deadline: float) -> LookupOutcome:
        if not self.loaded:
            raise InvalidArgument("table 'item' is not served by shard 0")
        response = embedding_pb2.LookupResponse()
        for tl in request.tables:
            ids = np.frombuffer(tl.ids.data, np.int64)
            rows = np.repeat(ids[:, None].astype(np.float32), 4, axis=1) + self.offset
            response.tables.add(table=tl.table, rows=pack(rows), found=pack(np.ones(len(ids), bool)))
        return LookupOutcome(response=response, ids=int(sum(len(t.ids.data) // 8 for t in request.tables)), served={}, missing=0, not_owned=0)


def probe() -> embedding_pb2.LookupRequest:
    request = embedding_pb2.LookupRequest()
    request.tables.add(table="item", ids=pack(np.array([3, 7], np.int64)))
    return request


class Replica:
    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(1)
        self.core = FakeCore()
        self.service = EmbeddingShardService(shard_id=0, plan_version=1, plan_json="{}", executor=self.executor, faults=FaultInjector(enabled=False))
        self.server: Any = None
        self.deep: DeepCheck | None = None
        self.address = ""

    async def start(self) -> None:
        self.server = make_server(max_message_bytes=1 << 20)
        embedding_pb2_grpc.add_EmbeddingShardServicer_to_server(self.service, self.server)
        health = await add_health_and_reflection(self.server, [SERVICE_NAME])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        self.service.set_ready(self.core)  # type: ignore[arg-type]
        self.service.set_probe(probe())
        for name in ("", SERVICE_NAME):
            await health.set(name, SERVING)
        self.deep = DeepCheck(health, [SERVICE_NAME], self.service.deep_probe, config=FAST, on_change=self.service.set_not_serving, what="replica")
        assert await self.deep.check_once() == ""  # the baseline
        self.deep.start()

    async def aclose(self) -> None:
        assert self.deep is not None
        await self.deep.aclose()
        await self.server.stop(None)
        self.executor.shutdown(wait=False)


async def wait_status(address: str, service: str, want: int) -> None:
    """Follow the health Watch stream until ``service`` reports ``want`` (no polling)."""
    async with grpc.aio.insecure_channel(address) as ch:
        async for reply in health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=service), timeout=30):
            if reply.status == want:
                return


async def check(address: str, service: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        return int((await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)).status)


def test_a_wedged_executor_turns_readiness_not_serving_and_the_router_stops_sending() -> None:
    async def main() -> None:
        a, b = Replica(), Replica()
        await a.start()
        await b.start()
        unwedge = threading.Event()
        try:
            b.executor.submit(unwedge.wait)  # every lookup on b's executor now waits behind this
            await asyncio.wait_for(wait_status(b.address, "", NOT_SERVING), 30)
            assert await check(b.address, SERVICE_NAME) == NOT_SERVING and await check(b.address, LIVENESS_SERVICE) == SERVING
            assert b.deep is not None and "no answer within" in b.deep.reason
            router = Router([a.address, b.address], RoutingConfig(), rng=np.random.default_rng(0))
            channels = {addr: grpc.aio.insecure_channel(addr) for addr in (a.address, b.address)}
            picked: list[str] = []
            codes: dict[str, set[grpc.StatusCode]] = {a.address: set(), b.address: set()}
            try:
                for _ in range(40):
                    replica = router.pick(0.0)  # a frozen clock: an opened breaker stays open
                    picked.append(replica)
                    request = probe()
                    request.header.CopyFrom(make_header(timeout_s=5))
                    try:
                        await embedding_pb2_grpc.EmbeddingShardStub(channels[replica]).Lookup(request, timeout=5)
                        code = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as exc:
                        code = exc.code()
                        assert "NOT_SERVING" in (exc.details() or "")
                    codes[replica].add(code)
                    router.on_result(replica, code, 0.001, 0.0)
            finally:
                for ch in channels.values():
                    await ch.close()
            assert codes[a.address] == {grpc.StatusCode.OK} and codes[b.address] == {grpc.StatusCode.UNAVAILABLE}
            assert picked.count(b.address) == RoutingConfig().breaker_failures  # then its breaker opened
            assert picked[-20:] == [a.address] * 20
            unwedge.set()
            await asyncio.wait_for(wait_status(b.address, "", SERVING), 30)  # the next passing check
            assert b.service.not_serving == ""
        finally:
            unwedge.set()
            await a.aclose()
            await b.aclose()

    asyncio.run(main())


def test_an_unloaded_table_or_changed_rows_fail_the_deep_check_and_an_upsert_rebaselines() -> None:
    async def main() -> None:
        r = Replica()
        await r.start()
        try:
            assert r.deep is not None
            await r.deep.aclose()  # drive the checks by hand
            deep = r.deep
            assert await deep.check_once() == ""
            r.core.loaded = False
            assert "not served by shard 0" in await deep.check_once()
            assert await check(r.address, "") == NOT_SERVING and "not served" in r.service.not_serving
            r.core.loaded = True
            assert await deep.check_once() == "" and await check(r.address, "") == SERVING
            r.core.offset = 0.5  # other rows, no upsert: a corrupted tier
            assert "other rows than before" in await deep.check_once()
            r.service.upserts_started += 1  # an Upsert ran: the new rows become the baseline
            assert await deep.check_once() == ""
            assert await deep.check_once() == "" and await check(r.address, SERVICE_NAME) == SERVING
            assert (deep.checks, deep.failures) == (7, 2)
        finally:
            await r.aclose()

    asyncio.run(main())
