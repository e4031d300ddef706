"""``recserve generate serve`` as a user runs it: one real process on loopback serving a
tiny ``recserve train --lm``-format checkpoint (``--model``), started once for the module.

Health and reflection, a stream against full-recompute decoding of the same checkpoint
(the oracle, in this process), ``emitted_unix_us`` stamps, every kind of bad input as
INVALID_ARGUMENT naming the field and the value while the server keeps serving, a
cancelled stream freeing its sequence (the process's own ``/metrics`` and load metadata),
a passed deadline, the random-bytes fuzzer on ``Generate``, the RPC counters, and SIGTERM
draining a stream in flight, then exit 0.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from generation.config import ModelConfig
from generation.model import TinyDecoder
from generation.oracle import generate_recompute
from generation.train import save_checkpoint
from generation.types import GenerationRequest
from recserve.cluster.group import Health, launch_env, watch_health
from recserve.cluster.process import ChildProcess, spawn_child
from recserve.rpc.deadline import make_header
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.grpc_fuzz import fuzz_server

pytestmark = pytest.mark.integration

SERVICE = "recserve.v1.Generation"
GENERATE = f"/{SERVICE}/Generate"
START_S = 60.0
RPC_S = 20.0
CAP = 48
SPEC = f"""
[[tables]]
name = "item"
rows = 16
dim = 4

[generation]
device = "cpu"
max_seq_len = 96
num_blocks = 64
block_tokens = 4
max_seqs = 8
token_budget = 64
prefill_chunk_tokens = 16
max_new_tokens_cap = {CAP}
stop_token = -1
"""


@dataclasses.dataclass
class Server:
    child: ChildProcess
    address: str
    metrics_url: str
    model: TinyDecoder
    log: Path


def _read_port(path: Path, child: ChildProcess, log: Path) -> int:
    end = time.monotonic() + START_S
    while not path.exists():
        assert child.poll() is None, f"generate serve exited with {child.poll()}: {log.read_text()[-2000:]}"
        assert time.monotonic() < end, f"no port file after {START_S:g} s: {log.read_text()[-2000:]}"
        time.sleep(0.02)
    return int(path.read_text())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("generate-serve")
    torch.manual_seed(3)
    model = TinyDecoder(ModelConfig(n_layers=2, n_heads=2, dim=16, max_seq_len=96), init_std=0.3).eval()
    save_checkpoint(root / "lm", model)
    (root / "spec.toml").write_text(SPEC)
    log = root / "generation.log"
    argv = [sys.executable, "-m", "recserve", "generate", "serve", "--config", str(root / "spec.toml"), "--model", str(root / "lm"),
            "--port", "0", "--port-file", str(root / "port"), "--metrics-port", "0", "--metrics-port-file", str(root / "metrics-port")]  # fmt: skip
    child = spawn_child(argv, env=launch_env({}, owns_transport=False, threads=1), log_file=log)
    try:
        port = _read_port(root / "port", child, log)
        address = f"127.0.0.1:{port}"
        assert watch_health(address, SERVICE, START_S) is Health.SERVING, log.read_text()[-2000:]
        metrics_url = f"http://127.0.0.1:{int((root / 'metrics-port').read_text())}/metrics"
        yield Server(child, address, metrics_url, model, log)
    finally:
        child.stop()


@pytest.fixture
def stub(server: Server) -> Iterator[generation_pb2_grpc.GenerationStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def request(prompt: str = "", *, max_new_tokens: int = 8, tokens: np.ndarray | None = None, **fields: object) -> generation_pb2.GenerateRequest:
    out = generation_pb2.GenerateRequest(header=make_header(timeout_s=RPC_S), prompt=prompt, max_new_tokens=max_new_tokens, **fields)  # type: ignore[arg-type]
    if tokens is not None:
        out.prompt_tokens.CopyFrom(pack(tokens))
    return out


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=RPC_S) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_health_and_reflection_report_the_generation_service(server: Server) -> None:
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE):
            assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=RPC_S).status == health_pb2.HealthCheckResponse.SERVING
        assert SERVICE in ProtoReflectionDescriptorDatabase(channel).get_services()


def test_a_stream_equals_full_recompute_of_the_checkpoint_and_is_stamped(server: Server, stub: generation_pb2_grpc.GenerationStub) -> None:
    prompt = "because you liked items in category 12"
    ids = np.frombuffer(prompt.encode(), dtype=np.uint8).astype(np.int64)  # text prompts are their bytes, no BOS
    want = generate_recompute(server.model, GenerationRequest(ids, 16)).tolist()
    before_us = time.time_ns() // 1000
    call = stub.Generate(request(prompt, max_new_tokens=16), timeout=RPC_S)
    chunks = list(call)
    after_us = time.time_ns() // 1000
    assert [int(t) for c in chunks for t in unpack(c.tokens, "tokens", expect_dtype=common_pb2.INT32, expect_ndim=1)] == want
    assert [c.index for c in chunks] == list(range(16))
    assert [(c.finished, c.finish_reason) for c in chunks] == [(False, "")] * 15 + [(True, "length")]
    stamps = [c.emitted_unix_us for c in chunks]
    assert before_us <= stamps[0] and stamps == sorted(stamps) and stamps[-1] <= after_us
    metadata = dict(call.initial_metadata())
    assert int(metadata["recserve-active-tokens"]) >= 0 and 0.0 <= float(metadata["recserve-kv-occupancy"]) <= 1.0


# Factories, not requests: a header built at import (collection) time carries a deadline
# that has passed by the time the suite reaches this module.
BAD = [
    (lambda: request(""), "prompt = ''"),
    (lambda: request("hi", tokens=np.array([1, 2], np.int32)), "prompt = 'hi' is invalid together with prompt_tokens"),
    (lambda: request(tokens=np.array([7, 300], np.int32)), "prompt_tokens[1] = 300 is out of range"),
    (lambda: request(tokens=np.array([7, -2], np.int64)), "prompt_tokens[1] = -2 is out of range"),
    (lambda: request(tokens=np.array([1.0, 2.0], np.float32)), "prompt_tokens: dtype is FLOAT32"),
    (lambda: request("x" * 96), "prompt has 96 tokens, over the context limit"),
    (lambda: request("x", max_new_tokens=0), "max_new_tokens = 0 is invalid"),
    (lambda: request("x", max_new_tokens=-1), "max_new_tokens = -1 is invalid"),
    (lambda: request("x", max_new_tokens=CAP + 1), f"max_new_tokens = {CAP + 1} is invalid"),
    (lambda: request("x" * 60, max_new_tokens=40), "max_new_tokens = 40 is over the context limit"),
    (lambda: request("x", temperature=-1.0), "temperature = -1.0 is invalid"),
    (lambda: request("x", temperature=float("nan")), "temperature = nan is invalid"),
]


@pytest.mark.parametrize(("bad", "message"), BAD, ids=[m.split(" is")[0].split(":")[0] for _, m in BAD])
def test_bad_input_is_invalid_argument_naming_field_and_value(
    stub: generation_pb2_grpc.GenerationStub, bad: Callable[[], generation_pb2.GenerateRequest], message: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(bad(), timeout=RPC_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in (err.value.details() or "")
    # ... and the server keeps serving.
    assert [c.finish_reason for c in stub.Generate(request("ok", max_new_tokens=2), timeout=RPC_S)] == ["", "length"]


def test_a_cancelled_stream_frees_its_sequence(server: Server, stub: generation_pb2_grpc.GenerationStub) -> None:
    key = ("recserve_scheduler_cancelled_total", (("loop", "generation"),))
    before = scrape(server.metrics_url).get(key, 0.0)
    call = stub.Generate(request("a long one", max_new_tokens=CAP), timeout=RPC_S)
    first = next(call)
    call.cancel()
    assert not first.finished
    end = time.monotonic() + RPC_S
    while scrape(server.metrics_url).get(key, 0.0) < before + 1:  # the server saw the cancel (asynchronous)
        assert time.monotonic() < end, "the server never counted the cancelled stream"
        time.sleep(0.05)
    assert scrape(server.metrics_url)[key] == before + 1
    after = stub.Generate(request("next", max_new_tokens=1), timeout=RPC_S)
    assert [c.finished for c in after] == [True]
    # The cancelled sequence holds nothing: no tokens still owed, no KV block in use.
    assert dict(after.initial_metadata()) == {"recserve-active-tokens": "0", "recserve-kv-occupancy": "0.0000"}


def test_a_passed_deadline_is_deadline_exceeded(stub: generation_pb2_grpc.GenerationStub) -> None:
    late = request("x")
    late.header.deadline_unix_ms = int(time.time() * 1000) - 1000
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(late, timeout=RPC_S))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_random_bytes_never_crash_generate(server: Server) -> None:
    def check(channel: grpc.Channel) -> None:
        chunks = list(generation_pb2_grpc.GenerationStub(channel).Generate(request("still here", max_new_tokens=3), timeout=RPC_S))
        assert [c.finished for c in chunks] == [False, False, True]

    report = fuzz_server(server.address, cases_per_method=16, check=check, examples={GENERATE: [request("an example", max_new_tokens=4)]})
    assert report.methods[GENERATE].cases >= 16 and report.methods[GENERATE].malformed > 0


def test_rpc_metrics_count_each_stream_once(server: Server, stub: generation_pb2_grpc.GenerationStub) -> None:
    ok = ("recserve_rpc_requests_total", (("code", "OK"), ("method", "Generate"), ("service", "Generation")))
    bad = ("recserve_rpc_requests_total", (("code", "INVALID_ARGUMENT"), ("method", "Generate"), ("service", "Generation")))
    before = scrape(server.metrics_url)
    for _ in range(3):
        assert len(list(stub.Generate(request("count me", max_new_tokens=2), timeout=RPC_S))) == 2
    with pytest.raises(grpc.RpcError):
        list(stub.Generate(request(""), timeout=RPC_S))
    after = scrape(server.metrics_url)
    assert after[ok] - before.get(ok, 0.0) == 3 and after[bad] - before.get(bad, 0.0) == 1


def test_sigterm_finishes_the_stream_in_flight_then_exits_0(server: Server, stub: generation_pb2_grpc.GenerationStub) -> None:
    call = stub.Generate(request("last words", max_new_tokens=CAP), timeout=RPC_S)
    first = next(call)
    server.child.terminate()
    rest = list(call)  # the grace period lets it finish
    assert [first.index, *(c.index for c in rest)] == list(range(CAP)) and rest[-1].finish_reason == "length"
    assert server.child.stop() == 0, server.log.read_text()[-2000:]
