"""Liveness, readiness and the deep check (issue 17, recserve/rpc/health.py) on real
in-process grpc.aio servers hosting the shard servicer over a fake core:

- a wedged executor: the deep check's fixed lookup gets no answer in time, readiness
  turns NOT_SERVING (liveness stays SERVING), calls answer UNAVAILABLE, and a router
  over two replicas stops sending to it; unwedged, it is SERVING again;
- an unloaded table (the lookup fails) or other rows than before (no upsert since)
  fail the check; an upsert re-takes the baseline;
- expected values (issue 17): a baseline is taken once its epoch holds still, and a
  differing answer fails only under the same epoch; the ranker's fixed Rank compares
  scores (rtol 1e-4; a reload re-takes it), the cascade's fixed Recommend item ids (an
  index refresh re-takes it), both over fake cores; a real generation replica's fixed
  greedy decode fails on a wedged executor or other weights (NOT_SERVING, liveness
  SERVING, Generate UNAVAILABLE) and recovers."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cascade.server import recommend_baseline
from embedding_server.fault import FaultInjector
from embedding_server.server import SERVICE_NAME
from embedding_server.service import EmbeddingShardService
from embedding_server.shard import LookupOutcome
from generation.server import GENERATION_SERVICE, GenerationServicer, decode_baseline
from generation.service import GenerationCore, load_model
from ranker.server import rank_baseline
from ranker.service import Answer
from recserve.config.spec import GenerationServiceConfig
from recserve.errors import ConfigError, InternalError, InvalidArgument, ResourceExhausted, Unauthenticated
from recserve.routing import Router, RoutingConfig
from recserve.rpc.deadline import make_header
from recserve.rpc.health import DEEP_CHECK_INTERVAL_ENV, LIVENESS_SERVICE, Baseline, DeepCheck, DeepCheckConfig
from recserve.rpc.server import add_health_and_reflection, make_server
from recserve.rpc.serving import Slot
from recserve.rpc.tensors import pack
from recserve.v1 import embedding_pb2, embedding_pb2_grpc, generation_pb2, generation_pb2_grpc

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


# -- expected values: Baseline (recserve/rpc/health.py) ----------------------------------


class Answers:
    """A probe's answers and epochs, set by the test (None = no verdict / unreadable)."""

    def __init__(self) -> None:
        self.answer: int | None = 1
        self.epoch: object = "e0"
        self.epoch_reads = 0

    async def get(self) -> int | None:
        return self.answer

    async def read_epoch(self) -> object:
        self.epoch_reads += 1
        return self.epoch


def differs(want: int, got: int) -> str:
    return "" if want == got else f"{got} != {want}"


def test_a_baseline_is_taken_once_its_epoch_holds_still_and_a_change_fails_only_under_the_same_epoch() -> None:
    async def main() -> None:
        a = Answers()
        base = Baseline(a.get, differs, epoch=a.read_epoch, what="probe")
        await base()  # the first epoch read: not yet seen twice
        assert base.expected is None
        a.epoch = "e1"  # it moved during the next answer: still no baseline
        await base()
        assert base.expected is None
        await base()  # e1 again: the answer is the baseline
        assert (base.expected, base.expected_epoch) == (1, "e1")
        reads = a.epoch_reads
        await base()  # the same answer: no epoch read
        assert a.epoch_reads == reads
        a.answer = 2  # another answer, nothing moved: wrong
        with pytest.raises(InternalError, match="2 != 1"):
            await base()
        a.answer = None  # degraded / shed: no verdict
        await base()
        a.answer, a.epoch = 2, "e2"  # an upsert or a reload moved the epoch: re-taken, not failed
        await base()
        assert base.expected is None and base.retaken == 1
        await base()
        assert (base.expected, base.expected_epoch) == (2, "e2")
        a.answer, a.epoch = 3, None  # the epoch cannot be read: no verdict
        await base()
        assert base.expected == 2

    asyncio.run(main())


def test_the_deep_check_interval_comes_from_the_environment_and_a_bad_one_is_refused() -> None:
    assert DeepCheckConfig.from_env({}) == DeepCheckConfig()
    assert DeepCheckConfig.from_env({DEEP_CHECK_INTERVAL_ENV: "3600"}).interval_s == 3600.0
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ConfigError, match=f"RECSERVE_DEEP_CHECK_INTERVAL_S = '{bad}' is invalid"):
            DeepCheckConfig.from_env({DEEP_CHECK_INTERVAL_ENV: bad})


# -- the ranker's fixed Rank (ranker/server.py rank_baseline) -----------------------------


class FakeRankingCore:
    """What rank_baseline reads of a RankingCore: deep_probe's answers by model."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(models=("dlrm", "l3"))
        self.reloads = 0
        self.current = SimpleNamespace(version="v1", export=SimpleNamespace(arrays=SimpleNamespace(num_items=100)))
        self.scores = np.array([0.5, 0.1, 0.9, 0.3], np.float32)  # by candidate id 0..3
        self.degraded: tuple[str, ...] = ()
        self.shed: set[str] = set()

    async def deep_probe(self) -> dict[str, Answer]:
        order = np.argsort(-self.scores, kind="stable")
        return {m: Answer(m, self.current.version, order.astype(np.int64), self.scores[order], None, 0, self.degraded)
                for m in self.config.models if m not in self.shed}  # fmt: skip


def test_the_rankers_deep_check_compares_scores_with_its_baseline_and_a_reload_retakes_it() -> None:
    async def main() -> None:
        core = FakeRankingCore()
        base = rank_baseline(core, ())  # type: ignore[arg-type]  # no shards: their upsert counts are ()
        await base()
        await base()  # the epoch held still over one check: baseline taken
        assert base.expected is not None and np.array_equal(base.expected["dlrm"], core.scores)
        core.scores = core.scores * np.float32(1 + 2e-5)  # last-bit rounding of another batch size: the same
        await base()
        core.scores = np.array([0.5, 0.1, 0.9, 0.35], np.float32)  # item 3 scored differently, no reload, no upsert
        with pytest.raises(InternalError, match=r"model 'dlrm' scored item 3 0\.35, the baseline 0\.3"):
            await base()
        core.degraded = ("lookup_missing",)  # a degraded answer is no verdict
        await base()
        core.degraded, core.shed = (), {"l3"}  # nor is a shed one
        await base()
        core.shed = set()
        core.reloads, core.current.version = 1, "v2"  # ReloadModels: the new set's answer becomes the baseline
        await base()
        await base()
        assert base.expected is not None and np.array_equal(base.expected["l3"], core.scores)
        await base()  # and it passes

    asyncio.run(main())


# -- the cascade's fixed Recommend (cascade/server.py recommend_baseline) ------------------


class FakeCascadeCore:
    """What recommend_baseline reads of a CascadeCore."""

    def __init__(self) -> None:
        self.index_version = "m/a.0"
        self.view = SimpleNamespace(num_items=100)
        self.ids = np.array([7, 3, 9, 1], np.int64)
        self.scores = np.array([0.9, 0.8, 0.8 * (1 + 1e-6), 0.1], np.float32)
        self.degraded = False
        self.shed = False
        self.refused = False  # every tenant keyed: the rankers refuse a key-less Rank
        self.queries: list[Any] = []

    def query(self, user_id: int, k: int, exclude: np.ndarray, recent: np.ndarray, **kw: Any) -> Any:
        self.queries.append((user_id, k, kw["tenant"]))
        return SimpleNamespace(user_id=user_id)

    async def recommend(self, query: Any) -> Any:
        if self.shed:
            raise ResourceExhausted("shed", retry_after_s=0.1)
        if self.refused:
            raise Unauthenticated("a request without a tenant needs its API key")
        return SimpleNamespace(item_ids=self.ids.copy(), scores=self.scores.copy(), degraded=self.degraded)


def test_the_cascades_deep_check_compares_item_ids_and_an_index_refresh_retakes_it_degraded_shed_or_refused_is_no_verdict() -> None:
    async def main() -> None:
        core = FakeCascadeCore()
        process = SimpleNamespace(ranker_addresses=(), shard_addresses=(), cluster=SimpleNamespace(tls=None))
        base = recommend_baseline(core, process)  # type: ignore[arg-type]
        await base()
        await base()
        assert base.expected is not None and base.expected[0].tolist() == [7, 3, 9, 1]
        assert core.queries[0] == (0, 0, "")  # a known user, the default k, the key-less tenant
        core.ids = np.array([7, 9, 3, 1], np.int64)  # the near-tied 3 and 9 swapped: the same answer
        core.scores = np.array([0.9, 0.8 * (1 + 1e-6), 0.8, 0.1], np.float32)
        await base()
        core.ids = np.array([7, 3, 9, 2], np.int64)  # another item, same index, rankers and rows
        with pytest.raises(InternalError, match="first difference at rank 3"):
            await base()
        core.degraded = True  # no verdict
        await base()
        core.degraded, core.shed = False, True
        await base()
        core.shed, core.refused = False, True
        await base()
        core.refused = False
        core.index_version = "m/b.0"  # RefreshIndex: re-taken
        await base()
        assert base.retaken == 1
        await base()
        assert base.expected is not None and base.expected[0].tolist() == [7, 3, 9, 2]

    asyncio.run(main())


# -- a generation replica's fixed greedy decode (generation/server.py decode_baseline) ------


GEN = GenerationServiceConfig(
    n_layers=1, n_heads=2, dim=32, max_seq_len=128, device="cpu", num_blocks=32, block_tokens=8, max_seqs=4,
    token_budget=64, prefill_chunk_tokens=32, max_new_tokens_cap=16, stop_token=-1, threads=1,
)  # fmt: skip


class GenerationReplica:
    """A real Generation server (its core on a one-thread executor the test can wedge),
    with health and the deep check (driven by hand: ``check_once``)."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(1)
        self.core = GenerationCore(GEN, load_model(GEN), executor=self.executor)
        self.slot: Slot[GenerationCore] = Slot("generation model")
        self.server: Any = None
        self.deep: DeepCheck | None = None
        self.address = ""

    async def start(self) -> None:
        self.server = make_server(max_message_bytes=1 << 20)
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(self.slot), self.server)
        health = await add_health_and_reflection(self.server, [GENERATION_SERVICE])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        self.core.start()
        self.slot.value = self.core
        for name in ("", GENERATION_SERVICE):
            await health.set(name, SERVING)
        self.deep = DeepCheck(health, [GENERATION_SERVICE], decode_baseline(self.core), config=FAST, on_change=self.slot.set_not_serving, what="generation")

    async def generate(self) -> grpc.StatusCode:
        request = generation_pb2.GenerateRequest(prompt="hello", max_new_tokens=2)
        request.header.CopyFrom(make_header(timeout_s=10))
        async with grpc.aio.insecure_channel(self.address) as ch:
            try:
                async for _ in generation_pb2_grpc.GenerationStub(ch).Generate(request, timeout=10):
                    pass
            except grpc.aio.AioRpcError as exc:
                assert "NOT_SERVING" in (exc.details() or "")
                return exc.code()
        return grpc.StatusCode.OK

    async def aclose(self) -> None:
        assert self.deep is not None
        await self.deep.aclose()
        await self.server.stop(None)
        await self.core.aclose()
        self.executor.shutdown(wait=False)


def test_the_generation_deep_check_fails_on_a_wedged_executor_or_other_tokens_and_recovers() -> None:
    async def main() -> None:
        r = GenerationReplica()
        await r.start()
        unwedge = threading.Event()
        try:
            deep = r.deep
            assert deep is not None
            assert await deep.check_once() == ""  # the baseline: the first decode
            assert await deep.check_once() == ""  # repeated (its prompt block now from the prefix cache)
            r.executor.submit(unwedge.wait)  # every decode step now waits behind this
            assert "no answer within" in await deep.check_once()
            assert await check(r.address, "") == NOT_SERVING and await check(r.address, GENERATION_SERVICE) == NOT_SERVING
            assert await check(r.address, LIVENESS_SERVICE) == SERVING  # the process lives: no restart
            assert await r.generate() == grpc.StatusCode.UNAVAILABLE  # the router's breakers take it out
            unwedge.set()
            assert await deep.check_once() == "" and await check(r.address, "") == SERVING
            assert await r.generate() == grpc.StatusCode.OK
            # Other weights (a corrupted load): steer every greedy step to one token.
            model = r.core.engine.model
            base = deep._probe
            assert isinstance(base, Baseline) and base.expected is not None
            token = next(t for t in range(1, 200) if t not in base.expected)
            saved = model.ln_f.bias.detach().clone()
            with torch.no_grad():
                model.ln_f.bias.copy_(model.tok.weight[token] * 100.0)
            reason = await deep.check_once()
            assert "answered differently from its baseline" in reason and f"tokens {[token] * len(base.expected)}" in reason
            assert await check(r.address, "") == NOT_SERVING and await check(r.address, LIVENESS_SERVICE) == SERVING
            with torch.no_grad():
                model.ln_f.bias.copy_(saved)
            assert await deep.check_once() == "" and await check(r.address, GENERATION_SERVICE) == SERVING
            assert (deep.checks, deep.failures) == (6, 2)
        finally:
            unwedge.set()
            await r.aclose()

    asyncio.run(main())
