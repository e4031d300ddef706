"""The async serving loop: drives a :class:`~recserve.scheduling.core.Scheduler` on an
asyncio event loop and runs its batches (docs/architecture.md §6).

- It sleeps until new work, a finished batch, or the scheduler's ``next_wakeup``
  (window end / slack point / earliest deadline), then forms batches while fewer than
  ``max_inflight`` are running. With every slot busy it still wakes at the earliest
  deadline, so expired items fail on time.
- The runner takes a :class:`Batch` and returns one outcome per item; it may answer
  items early with :meth:`ServingLoop.resolve` (their outcome at the end is ignored). A coroutine
  function (an RPC fan-out) is awaited on the loop; a plain function (CPU work: numpy,
  torch) runs on the executor — a thread pool of ``max_inflight`` threads by default —
  never on the event loop.
- An exception in the runner fails every item of the batch; a wrong outcome count is an
  INTERNAL error for every item (the core checks it).
- Callers ``await submit(...)`` for the result or iterate ``submit_stream(...)`` for
  partial outputs; cancelling the awaiting task (or the future) cancels the item.
- ``start()`` / ``aclose()`` are explicit; ``aclose()`` drains what is queued, or with
  ``drain=False`` fails it with UNAVAILABLE. Batches already running always finish.
- Metrics, label ``loop`` = ``name`` (:mod:`recserve.metrics.catalog`): batch size (one
  observation per batch) and queue wait (one per item taken from the queue) are
  histograms observed here; queue depth and the cancelled / expired counts are read
  from the scheduler at scrape time, from ``start()`` on (a closed loop's counts stay).

All scheduler calls happen on the event loop thread, so the core needs no locks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import logging
import math
import time
from typing import Any, Awaitable, Callable, Sequence, Union

from recserve.errors import ConfigError, FailedPrecondition, InternalError, RecserveError, Unavailable
from recserve.metrics import catalog
from recserve.metrics.collectors import SCHEDULERS
from recserve.scheduling.core import Scheduler
from recserve.scheduling.metrics import DropReason
from recserve.scheduling.types import Batch, Handle, Priority, Resolution, WorkItem

log = logging.getLogger(__name__)

SyncRunner = Callable[[Batch], Sequence[Any]]
AsyncRunner = Callable[[Batch], Awaitable[Sequence[Any]]]
Runner = Union[SyncRunner, AsyncRunner]

_END = object()  # end-of-stream marker in a partials queue


def _ignore(value: float) -> None:
    pass


class _ItemFuture(asyncio.Future[Any]):
    """One item's result future and its listener in one object: the core resolves it
    through ``on_done`` / ``on_error`` and feeds ``on_partial`` to the stream queue.
    ``cancel()`` — by the caller, or by asyncio when the task awaiting it is cancelled —
    also cancels the item in the scheduler; no per-item done callback is needed.

    Built as ``_ItemFuture(loop=loop)`` (asyncio's own C ``__init__``, no Python call:
    one is made per caller) and then given its three slots by :meth:`ServingLoop.submit_nowait`."""

    __slots__ = ("_owner", "_partials", "handle")
    _owner: ServingLoop
    _partials: asyncio.Queue[Any] | None
    handle: Handle | None

    def cancel(self, msg: Any | None = None) -> bool:
        if not super().cancel(msg):
            return False
        if self.handle is not None:
            self._owner._cancel(self.handle)
        return True

    def on_partial(self, handle: Handle, output: Any) -> None:
        if self._partials is not None:
            self._partials.put_nowait(output)

    def on_done(self, handle: Handle, output: Any) -> None:
        self.handle = None  # finished: nothing left to cancel; no reference cycle
        try:
            self.set_result(output)
        except asyncio.InvalidStateError:  # done already (cancelled): asking done() first costs every caller a call
            pass
        if self._partials is not None:
            self._partials.put_nowait(_END)

    def on_error(self, handle: Handle, error: RecserveError) -> None:
        self.handle = None
        if not self.done():
            self.set_exception(error)
        if self._partials is not None:
            self._partials.put_nowait(_END)


class ItemStream:
    """Partial outputs of one item as an async iterator; ``await result()`` for the final
    output. The iterator ends when the item finishes and raises its error if it failed.
    Cancelling a task blocked in iteration, or calling ``cancel()``, cancels the item."""

    def __init__(self, future: asyncio.Future[Any], partials: asyncio.Queue[Any]) -> None:
        self._future = future
        self._partials = partials

    def __aiter__(self) -> ItemStream:
        return self

    async def __anext__(self) -> Any:
        try:
            value = await self._partials.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if value is _END:
            self._partials.put_nowait(_END)  # later __anext__ calls stop too
            if not self._future.cancelled() and self._future.exception() is not None:
                raise self._future.exception()  # type: ignore[misc]
            raise StopAsyncIteration
        return value

    async def result(self) -> Any:
        return await self._future

    def cancel(self) -> None:
        self._future.cancel()

    async def aclose(self) -> None:
        self.cancel()


class ServingLoop:
    """Runs ``scheduler``'s batches with ``runner``, up to ``max_inflight`` at once."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        max_inflight: int = 1,
        executor: concurrent.futures.Executor | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        name: str = "scheduler",
    ) -> None:
        if max_inflight < 1:
            raise ConfigError(f"max_inflight = {max_inflight!r} is invalid: use at least 1 batch in flight")
        self.scheduler = scheduler
        scheduler.parallelism = max_inflight  # its slack check at add: batches drain this many at once
        self._runner = runner
        self._is_async = inspect.iscoroutinefunction(runner) or inspect.iscoroutinefunction(getattr(runner, "__call__", None))
        self.max_inflight = max_inflight
        self._own_executor = executor is None and not self._is_async
        self._executor = executor
        self._clock = clock
        self.name = name
        self._last_id = 0  # the latest default request id's number (name-1, name-2, ...)
        self._woken = False  # see _wake_up
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task[None] | None = None
        self._closing = False
        self._drain = True
        self._broken: BaseException | None = None
        self._observe_batch: Callable[[float], None] = _ignore

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start driving the scheduler; call from inside the running event loop."""
        if self._driver is not None:
            raise FailedPrecondition(f"serving loop {self.name!r} was already started")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._observe_batch = catalog.SCHEDULER_BATCH_SIZE.labels(self.name).observe
        self.scheduler.observe_queue_waits(catalog.SCHEDULER_QUEUE_WAIT.labels(self.name).observe_many)
        SCHEDULERS.track(self, self.name, self._metric_reading)
        if self._own_executor:
            self._executor = concurrent.futures.ThreadPoolExecutor(self.max_inflight, thread_name_prefix=f"recserve-{self.name}")
        # An empty context: the driver and every batch task it creates copy it, and a
        # batch serves many callers, so none may run in the context of whichever caller
        # happened to start the loop (its API key, its request id: issue 17's "no
        # answer crosses callers").
        self._driver = self._loop.create_task(self._drive(), name=f"recserve-{self.name}-loop", context=contextvars.Context())

    async def aclose(self, *, drain: bool = True) -> None:
        """Stop accepting work. ``drain``: run everything queued to completion (windows
        do not wait); otherwise fail it with UNAVAILABLE. Returns when no batch is running."""
        if self._driver is None:
            self._closing = True
            return
        if not self._closing:
            self._closing = True
            self._drain = drain
        self._wake_up()
        await asyncio.shield(self._driver)
        if self._tasks:  # the driver stopped on a policy bug: still wait for the running batches
            await asyncio.wait(set(self._tasks))  # wait, unlike gather, never cancels them
        if self._own_executor and self._executor is not None:
            self._executor.shutdown(wait=True)
        SCHEDULERS.retire(self)

    def _metric_reading(self) -> dict[str, float]:
        """Queue depth, drops and sheds for ``/metrics`` (read on the scrape thread: plain reads)."""
        sched = self.scheduler
        drops = sched.metrics.drops
        return {"queue_depth": sched.queued_count, "cancelled": drops[DropReason.CANCELLED], "expired": drops[DropReason.DEADLINE], "shed": sched.shed}

    async def __aenter__(self) -> ServingLoop:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ submission
    def submit_nowait(
        self,
        payload: Any,
        *,
        cost: float = 1.0,
        deadline: float = math.inf,
        tenant: str = "default",
        priority: Priority | str = Priority.STANDARD,
        request_id: str | None = None,
        min_service_s: float = 0.0,
    ) -> asyncio.Future[Any]:
        """Queue one item; returns its result future (cancel it to cancel the item).
        ``deadline`` is monotonic seconds; ``min_service_s``:
        :class:`~recserve.scheduling.types.WorkItem`'s. Admission errors
        (ResourceExhausted with a retry-after hint, DeadlineExceeded, InvalidArgument)
        raise here, synchronously."""
        # Every lookup caller comes through here: no helper call, no per-item object
        # beyond the item, its future and its handle (issue 9's lean caller path).
        loop = self._loop
        if loop is None:
            raise FailedPrecondition(f"serving loop {self.name!r} is not started; call start() first")
        if self._closing or self._broken is not None:
            raise Unavailable(f"serving loop {self.name!r} is closed; not accepting work")
        if request_id is None:
            self._last_id += 1
            request_id = f"{self.name}-{self._last_id}"
        item = WorkItem(request_id, tenant, priority if type(priority) is Priority else Priority.parse(priority), deadline, cost, payload, min_service_s)
        future = _ItemFuture(loop=loop)
        future._owner = self
        future._partials = None
        future.handle = self.scheduler.add(item, self._clock(), future)
        if not self._woken:  # the driver's event is set already otherwise: skip Event.set
            self._woken = True
            self._wake.set()  # type: ignore[union-attr]  # made with the loop in start()
        return future

    async def submit(
        self,
        payload: Any,
        *,
        cost: float = 1.0,
        deadline: float = math.inf,
        tenant: str = "default",
        priority: Priority | str = Priority.STANDARD,
        request_id: str | None = None,
        min_service_s: float = 0.0,
    ) -> Any:
        """Queue one item and await its final output (see :meth:`submit_nowait`)."""
        return await self.submit_nowait(
            payload, cost=cost, deadline=deadline, tenant=tenant, priority=priority, request_id=request_id, min_service_s=min_service_s,
        )

    def submit_stream(
        self,
        payload: Any,
        *,
        cost: float = 1.0,
        deadline: float = math.inf,
        tenant: str = "default",
        priority: Priority | str = Priority.STANDARD,
        request_id: str | None = None,
    ) -> ItemStream:
        """Queue one streaming item: iterate the result for partial outputs (Continue),
        ``await stream.result()`` for the final output."""
        future = self.submit_nowait(payload, cost=cost, deadline=deadline, tenant=tenant, priority=priority, request_id=request_id)
        assert isinstance(future, _ItemFuture)
        # Attached after add, before anything can reach it: partial outputs come only
        # from a batch, and batches form on the driver, after this returns.
        partials: asyncio.Queue[Any] = asyncio.Queue()
        future._partials = partials
        return ItemStream(future, partials)

    def resolve(self, handle: Handle, outcome: Resolution) -> bool:
        """Answer one item of a running batch early (``Done`` / ``Failed``), with this
        loop's clock; see :meth:`Scheduler.resolve`. Call it on the loop's event-loop
        thread, e.g. from a coroutine runner as each item's part of the work arrives."""
        return self.scheduler.resolve(handle, outcome, self._clock())

    def resolve_done(self, handles: Sequence[Handle], outputs: Sequence[Any]) -> int:
        """Answer several running items early with their outputs, in one call
        (:meth:`Scheduler.resolve_done`); on the loop's event-loop thread."""
        return self.scheduler.resolve_done(handles, outputs, self._clock())

    def _cancel(self, handle: Handle) -> None:
        if self.scheduler.cancel(handle, self._clock()):
            self._wake_up()

    def _wake_up(self) -> None:
        # _woken: the event is set and the driver has not cleared it since (it clears
        # both together), so a burst of submits calls Event.set once, not per item.
        if self._wake is not None and not self._woken:
            self._woken = True
            self._wake.set()

    # ------------------------------------------------------------------ driving
    async def _drive(self) -> None:
        assert self._loop is not None and self._wake is not None
        loop, wake, sched = self._loop, self._wake, self.scheduler
        try:
            while True:
                wake.clear()
                self._woken = False
                now = self._clock()
                if self._closing and not self._drain:
                    sched.abort_pending(Unavailable(f"serving loop {self.name!r} closed before the request ran"), now)
                sched.expire(now)  # also when every slot is busy: expired items fail on time
                while len(self._tasks) < self.max_inflight:
                    batch = sched.schedule(now, flush=self._closing)
                    if batch is None:
                        break
                    self._observe_batch(len(batch.handles))
                    task = loop.create_task(self._run(batch))
                    self._tasks.add(task)
                if self._closing and sched.idle and not self._tasks:
                    return
                if len(self._tasks) < self.max_inflight:
                    wake_at = sched.next_wakeup(now, flush=self._closing)
                else:
                    wake_at = sched.next_deadline()
                timer = None
                if wake_at is not None:
                    delay = wake_at - self._clock()
                    if delay <= 0:
                        # Due already (a batch formed above may have left more ready work,
                        # or time passed): go round again, but let other tasks run first.
                        await asyncio.sleep(0)
                        continue
                    timer = loop.call_later(delay, wake.set)
                await wake.wait()
                if timer is not None:
                    timer.cancel()
        except Exception as exc:  # a policy bug must not leave callers hanging
            log.exception("serving loop %r stopped", self.name)
            self._broken = exc
            sched.abort_pending(InternalError(f"serving loop {self.name!r} stopped: {exc!r}"), self._clock())

    async def _run(self, batch: Batch) -> None:
        assert self._loop is not None
        sched = self.scheduler
        try:
            try:
                if self._is_async:
                    outcomes = await self._runner(batch)  # type: ignore[misc]
                else:
                    outcomes = await self._loop.run_in_executor(self._executor, self._runner, batch)
                    if inspect.isawaitable(outcomes):
                        if inspect.iscoroutine(outcomes):
                            outcomes.close()
                        raise InternalError("the runner returned an awaitable from a thread; pass an async def runner instead")
            except asyncio.CancelledError:
                sched.fail(batch, Unavailable(f"serving loop {self.name!r} was cancelled while the batch ran"), self._clock())
                raise
            except Exception as exc:
                log.debug("batch %d failed: %r", batch.batch_id, exc)
                sched.fail(batch, exc, self._clock())
            else:
                try:
                    sched.complete(batch, outcomes, self._clock())
                except Exception:  # a policy hook bug; complete already failed the batch's unfinished items
                    log.exception("serving loop %r: completing batch %d failed", self.name, batch.batch_id)
        finally:
            self._tasks.discard(asyncio.current_task())  # type: ignore[arg-type]
            self._wake_up()
