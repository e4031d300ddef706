"""The grpc.aio ``EmbeddingShard`` servicer: the async edge around :class:`ShardCore`.

Per RPC: apply the test fault hook (if enabled), refuse while the tiers are loading
(UNAVAILABLE), parse the header into one monotonic deadline, reject oversize requests on
the event loop (cheap, from byte lengths), then run the gathers on the thread-pool
executor — or, for a small lookup on a single-threaded server whose executor is idle,
right on the event loop: the thread hop (executor queue, cross-thread wake-up, GIL
hand-over) costs about as much as gathering a few thousand rows here, and with one
worker thread nothing runs in parallel anyway. Errors leave through
:func:`recserve.rpc.status.abort_with` only; the server keeps serving after any of them.
Request bytes that are not valid protobuf never reach this servicer: the server built
by :func:`recserve.rpc.server.make_server` answers them INVALID_ARGUMENT.

Lookup contract (enforced by :class:`ShardCore`): within one ``LookupRequest`` an id
appears at most once per (table, column slice), over all its ``TableLookup`` entries;
a duplicate is rejected with INVALID_ARGUMENT naming the table and the id (it would
otherwise be answered and counted twice). A pooled request carries at most
``shard_server.max_bags_per_rpc`` bags in all (INVALID_ARGUMENT naming the limit).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

import grpc

from embedding_server.fault import FaultInjector
from embedding_server.shard import ShardCore, count_ids
from embedding_server.stats import LatencyWindow, ShardCounters, cpu_seconds, rss_bytes
from recserve.errors import InternalError, RecserveError, Unavailable
from recserve.rpc.auth import AdminAuth
from recserve.rpc.deadline import context_from_header
from recserve.rpc.status import abort_with
from recserve.v1 import embedding_pb2, embedding_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")
# Lookups up to this many ids may run inline on a one-thread server (see module doc):
# a few ms of gathering at most, so health and ShardInfo are never held up for long.
INLINE_LOOKUP_IDS = 8192


class EmbeddingShardService(embedding_pb2_grpc.EmbeddingShardServicer):
    """Serves one shard. ``core`` is None until :meth:`set_ready` (tiers loaded)."""

    def __init__(
        self,
        *,
        shard_id: int,
        plan_version: int,
        plan_json: str,
        executor: Executor,
        faults: FaultInjector,
        admin: AdminAuth | None = None,
        inline_ids: int = 0,
    ) -> None:
        """``inline_ids``: lookups of at most this many ids run on the event loop while
        no executor job is in flight (0: always use the executor). Set it only for a
        one-thread executor: running inline only while the executor is idle keeps core
        calls serialised, so an inline lookup never waits on a table lock held by an
        executor job (which would block the event loop)."""
        self.shard_id = shard_id
        self.plan_version = plan_version
        self.plan_json = plan_json
        self.executor = executor
        self.faults = faults
        # Upsert's check (recserve.rpc.auth): default refuses every Upsert (no token, not insecure).
        self.admin = admin or AdminAuth("")
        self.core: ShardCore | None = None
        self.counters = ShardCounters()
        self.latency = LatencyWindow()
        self.inline_ids = inline_ids
        self._executor_jobs = 0  # core calls submitted to the executor and not finished
        # Why the deep check fails ("" = it passes): calls then answer UNAVAILABLE, so the
        # lookup clients' breakers take this replica out (recserve.rpc.health).
        self.not_serving = ""
        self.upserts_started = 0  # Upserts sent to the core: the deep check re-reads its rows after one
        self.instance_id = secrets.token_hex(8)  # this process's, in ShardInfo (deep checks' epochs)
        self._probe_request: embedding_pb2.LookupRequest | None = None
        self._probe_expected: list[bytes] | None = None
        self._probe_upserts = -1

    async def _on_executor(self, fn: Callable[..., T], *args: Any) -> T:
        # A job counts until the executor is done with it, not until its RPC is: a
        # cancelled RPC (client gone, deadline) stops awaiting a job that keeps running,
        # and an inline lookup must not then run beside it.
        loop = asyncio.get_running_loop()
        job = self.executor.submit(fn, *args)
        self._executor_jobs += 1
        job.add_done_callback(lambda _: self._job_done_threadsafe(loop))
        return await asyncio.wrap_future(job)

    def _job_done_threadsafe(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.call_soon_threadsafe(self._job_done)
        except RuntimeError:  # the loop is closed: nothing can run inline any more
            pass

    def _job_done(self) -> None:
        self._executor_jobs -= 1

    def set_ready(self, core: ShardCore) -> None:
        self.core = core

    def metrics_reading(self) -> dict[str, float]:
        """Rows served by tier and the core's storage counts, for ``/metrics``
        (:class:`recserve.metrics.collectors.ShardCollector`; read on the scrape thread)."""
        c, core = self.counters, self.core
        out = {"rows_hot": float(c.rows_served_hot), "rows_warm": float(c.rows_served_warm), "rows_cold": float(c.rows_served_cold)}
        out.update(core.storage_counts() if core is not None else {})
        return out

    def _ready(self) -> ShardCore:
        if self.core is None:
            raise Unavailable(f"shard {self.shard_id} is loading its tiers; retry shortly", retry_after_s=0.5)
        if self.not_serving:
            raise Unavailable(f"shard {self.shard_id} is NOT_SERVING: {self.not_serving}", retry_after_s=1.0)
        return self.core

    def set_not_serving(self, reason: str) -> None:
        """The deep check's verdict (recserve.rpc.health.DeepCheck's ``on_change``)."""
        self.not_serving = reason

    def set_probe(self, request: embedding_pb2.LookupRequest) -> None:
        """The fixed lookup the deep check runs: a few owned ids of every table."""
        self._probe_request = request

    async def deep_probe(self) -> None:
        """Run the fixed lookup on the executor, as a Lookup would, and compare its rows
        with those it answered before. The baseline is (re)taken on the first probe and
        after any Upsert (which may rightly change them); a table that is not loaded
        fails the lookup, a wedged executor never answers (DeepCheck's timeout)."""
        core, request = self.core, self._probe_request
        if core is None or request is None:
            raise Unavailable(f"shard {self.shard_id} has no core loaded")
        upserts = self.upserts_started
        outcome = await self._on_executor(core.lookup, request, time.monotonic() + 60.0)
        got = [t.rows.SerializeToString() + t.found.SerializeToString() for t in outcome.response.tables]  # the answer, not its stats
        if self._probe_expected is None or upserts != self._probe_upserts or self.upserts_started != upserts:
            self._probe_expected, self._probe_upserts = got, upserts
            return
        if got != self._probe_expected:
            tables = [t.table for t in request.tables]
            raise InternalError(f"shard {self.shard_id}: the fixed lookup of tables {tables} answered other rows than before (no upsert since)")

    async def _fail(self, context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
        self.counters.errors += 1
        if not isinstance(error, RecserveError):
            log.exception("shard %d: %s failed", self.shard_id, method, exc_info=error)
        await abort_with(context, error)

    async def Lookup(self, request: embedding_pb2.LookupRequest, context: grpc.aio.ServicerContext) -> embedding_pb2.LookupResponse:
        """Rows (or pooled partial sums) for every ``TableLookup``; see the module
        docstring for the contract (unique ids per table and slice, bag limit)."""
        started = time.perf_counter()
        c = self.counters
        c.rpcs += 1
        try:
            if self.faults.enabled:  # test-only hook: no coroutine per RPC when it is off
                await self.faults.before("Lookup", context)
            core = self.core
            if core is None or self.not_serving:
                core = self._ready()  # raises the UNAVAILABLE that says why
            deadline = context_from_header(request.header, context.time_remaining()).deadline
            n_ids = count_ids(request.tables)
            core.check_size(n_ids, "LookupRequest")
            if n_ids <= self.inline_ids and self._executor_jobs == 0:
                outcome = core.lookup(request, deadline)
            else:
                outcome = await self._on_executor(core.lookup, request, deadline)
        except Exception as exc:  # noqa: BLE001  (every failure is mapped to a status)
            await self._fail(context, "Lookup", exc)
            raise  # unreachable: abort_with raises
        c.ids_requested += outcome.ids
        c.add_served(outcome.served)
        c.rows_missing += outcome.missing
        c.rows_not_owned += outcome.not_owned
        self.latency.record(time.perf_counter() - started)
        return outcome.response

    async def Upsert(self, request: embedding_pb2.UpsertRequest, context: grpc.aio.ServicerContext) -> embedding_pb2.UpsertResponse:
        self.counters.rpcs += 1
        try:
            await self.faults.before("Upsert", context)
            self.admin.check(context.invocation_metadata(), f"shard {self.shard_id}: Upsert", request.admin_token)
            core = self._ready()
            context_from_header(request.header, context.time_remaining())
            core.check_size(count_ids(request.tables), "UpsertRequest")
            self.upserts_started += 1
            if self.faults.enabled:  # test-only: a "full disk" fails the store's write itself
                core.store.fail_writes = self.faults.store_write_error()
            written = await self._on_executor(core.upsert, request)
        except Exception as exc:  # noqa: BLE001
            await self._fail(context, "Upsert", exc)
            raise
        self.counters.upserts += written
        return embedding_pb2.UpsertResponse(rows_written=written, plan_version=self.plan_version)

    async def ShardInfo(self, request: embedding_pb2.ShardInfoRequest, context: grpc.aio.ServicerContext) -> embedding_pb2.ShardInfoResponse:
        c = self.counters
        p50, p99 = self.latency.percentiles_ms(50, 99)
        hits, misses = self.core.cache_counts() if self.core else (0, 0)
        return embedding_pb2.ShardInfoResponse(
            shard_id=self.shard_id,
            plan_version=self.plan_version,
            tables=self.core.tier_info() if self.core else [],
            rpcs=c.rpcs,
            ids_requested=c.ids_requested,
            rows_served_hot=c.rows_served_hot,
            rows_served_warm=c.rows_served_warm,
            rows_served_cold=c.rows_served_cold,
            rows_missing=c.rows_missing,
            rows_not_owned=c.rows_not_owned,
            row_cache_hits=hits,
            row_cache_misses=misses,
            row_cache_hit_rate=hits / (hits + misses) if hits + misses else 0.0,
            p50_ms=p50,
            p99_ms=p99,
            cpu_seconds=cpu_seconds(),
            rss_bytes=rss_bytes(),
            upserts=c.upserts,
            errors=c.errors,
            ready=self.core is not None,
            instance_id=self.instance_id,
        )

    async def GetPlan(self, request: embedding_pb2.GetPlanRequest, context: grpc.aio.ServicerContext) -> embedding_pb2.GetPlanResponse:
        versions = {name: self.core.model_versions.get(name, "") for name in self.core.tables} if self.core else {}
        return embedding_pb2.GetPlanResponse(plan_version=self.plan_version, plan_json=self.plan_json, table_model_versions=versions)
