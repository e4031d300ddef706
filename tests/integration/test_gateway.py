"""The HTTP gateway on a real cluster (tests/integration/gateway_world.py): shards, a
ranker, the cascade and ``recserve gateway serve``, each a process on loopback.

Every endpoint and each error status (400, 401, 422, 429, 503, 504), request ids, the
OpenAPI document as served, ``/metrics`` moving by exactly the requests sent, and a client
disconnect cancelling the downstream RPC. Oracles from outside the gateway: the
ranker's own gRPC answer for the same Rank, the document checked by
``openapi_spec_validator`` and answers by ``openapi_schema_validator``, each process's
own ``/metrics``.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from openapi_schema_validator import OAS30Validator
from openapi_spec_validator import validate as validate_spec
from prometheus_client.parser import text_string_to_metric_families

from embedding_server.fault import set_fault
from recserve.cluster.gateway import GatewayCluster
from recserve.cluster.group import REPO_ROOT
from recserve.rpc.deadline import make_header
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import ranking_pb2
from recserve.v1.ranking_pb2_grpc import RankingStub
from tests.integration.gateway_world import GatewayWorld, gateway_world, world_spec

pytestmark = pytest.mark.integration

FEED_KEY = "gw-test-feed-key-1f0c9a"
SLOW_KEY = "gw-test-slow-key-77b2e4"
MAX_BODY = 4096
TENANTS = f"""[gateway]
timeout_ms = 10000.0
max_body_bytes = {MAX_BODY}

[[tenants]]
name = "default"

[[tenants]]
name = "feed"
api_key_env = "GW_TEST_FEED_KEY"

[[tenants]]
name = "slow"
api_key_env = "GW_TEST_SLOW_KEY"
rate_per_s = 0.001
burst = 1
"""
ENV = {"GW_TEST_FEED_KEY": FEED_KEY, "GW_TEST_SLOW_KEY": SLOW_KEY}
WAIT_S = 30.0
SHARD_DELAY_MS = 2500.0  # long enough to hang up while the Rank waits; short, since the ranker's stop waits for it


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayWorld]:
    with gateway_world(tmp_path_factory.mktemp("gateway"), extra=TENANTS, env=ENV, fault_hook=True) as world:
        yield world


def call(url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, raw: bytes | None = None) -> tuple[int, dict[str, str], Any]:
    """One HTTP request; (status, headers, parsed JSON body or text)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
    try:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        text = resp.read()
        hdrs = {k.lower(): v for k, v in resp.getheaders()}
        parsed = json.loads(text) if hdrs.get("content-type", "").startswith("application/json") else text.decode()
        return resp.status, hdrs, parsed
    finally:
        conn.close()


def schema_check(doc: dict[str, Any], name: str, instance: Any) -> None:
    """``instance`` against the served document's component ``name`` (refs resolved)."""
    schema = {**doc["components"]["schemas"][name], "components": doc["components"]}
    OAS30Validator(schema).validate(instance)


def metric(url: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` with ``labels`` (a subset) in a process's /metrics; 0 if absent."""
    with urllib.request.urlopen(url, timeout=WAIT_S) as resp:
        text = resp.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.fixture(scope="module")
def doc(gw: GatewayWorld) -> dict[str, Any]:
    status, _, body = call(gw.url, "GET", "/openapi.json")
    assert status == 200
    return body  # type: ignore[no-any-return]


# ---- endpoints --------------------------------------------------------------------


def test_the_served_openapi_document_is_valid(doc: dict[str, Any]) -> None:
    validate_spec(doc)
    assert {"/v1/recommendations", "/v1/rank", "/v1/generate", "/healthz", "/readyz", "/metrics", "/openapi.json", "/", "/v1/status"} == set(doc["paths"])


def test_recommendations_answer_k_items_with_stage_reports_in_the_documented_shape(gw: GatewayWorld, doc: dict[str, Any]) -> None:
    status, headers, body = call(gw.url, "POST", "/v1/recommendations", {"user_id": 5, "k": 7, "deadline_ms": 5000}, {"X-Request-Id": "feed-req-0001"})
    assert status == 200, body
    schema_check(doc, "RecommendResponse", body)
    assert len(body["item_ids"]) == 7 and len(set(body["item_ids"])) == 7 and len(body["scores"]) == 7
    assert [s["stage"] for s in body["stages"]] == ["L0", "L1", "L2", "L3"]
    assert body["model_version"] == gw.world.export.model_version and body["index_version"]
    assert headers["x-request-id"] == body["request_id"] == "feed-req-0001"  # the caller's id, end to end
    excluded = body["item_ids"][:3]
    status, headers, again = call(gw.url, "POST", "/v1/recommendations", {"user_id": 5, "k": 7, "exclude_ids": excluded})
    assert status == 200 and not set(excluded) & set(again["item_ids"])
    assert len(headers["x-request-id"]) == 32 and headers["x-request-id"] == again["request_id"]  # none sent: a fresh one


def test_rank_answers_what_the_ranker_answers_over_grpc(gw: GatewayWorld, doc: dict[str, Any]) -> None:
    candidates = [11, 3, 250, 42, 7, 1999]
    status, _, body = call(gw.url, "POST", "/v1/rank", {"user_id": 9, "candidate_ids": candidates, "model": "dlrm"}, {"X-API-Key": FEED_KEY})
    assert status == 200, body
    schema_check(doc, "RankResponse", body)
    with grpc.insecure_channel(gw.ranker_addresses[0]) as channel:
        request = ranking_pb2.RankRequest(header=make_header(timeout_s=WAIT_S), user_id=9, candidate_ids=pack(np.array(candidates, np.int64)), model="dlrm")
        want = RankingStub(channel).Rank(request, timeout=WAIT_S)
    assert body["item_ids"] == unpack(want.item_ids, "item_ids").tolist()
    np.testing.assert_allclose(body["scores"], unpack(want.scores, "scores"), rtol=1e-6)
    assert sorted(body["item_ids"]) == sorted(candidates) and body["scores"] == sorted(body["scores"], reverse=True)


def test_generate_without_generation_replicas_is_503_with_a_json_body(gw: GatewayWorld, doc: dict[str, Any]) -> None:
    # This world starts no generation replica (tests/integration/test_gateway_generate.py streams from one).
    status, headers, body = call(gw.url, "POST", "/v1/generate", {"prompt": "hi"})
    assert status == 503 and body["error"]["status"] == 503 and "no generation replicas" in body["error"]["message"]
    assert headers["retry-after"] == "1"
    schema_check(doc, "ErrorResponse", body)
    assert headers["x-request-id"] == body["request_id"]


def test_health_readiness_and_metrics(gw: GatewayWorld, doc: dict[str, Any]) -> None:
    status, _, body = call(gw.url, "GET", "/healthz")
    assert (status, body) == (200, {"status": "ok"})
    status, _, body = call(gw.url, "GET", "/readyz")
    assert status == 200 and body["ready"] is True
    schema_check(doc, "ReadyResponse", body)
    assert {d["address"] for d in body["downstream"]} == {*gw.recommenders, *gw.ranker_addresses} and all(d["serving"] for d in body["downstream"])
    route = "/v1/recommendations"
    before = metric(gw.gateway.metrics_url, "recserve_http_requests_total", route=route, status="200")
    latency_before = metric(gw.gateway.metrics_url, "recserve_http_latency_seconds_count", route=route)
    n = 4
    for user in range(n):
        assert call(gw.url, "POST", route, {"user_id": user, "k": 3})[0] == 200
    assert metric(gw.gateway.metrics_url, "recserve_http_requests_total", route=route, status="200") - before == n
    assert metric(gw.gateway.metrics_url, "recserve_http_latency_seconds_count", route=route) - latency_before == n


# ---- errors -------------------------------------------------------------------------


@pytest.mark.parametrize("raw, status, field", [
    (b'{"user_id": 5, "k": ', 400, "body"),
    (b"[5, 10]", 400, "body"),
    (json.dumps({"user_id": 1, "exclude_ids": list(range(2000))}).encode(), 400, "body"),  # over max_body_bytes
    (b'{"user_id": "five"}', 422, "user_id"),
    (b'{"user_id": 5, "limit": 3}', 422, "limit"),
    (b'{"user_id": -4}', 422, "user_id"),
    (b'{"user_id": 5, "k": 0}', 422, "k"),
    (b'{"user_id": 5, "k": 5000}', 422, "k"),
    (b'{"user_id": 5, "exclude_ids": [1, false]}', 422, "exclude_ids[1]"),
    (b'{"k": 5}', 422, "user_id"),
])  # fmt: skip
def test_bad_bodies_are_400_or_422_naming_the_field(gw: GatewayWorld, doc: dict[str, Any], raw: bytes, status: int, field: str) -> None:
    assert len(raw) <= MAX_BODY or field == "body"
    got, headers, body = call(gw.url, "POST", "/v1/recommendations", raw=raw)
    assert got == status, body
    schema_check(doc, "ErrorResponse", body)
    assert body["error"]["field"] == field and body["error"]["status"] == status and body["request_id"] == headers["x-request-id"]


def test_a_value_only_the_downstream_can_judge_comes_back_400_naming_it(gw: GatewayWorld) -> None:
    n = gw.world.export.arrays.num_items
    status, _, body = call(gw.url, "POST", "/v1/recommendations", {"user_id": 5, "exclude_ids": [1, n + 7]})
    assert status == 400, body
    assert body["error"]["kind"] == "invalid_argument" and body["error"]["field"] == "exclude_ids[1]" and body["error"]["value"] == n + 7


def test_unknown_routes_and_methods_get_the_json_error_body(gw: GatewayWorld) -> None:
    status, _, body = call(gw.url, "GET", "/v2/nothing")
    assert status == 404 and body["error"]["status"] == 404
    status, headers, body = call(gw.url, "GET", "/v1/recommendations")
    assert status == 405 and body["error"]["status"] == 405 and "POST" in headers.get("allow", "")


def test_a_wrong_key_is_401_and_a_right_one_serves_its_tenant(gw: GatewayWorld) -> None:
    status, _, body = call(gw.url, "POST", "/v1/recommendations", {"user_id": 5}, {"X-API-Key": FEED_KEY[:-1] + "x"})
    assert status == 401 and body["error"]["kind"] == "unauthenticated" and FEED_KEY[:-1] not in json.dumps(body)
    assert call(gw.url, "POST", "/v1/recommendations", {"user_id": 5}, {"X-API-Key": FEED_KEY})[0] == 200


def test_over_quota_is_429_with_retry_after(gw: GatewayWorld) -> None:
    key = {"X-API-Key": SLOW_KEY}
    assert call(gw.url, "POST", "/v1/recommendations", {"user_id": 5}, key)[0] == 200  # its one token (burst 1)
    status, headers, body = call(gw.url, "POST", "/v1/recommendations", {"user_id": 5}, key)
    assert status == 429 and body["error"]["kind"] == "resource_exhausted" and "'slow'" in body["error"]["message"]
    assert int(headers["retry-after"]) >= 1
    assert call(gw.url, "POST", "/v1/recommendations", {"user_id": 5}, {"X-API-Key": FEED_KEY})[0] == 200  # other tenants unaffected


def test_a_deadline_that_cannot_be_met_is_504(gw: GatewayWorld) -> None:
    # A deadline inside the cascade's reply margin opens with every stage skipped, so a
    # fallback answer may still make it back (by design: cascade/budget.py), and on a
    # loaded box gRPC's deadline timer can fire after such a reply has arrived. So each
    # try is either a 504 or that all-skipped fallback, and the 504 must show up.
    seen = []
    for _ in range(10):
        status, _, body = call(gw.url, "POST", "/v1/recommendations", {"user_id": 5, "k": 5, "deadline_ms": 1})
        seen.append(status)
        if status == 504:
            assert body["error"]["kind"] == "deadline_exceeded"
            break
        assert status == 200 and body["degraded"], body
        assert all(s["degraded_reason"] == "skipped_budget" for s in body["stages"][1:]), body
    assert seen[-1] == 504, seen


def test_a_gateway_whose_downstream_is_down_is_not_ready_and_answers_503(gw: GatewayWorld, tmp_path: Path) -> None:
    """A second gateway (keyed tenants only) in front of an address where nothing
    listens: /readyz and requests are 503 with Retry-After; no key is 401."""
    spec = tmp_path / "keyed.toml"
    spec.write_text(world_spec(gw.world, '[[tenants]]\nname = "feed"\napi_key_env = "GW_TEST_FEED_KEY"\n'))
    with socket.socket() as s:  # a port nothing listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
        gateway = GatewayCluster(spec, [dead], data_root=tmp_path / "gw", env=ENV)
        gateway.start(wait=False)
        try:
            status, headers, body = call(gateway.url, "GET", "/readyz")
            assert status == 503 and body["ready"] is False and headers["retry-after"] == "1"
            assert body["downstream"] == [{"address": dead, "serving": False}]
            status, headers, body = call(gateway.url, "POST", "/v1/recommendations", {"user_id": 5}, {"X-API-Key": FEED_KEY})
            assert status == 503 and body["error"]["kind"] == "unavailable" and int(headers["retry-after"]) >= 1, body
            status, _, body = call(gateway.url, "POST", "/v1/recommendations", {"user_id": 5})
            assert status == 401 and "X-API-Key" in body["error"]["message"]
            assert call(gateway.url, "GET", "/healthz")[0] == 200  # alive all the same
        finally:
            gateway.stop()


def test_a_keyed_tenant_without_its_key_variable_stops_the_gateway_at_start(gw: GatewayWorld) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ENV} | {"GW_TEST_FEED_KEY": FEED_KEY}  # the slow tenant's key is missing
    proc = subprocess.run([sys.executable, "-m", "recserve", "gateway", "serve", "--config", str(gw.spec_path), "--recommenders", "127.0.0.1:1"],
                          capture_output=True, text=True, timeout=WAIT_S, env=env, cwd=REPO_ROOT)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "tenant 'slow'" in proc.stderr and "GW_TEST_SLOW_KEY" in proc.stderr and "Traceback" not in proc.stderr
    assert FEED_KEY not in proc.stderr + proc.stdout


def test_a_client_disconnect_cancels_the_downstream_rank(gw: GatewayWorld) -> None:
    """With every shard slowed down, a Rank through the gateway is stuck in the ranker's
    lookups; the client hangs up; the ranker's server sees the RPC CANCELLED and its
    scheduler counts the item cancelled (its own /metrics), and the gateway counts the
    request as 499. (The shards' delay outlasts the test; it ends before the module's
    teardown stops the ranker, which would otherwise wait for it.)"""
    ranker_metrics, gateway_metrics = gw.metrics_urls["ranker-0"], gw.gateway.metrics_url
    cancelled = metric(ranker_metrics, "recserve_rpc_requests_total", method="Rank", code="CANCELLED")
    dropped = metric(ranker_metrics, "recserve_scheduler_cancelled_total", loop="rank-dlrm")
    hung_up = metric(gateway_metrics, "recserve_http_requests_total", route="/v1/rank", status="499")
    sent = metric(ranker_metrics, "recserve_lookup_rpcs_total")
    for address in gw.shard_addresses:
        set_fault(address, delay_ms=SHARD_DELAY_MS, methods=["Lookup"])
    try:
        host, port = gw.gateway.address.split(":")
        body = json.dumps({"user_id": 3, "candidate_ids": [101, 102, 103, 104]}).encode()
        with socket.create_connection((host, int(port)), timeout=WAIT_S) as conn:
            conn.sendall(b"POST /v1/rank HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            _wait_for(lambda: metric(ranker_metrics, "recserve_lookup_rpcs_total") > sent, "the ranker to send the Rank's lookups")
        # The connection is closed: the gateway's handler is cancelled, and with it the RPC.
        _wait_for(lambda: metric(ranker_metrics, "recserve_rpc_requests_total", method="Rank", code="CANCELLED") == cancelled + 1,
                  "the ranker to see the Rank CANCELLED")  # fmt: skip
        _wait_for(lambda: metric(ranker_metrics, "recserve_scheduler_cancelled_total", loop="rank-dlrm") == dropped + 1,
                  "the ranker's scheduler to count the item cancelled")  # fmt: skip
        _wait_for(lambda: metric(gateway_metrics, "recserve_http_requests_total", route="/v1/rank", status="499") == hung_up + 1, "the gateway to count a 499")
    finally:
        for address in gw.shard_addresses:
            set_fault(address)


def _wait_for(condition: Any, what: str, timeout_s: float = WAIT_S) -> None:
    """Poll an observable condition (another process's state) until it holds."""
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)
