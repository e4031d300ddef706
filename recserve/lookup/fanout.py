"""Run one window: prepare, fan out one RPC per shard in parallel, hedge, resolve callers.

:class:`WindowRun` is the async edge around the pure parts (window merge, routing,
wire codec, reassembly). For one window it

1. merges and deduplicates the callers' ids per table, serves what it can from the near
   cache and routes the rest (:mod:`~recserve.lookup.route`);
2. sends one RPC per destination shard, all at once (several, each of at most
   ``max_ids_per_rpc`` ids, where a shard's share is larger); each carries the *latest*
   deadline among the callers it serves;
3. as replies arrive, scatters them into the window's unique-row matrices; a shard that
   fails with a retryable status, or has not answered by its hedge delay, gets its
   replicated rows re-sent to the next live replica, within the hedge budget — never
   for non-retryable statuses. With shard-side partial pooling, hedges ask for rows,
   not sums, so a late primary's sum and a hedge's rows never count a row twice;
4. resolves callers in groups, each through the scheduler (``resolve`` of its handle,
   while the window still runs): as soon as every row a caller needs has arrived or can
   no longer arrive, or at the caller's own deadline with what has arrived (the rest
   default rows, counted as missing);
5. cancels whatever is still in flight once every caller is resolved (no zombie work).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from recserve.errors import RecserveError
from recserve.lookup.reassemble import TableAssembly, resolve_callers
from recserve.lookup.route import FetchUnit, chunk_units, first_live, route_window
from recserve.lookup.runtime import Runtime
from recserve.lookup.types import CallerLookup, LookupResult
from recserve.lookup.window import OutOfRange, TableWindow, merge_window
from recserve.lookup.wire import build_request, parse_response
from recserve.rpc.deadline import make_header
from recserve.rpc.status import grpc_code, is_retryable
from recserve.scheduling import Handle, ItemStatus
from recserve.v1 import common_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")
# Handle.done without a property call per caller: ``status in _TERMINAL`` on a tuple
# compares by identity in C (a frozenset would hash the Enum member in Python).
_TERMINAL = (ItemStatus.DONE, ItemStatus.FAILED, ItemStatus.DROPPED, ItemStatus.CANCELLED)
_RUNNING = ItemStatus.RUNNING
# Whole-array any / all / min of 1-D arrays as one C call each: ``ndarray.any()`` and
# ``np.flatnonzero`` go through several Python frames per call in numpy 2, and the
# window's reply path makes dozens of them (cold code: each frame costs).
_any = np.logical_or.reduce
_all = np.logical_and.reduce
_min = np.minimum.reduce


@dataclasses.dataclass(eq=False)
class _Call:
    shard: int
    units: list[FetchUnit]
    n_ids: int
    sent_at: float
    hedge_at: float
    is_hedge: bool
    counted: bool = True  # its ids are in rt.inflight_ids
    hedged: bool = False
    finished: bool = False


class WindowRun:
    """One window's life: ``await WindowRun(runtime, handles, loop.resolve_done, reject).run()``.

    ``handles`` are the scheduler's running items of the window (payload: a
    :class:`CallerLookup`); each group of callers whose results are ready is answered
    with ``resolve_done(handles, results)``, on the event loop thread. A caller with an
    id out of range (its check deferred to the window) is failed alone with
    ``reject(handle, error)`` before anything is sent, and the window goes on without
    it. An exception out of :meth:`run` is the batch's failure (the serving loop fails
    every unresolved item).
    """

    def __init__(
        self,
        rt: Runtime,
        handles: Sequence[Handle],
        resolve_done: Callable[[Sequence[Handle], Sequence[Any]], int],
        reject: Callable[[Handle, RecserveError], object],
    ) -> None:
        self.rt = rt
        self._deliver_done = resolve_done
        self._reject = reject
        self.plan = rt.plan
        self.dims, self.table_rows, self.pooling = rt.dims, rt.table_rows, rt.pooling
        self._bind(handles)
        self.windows: dict[str, TableWindow] = {}
        self.asm: dict[str, TableAssembly] = {}
        # The near cache this window's slots index: a plan refresh swaps in a new cache
        # with other slots, so replies must fill the one the slots were taken from.
        self.near_cache = rt.near_cache
        self.cache_slot: dict[str, np.ndarray] = {}
        self.cache_version: dict[str, np.ndarray] = {}
        self.occ_bags: dict[str, np.ndarray] | None = None
        self.calls: dict[asyncio.Task[Any], _Call] = {}
        self.header: common_pb2.RequestHeader | None = None
        self.first_send = math.inf
        self.last_reply = -math.inf

    def _bind(self, handles: Sequence[Handle]) -> None:
        """The window's callers and what follows from them alone."""
        self.handles = list(handles)
        self.callers: list[CallerLookup] = [h.item.payload for h in self.handles]
        n = len(self.callers)
        self.n_ids = sum(c.n_ids for c in self.callers)
        self.partial = self.rt.config.partial_pooling and all(c.pooled for c in self.callers)
        self.resolved = np.zeros(n, dtype=bool)
        self.deadlines = np.fromiter((c.deadline for c in self.callers), dtype=np.float64, count=n)
        # Every RPC carries the window's latest caller deadline: a row's own latest
        # deadline would be tighter for some RPCs, but once every caller is resolved the
        # window cancels what is still in flight, so the looser bound costs no work.
        self.latest_deadline = float(self.deadlines.max()) if n else math.inf

    async def _prepare_sound(self) -> dict[int, list[FetchUnit]]:
        """:meth:`_prepare`; callers with an id out of range are rejected (each alone,
        InvalidArgument naming the feature and id) and the rest prepared without them."""
        rt = self.rt
        try:
            return await self._offload(self._prepare, rt.clock())
        except OutOfRange as bad:
            rt.stats.callers_rejected += len(bad.errors)
            for c, error in bad.errors.items():
                self._reject(self.handles[c], error)
            self._bind([h for c, h in enumerate(self.handles) if c not in bad.errors])
            if not self.handles:
                return {}
            return await self._offload(self._prepare, rt.clock())

    # ---- prepare (pure, may run on a worker thread) ------------------------------------

    def _prepare(self, now: float) -> dict[int, list[FetchUnit]]:
        rt = self.rt
        t0 = time.perf_counter()
        self.windows = merge_window(self.callers, self.table_rows)
        fetch: dict[str, np.ndarray] = {}
        for table, w in self.windows.items():
            asm = TableAssembly(w, self.dims[table], np.ones(w.unique, np.int16), partial=self.partial)
            self.asm[table] = asm
            positions = np.arange(w.unique, dtype=np.int64)
            if self.near_cache is not None and not self.partial:
                occurrences = np.bincount(w.inverse, minlength=w.unique)  # caller lookups per unique id
                hit, rows, slot = self.near_cache.get(table, w.unique_ids, now, occurrences)
                rt.stats.near_cache_lookups += w.occurrences
                rt.stats.near_cache_hits += int(occurrences[hit].sum())
                asm.put_cached(positions[hit], rows)
                self.cache_slot[table] = slot
                self.cache_version[table] = self.near_cache.versions(table, slot)
                positions = positions[~hit]
            fetch[table] = positions
            rt.stats.ids_requested += w.occurrences
            rt.stats.ids_unique += w.unique
            rt.stats.ids_fetched += int(positions.size)
        if self.partial:
            self.occ_bags = {t: w.occurrence_bags() for t, w in self.windows.items()}
        routed = route_window(
            {t: w.unique_ids for t, w in self.windows.items()},
            fetch,
            {t: self.plan.table(t) for t in self.windows},
            {t: self.plan.router(t) for t in self.windows},
            rt.shard_state(now),
            rotation=rt.windows_started,
            min_ids_per_extra_rpc=rt.config.min_ids_per_extra_rpc,
        )
        for u in routed.units:
            if not u.full_row:
                self.asm[u.table].need[u.positions] = self.plan.table(u.table).column_splits
        rt.stats.prep_s += time.perf_counter() - t0
        return routed.by_shard()

    # ---- sending -----------------------------------------------------------------------

    def _header(self, deadline: float, now: float) -> common_pb2.RequestHeader:
        """The window's RPC header, built at its first send and shared by every RPC (the
        deadline is the window's, so the wall-clock ``deadline_unix_ms`` is too): the
        first caller's tenant, the most urgent caller's priority, and ``deadline``
        (monotonic s on the injected clock) as the time left from ``now``."""
        if self.header is None:
            self.header = make_header(
                timeout_s=None if math.isinf(deadline) else deadline - now,
                tenant=self.handles[0].item.tenant,
                priority=min([h.item.priority for h in self.handles]).name.lower(),
                request_id=f"window-{id(self):x}",
            )
        return self.header

    def _known(self, shard: int) -> bool:
        """Whether ``shard`` is in the client's current fleet: a plan refresh may have
        shrunk it while this window (on its older plan) still talks to a dropped shard."""
        return shard < self.rt.inflight_ids.shape[0]

    def _send(self, shard: int, units: list[FetchUnit], *, is_hedge: bool) -> None:
        rt = self.rt
        now = rt.clock()
        deadline = self.latest_deadline
        timeout = rt.config.rpc_timeout_ms / 1000.0 if math.isinf(deadline) else max(deadline - now, 1e-3)
        t0 = time.perf_counter()
        request = build_request(
            units,
            self.windows,
            row_dtype=rt.config.row_dtype,
            header=self._header(deadline, now),
            plan_version=self.plan.version,
            # Hedges ask for rows even in partial-pooling mode (see TableAssembly).
            occurrence_bags=None if is_hedge else self.occ_bags,
        )
        rt.stats.serialise_s += time.perf_counter() - t0
        n_ids = sum([u.positions.shape[0] for u in units])
        # No per-row in-flight count to scatter: which rows are still on the wire is
        # read from the unfinished calls' units when a settle check needs it.
        known = self._known(shard)
        if known:
            rt.inflight_ids[shard] += n_ids
        rt.stats.ids_sent += n_ids
        if is_hedge:
            rt.stats.rpcs_hedge += 1
        else:
            rt.stats.rpcs_primary += 1
            rt.budget.on_primary()
        replicated = False
        for u in units:
            alternatives = u.alternatives
            if alternatives.shape[1] > 0 and _any(alternatives[:, 0] >= 0):
                replicated = True
                break
        delay = rt.tracker.fleet_hedge_delay(shard) if known else rt.tracker.default_delay_s
        hedge_at = now + delay if replicated else math.inf
        call = _Call(shard, units, n_ids, now, hedge_at, is_hedge, counted=known)
        # The loop's create_task (not ensure_future's checks); its done callback wakes
        # :meth:`_drive` (one callback for the call's life, not one per wait).
        # start_lookup starts the RPC now (its send goes out at the loop's next turn);
        # the task only awaits its reply.
        task = asyncio.get_running_loop().create_task(rt.transport.start_lookup(shard, request, timeout))
        task.add_done_callback(self._wake)
        self.calls[task] = call
        if now < self.first_send:
            self.first_send = now

    def _finish_call(self, call: _Call, *, latency_s: float | None) -> None:
        if call.finished:
            return
        call.finished = True
        if self._known(call.shard):
            if call.counted:
                self.rt.inflight_ids[call.shard] -= call.n_ids
            if latency_s is not None:
                self.rt.tracker.record(call.shard, latency_s, self.rt.clock())

    def _hedge(self, call: _Call, reason: str) -> None:
        """Re-send ``call``'s replicated rows that have not arrived to their next live
        replica: one RPC per alternative shard, each paid from the hedge budget."""
        if call.hedged:
            return
        call.hedged = True
        live: np.ndarray | None = None  # read once, and only if some row is still open
        groups: dict[int, list[FetchUnit]] = {}
        for u in call.units:
            if u.alternatives.shape[1] == 0:
                continue
            asm = self.asm[u.table]
            open_rows = asm.got[u.positions] < asm.need[u.positions]
            if not _any(open_rows):
                continue
            alts = u.alternatives[open_rows]
            pos = u.positions[open_rows]
            if live is None:
                live = self.rt.breakers.live(self.rt.clock())
            ok = (alts >= 0) & (alts < live.shape[0]) & np.take(live, np.clip(alts, 0, live.shape[0] - 1))
            has, chosen, rest = first_live(alts, ok)
            for s in np.unique(chosen[has]).tolist():
                m = has & (chosen == s)
                groups.setdefault(int(s), []).append(FetchUnit(int(s), u.table, pos[m], 0, 0, rest[m]))
        for shard, units in groups.items():
            for chunk in chunk_units(units, self.rt.config.max_ids_per_rpc):
                if not self.rt.budget.try_spend():
                    self.rt.stats.hedges_denied += 1
                    continue
                log.debug("hedging %d rows of shard %d to shard %d (%s)", sum(len(u) for u in chunk), call.shard, shard, reason)
                self._send(shard, chunk, is_hedge=True)

    # ---- receiving ---------------------------------------------------------------------

    def _on_done(self, task: asyncio.Task[Any], call: _Call) -> None:
        rt = self.rt
        now = rt.clock()
        try:
            response = task.result()
        except RecserveError as e:  # the shard's status (transport.shard_call_error)
            self._finish_call(call, latency_s=None)
            rt.stats.rpc_errors += 1
            code = grpc_code(e)
            if is_retryable(code):
                if self._known(call.shard):
                    rt.breakers.on_failure(call.shard, now)
                self._hedge(call, f"error {code.name}")
            else:
                log.warning("shard %d lookup failed (not retried): %s", call.shard, e.message)
            return
        except Exception as e:  # a bug below the transport: fail this call only
            self._finish_call(call, latency_s=None)
            rt.stats.rpc_errors += 1
            log.error("shard %d lookup failed: %r", call.shard, e)
            return
        if self._known(call.shard):
            rt.breakers.on_success(call.shard)
            if now < call.hedge_at:
                rt.tracker.on_time(call.shard)
        if now > self.last_reply:
            self.last_reply = now
        t0 = time.perf_counter()
        pooled = self.partial and not call.is_hedge
        try:
            replies = parse_response(
                response,
                call.units,
                self.dims,
                row_dtype=rt.config.row_dtype,
                pooled=pooled,
                num_bags={t: w.bag_lengths.shape[0] for t, w in self.windows.items()} if pooled else None,
            )
        except Exception as e:  # malformed reply: treat as a non-retryable failure
            self._finish_call(call, latency_s=now - call.sent_at)
            rt.stats.rpc_errors += 1
            log.error("shard %d sent a malformed lookup reply: %s", call.shard, e)
            return
        t1 = time.perf_counter()
        rt.stats.serialise_s += t1 - t0
        near_cache = self.near_cache
        for u, r in zip(call.units, replies):
            asm = self.asm[u.table]
            if r.pooled is not None:
                if not asm.put_partial(u.positions, r.pooled, r.found, r.not_owned):
                    log.error("shard %d sent a partial sum over rows already pooled; dropped", call.shard)
                continue
            assert r.rows is not None
            asm.put_rows(u.positions, r.rows, u.col_start, u.col_end, r.found, r.not_owned)
            if near_cache is None or u.col_start != 0 or u.col_end != 0:
                continue
            cache_slot = self.cache_slot.get(u.table)
            if cache_slot is None:
                continue
            # Rows the cache holds a slot for, found and owned (fill checks each row's
            # version against the one taken when the window looked it up).
            slot = cache_slot[u.positions]
            keep = slot >= 0
            if not _all(r.found) or _any(r.not_owned):  # the common reply skips both masks
                keep &= r.found & ~r.not_owned
            at = keep.nonzero()[0]
            if at.size:
                ver = self.cache_version[u.table][u.positions[at]]
                near_cache.fill(u.table, slot[at], ver, r.rows[at], now)
        rt.stats.scatter_s += time.perf_counter() - t1
        self._finish_call(call, latency_s=now - call.sent_at)
        if response.plan_version > self.plan.version:
            rt.on_plan_version(int(response.plan_version), call.shard)

    # ---- resolving ---------------------------------------------------------------------

    def _settled_callers(self) -> np.ndarray:
        """bool [C]: callers all of whose rows arrived or have no call outstanding.

        A row is open while it is incomplete and some unfinished call carries it. Those
        rows are marked from the unfinished calls' units here, only when some call is
        unfinished (after the window's last reply no array is built)."""
        flying: dict[str, np.ndarray] = {}
        for call in self.calls.values():
            if call.finished:
                continue
            for u in call.units:
                mask = flying.get(u.table)
                if mask is None:
                    mask = flying[u.table] = np.zeros(self.asm[u.table].got.shape[0], dtype=bool)
                mask[u.positions] = True
        unsettled: np.ndarray | None = None
        for table, open_rows in flying.items():
            asm = self.asm[table]
            open_rows &= asm.got < asm.need
            if not _any(open_rows):
                continue
            w = self.windows[table]
            cum = np.zeros(w.inverse.shape[0] + 1, dtype=np.int64)
            open_rows.take(w.inverse).cumsum(out=cum[1:])
            count = cum[w.id_offsets[1:]] - cum[w.id_offsets[:-1]]
            unsettled = count if unsettled is None else unsettled + count
        if unsettled is None:
            return ~np.zeros(len(self.callers), dtype=bool)
        return unsettled == 0

    def _results(self, group: list[int]) -> list[LookupResult]:
        """The results of callers ``group`` from what has arrived (pure CPU work, may run
        on the executor)."""
        t0 = time.perf_counter()
        results = resolve_callers(self.callers, group, self.windows, self.asm, self.pooling)
        dt = time.perf_counter() - t0
        callers = self.callers
        if self.partial or all([callers[c].pooled for c in group]):
            self.rt.stats.pool_s += dt
        else:
            self.rt.stats.gather_s += dt
        return results

    async def _resolve(self, group: list[int]) -> None:
        """Resolve callers ``group`` through the scheduler. Callers already terminal there
        (cancelled while the window ran) are skipped: nobody waits for their result."""
        handles = self.handles
        live = [c for c in group if handles[c].status not in _TERMINAL]
        self.resolved[group] = True
        if not live:
            return
        results = await self._offload(self._results, live)
        stats = self.rt.stats
        missing = [r.missing for r in results]
        stats.missing += sum(missing)
        stats.degraded_callers += len(missing) - missing.count(0)
        # On the loop thread, never the executor; callers cancelled meanwhile are skipped.
        self._deliver_done([handles[c] for c in live], results)

    async def _offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run CPU work on the executor for big windows, inline for small ones."""
        if self.rt.executor is None or self.n_ids < self.rt.config.offload_ids:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.rt.executor, fn, *args)

    # ---- the window's life -------------------------------------------------------------

    async def run(self) -> None:
        rt = self.rt
        rt.windows_started += 1
        rt.stats.windows += 1
        rt.stats.callers += len(self.callers)
        try:
            by_shard = await self._prepare_sound()
            for shard, units in by_shard.items():
                for chunk in chunk_units(units, rt.config.max_ids_per_rpc):
                    self._send(shard, chunk, is_hedge=False)
            await self._drive()
        finally:
            self._cancel_outstanding()
            if self.first_send < self.last_reply:
                rt.stats.rpc_wall_s += self.last_reply - self.first_send

    async def _drive(self) -> None:
        rt = self.rt
        loop = asyncio.get_running_loop()
        handles = self.handles
        n = len(handles)
        while not _all(self.resolved):
            now = rt.clock()
            unresolved = ~self.resolved
            # Callers cancelled while the window runs need nothing more: stop waiting for
            # them (noticed at the window's next wake-up). Statuses are read in one list
            # comprehension, no property per caller; all still running is the common case.
            statuses = [h.status for h in handles]
            ready_mask = self._settled_callers() | (self.deadlines <= now)
            if statuses.count(_RUNNING) != n:
                ready_mask |= np.array([s in _TERMINAL for s in statuses], dtype=bool)
            ready = (unresolved & ready_mask).nonzero()[0]
            if ready.size:
                await self._resolve(ready.tolist())
                continue
            active = [t for t, c in self.calls.items() if not c.finished]
            if not active:  # nothing more can arrive
                await self._resolve(unresolved.nonzero()[0].tolist())
                break
            wake = float(_min(self.deadlines[unresolved]))
            for t in active:
                c = self.calls[t]
                if not c.hedged and c.hedge_at < wake:
                    wake = c.hedge_at
            done = [t for t in active if t.done()]
            if not done:
                # One future, woken by any call's done callback (see _send) or by the
                # timer: asyncio.wait would add and remove a callback per call per wait.
                waiter = loop.create_future()
                self._waiter = waiter
                timer = None if math.isinf(wake) else loop.call_later(max(wake - now, 0.0), self._wake)
                try:
                    await waiter
                finally:
                    self._waiter = None
                    if timer is not None:
                        timer.cancel()
                done = [t for t in active if t.done()]
            for t in done:
                self._on_done(t, self.calls[t])
            now = rt.clock()
            for t in active:  # hedges sent below join self.calls, not this list
                c = self.calls[t]
                if not c.finished and not c.hedged and c.hedge_at <= now:
                    if self._known(c.shard):
                        rt.tracker.on_late(c.shard, now)
                    self._hedge(c, "late")

    # The future :meth:`_drive` waits on while calls are in flight (None otherwise).
    _waiter: "asyncio.Future[None] | None" = None

    def _wake(self, _task: object = None) -> None:
        """Wake :meth:`_drive`: a call finished (done callback) or its timer fired."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _cancel_outstanding(self) -> None:
        now = self.rt.clock()
        for task, call in self.calls.items():
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a late failure nobody waits for is not an error
            if not call.finished:
                task.cancel()
                # A cancelled call waited at least this long: record it as a (censored)
                # latency so a stuck shard reads as slow and hot ids steer around it.
                self._finish_call(call, latency_s=now - call.sent_at)
