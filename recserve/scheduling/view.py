"""The view of the scheduler that the core lends its policy (the concrete
:class:`~recserve.scheduling.policy_base.SchedulerView`).

During ``Scheduler.schedule`` the policy builds the batch through it: ``take`` (queue →
batch), ``run`` (resident → batch), ``preempt`` (resident → queue), ``set_cost``. Every
transition goes through the core's own bookkeeping, so queue counts, tenant quotas and
metrics stay consistent whatever the policy does; a policy that raises mid-select has
its partial batch rolled back.

The view never sees the :class:`~recserve.scheduling.core.Scheduler`: the core injects
exactly what it lends — its EDF queue, its resident map and in-flight batches (shared
containers the core never rebinds), the queue-wait metric, the service-time estimate,
and its ``requeue`` / ``set_cost`` transitions — so this module does not import the core
and the core's private fields stay private.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from recserve.errors import InternalError
from recserve.scheduling.queue import EdfQueue
from recserve.scheduling.types import Batch, Handle, ItemStatus

_QUEUED, _RUNNING, _RESIDENT = ItemStatus.QUEUED, ItemStatus.RUNNING, ItemStatus.RESIDENT


class CoreView:
    """The :class:`~recserve.scheduling.policy_base.SchedulerView` the core lends to its
    policy during ``select`` / ``ready_at``; collects the batch being built."""

    __slots__ = (
        "_queue", "_resident", "_inflight", "_record_waits", "_estimate_service_s", "_requeue", "_set_cost",
        "_now", "_flush", "_handles", "_cost", "_from_queue", "_from_resident",
    )

    def __init__(
        self,
        *,
        queue: EdfQueue,
        resident: dict[int, Handle],
        inflight: Mapping[int, Batch],
        record_waits: Callable[[list[float]], None],
        estimate_service_s: Callable[[float], float],
        requeue: Callable[[Handle, float], None],
        set_cost: Callable[[Handle, float], None],
    ) -> None:
        self._queue = queue
        self._resident = resident  # seq -> handle; run() / rollback() move handles in and out
        self._inflight = inflight  # read only: batches now running
        # Queue-wait seconds of the items taken, a list per take / take_while call: one
        # call per batch, not per item (issue 9: a window takes dozens of callers).
        self._record_waits = record_waits
        self._estimate_service_s = estimate_service_s
        self._requeue = requeue  # (handle, now): resident -> queued, counted as a preemption
        self._set_cost = set_cost  # (handle, cost): keeps queue cost and tenant quota in step
        self._now = 0.0
        self._flush = False
        self._handles: list[Handle] = []
        self._cost = 0.0
        self._from_queue = False
        self._from_resident: list[Handle] = []

    def begin(self, now: float, flush: bool) -> None:
        self._now = now
        self._flush = flush
        self._handles = []
        self._cost = 0.0
        self._from_queue = False
        self._from_resident = []

    def finish(self) -> tuple[list[Handle], float, bool]:
        handles, self._handles = self._handles, []
        self._from_resident = []
        return handles, self._cost, self._from_queue

    def rollback(self) -> None:
        """The policy raised mid-select: put what it took back where it came from."""
        resident = set(map(id, self._from_resident))
        for handle in self._handles:
            handle.steps -= 1
            if id(handle) in resident:
                handle.status = _RESIDENT
                self._resident[handle.seq] = handle
            else:
                handle.status = _QUEUED
                self._queue.push(handle, handle.enqueued_at)
        self.finish()

    # reads
    @property
    def queued_count(self) -> int:
        return self._queue.count

    @property
    def queued_cost(self) -> float:
        return self._queue.cost

    @property
    def open_since(self) -> float | None:
        return self._queue.open_since

    @property
    def resident(self) -> Sequence[Handle]:
        return tuple(self._resident.values())

    @property
    def resident_count(self) -> int:
        return len(self._resident)

    @property
    def running(self) -> Iterator[Handle]:
        for batch in self._inflight.values():
            for handle in batch.handles:
                if handle.status is _RUNNING:
                    yield handle

    @property
    def inflight_batches(self) -> int:
        return len(self._inflight)

    @property
    def flush(self) -> bool:
        return self._flush

    @property
    def batch_size(self) -> int:
        return len(self._handles)

    @property
    def batch_cost(self) -> float:
        return self._cost

    def earliest_deadline(self) -> float:
        return self._queue.earliest_deadline()

    def estimate_service_s(self, cost: float) -> float:
        return self._estimate_service_s(cost)

    def peek(self) -> Handle | None:
        return self._queue.peek()

    def set_record_waits(self, record_waits: Callable[[list[float]], None]) -> None:
        """Replace the queue-wait recorder (the core adds an exporter's to its own)."""
        self._record_waits = record_waits

    # batch building
    def take(self) -> Handle:
        try:
            handle = self._queue.pop()
        except IndexError:
            raise InternalError("policy called take() on an empty queue") from None
        handle.status = _RUNNING
        handle.steps += 1
        self._record_waits([self._now - handle.enqueued_at])
        self._handles.append(handle)
        self._cost += handle.cost
        self._from_queue = True
        return handle

    def take_while(self, max_cost: float) -> int:
        """Take queued items in order while the batch cost stays <= ``max_cost``; the
        first item of an empty batch is taken whatever its cost. Returns how many."""
        taken = self._queue.pop_up_to(max_cost - self._cost, not self._handles, _RUNNING)
        if not taken:
            return 0
        now = self._now
        cost = self._cost
        for handle in taken:
            handle.steps += 1
            cost += handle.cost
        self._cost = cost
        self._handles.extend(taken)
        self._from_queue = True
        self._record_waits([now - handle.enqueued_at for handle in taken])
        return len(taken)

    def run(self, handle: Handle) -> None:
        if handle.status is not _RESIDENT:
            raise InternalError(f"policy tried to run request {handle.request_id}, which is {handle.status.value}, not resident")
        del self._resident[handle.seq]
        handle.status = _RUNNING
        handle.steps += 1
        self._handles.append(handle)
        self._from_resident.append(handle)
        self._cost += handle.cost

    def preempt(self, handle: Handle, state: Any = None) -> None:
        if handle.status is not _RESIDENT:
            raise InternalError(f"policy tried to preempt request {handle.request_id}, which is {handle.status.value}, not resident")
        del self._resident[handle.seq]
        if state is not None:
            handle.state = state
        self._requeue(handle, self._now)

    def set_cost(self, handle: Handle, cost: float) -> None:
        if handle.status is not _QUEUED and handle.status is not _RESIDENT:
            raise InternalError(f"policy tried to change the cost of request {handle.request_id}, which is {handle.status.value}")
        self._set_cost(handle, cost)
