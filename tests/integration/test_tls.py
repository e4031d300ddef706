"""TLS on gRPC and on the HTTP gateway, and the admin token and tenant keys in real call
metadata (issue 17, "Security").

A self-signed certificate for 127.0.0.1 is made with the ``openssl`` CLI (skipped where
there is none). One in-process gRPC server is started the way every recserve server is
(:func:`recserve.rpc.serving.serve_loaded`, with ``[tls]``), carrying the cascade's
Recommender and Admin servicers with empty slots: a call that passes the admin or tenant
check answers UNAVAILABLE ("still loading"), one that does not is refused first. Then
the gateway (:func:`recserve.gateway.server.serve`) serves HTTPS in front of it: its
``/readyz`` reaches that server's health over TLS too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recserve.config.load import default_config
from recserve.config.spec import ClusterConfig, TenantConfig, TlsConfig
from recserve.rpc.auth import admin_metadata, client_ssl_context, open_channel
from recserve.rpc.deadline import make_header
from recserve.v1 import admin_pb2, admin_pb2_grpc, recommender_pb2, recommender_pb2_grpc

pytestmark = pytest.mark.integration

TOKEN = "tls-test-admin-token"
FEED_KEY = "tls-test-feed-key"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed (it makes the self-signed certificate)")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return TlsConfig(cert_file=str(cert), key_file=str(key), ca_file=str(cert))  # self-signed: it is its own root


def spec(tls: TlsConfig) -> ClusterConfig:
    return dataclasses.replace(default_config(), tls=tls, tenants=(TenantConfig(name="feed", api_key_env="TLS_TEST_FEED_KEY"), TenantConfig(name="public")))


class Nothing:
    async def aclose(self) -> None:
        pass


@dataclasses.dataclass
class Server:
    address: str
    cluster: ClusterConfig


@contextlib.asynccontextmanager
async def grpc_server(tls: TlsConfig) -> AsyncIterator[Server]:
    """The cascade's servicers (slots left empty) on a TLS server, SERVING."""
    from cascade.server import ADMIN_SERVICE, RECOMMENDER_SERVICE, AdminServicer, CascadeProcessConfig, RecommenderServicer
    from recserve.rpc.auth import TenantAuth
    from recserve.rpc.server import add_health_and_reflection, make_server
    from recserve.rpc.serving import Slot, serve_loaded

    cluster = spec(tls)
    server = make_server(max_message_bytes=1 << 20)
    tenants = TenantAuth.from_cluster(cluster, {"TLS_TEST_FEED_KEY": FEED_KEY})
    recommender_pb2_grpc.add_RecommenderServicer_to_server(RecommenderServicer(Slot("cascade"), tenants), server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(Slot("cascade"), CascadeProcessConfig(cluster, "m", ("r:1",), (), admin_token=TOKEN)), server)
    health = await add_health_and_reflection(server, [RECOMMENDER_SERVICE, ADMIN_SERVICE])
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()

    async def load() -> Nothing:
        return Nothing()

    task = asyncio.ensure_future(serve_loaded(server, health, [RECOMMENDER_SERVICE, ADMIN_SERVICE], Slot("nothing"), load, what="tls test", host="127.0.0.1",
                                              port=0, on_ready=lambda core, port: ready.set_result(port), stop=stop, grace_s=0.1, tls=tls))  # fmt: skip
    try:
        port = await asyncio.wait_for(ready, 30)
        yield Server(f"127.0.0.1:{port}", cluster)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def test_grpc_over_tls_serves_and_refuses_plaintext(tls: TlsConfig) -> None:
    from recserve.rpc.serving import wait_until_serving

    async def body() -> None:
        async with grpc_server(tls) as srv:
            await wait_until_serving([srv.address], service="recserve.v1.Recommender", timeout_s=30, tls=tls)
            async with open_channel(srv.address, tls) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="recserve.v1.Admin"), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            async with grpc.aio.insecure_channel(srv.address) as plain:  # the port speaks TLS only
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(body())


async def code_of(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_admin_token_and_tenant_key_travel_in_metadata(tls: TlsConfig) -> None:
    asyncio.run(_admin_and_tenant_calls(tls))


async def _admin_and_tenant_calls(tls: TlsConfig) -> None:
    async with grpc_server(tls) as srv, open_channel(srv.address, tls) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        refresh = admin_pb2.RefreshIndexRequest(header=make_header(timeout_s=10))
        assert await code_of(admin.RefreshIndex(refresh, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        assert await code_of(admin.RefreshIndex(refresh, timeout=10, metadata=admin_metadata("wrong"))) == grpc.StatusCode.PERMISSION_DENIED
        assert await code_of(admin.RefreshIndex(refresh, timeout=10, metadata=admin_metadata(TOKEN))) == grpc.StatusCode.UNAVAILABLE  # allowed; loading
        rec = recommender_pb2_grpc.RecommenderStub(channel)

        def ask(tenant: str) -> recommender_pb2.RecommendRequest:
            return recommender_pb2.RecommendRequest(header=make_header(timeout_s=10, tenant=tenant), user_id=1, k=5)

        assert await code_of(rec.Recommend(ask("feed"), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED  # the header alone
        assert await code_of(rec.Recommend(ask("feed"), timeout=10, metadata=(("x-api-key", "guess"),))) == grpc.StatusCode.UNAUTHENTICATED
        assert await code_of(rec.Recommend(ask("feed"), timeout=10, metadata=(("x-api-key", FEED_KEY),))) == grpc.StatusCode.UNAVAILABLE
        assert await code_of(rec.Recommend(ask(""), timeout=10)) == grpc.StatusCode.UNAVAILABLE  # the key-less tenant


def test_the_gateway_serves_https_and_reaches_grpc_over_tls(tls: TlsConfig, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from recserve.gateway import server as gateway_server

    real_write = gateway_server.write_port_file
    ports: list[asyncio.Future[int]] = []

    def write_port_file(path: str | Path, port: int) -> None:  # the port file, and a future to await
        real_write(path, port)
        ports[0].set_result(port)

    monkeypatch.setattr(gateway_server, "write_port_file", write_port_file)

    async def body() -> None:
        ports.append(asyncio.get_running_loop().create_future())
        async with grpc_server(tls) as srv:
            await _https_calls(gateway_server, srv, tls, tmp_path, ports[0])

    asyncio.run(body())


async def _https_calls(gateway_server: Any, grpc_server: Server, tls: TlsConfig, tmp_path: Path, bound: asyncio.Future[int]) -> None:
    stop = asyncio.Event()
    config = gateway_server.GatewayProcessConfig(cluster=grpc_server.cluster, recommenders=(grpc_server.address,), port_file=str(tmp_path / "gw.port"))
    task = asyncio.ensure_future(gateway_server.serve(config, stop, environ={"TLS_TEST_FEED_KEY": FEED_KEY}))
    try:
        port = await asyncio.wait_for(bound, 30)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client_ssl_context(tls))) as session:
            async with session.get(f"https://127.0.0.1:{port}/healthz") as response:
                assert response.status == 200 and (await response.json()) == {"status": "ok"}
            async with session.get(f"https://127.0.0.1:{port}/readyz") as response:  # the gateway's check of the TLS gRPC server
                assert response.status == 200, await response.text()
        async with aiohttp.ClientSession() as plain:
            with pytest.raises(aiohttp.ClientError):
                async with plain.get(f"http://127.0.0.1:{port}/healthz") as response:
                    await response.read()
        # A client that does not trust the certificate is refused by its own verification.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl.create_default_context())) as untrusting:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await untrusting.get(f"https://127.0.0.1:{port}/healthz")
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)

