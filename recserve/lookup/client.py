"""The feature-parallel lookup client (docs/architecture.md §5; reference §10.6.6).

Callers ``await client.lookup(kjt, pooled=...)``; the client validates each caller on
its own, then queues it on a :class:`~recserve.scheduling.ServingLoop` driven by a
:class:`~recserve.scheduling.FeatureParallelPolicy`. While the client is busy a window
closes at dispatch (``lookup.close_at_dispatch``: it collects every caller that arrives
while the previous window's RPCs are in flight, and closes when that window is done);
when idle, after the small ``window_ms`` timer (or earlier: ``target_ids`` waiting, or
the tightest caller's slack only just covering the expected window time); the window's
runner (:class:`~recserve.lookup.fanout.WindowRun`) dedups, routes, fans out one RPC
per shard, hedges and resolves every caller by its own deadline, each through the
scheduler (``ServingLoop.resolve_done``) as soon as its rows are in: the scheduler's item
future is the one result channel. Up to ``max_inflight_batches`` windows run at once.

Example::

    client = LookupClient.connect(LookupClientConfig.from_cluster(cfg), plan, addresses)
    await client.start()
    result = await client.lookup(kjt, pooled=True, timeout_s=0.05)
    result.pooled["user_history"]          # [B, D] fp32
    await client.aclose()
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from recserve.errors import FailedPrecondition, InternalError, InvalidArgument, RecserveError
from recserve.lookup.config import LookupClientConfig
from recserve.lookup.fanout import WindowRun
from recserve.lookup.runtime import Runtime
from recserve.routing import Breakers, HedgeBudget, LatencyTracker
from recserve.lookup.near_cache import NearCache
from recserve.lookup.stats import LookupStats
from recserve.metrics.collectors import LOOKUP as LOOKUP_METRICS
from recserve.lookup.transport import GrpcShardTransport, ShardTransport
from recserve.lookup.types import LookupResult
from recserve.lookup.upsert import send_upsert
from recserve.lookup.validate import validate_features
from recserve.rpc.deadline import context_from_header, make_header
from recserve.scheduling import Batch, Failed, FeatureParallelConfig, FeatureParallelPolicy, Handle, Priority, Scheduler, ServingLoop
from recserve.scheduling.admission import AdmissionConfig
from recserve.sharding.plan import ShardingPlan
from recserve.v1 import common_pb2

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

log = logging.getLogger(__name__)
_STANDARD: Priority | str = Priority.STANDARD


class LookupClient:
    """Batches, dedups and fans out embedding lookups of many concurrent callers.

    ``transport`` reaches the shards (inject a fake in unit tests); ``clock`` is the
    monotonic clock deadlines are expressed in; ``executor`` runs big windows' CPU work
    (a 1-thread pool by default).
    """

    def __init__(
        self,
        config: LookupClientConfig,
        plan: ShardingPlan,
        transport: ShardTransport,
        *,
        clock: Callable[[], float] = time.monotonic,
        executor: Executor | None = None,
        admission: AdmissionConfig = AdmissionConfig(),
    ) -> None:
        self.config = config
        self.transport = transport
        self._check_plan(plan)
        self._clock = clock
        self._own_executor = executor is None
        self._executor = executor
        lk = config.lookup
        self.runtime = Runtime(
            config=config,
            transport=transport,
            plan=plan,
            # Until a shard has a few measured replies its hedge delay is a conservative 50 ms:
            # first calls pay lazy set-up on both sides and should not burn the hedge budget.
            tracker=LatencyTracker(plan.num_shards, percentile=lk.hedge_percentile, min_delay_s=config.hedge_min_ms / 1e3, default_delay_s=0.05),
            budget=HedgeBudget(lk.hedge_budget, config.hedge_burst),
            breakers=Breakers(plan.num_shards, failures=config.breaker_failures, open_s=config.breaker_open_ms / 1e3),
            inflight_ids=np.zeros(plan.num_shards, dtype=np.int64),
            near_cache=self._make_near_cache(plan),
            stats=LookupStats(),
            on_plan_version=self._on_plan_version,
            clock=clock,
        )
        self._table_of_feature = config.table_of_feature()
        self._table_rows = {t.name: t.rows for t in config.tables}
        # Adaptive window min(max_window_ms, target_ids / arrival rate) (reference
        # §10.6.8), closed early at target_ids waiting or when the tightest caller's slack
        # only just covers the measured window time; window_ms == max_window_ms fixes it.
        policy = FeatureParallelPolicy(
            FeatureParallelConfig(
                window_ms=lk.window_ms,
                max_cost=lk.target_ids,
                adaptive=lk.max_window_ms > lk.window_ms,
                max_window_ms=lk.max_window_ms,
                target_cost=lk.target_ids,
                dispatch_margin_ms=config.dispatch_margin_ms,
                close_at_dispatch=lk.close_at_dispatch,
            )
        )
        self.scheduler = Scheduler(policy, admission)
        self._loop: ServingLoop | None = None
        self._refresh: asyncio.Task[bool] | None = None

    @classmethod
    def connect(cls, config: LookupClientConfig, plan: ShardingPlan, addresses: Sequence[str], **kwargs: Any) -> "LookupClient":
        """A client over real gRPC channels to ``addresses`` (shard k at ``addresses[k]``)."""
        return cls(config, plan, GrpcShardTransport(addresses, max_frame_bytes=config.lookup.http2_max_frame_bytes), **kwargs)

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self, *, warm_up: bool = True) -> None:
        """Start the serving loop. ``warm_up`` first opens every shard's channel (one
        ShardInfo each, in parallel; failures are ignored — a dead shard is the breaker's
        business), so the first window does not pay connection set-up and get hedged
        for it; a shard already on a newer plan triggers a refresh."""
        if warm_up:
            timeout = self.config.rpc_timeout_ms / 1e3
            shards = range(self.runtime.plan.num_shards)
            infos = await asyncio.gather(*(self.transport.shard_info(k, timeout) for k in shards), return_exceptions=True)
            for k, info in zip(shards, infos):
                if not isinstance(info, BaseException) and info.plan_version > self.runtime.plan.version:
                    await self.refresh_plan(k)
                    break
        if self._own_executor:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="recserve-lookup")
        self.runtime.executor = self._executor
        self._loop = ServingLoop(self.scheduler, self._run_window, self.config.lookup.max_inflight_batches, clock=self._clock, name="lookup")
        self._loop.start()
        LOOKUP_METRICS.track(self.runtime.stats)  # recserve_lookup_*, read at scrape time

    async def aclose(self) -> None:
        if self._loop is not None:
            await self._loop.aclose()
        if self._refresh is not None and not self._refresh.done():
            self._refresh.cancel()
        await self.transport.close()
        if self._own_executor and self._executor is not None:
            self._executor.shutdown(wait=True)
        LOOKUP_METRICS.retire(self.runtime.stats)  # its counts stay in the process's totals

    async def __aenter__(self) -> "LookupClient":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- lookups -------------------------------------------------------------------------

    def lookup(
        self,
        features: "KeyedJaggedTensor",
        *,
        pooled: bool,
        deadline: float | None = None,
        timeout_s: float | None = None,
        header: common_pb2.RequestHeader | None = None,
    ) -> "asyncio.Future[LookupResult]":
        """Look up ``features`` (a KJT keyed by feature) for one caller: ``await`` the
        returned future for the result.

        The deadline is the earliest of ``deadline`` (monotonic s on the client's clock),
        ``now + timeout_s`` and the header's ``deadline_unix_ms``; none of them (or
        ``math.inf``) means no deadline beyond the RPC timeout. A NaN ``deadline`` or
        ``timeout_s`` is InvalidArgument; a ``timeout_s`` <= 0 (or -inf) is a deadline
        already passed: DeadlineExceeded, like a header deadline in the past.

        The future raises InvalidArgument for a bad input (this caller only),
        ResourceExhausted when admission rejects, DeadlineExceeded when the deadline had
        passed on arrival or passes while the caller still waits in the queue (every
        window slot busy: the scheduler drops it, no window ever sees it). Otherwise it
        gives a result by the deadline, degraded (default rows, ``missing`` counted) for
        rows that could not arrive in time. Cancelling it (or the task awaiting it)
        cancels the caller. Not a coroutine: a caller costs one future, not a coroutine
        frame as well (a window holds dozens of callers).
        """
        loop = self._loop
        if loop is None:
            raise FailedPrecondition("LookupClient is not started; await client.start() first")
        try:
            # x != x only for NaN, which min() would drop, silently serving without a deadline.
            if (timeout_s is not None and timeout_s != timeout_s) or (deadline is not None and deadline != deadline):
                name, value = ("timeout_s", timeout_s) if timeout_s is not None and timeout_s != timeout_s else ("deadline", deadline)
                raise InvalidArgument(f"lookup {name} = {value!r} is invalid: give seconds as a number (math.inf or None for no deadline)")
            tenant, priority = "default", _STANDARD  # the enum: no parse per caller
            limit = math.inf if deadline is None else deadline
            if timeout_s is not None:
                limit = min(limit, self._clock() + timeout_s)
            if header is not None:
                ctx = context_from_header(header)
                tenant, priority = ctx.tenant, ctx.priority
                limit = min(limit, ctx.deadline)
            try:
                # A one-feature caller's id range is checked by its window, over every
                # caller's ids at once (merge_window); a bad one fails alone there.
                caller = validate_features(
                    features, table_of_feature=self._table_of_feature, table_rows=self._table_rows, pooled=pooled, deadline=limit, defer_range_check=True
                )
            except InvalidArgument:
                self.runtime.stats.callers_rejected += 1
                raise
            # The scheduler's item future is the one result channel: the window resolves
            # it (ServingLoop.resolve_done) with this caller's result; cancelling it (or
            # the task awaiting it) cancels the item.
            result: asyncio.Future[LookupResult] = loop.submit_nowait(caller, cost=max(caller.n_ids, 1), deadline=limit, tenant=tenant, priority=priority)
            return result
        except RecserveError as e:  # this caller's error, raised where it awaits (as from a coroutine)
            failed: asyncio.Future[LookupResult] = asyncio.get_running_loop().create_future()
            failed.set_exception(e)
            return failed

    async def _run_window(self, batch: Batch) -> list[Failed]:
        loop = self._loop
        assert loop is not None
        running = [h for h in batch.handles if not h.done]  # not cancelled since scheduling
        if running:
            await WindowRun(self.runtime, running, loop.resolve_done, self._reject).run()
        # Every caller was resolved through loop.resolve_done, so the scheduler ignores these;
        # were one left unresolved (a bug), it fails loudly instead of hanging or
        # receiving None.
        unresolved = InternalError("lookup window finished without resolving this caller")
        return [Failed(unresolved)] * len(batch)

    def _reject(self, handle: Handle, error: RecserveError) -> None:
        """Fail one running caller of a window alone (an id out of range)."""
        assert self._loop is not None
        self._loop.resolve(handle, Failed(error))

    # ---- upserts -------------------------------------------------------------------------

    async def upsert(self, table: str, ids: Any, rows: Any, *, timeout_s: float = 5.0) -> int:
        """Write ``rows`` (fp32 [N, dim]) of ``ids`` to every owner; returns once all
        owners acknowledged (rows written, summed over owners). The near cache drops
        these ids before sending and again after the acknowledgement, so no lookup
        issued after this returns is served the old row from the cache."""
        plan = self.runtime.plan
        raw = np.asarray(ids)
        if raw.size and raw.dtype.kind not in "iu":  # a cast would silently write id 1 for 1.5
            raise InvalidArgument(f"upsert of table {table!r}: ids have dtype {raw.dtype}; use integer ids (int64)")
        ids_arr = raw.astype(np.int64, copy=False)
        cache = self.runtime.near_cache
        if cache is not None:
            cache.invalidate(table, ids_arr)
        written = await send_upsert(
            self.transport,
            plan,
            table,
            ids_arr,
            np.asarray(rows, dtype=np.float32),
            header=make_header(timeout_s=timeout_s),
            admin_token=self.config.admin_token,
            timeout_s=timeout_s,
        )
        if cache is not None:
            cache.invalidate(table, ids_arr)
        return sum(written.values())

    # ---- plan ----------------------------------------------------------------------------

    @property
    def plan(self) -> ShardingPlan:
        return self.runtime.plan

    def _check_plan(self, plan: ShardingPlan) -> None:
        for t in self.config.tables:
            tp = plan.table(t.name)
            if (tp.rows, tp.dim) != (t.rows, t.dim):
                raise InvalidArgument(f"table {t.name!r}: config says {t.rows:,} x {t.dim}, plan v{plan.version} says {tp.rows:,} x {tp.dim}")
        if plan.num_shards > self.transport.num_shards:
            raise InvalidArgument(f"plan v{plan.version} has {plan.num_shards} shards but only {self.transport.num_shards} addresses are known")

    def _make_near_cache(self, plan: ShardingPlan) -> NearCache | None:
        """Up to ``near_cache_rows`` of each table's hot ids (the planner's top by access
        frequency; the plan does not rank ids within a tier, so a larger cache would
        only add arbitrary warm ids)."""
        n = self.config.lookup.near_cache_rows
        if n <= 0:
            return None
        tables = {t.name: (plan.table(t.name).hot_ids[:n], t.dim) for t in self.config.tables}
        return NearCache(tables, self.config.lookup.near_cache_staleness_ms / 1e3)

    def _on_plan_version(self, version: int, shard: int) -> None:
        if version <= self.runtime.plan.version or (self._refresh is not None and not self._refresh.done()):
            return
        self._refresh = asyncio.ensure_future(self.refresh_plan(shard))

    async def refresh_plan(self, shard: int = 0) -> bool:
        """Fetch the plan from ``shard`` via GetPlan and switch to it if it is newer.
        Windows already running finish on the plan they started with."""
        try:
            reply = await self.transport.get_plan(shard, self.config.rpc_timeout_ms / 1e3)
            plan = ShardingPlan.from_json(reply.plan_json)
            if plan.version <= self.runtime.plan.version:
                return False
            self._check_plan(plan)
        except Exception as e:  # keep serving on the old plan; the next reply retries
            log.warning("plan refresh from shard %d failed: %s", shard, e)
            return False
        rt = self.runtime
        if plan.num_shards != rt.inflight_ids.shape[0]:
            rt.tracker.resize(plan.num_shards)
            rt.breakers.resize(plan.num_shards)
            grown = np.zeros(plan.num_shards, dtype=np.int64)
            keep = min(plan.num_shards, rt.inflight_ids.shape[0])
            grown[:keep] = rt.inflight_ids[:keep]
            rt.inflight_ids = grown
        rt.near_cache = self._make_near_cache(plan)
        rt.plan = plan
        rt.stats.plan_refreshes += 1
        log.info("lookup client switched to sharding plan v%d", plan.version)
        return True

    # ---- observability -------------------------------------------------------------------

    @property
    def stats(self) -> LookupStats:
        return self.runtime.stats

    @property
    def near_cache_hit_rate(self) -> float:
        cache = self.runtime.near_cache
        return cache.hit_rate if cache is not None else 0.0
