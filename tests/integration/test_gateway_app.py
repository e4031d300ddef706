"""The gateway's aiohttp app (recserve/gateway/app.py) over loopback with a fake
downstream: the deadline it hands down, the process and tenant concurrency caps, the
readiness cache, a chunked body over the cap, request-id hygiene. (The real cluster's
tests are in test_gateway.py; these need a downstream that holds requests on demand.)"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from recserve.client.rec import Recommendation, StageReport
from recserve.config import load
from recserve.config.spec import ClusterConfig, GatewayConfig, TenantConfig
from recserve.gateway.app import READY_CACHE_S, make_app
from recserve.gateway.tenants import TenantTable

KEY = "app-test-key-5b1d0e77"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeDownstream:
    """Records every call; ``hold`` keeps Recommend calls waiting until it is set."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.calls: list[dict[str, Any]] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.entered = asyncio.Event()
        self.ready_checks = 0
        self.serving = True

    async def recommend(self, user_id: int, k: int = 0, **kwargs: Any) -> Recommendation:
        self.calls.append({"user_id": user_id, "k": k, **kwargs})
        self.entered.set()
        await self.hold.wait()
        ids = np.arange(k or 3, dtype=np.int64)
        return Recommendation(item_ids=ids, scores=np.zeros(ids.shape, np.float32), stages=(StageReport("L0", 1.0, 0.5, 10, 3, False, "", 1.0),),
                              coverage=1.0, degraded=False, degraded_reason="", index_version="ix", model_version="m", replica="r", attempts=1)  # fmt: skip

    async def rank(self, user_id: int, candidate_ids: np.ndarray, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def check_ready(self, timeout_s: float = 1.0) -> dict[str, bool]:
        self.ready_checks += 1
        await asyncio.sleep(0)
        return {"127.0.0.1:1": self.serving}


def cluster_with(gateway: GatewayConfig, tenants: tuple[TenantConfig, ...]) -> ClusterConfig:
    return dataclasses.replace(load(), gateway=gateway, tenants=tenants)




def run(cluster: ClusterConfig, test: Callable[[ClientSession, str, FakeDownstream], Awaitable[None]], keys: dict[str, str] | None = None) -> None:
    async def main() -> None:
        downstream = FakeDownstream(FakeClock())
        table = TenantTable(cluster.tenants, keys or {}, header=cluster.gateway.api_key_header)
        server = TestServer(make_app(cluster, downstream, table))
        await server.start_server()
        try:
            async with ClientSession() as session:
                await test(session, str(server.make_url("")).rstrip("/"), downstream)
        finally:
            await server.close()

    asyncio.run(main())


def test_the_deadline_is_arrival_plus_the_earlier_of_timeout_and_deadline_ms() -> None:
    cluster = cluster_with(GatewayConfig(timeout_ms=800.0), ())

    async def test(session: ClientSession, url: str, down: FakeDownstream) -> None:
        for body, want_s in (({"user_id": 1}, 0.8), ({"user_id": 1, "deadline_ms": 50}, 0.05), ({"user_id": 1, "deadline_ms": 800}, 0.8)):
            async with session.post(url + "/v1/recommendations", json=body) as resp:
                assert resp.status == 200, await resp.text()
            assert down.calls[-1]["deadline"] == pytest.approx(1000.0 + want_s)
        async with session.post(url + "/v1/recommendations", json={"user_id": 1, "deadline_ms": 900}) as resp:
            assert resp.status == 422 and (await resp.json())["error"]["field"] == "deadline_ms"  # over the gateway's own timeout
        assert down.calls[-1]["tenant"] == "default" and down.calls[-1]["request_id"]  # every call names its tenant and request

    run(cluster, test)


def test_the_process_cap_and_the_tenant_cap_both_answer_429_with_retry_after_while_requests_are_held() -> None:
    cluster = cluster_with(GatewayConfig(max_concurrency=2), (TenantConfig("open", max_concurrent_requests=1), TenantConfig("keyed", api_key_env="K_KEY")))

    async def test(session: ClientSession, url: str, down: FakeDownstream) -> None:
        down.hold.clear()
        first = asyncio.ensure_future(session.post(url + "/v1/recommendations", json={"user_id": 1}))
        await down.entered.wait()  # the open tenant's one slot is taken
        async with session.post(url + "/v1/recommendations", json={"user_id": 2}) as resp:
            assert resp.status == 429 and resp.headers["Retry-After"] == "1"
            assert "max_concurrent_requests" in (await resp.json())["error"]["message"]
        down.entered.clear()
        second = asyncio.ensure_future(session.post(url + "/v1/recommendations", json={"user_id": 3}, headers={"X-API-Key": KEY}))
        await down.entered.wait()  # now the process holds 2 = max_concurrency
        async with session.post(url + "/v1/recommendations", json={"user_id": 4}, headers={"X-API-Key": KEY}) as resp:
            assert resp.status == 429 and resp.headers["Retry-After"] == "1"  # shed (issue 17), not "unavailable"
            err = (await resp.json())["error"]
            assert err["kind"] == "resource_exhausted" and err["status"] == 429 and "max_concurrency" in err["message"]
        down.hold.set()
        for fut in (first, second):
            resp = await fut
            assert resp.status == 200
            resp.release()
        async with session.post(url + "/v1/recommendations", json={"user_id": 5}) as resp:
            assert resp.status == 200  # the slots came back

    run(cluster, test, keys={"keyed": KEY})


def test_readiness_is_cached_and_follows_the_downstream() -> None:
    cluster = cluster_with(GatewayConfig(), ())

    async def test(session: ClientSession, url: str, down: FakeDownstream) -> None:
        answers = await asyncio.gather(*(session.get(url + "/readyz") for _ in range(5)))
        assert [r.status for r in answers] == [200] * 5 and down.ready_checks == 1  # concurrent callers shared one check
        for r in answers:
            r.release()
        down.serving = False
        async with session.get(url + "/readyz") as resp:
            assert resp.status == 200 and down.ready_checks == 1  # cached
        down.clock.now += READY_CACHE_S + 0.01
        async with session.get(url + "/readyz") as resp:
            assert resp.status == 503 and resp.headers["Retry-After"] == "1" and down.ready_checks == 2
            assert (await resp.json()) == {"ready": False, "downstream": [{"address": "127.0.0.1:1", "serving": False}]}

    run(cluster, test)


def test_a_chunked_body_over_the_cap_is_400_and_request_ids_are_sane() -> None:
    cluster = cluster_with(GatewayConfig(max_body_bytes=2048), ())

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"user_id": 1, "exclude_ids": ['
        for _ in range(100):
            yield b"1234567, " * 10
        yield b"1]}"

    async def test(session: ClientSession, url: str, down: FakeDownstream) -> None:
        async with session.post(url + "/v1/recommendations", data=chunks(), headers={"Content-Type": "application/json"}) as resp:
            body = await resp.json()
            assert resp.status == 400 and body["error"]["field"] == "body" and "2,048" in body["error"]["message"]
        assert down.calls == []
        async with session.post(url + "/v1/recommendations", json={"user_id": 1}, headers={"X-Request-Id": "bad id\twith spaces"}) as resp:
            assert resp.status == 200 and resp.headers["X-Request-Id"] != "bad id\twith spaces" and len(resp.headers["X-Request-Id"]) == 32
            assert down.calls[-1]["request_id"] == resp.headers["X-Request-Id"]  # the id sent downstream is the one answered

    run(cluster, test)




def test_refused_requests_give_their_process_slot_back() -> None:
    cluster = cluster_with(GatewayConfig(max_concurrency=1), (TenantConfig("keyed", api_key_env="K_KEY"),))

    async def test(session: ClientSession, url: str, down: FakeDownstream) -> None:
        for body, headers, want in (({"user_id": -1}, {"X-API-Key": KEY}, 422), ({"user_id": 1}, {}, 401), ({"user_id": 1}, {"X-API-Key": "wrong-key-123"}, 401)):
            async with session.post(url + "/v1/recommendations", json=body, headers=headers) as resp:
                assert resp.status == want
        async with session.post(url + "/v1/recommendations", json={"user_id": 1}, headers={"X-API-Key": KEY}) as resp:
            assert resp.status == 200  # with max_concurrency 1, a leaked slot would make this a 503

    run(cluster, test, keys={"keyed": KEY})
