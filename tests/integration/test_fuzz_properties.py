"""Bad input, property-based, against one real stack (issue 17, "Bad-input suites"), CI-sized.

One :func:`~tests.integration.gateway_world.gateway_world` for the module: 2 shards, a
ranker, the cascade, a generation replica and the gateway, every process with an admin
token. Every gRPC method of every service (EmbeddingShard, Ranking, Admin on the ranker
and on the cascade, Recommender, Generation) gets hypothesis-drawn requests
(:mod:`recserve.bench.fuzz_grpc`: random field values, hostile tensors, missing fields,
crossovers with good requests, past and far-future deadlines); the gateway gets
schemathesis cases from its ``/openapi.json`` plus random JSON, wrong types, oversize
bodies and bad UTF-8 (:mod:`recserve.bench.fuzz_http`). Each answer must be a clear
client error (DEADLINE_EXCEEDED for a deadline in the past); afterwards every process
is alive, has no more open fds or threads than before (beyond a small slack), and
answers good requests. The full-size run is ``recserve bench fuzz``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from recserve.bench.fuzz import check_good_requests, good_requests
from recserve.bench.fuzz_grpc import ResourceProbe
from recserve.bench.fuzz_http import fuzz_gateway
from recserve.v1 import admin_pb2, common_pb2
from recserve.v1.admin_pb2_grpc import AdminStub
from tests.grpc_fuzz import fuzz_properties
from tests.integration.gateway_world import GatewayWorld, gateway_world

pytestmark = pytest.mark.integration

TOKEN = "fuzz-admin-token"
GENERATION = """[generation]
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
max_new_tokens_cap = 16
stop_token = -1
"""
CASES = 12  # per gRPC method; `recserve bench fuzz` runs >= 10,000 per service
HTTP_CASES = 15  # per gateway operation, plus the hand-made hostile bodies
FD_SLACK = 6  # a per-request leak grows by about the number of cases (hundreds)
THREAD_SLACK = 4
SKIP = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")  # fuzzed by tests/grpc_fuzz.py's raw pass


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayWorld]:
    with gateway_world(tmp_path_factory.mktemp("fuzz"), extra=GENERATION, admin_token=TOKEN, generators=1) as world:
        yield world


def servers(gw: GatewayWorld) -> dict[str, tuple[str, int]]:
    """Process name -> (gRPC address, pid)."""
    assert gw.generation is not None
    out = {f"shard-{k}": (gw.shards.address(k), gw.shards.pid(k)) for k in range(gw.shards.num_shards)}
    out["ranker-0"] = (gw.rankers.address(0), gw.rankers.pid(0))
    out["cascade-0"] = (gw.cascade.address, gw.cascade.pid)
    out["generation-0"] = (gw.generation.address(0), gw.generation.pid(0))
    return out


def addresses(gw: GatewayWorld) -> dict[str, str]:
    return {name: address for name, (address, _) in servers(gw).items()}


def assert_good_requests_answered(gw: GatewayWorld) -> None:
    """Every good request, freshly stamped, answered OK by its server."""
    failures = check_good_requests(addresses(gw), gw.world.plan_path)
    assert not failures, failures


def test_every_grpc_method_answers_property_based_bad_input_with_client_errors_and_leaks_nothing(gw: GatewayWorld) -> None:
    procs = servers(gw)
    probe = ResourceProbe({name: pid for name, (_, pid) in procs.items()})
    examples = good_requests(gw.world.plan_path)
    # Warm-up: a few cases per method first, so lazily started pools are in the baseline.
    for address, _ in procs.values():
        fuzz_properties(address, cases_per_method=3, seed=1, examples=examples, admin_token=TOKEN, skip_services=SKIP)
    before = probe.sample()
    reports = {name: fuzz_properties(address, cases_per_method=CASES, seed=0, examples=examples, admin_token=TOKEN, skip_services=SKIP)
               for name, (address, _) in procs.items()}  # fmt: skip
    assert probe.dead() == []
    assert_good_requests_answered(gw)
    leaks = ResourceProbe.leaks(before, probe.sample(), fd_slack=FD_SLACK, thread_slack=THREAD_SLACK)
    assert not leaks, leaks
    violations = [v for r in reports.values() for v in r.violations]
    assert not violations, "\n".join(violations)
    reached = {path for r in reports.values() for path in r.methods}
    services = {path.split("/")[1] for path in reached}
    assert services == {f"recserve.v1.{s}" for s in ("EmbeddingShard", "Ranking", "Admin", "Recommender", "Generation")}, services
    assert {p for p in reached if p.startswith("/recserve.v1.Admin/")} == {f"/recserve.v1.Admin/{m}" for m in ("ReloadModels", "ModelStatus", "RefreshIndex", "AddItems")}
    for name, report in reports.items():
        for path, stats in report.methods.items():
            assert stats.cases >= CASES // 2, (name, path, stats.cases)  # hypothesis may stop early on a tiny message type only
    # The cases reached validation: some answers were client errors, not all OK.
    codes = {code for r in reports.values() for s in r.methods.values() for code in s.codes}
    assert {"INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "OK"} <= codes, codes


def test_the_gateway_answers_schemathesis_and_hostile_bodies_with_4xx_and_keeps_serving(gw: GatewayWorld) -> None:
    probe = ResourceProbe({"gateway": gw.gateway.pid})
    fuzz_gateway(gw.url, cases_per_operation=3, seed=1)  # warm-up
    before = probe.sample()
    report = fuzz_gateway(gw.url, cases_per_operation=HTTP_CASES, seed=0)
    assert probe.dead() == []
    assert not report.violations, "\n".join(report.violations)
    assert {"POST /v1/recommendations", "POST /v1/rank", "POST /v1/generate"} <= set(report.operations), report.operations
    assert report.hostile_cases >= 20 and report.cases > report.hostile_cases
    statuses = {s for op in report.operations.values() for s in op.statuses}
    assert 200 in statuses and (400 in statuses or 422 in statuses), statuses
    leaks = ResourceProbe.leaks(before, probe.sample(), fd_slack=FD_SLACK, thread_slack=THREAD_SLACK)
    assert not leaks, leaks
    assert_good_requests_answered(gw)


def test_admin_methods_refuse_an_expired_deadline_and_say_which_process_serves_them(gw: GatewayWorld) -> None:
    """Found by the fuzzer: ModelStatus (and the other Admin methods) answered a request
    whose header deadline had passed; the ranker's RefreshIndex and the cascade's
    ReloadModels answered "Unexpected <class 'NotImplementedError'>"."""
    expired = common_pb2.RequestHeader(deadline_unix_ms=int(time.time() * 1000) - 1_000)
    bearer = (("authorization", f"Bearer {TOKEN}"),)
    for address in (gw.rankers.address(0), gw.cascade.address):
        with grpc.insecure_channel(address) as channel:
            stub = AdminStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelStatus(admin_pb2.ModelStatusRequest(header=expired), timeout=10)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                stub.AddItems(admin_pb2.AddItemsRequest(header=expired), timeout=10, metadata=bearer)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
            assert stub.ModelStatus(admin_pb2.ModelStatusRequest(), timeout=10).model_version  # a live one is answered
    with grpc.insecure_channel(gw.rankers.address(0)) as channel:
        with pytest.raises(grpc.RpcError) as err:
            AdminStub(channel).RefreshIndex(admin_pb2.RefreshIndexRequest(), timeout=10, metadata=bearer)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert str(err.value.details()).startswith("Admin.RefreshIndex is served by the cascade"), err.value.details()
    with grpc.insecure_channel(gw.cascade.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            AdminStub(channel).ReloadModels(admin_pb2.ReloadModelsRequest(models_dir="/x"), timeout=10, metadata=bearer)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert str(err.value.details()).startswith("Admin.ReloadModels is served by the rankers"), err.value.details()
