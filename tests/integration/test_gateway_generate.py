"""``POST /v1/generate`` on a real gateway process (``recserve gateway serve
--generators``) in front of a real generation replica (:class:`GenerationCluster`), both
on loopback and started once for the module.

Server-sent events carrying the same tokens the replica streams over gRPC (the oracle,
asked directly), errors before the first chunk as ordinary JSON answers naming the
field, a client that disconnects cancelling the replica's sequence (its own
``/metrics``), ``/readyz`` listing the replica, the OpenAPI document describing the
events, and — in-process, with a fake generator — 503 from a gateway without generators
and an error after the first chunk arriving as the stream's last event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import socket
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer
from openapi_schema_validator import OAS30Validator
from prometheus_client.parser import text_string_to_metric_families

from recserve.cluster.gateway import GatewayCluster
from recserve.cluster.generation import GenerationCluster
from recserve.config import load
from recserve.errors import Unavailable
from recserve.gateway.app import make_app
from recserve.gateway.openapi import openapi_document
from recserve.gateway.tenants import TenantTable
from recserve.rpc.deadline import make_header
from recserve.rpc.tensors import unpack
from recserve.v1 import generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.integration

WAIT_S = 30.0
CAP = 48
SPEC = f"""
[[tables]]
name = "item"
rows = 16
dim = 4

[generation]
device = "cpu"
n_layers = 2
n_heads = 2
dim = 16
max_seq_len = 96
num_blocks = 64
block_tokens = 4
max_seqs = 8
token_budget = 64
prefill_chunk_tokens = 16
max_new_tokens_cap = {CAP}
stop_token = -1

[[tenants]]
name = "default"
"""


class World:
    def __init__(self, root: Path) -> None:
        (root / "spec.toml").write_text(SPEC)
        self.spec = root / "spec.toml"
        self.generation = GenerationCluster(self.spec, num_replicas=1, data_root=root / "generation")
        self.gateway: GatewayCluster | None = None
        self.root = root

    def start(self) -> None:
        self.generation.start(wait=False)
        # No cascade here: the gateway only needs one address to start with (it connects lazily).
        self.gateway = GatewayCluster(self.spec, ["127.0.0.1:9"], generators=self.generation.addresses, data_root=self.root / "gateway")
        self.gateway.start(wait=False)  # /readyz stays 503 without a cascade: wait on /healthz instead
        self.generation.wait_serving(0)
        end = time.monotonic() + WAIT_S
        while True:
            try:
                status, _, _ = http_call(self.url, "GET", "/healthz")
                if status == 200:
                    return
            except OSError:
                pass
            assert time.monotonic() < end, self.gateway.log_path.read_text()[-2000:]
            time.sleep(0.05)

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return self.gateway.url

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        self.generation.stop()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("gateway-generate"))
    try:
        w.start()
        yield w
    finally:
        w.stop()


def http_call(url: str, method: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    host, _, port = url.removeprefix("http://").rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data is not None else {})
        reply = conn.getresponse()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
    finally:
        conn.close()


def events(raw: bytes) -> list[tuple[str, int | None, dict[str, Any]]]:
    """Parse an event stream: (event, id, data) per event."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((fields["event"], int(fields["id"]) if "id" in fields else None, json.loads(fields["data"])))
    return out


def grpc_tokens(address: str, prompt: str, max_new_tokens: int) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        req = generation_pb2.GenerateRequest(header=make_header(timeout_s=WAIT_S), prompt=prompt, max_new_tokens=max_new_tokens)
        return [int(t) for c in generation_pb2_grpc.GenerationStub(channel).Generate(req, timeout=WAIT_S) for t in unpack(c.tokens, "tokens")]


def test_generate_streams_server_sent_events_with_the_replicas_tokens(world: World) -> None:
    status, headers, raw = http_call(world.url, "POST", "/v1/generate", {"prompt": "why item 42?", "max_new_tokens": 12})
    assert status == 200, raw
    assert headers["content-type"].startswith("text/event-stream") and headers["x-request-id"]
    got = events(raw)
    assert [e for e, _, _ in got] == ["chunk"] * 12 and [i for _, i, _ in got] == list(range(12))
    data = [d for _, _, d in got]
    assert [d["index"] for d in data] == list(range(12)) and [d["finished"] for d in data] == [False] * 11 + [True]
    assert data[-1]["finish_reason"] == "length"
    assert [t for d in data for t in d["tokens"]] == grpc_tokens(world.generation.address(0), "why item 42?", 12)
    stamps = [d["emitted_unix_us"] for d in data]
    assert stamps == sorted(stamps) and stamps[0] > 0
    doc = openapi_document(load(world.spec))
    schema = {**doc["components"]["schemas"]["GenerateChunk"], "components": doc["components"]}
    for d in data:
        OAS30Validator(schema).validate(d)


@pytest.mark.parametrize(("body", "status", "field", "value"), [
    ({"prompt": ""}, 400, "prompt", "''"),
    ({"prompt": "a", "prompt_tokens": [1]}, 400, "prompt", "'a'"),
    ({"prompt_tokens": [65, 999]}, 400, "prompt_tokens[1]", 999),
    ({"prompt": "x" * 96}, 400, None, None),  # over the context: the message names the field and the count
    ({"prompt": "x", "max_new_tokens": 0}, 422, "max_new_tokens", 0),
    ({"prompt": "x", "max_new_tokens": CAP + 1}, 422, "max_new_tokens", CAP + 1),
    ({"prompt": "x", "temperature": -1}, 422, "temperature", -1),
    ({"prompt": "x", "max_tokens": 3}, 422, "max_tokens", 3),
])  # fmt: skip
def test_errors_before_the_first_chunk_are_json_answers(world: World, body: dict[str, Any], status: int, field: str | None, value: Any) -> None:
    got, headers, raw = http_call(world.url, "POST", "/v1/generate", body)
    answer = json.loads(raw)
    assert got == status and headers["content-type"].startswith("application/json"), answer
    assert (answer["error"]["field"], answer["error"]["value"]) == (field, value)
    if field is None:
        assert "prompt has 96 tokens, over the context limit" in answer["error"]["message"]


def test_a_nan_temperature_reaches_the_replica_and_is_named(world: World) -> None:
    got, _, raw = http_call(world.url, "POST", "/v1/generate", raw=b'{"prompt": "x", "temperature": NaN}')
    answer = json.loads(raw)
    assert got == 400 and answer["error"]["field"] == "temperature" and "temperature = nan is invalid" in answer["error"]["message"]


def _cancelled(world: World) -> float:
    url = world.generation.metrics_url(0)
    assert url is not None
    with urllib.request.urlopen(url, timeout=WAIT_S) as reply:
        text = reply.read().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return sum(s.value for s in samples if s.name == "recserve_scheduler_cancelled_total" and s.labels.get("loop") == "generation")


def test_a_client_that_disconnects_cancels_the_replicas_sequence(world: World) -> None:
    before = _cancelled(world)
    host, _, port = world.url.removeprefix("http://").rpartition(":")
    body = json.dumps({"prompt": "a long story", "max_new_tokens": CAP}).encode()
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
        seen = b""
        while b"event: chunk" not in seen:  # the stream started
            part = sock.recv(4096)
            assert part, "the gateway closed the stream before its first event"
            seen += part
    end = time.monotonic() + WAIT_S
    while _cancelled(world) < before + 1:  # the replica learns of it asynchronously
        assert time.monotonic() < end, "the replica never counted the cancelled sequence"
        time.sleep(0.05)
    assert _cancelled(world) == before + 1


def test_readyz_lists_the_generation_replica(world: World) -> None:
    _, _, raw = http_call(world.url, "GET", "/readyz")
    downstream = {d["address"]: d["serving"] for d in json.loads(raw)["downstream"]}
    assert downstream[world.generation.address(0)] is True
    assert downstream["127.0.0.1:9"] is False  # no cascade in this world: not ready overall


def test_the_openapi_document_describes_the_event_stream(world: World) -> None:
    _, _, raw = http_call(world.url, "GET", "/openapi.json")
    post = json.loads(raw)["paths"]["/v1/generate"]["post"]
    assert "text/event-stream" in post["responses"]["200"]["content"]
    assert {"400", "401", "422", "429", "503", "504"} <= set(post["responses"])


class NoDownstream:
    clock = staticmethod(time.monotonic)

    async def check_ready(self, timeout_s: float = 1.0) -> dict[str, bool]:
        return {}


@dataclasses.dataclass
class FakeChunk:
    index: int
    tokens: np.ndarray
    text: str
    finished: bool = False
    finish_reason: str = ""
    emitted_unix_us: int = 1


class FailingGenerator:
    """One chunk, then ``error`` (what a replica dying mid-stream looks like to the gateway)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.closed = False

    async def generate(self, prompt: str = "", **kwargs: Any) -> AsyncIterator[FakeChunk]:
        try:
            yield FakeChunk(0, np.array([104], np.int32), "h")
            raise self.error
        finally:
            self.closed = True

    async def check_ready(self, timeout_s: float = 1.0) -> dict[str, bool]:
        return {}


def in_process(generator: Any, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    async def main() -> tuple[int, dict[str, str], bytes]:
        cluster = load()
        table = TenantTable(cluster.tenants, {}, header=cluster.gateway.api_key_header)
        server = TestServer(make_app(cluster, NoDownstream(), table, generator=generator))  # type: ignore[arg-type]
        await server.start_server()
        try:
            async with ClientSession() as session:
                async with session.post(str(server.make_url("/v1/generate")), json=body) as reply:
                    return reply.status, {k.lower(): v for k, v in reply.headers.items()}, await reply.read()
        finally:
            await server.close()

    return asyncio.run(main())


def test_a_gateway_without_generators_answers_503() -> None:
    status, headers, raw = in_process(None, {"prompt": "hi"})
    assert status == 503 and headers["retry-after"] == "1" and "no generation replicas" in json.loads(raw)["error"]["message"]


@pytest.mark.parametrize(("error", "status", "kind"), [(Unavailable("generator 127.0.0.1:1: Generate: UNAVAILABLE: gone"), 503, "unavailable"),
                                                       (RuntimeError("a bug"), 500, "internal")])
def test_an_error_after_the_first_chunk_is_the_streams_last_event(error: BaseException, status: int, kind: str) -> None:
    generator = FailingGenerator(error)
    got, headers, raw = in_process(generator, {"prompt": "hi"})
    assert got == 200 and headers["content-type"].startswith("text/event-stream")
    (e1, i1, d1), (e2, i2, d2) = events(raw)
    assert (e1, i1, d1["tokens"], d1["finished"]) == ("chunk", 0, [104], False)
    assert (e2, i2, d2["error"]["status"], d2["error"]["kind"]) == ("error", None, status, kind)
    assert d2["request_id"] == headers["x-request-id"] and generator.closed


def test_prompt_tokens_stream_like_their_text(world: World) -> None:
    text = "item 7"
    by_text = events(http_call(world.url, "POST", "/v1/generate", {"prompt": text, "max_new_tokens": 5})[2])
    by_ids = events(http_call(world.url, "POST", "/v1/generate", {"prompt_tokens": list(np.frombuffer(text.encode(), np.uint8).tolist()), "max_new_tokens": 5})[2])
    assert [d["tokens"] for _, _, d in by_text] == [d["tokens"] for _, _, d in by_ids]
