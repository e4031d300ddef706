"""The one device executor of a co-located process: ranker forwards and decode steps on
one worker thread, in the order the :class:`~recserve.scheduling.bulkhead.DeviceBulkhead`
decides (docs/architecture.md §6, "Shared device").

One thread stands for the device: a GPU runs one kernel stream at a time well, and on a
CPU two torch workloads on two threads only fight over the same cores. Each workload
gets a :class:`LaneExecutor` — a :class:`concurrent.futures.Executor` — for its lane, so
the code that already runs its work on an executor (the ranker's forward,
:class:`~recserve.scheduling.ServingLoop`'s batch runner for decode) is unchanged: it is
handed this executor instead of its own thread pool. A lane executor's ``shutdown`` does
nothing; the process that made the :class:`DeviceExecutor` shuts it down, after both
workloads have closed.

The critical lane's ``announced()`` context wraps a ranker batch's whole run (lookups
and forward), so decode yields to a batch that is on its way
(:meth:`~recserve.scheduling.bulkhead.DeviceBulkhead.announce`); while decode is held
back the worker sleeps until the bulkhead's ``next_wakeup``.

The bulkhead is a state machine without locks; here it is only touched under one
condition variable. A job whose future was cancelled before it ran is skipped.
Metrics, label ``lane`` (:mod:`recserve.metrics.catalog`): jobs run, device seconds and
queue wait per lane; and the seconds the device idled holding decode back.

Example::

    device = DeviceExecutor(BulkheadConfig(min_device_share=0.2))
    rank_pool = device.lane(Lane.CRITICAL)        # RankingCore(..., executor=rank_pool)
    decode_pool = device.lane(Lane.BEST_EFFORT)   # ServingLoop(..., executor=decode_pool)
    ...
    device.shutdown()
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from recserve.errors import Unavailable
from recserve.metrics import catalog
from recserve.scheduling.bulkhead import BulkheadConfig, BulkheadStats, DeviceBulkhead, Job, Lane

log = logging.getLogger(__name__)
R = TypeVar("R")

_Work = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DeviceExecutor:
    """Runs every lane's work on one thread, one job at a time, bulkhead-ordered."""

    def __init__(self, config: BulkheadConfig = BulkheadConfig(), *, clock: Callable[[], float] = time.monotonic, name: str = "device") -> None:
        self.config = config
        self.name = name
        self._clock = clock
        self._bulkhead: DeviceBulkhead[_Work] = DeviceBulkhead(config)
        self._cond = threading.Condition()
        self._closed = False
        self._metrics = {lane: (catalog.DEVICE_JOBS.labels(lane.name.lower()), catalog.DEVICE_BUSY.labels(lane.name.lower()),
                                catalog.DEVICE_QUEUE_WAIT.labels(lane.name.lower())) for lane in Lane}  # fmt: skip
        self._paced_seen = 0.0  # the bulkhead's paced_s already counted in DEVICE_PACED
        self._thread = threading.Thread(target=self._work, name=f"recserve-{name}", daemon=True)
        self._thread.start()

    def lane(self, lane: Lane) -> LaneExecutor:
        """An executor whose jobs run on ``lane``."""
        return LaneExecutor(self, Lane(lane))

    def submit(self, lane: Lane, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[R]:
        """Queue ``fn(*args, **kwargs)`` on ``lane``; its future. Unavailable once shut down."""
        future: concurrent.futures.Future[R] = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise Unavailable(f"device executor {self.name!r} is shut down; not accepting {lane.name.lower()} work")
            self._bulkhead.push(lane, (future, fn, args, kwargs), self._clock())
            self._cond.notify()
        return future

    def announce(self) -> None:
        """A critical (ranker) batch is in flight and will want the device soon."""
        with self._cond:
            self._bulkhead.announce(self._clock())

    def withdraw(self) -> None:
        """An announced batch is done with the device: held-back decode may go."""
        with self._cond:
            self._bulkhead.withdraw(self._clock())
            self._cond.notify()

    def stats(self) -> BulkheadStats:
        with self._cond:
            return self._bulkhead.stats()

    def shutdown(self, wait: bool = True) -> None:
        """Stop accepting work; what is queued still runs. ``wait``: until it has."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _work(self) -> None:
        bulkhead, cond = self._bulkhead, self._cond
        while True:
            with cond:
                job: Job[_Work] | None = bulkhead.pop(self._clock())
                while job is None:
                    if self._closed and bulkhead.idle:
                        return
                    now = self._clock()
                    wake = bulkhead.next_wakeup(now)  # decode held back for an announced batch: until its credit is back
                    cond.wait(None if wake is None else max(0.0, wake - now))
                    job = bulkhead.pop(self._clock())
            future, fn, args, kwargs = job.payload
            job.payload = (future, fn, (), {})  # drop the arguments once run: a batch's tensors go with them
            outcome: tuple[bool, Any] | None = None  # (ok, result or exception); None: cancelled before it ran
            if future.set_running_or_notify_cancel():
                try:
                    outcome = (True, fn(*args, **kwargs))
                except BaseException as exc:  # the caller's failure, delivered through its future
                    outcome = (False, exc)
            del args, kwargs
            # Account before resolving: whoever awaits the future sees the job counted.
            with cond:
                end = self._clock()
                bulkhead.done(job, end)
                paced, self._paced_seen = bulkhead.paced_s - self._paced_seen, bulkhead.paced_s
            if paced > 0:
                catalog.DEVICE_PACED.inc(paced)
            jobs, busy, wait = self._metrics[job.lane]
            jobs.inc()
            busy.inc(max(0.0, end - job.started_at))
            wait.observe(max(0.0, job.started_at - job.queued_at))
            if outcome is not None:
                if outcome[0]:
                    future.set_result(outcome[1])
                else:
                    future.set_exception(outcome[1])
            del outcome


class LaneExecutor(concurrent.futures.Executor):
    """One lane of a :class:`DeviceExecutor` as a standard executor (``loop.run_in_executor``)."""

    def __init__(self, device: DeviceExecutor, lane: Lane) -> None:
        self.device = device
        self.lane_kind = lane

    def submit(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[R]:
        return self.device.submit(self.lane_kind, fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing: the device outlives each workload; its owner shuts it down."""

    @contextlib.contextmanager
    def announced(self) -> Iterator[None]:
        """Around one critical batch's whole run (lookups and forward): decode yields to
        it while it is in flight (:meth:`DeviceExecutor.announce`). A no-op on the
        best-effort lane."""
        if self.lane_kind is not Lane.CRITICAL:
            yield
            return
        self.device.announce()
        try:
            yield
        finally:
            self.device.withdraw()
