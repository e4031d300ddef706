"""Supervision on real processes (issue 17): a SIGKILLed shard is restarted by the
supervisor on its port and serves its RocksDB state, every acknowledged upsert
included; a crash-looping child makes the gateway's ``/readyz`` 503 and shows on
``/v1/status`` (the report file the supervisor writes, read by the gateway)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from recserve.cluster import ShardCluster
from recserve.cluster.supervise import SUPERVISOR_STATE_ENV, Supervisor, SupervisorConfig, SupervisorThread, read_report
from recserve.config import load
from recserve.config.spec import GatewayConfig
from recserve.gateway.app import make_app
from recserve.gateway.tenants import TenantTable
from recserve.rpc.auth import admin_metadata
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import embedding_pb2, embedding_pb2_grpc
from tests.integration.conftest import ADMIN_TOKEN, ShardWorld, channel, server_config
from tests.integration.test_gateway_app import FakeClock, FakeDownstream

pytestmark = pytest.mark.integration

FAST = SupervisorConfig(initial_backoff_s=0.05, max_backoff_s=0.2, poll_s=0.02)


def read_rows(address: str, ids: np.ndarray) -> np.ndarray:
    with channel(address) as ch:
        req = embedding_pb2.LookupRequest()
        req.tables.add(table="item", ids=pack(ids))
        table = embedding_pb2_grpc.EmbeddingShardStub(ch).Lookup(req, timeout=30).tables[0]
    assert unpack(table.found, "found").all()
    return unpack(table.rows, "rows")


def test_a_sigkilled_shard_is_restarted_and_serves_every_acknowledged_upsert(shard_world: ShardWorld, tmp_path: Path) -> None:
    cluster = ShardCluster(shard_world.plan_path, tmp_path / "data", num_shards=1, server=server_config(), load_from=shard_world.source_dir, admin_token=ADMIN_TOKEN)
    ids = shard_world.plan.assignment(0, "item").cold_ids[:50]
    new = np.random.default_rng(5).standard_normal((len(ids), 32)).astype(np.float32)
    state = tmp_path / "supervisor.json"
    restarted = threading.Event()
    with cluster:
        address = cluster.address(0)
        with channel(address) as ch:
            req = embedding_pb2.UpsertRequest()
            req.tables.add(table="item", ids=pack(ids), rows=pack(new))
            reply = embedding_pb2_grpc.EmbeddingShardStub(ch).Upsert(req, timeout=30, metadata=admin_metadata(ADMIN_TOKEN))
        assert reply.rows_written == len(ids)  # acknowledged
        def on_event(line: str) -> None:
            if "restarted" in line:
                restarted.set()

        sup = SupervisorThread(Supervisor([cluster._group], FAST), state_file=state, on_event=on_event)
        sup.start()
        try:
            first_pid = cluster.pid(0)
            os.kill(first_pid, signal.SIGKILL)  # a crash: no goodbye, nothing flushed at exit
            assert restarted.wait(60), f"no restart; log:\n{cluster.log_path(0).read_text()[-2000:]}"
        finally:
            sup.stop()  # joined: its last report is written
        cluster.wait_serving(0)
        assert cluster.pid(0) != first_pid and cluster.address(0) == address  # a new process, on the old port
        assert np.array_equal(read_rows(address, ids), new)  # the upserted rows, not the source's
        report = read_report(state)
        assert report is not None
        child = report["children"]["shard-0"]
        assert (child["restarts"], child["last_exit_code"], child["state"], report["crash_looping"]) == (1, -signal.SIGKILL, "running", [])


def test_a_crash_looping_child_makes_readyz_503_and_shows_on_the_status_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "supervisor.json"
    monkeypatch.setenv(SUPERVISOR_STATE_ENV, str(state))
    cluster = dataclasses.replace(load(), gateway=GatewayConfig(), tenants=())

    async def main() -> None:
        downstream = FakeDownstream(FakeClock())  # every downstream SERVING
        app = make_app(cluster, downstream, TenantTable((), {}, header=cluster.gateway.api_key_header), scrape_targets={})
        server = TestServer(app)
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        try:
            async with ClientSession() as session:
                async with session.get(url + "/readyz") as resp:  # no report yet: readiness is the downstreams'
                    assert resp.status == 200 and "crash_looping" not in await resp.json()
                looping = {"crash_looping": ["ranker-1"], "window_s": 120.0, "children": {
                    "ranker-1": {"state": "backoff", "restarts": 3, "last_exit_code": 1, "recent_exits": 3, "crash_looping": True}}}  # fmt: skip
                state.write_text(json.dumps(looping))
                downstream.clock.now += 10.0  # past the readiness cache
                async with session.get(url + "/readyz") as resp:
                    body = await resp.json()
                    assert resp.status == 503 and resp.headers["Retry-After"]
                assert body["ready"] is False and body["crash_looping"] == ["ranker-1"] and body["supervisor"]["ranker-1"]["restarts"] == 3
                async with session.get(url + "/v1/status") as resp:
                    assert resp.status == 200 and (await resp.json())["supervisor"]["crash_looping"] == ["ranker-1"]
                state.write_text(json.dumps({**looping, "crash_looping": []}))  # recovered: ready again
                async with session.get(url + "/readyz") as resp:
                    assert resp.status == 200 and (await resp.json())["crash_looping"] == []
        finally:
            await server.close()

    asyncio.run(main())
