"""recserve.metrics without sockets: the RPC meter's status codes, the scrape-time
collectors (summing live sources, keeping retired counters, gauges not carried over),
the scheduler's hooks on a real ServingLoop, the lookup client's new counters over the
fake fleet, the row cache's evictions, and the metrics-port rules.

Counters on the default registry are shared by the whole test process, so tests that
read them use names of their own (a method, a loop) or compare before / after."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import REGISTRY

from embedding_server.cache import RowCache
from recserve.config.spec import CascadeConfig, LookupConfig, RankerConfig, ShardServerConfig
from recserve.errors import ConfigError, ResourceExhausted
from recserve.lookup.client import LookupClient
from recserve.lookup.stats import LookupStats
from recserve.metrics.collectors import LookupCollector, SchedulerCollector, ShardCollector, Sources
from recserve.metrics.interceptor import MetricsInterceptor, metered_handler, split_method
from recserve.metrics.serve import start_and_record, start_metrics_server
from recserve.scheduling import FeatureParallelConfig, FeatureParallelPolicy, Priority, WorkItem
from recserve.scheduling.core import Scheduler
from recserve.scheduling.loop import ServingLoop
from recserve.scheduling.policy_base import Policy
from recserve.scheduling.types import Batch, Done
from recserve.sharding.plan import Tier
from tests.unit.test_lookup_client import item_kjt, run
from tests.unit.test_lookup_fakes import FakeShards, make_config, make_plan, make_weights, tier_ids


def value(name: str, labels: dict[str, str] | None = None, registry: CollectorRegistry = REGISTRY) -> float:
    """A sample's value (0 when absent: a child not created yet)."""
    got = registry.get_sample_value(name, labels or {})
    return 0.0 if got is None else got


# -- the RPC meter -----------------------------------------------------------------------


class FakeContext:
    """What the meter reads of a grpc.aio servicer context."""

    def __init__(self, *, remaining: float | None = None) -> None:
        self._code: grpc.StatusCode | None = None
        self.remaining = remaining

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def time_remaining(self) -> float | None:
        return self.remaining

    def abort(self, code: grpc.StatusCode) -> None:  # grpc sets the code, then raises AbortError
        self._code = code
        raise RuntimeError(f"aborted with {code.name}")


def call_metered(method: str, behavior: Callable[[Any, FakeContext], Any], context: FakeContext) -> Any:
    handler: Any = metered_handler(grpc.unary_unary_rpc_method_handler(behavior), method)
    return asyncio.run(handler.unary_unary(b"request", context))


def test_split_method_gives_the_services_short_name() -> None:
    assert split_method("/recserve.v1.Ranking/Rank") == ("Ranking", "Rank")
    assert split_method("/grpc.health.v1.Health/Check") == ("Health", "Check")


@pytest.mark.parametrize(
    "case, code",
    [("ok", "OK"), ("abort", "INVALID_ARGUMENT"), ("set_code", "NOT_FOUND"), ("raise", "UNKNOWN"), ("deadline", "DEADLINE_EXCEEDED"), ("cancel", "CANCELLED")],
)  # fmt: skip
def test_every_outcome_is_counted_under_the_status_the_caller_sees(case: str, code: str) -> None:
    method = f"/test.v1.Meter/{case.title()}"

    async def behavior(request: Any, context: FakeContext) -> str:
        if case == "abort":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT)
        if case == "set_code":
            context._code = grpc.StatusCode.NOT_FOUND  # context.set_code without an abort
        if case == "raise":
            raise ValueError("a servicer bug")
        if case in ("deadline", "cancel"):
            raise asyncio.CancelledError  # grpc cancels the call's task under the servicer
        return "response"

    context = FakeContext(remaining=0.0 if case == "deadline" else (5.0 if case == "cancel" else None))
    if case == "ok" or case == "set_code":
        assert call_metered(method, behavior, context) == "response"
    else:
        with pytest.raises((RuntimeError, ValueError, asyncio.CancelledError)):
            call_metered(method, behavior, context)
    labels = {"service": "Meter", "method": case.title()}
    assert value("recserve_rpc_requests_total", {**labels, "code": code}) == 1.0
    assert value("recserve_rpc_latency_seconds_count", labels) == 1.0
    others = [s for f in text_string_to_metric_families(generate_latest().decode()) if f.name == "recserve_rpc_requests" for s in f.samples
              if s.labels.get("service") == "Meter" and s.labels.get("method") == case.title() and s.labels["code"] != code]  # fmt: skip
    assert others == []


def test_health_and_reflection_are_not_metered_and_sync_handlers_are_left_alone() -> None:
    async def behavior(request: Any, context: Any) -> None:
        return None

    handler = grpc.unary_unary_rpc_method_handler(behavior)
    assert metered_handler(handler, "/grpc.health.v1.Health/Check") is handler
    assert metered_handler(handler, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") is handler
    sync = grpc.unary_unary_rpc_method_handler(lambda request, context: None)
    assert metered_handler(sync, "/test.v1.Meter/Sync") is sync
    assert metered_handler(handler, "/test.v1.Meter/Async") is not handler


def test_the_interceptor_wraps_each_method_once_and_passes_unknown_methods_through() -> None:
    async def behavior(request: Any, context: Any) -> str:
        return "r"

    handler = grpc.unary_unary_rpc_method_handler(behavior)

    class Details:
        def __init__(self, method: str) -> None:
            self.method = method

    async def continuation(details: Any) -> grpc.RpcMethodHandler | None:
        return None if details.method.endswith("/Missing") else handler

    interceptor = MetricsInterceptor()

    async def go() -> tuple[Any, Any, Any]:
        cont = cast(Any, continuation)
        first = await interceptor.intercept_service(cont, cast(Any, Details("/test.v1.Meter/Twice")))
        second = await interceptor.intercept_service(cont, cast(Any, Details("/test.v1.Meter/Twice")))
        missing = await interceptor.intercept_service(cont, cast(Any, Details("/test.v1.Meter/Missing")))
        return first, second, missing

    first, second, missing = asyncio.run(go())
    assert first is second and first is not handler and missing is None
    asyncio.run(first.unary_unary(b"", FakeContext()))
    assert value("recserve_rpc_requests_total", {"service": "Meter", "method": "Twice", "code": "OK"}) == 1.0


# -- collectors --------------------------------------------------------------------------


def test_sources_sum_live_readings_and_keep_the_counters_of_retired_ones() -> None:
    sources = Sources(gauges=("depth",))
    a, b = {"n": 3.0, "depth": 2.0}, {"n": 4.0, "depth": 1.0}
    key_a, key_b = object(), object()
    assert sources.totals() == {}
    sources.track(key_a, "x", lambda: a)
    sources.track(key_b, "x", lambda: b)
    assert sources.totals() == {"x": {"n": 7.0, "depth": 3.0}}
    a["n"] = 5.0
    sources.retire(key_a)
    sources.retire(key_a)  # twice: ignored, not counted again
    a["n"] = 100.0  # a retired source is no longer read
    assert sources.totals() == {"x": {"n": 9.0, "depth": 1.0}}  # its gauge left with it
    sources.retire(key_b)
    assert sources.totals() == {"x": {"n": 9.0}}


def test_the_lookup_collector_exports_the_stats_and_stays_monotonic_across_a_reload() -> None:
    registry = CollectorRegistry()
    collector = LookupCollector()
    registry.register(collector)
    assert "recserve_lookup" not in generate_latest(registry).decode()  # nothing tracked: nothing exported
    old = LookupStats(windows=2, ids_requested=30, ids_unique=10, rpcs_primary=4, rpcs_hedge=1, ids_sent=12, near_cache_lookups=30, near_cache_hits=9)
    collector.track(old)
    assert value("recserve_lookup_windows_total", registry=registry) == 2
    assert value("recserve_lookup_rpcs_total", {"kind": "hedge"}, registry) == 1
    assert value("recserve_lookup_rpcs_total", {"kind": "primary"}, registry) == 4
    new = LookupStats(windows=1, ids_requested=5, ids_unique=5, rpcs_primary=2, ids_sent=5)
    collector.track(new)  # a reload: the new client starts before the old one closes
    collector.retire(old)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    total = {name: families[name].samples[0].value for name in ("recserve_lookup_windows", "recserve_lookup_ids_requested",
             "recserve_lookup_ids_unique", "recserve_lookup_ids_sent", "recserve_lookup_near_cache_hits", "recserve_lookup_near_cache_lookups")}  # fmt: skip
    assert total == {"recserve_lookup_windows": 3, "recserve_lookup_ids_requested": 35, "recserve_lookup_ids_unique": 15,
                     "recserve_lookup_ids_sent": 17, "recserve_lookup_near_cache_hits": 9, "recserve_lookup_near_cache_lookups": 30}  # fmt: skip
    assert all(families[name].type == "counter" for name in total)


def test_the_shard_and_scheduler_collectors_label_their_samples() -> None:
    registry = CollectorRegistry()
    shard, sched = ShardCollector(), SchedulerCollector()
    registry.register(shard)
    registry.register(sched)
    reading = {"rows_hot": 5.0, "rows_warm": 3.0, "rows_cold": 2.0, "row_cache_hits": 1.0, "row_cache_misses": 1.0, "row_cache_evictions": 0.0, "rocksdb_reads": 1.0}
    shard.track("shard", lambda: reading)
    sched.track("a", "rank-dlrm", lambda: {"queue_depth": 2.0, "cancelled": 1.0, "expired": 0.0, "shed": 3.0})
    sched.track("b", "lookup", lambda: {"queue_depth": 0.0, "cancelled": 0.0, "expired": 4.0})
    assert [value("recserve_shard_rows_total", {"tier": t}, registry) for t in ("hot", "warm", "cold")] == [5.0, 3.0, 2.0]
    assert value("recserve_shard_rocksdb_reads_total", registry=registry) == 1.0
    assert value("recserve_scheduler_queue_depth", {"loop": "rank-dlrm"}, registry) == 2.0
    assert value("recserve_scheduler_cancelled_total", {"loop": "rank-dlrm"}, registry) == 1.0
    assert value("recserve_scheduler_expired_total", {"loop": "lookup"}, registry) == 4.0
    assert value("recserve_scheduler_shed_total", {"loop": "rank-dlrm"}, registry) == 3.0


# -- the scheduler's hooks ---------------------------------------------------------------


class TakeAll(Policy):
    """Every queued item in one batch, at once."""

    def select(self, view: Any, now: float) -> None:
        while view.peek() is not None:
            view.take()

    def ready_at(self, view: Any, now: float) -> float | None:
        return now if view.peek() is not None else None


def test_a_serving_loop_exports_batch_sizes_queue_waits_depth_and_cancellations() -> None:
    name = "test-metrics-loop"
    labels = {"loop": name}
    gate: asyncio.Event | None = None

    async def runner(batch: Batch) -> list[Any]:
        assert gate is not None
        await gate.wait()
        return [Done(h.item.payload) for h in batch.handles]

    async def go() -> None:
        nonlocal gate
        gate = asyncio.Event()
        loop = ServingLoop(Scheduler(TakeAll()), runner, max_inflight=1, name=name)
        loop.start()
        first = loop.submit_nowait("a")
        await asyncio.sleep(0)  # the driver forms batch 1 (one item) and runs it: the slot is busy
        queued = [loop.submit_nowait(x) for x in "bcd"]
        await asyncio.sleep(0)
        assert value("recserve_scheduler_queue_depth", labels) == 3.0
        queued[0].cancel()  # the caller gave up while it waited
        assert value("recserve_scheduler_queue_depth", labels) == 2.0
        gate.set()
        assert await first == "a" and await asyncio.gather(*queued[1:]) == ["c", "d"]
        await loop.aclose()

    asyncio.run(go())
    assert value("recserve_scheduler_cancelled_total", labels) == 1.0  # kept after aclose
    assert value("recserve_scheduler_expired_total", labels) == 0.0
    assert value("recserve_scheduler_batch_size_count", labels) == 2.0  # [a], then [c, d]
    assert value("recserve_scheduler_batch_size_sum", labels) == 3.0
    assert value("recserve_scheduler_queue_wait_seconds_count", labels) == 3.0  # one per item taken


def test_a_shed_request_moves_the_scraped_shed_counter_of_its_loop() -> None:
    """Issue 17: a request refused at admission (slack below queue wait + service) counts
    in ``recserve_scheduler_shed_total{loop=...}``, on a real ServingLoop and scrape."""
    name = "test-metrics-shed-loop"
    labels = {"loop": name}
    before = value("recserve_scheduler_shed_total", labels)

    async def runner(batch: Batch) -> list[Any]:
        return [Done(None) for _ in batch.handles]

    async def go() -> None:
        policy = FeatureParallelPolicy(FeatureParallelConfig(window_ms=0.0, max_cost=1.0, dispatch_margin_ms=0.0))
        loop = ServingLoop(Scheduler(policy), runner, max_inflight=1, name=name, clock=lambda: 0.0)
        loop.start()
        try:
            sched = loop.scheduler
            for _ in range(sched.admission.config.shed_after_batches):  # a warm estimate: 10 ms per batch
                sched.service.observe(1.0, 0.010)
            for i in range(10):  # 10 batches ahead, straight into the core: ~100 ms of queue wait
                sched.add(WorkItem(f"q{i}", "t", Priority.STANDARD, 10.0, 1.0, payload=None), 0.0)
            assert value("recserve_scheduler_shed_total", labels) == before  # queued, nothing shed yet
            with pytest.raises(ResourceExhausted):
                loop.submit_nowait("tight", deadline=0.02)  # 20 ms of slack < 110 ms
            assert value("recserve_scheduler_shed_total", labels) == before + 1.0
        finally:
            await loop.aclose(drain=False)

    asyncio.run(go())
    assert value("recserve_scheduler_shed_total", labels) == before + 1.0  # kept after aclose


# -- the lookup client's new counters ------------------------------------------------------


def test_the_lookup_client_counts_ids_sent_and_near_cache_use_and_exports_them() -> None:
    plan, _ = make_plan()
    fake = FakeShards(plan, make_weights())
    client = LookupClient(make_config(lookup=LookupConfig(near_cache_rows=1000, near_cache_staleness_ms=10_000)), plan, fake)
    hot = tier_ids(plan, "item", Tier.HOT)[:10]
    cold = tier_ids(plan, "item", Tier.COLD)[:5]
    before = {n: value(f"recserve_lookup_{n}_total") for n in ("ids_sent", "near_cache_hits", "near_cache_lookups", "windows")}

    async def body() -> None:
        await client.lookup(item_kjt(np.concatenate([hot, hot[:2]])), pooled=False, timeout_s=1)
        await client.lookup(item_kjt(np.concatenate([hot, cold])), pooled=False, timeout_s=1)

    run(client, body)
    st = client.stats
    assert st.ids_sent == sum(c.n_ids for c in fake.calls) > 0
    # Window 1: 12 lookups ask the cache, all miss; window 2: the 10 hot ones hit, 5 cold miss.
    assert (st.near_cache_lookups, st.near_cache_hits) == (12 + 15, 10)
    after = {n: value(f"recserve_lookup_{n}_total") for n in before}
    assert {n: after[n] - before[n] for n in before} == {"ids_sent": st.ids_sent, "near_cache_hits": 10, "near_cache_lookups": 27, "windows": st.windows}


# -- the shard's row cache -------------------------------------------------------------------


def test_the_row_cache_counts_rows_it_evicts_not_rows_invalidated() -> None:
    cache = RowCache(id_space=1000, width=4, capacity_bytes=16 * (4 * 4 + 16))  # 16 slots
    rows = np.ones((16, 4), np.float32)
    cache.put(np.arange(16), rows)
    cache.invalidate(np.arange(2))
    assert cache.evictions == 0
    # 20 new rows, beyond capacity: the last 16 are kept, into 2 free slots + 14 evicted.
    cache.put(np.arange(100, 120), np.ones((20, 4), np.float32))
    assert cache.size == 16 and cache.evictions == 14  # every row left of the first fill made room
    assert not cache.get(np.arange(2, 16))[1].any()


# -- metrics ports -----------------------------------------------------------------------------


def test_metrics_ports_are_validated_where_configured() -> None:
    for make in (lambda p: ShardServerConfig(metrics_port=p), lambda p: RankerConfig(metrics_port=p), lambda p: CascadeConfig(metrics_port=p)):
        assert make(-1) is not None and make(0) is not None and make(9100) is not None
        with pytest.raises(ConfigError, match="metrics_port = -2"):
            make(-2)
        with pytest.raises(ConfigError, match="metrics_port = 70000"):
            make(70000)


def test_no_metrics_server_starts_for_port_minus_one(tmp_path: Any) -> None:
    assert start_metrics_server("127.0.0.1", -1) == -1
    assert start_and_record("127.0.0.1", -1, str(tmp_path / "metrics.port")) == -1
    assert not (tmp_path / "metrics.port").exists()  # nothing bound, nothing to read
