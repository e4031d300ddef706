"""The scheduler core: a synchronous state machine with no I/O (docs/architecture.md §6).

Every call takes ``now`` (monotonic seconds) from its caller, so tests drive it with a
fake clock and the async :class:`~recserve.scheduling.loop.ServingLoop` drives it with
``time.monotonic()``. Item lifecycle::

    add ──▶ QUEUED ──schedule──▶ RUNNING ──complete: Done──────▶ DONE
              ▲  │                 │  ├──complete: Continue──▶ RESIDENT ──schedule (policy runs it)──▶ RUNNING
              │  │                 │  ├──complete: Preempted─▶ QUEUED
              │  │                 │  └──complete: Failed────▶ FAILED      (that item only)
              │  │                 ├──resolve: Done / Failed──▶ DONE / FAILED (early; complete skips it)
              │  │                 └──fail──────────────────────▶ FAILED      (the whole batch)
              │  ├──deadline passes──▶ DROPPED (never executed)
              │  └──cancel──▶ CANCELLED      (RUNNING + cancel: outcome discarded at complete)
              └──policy preempts a RESIDENT item

Rules shared by every policy: priority classes first, EDF within a class (see
:class:`~recserve.scheduling.queue.EdfQueue`); admission at ``add`` (see
:mod:`~recserve.scheduling.admission`); an item whose deadline passes before it runs is
dropped with DEADLINE_EXCEEDED; results go to each handle's :class:`ItemListener`.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Sequence

from recserve.errors import Cancelled, DeadlineExceeded, InternalError, InvalidArgument, RecserveError
from recserve.scheduling.admission import Admission, AdmissionConfig
from recserve.scheduling.estimators import ServiceTimeEstimator
from recserve.scheduling.metrics import DropReason, SchedulerMetrics, SchedulerStats
from recserve.scheduling.policy_base import Policy
from recserve.scheduling.queue import EdfQueue
from recserve.scheduling.types import (
    TERMINAL, Batch, Continue, Done, Failed, Handle, ItemListener, ItemStatus, Preempted, Priority, Resolution, WorkItem,
)
from recserve.scheduling.view import CoreView
from recserve.scheduling.window import WindowPolicy

log = logging.getLogger(__name__)

_QUEUED, _RUNNING, _RESIDENT, _DONE = ItemStatus.QUEUED, ItemStatus.RUNNING, ItemStatus.RESIDENT, ItemStatus.DONE
_INF = math.inf


def _overrides(policy: Policy, hook: str) -> bool:
    return getattr(type(policy), hook) is not getattr(Policy, hook)


class _WaitParts:
    """What :meth:`Scheduler.estimated_wait_s` reads besides the queue: derived when a
    batch forms or ends (or the service fit gets a sample), then reused by every add
    until the next such event, instead of re-derived per caller (issue 9). Also the
    fit's estimate for the latest cost asked (callers of one shape share a cost)."""

    __slots__ = ("service_count", "mean_s", "size", "running", "parallelism", "free_slots", "service_s", "estimate_cost", "estimate_s")

    def __init__(self, *, service_count: int, mean_s: float, size: float, running: int, parallelism: int, service_s: float) -> None:
        self.service_count = service_count  # ServiceTimeEstimator.count it was derived at
        self.mean_s = mean_s  # mean service time per batch
        self.size = size  # max(1, mean items per batch)
        self.running = running  # batches in flight
        self.parallelism = parallelism
        self.free_slots = parallelism - 1
        self.service_s = service_s  # batch start -> an item's answer
        self.estimate_cost = math.nan  # the cost estimate_s is for (NaN: none yet; it equals no cost)
        self.estimate_s = 0.0


class Scheduler:
    """One scheduler: a policy, an EDF queue, admission limits and metrics.

    Not thread-safe: call it from one thread (the serving loop's event loop)."""

    def __init__(
        self,
        policy: Policy,
        admission: AdmissionConfig = AdmissionConfig(),
        *,
        metrics_window: int = 2048,
        service_alpha: float = 0.1,
    ) -> None:
        self.policy = policy
        self.metrics = SchedulerMetrics(metrics_window)
        self.service = ServiceTimeEstimator(service_alpha)
        self.admission = Admission(admission, queue_drain_s=self._queue_drain_hint, batch_service_s=self.service.mean_s)
        self._queue = EdfQueue()
        self._resident: dict[int, Handle] = {}  # seq -> handle, in the order they became resident
        self._inflight: dict[int, Batch] = {}
        self._running = 0
        self._seq = 0
        # Batches the owner runs at once (the serving loop's max_inflight): the queue
        # drains that many times faster, which the slack check at add accounts for.
        self._parallelism = 1
        # estimated_wait_s()'s inputs that move only when a batch forms or ends (or the
        # service fit gets a sample): derived once per such event, not per add.
        self._wait: _WaitParts | None = None
        self.shed = 0  # requests shed at add by the slack check (counted in drops as rejected too)
        self._batch_seq = 0
        self._mean_size = 1.0  # items per batch, weighted like the service-time fit (service_alpha)
        self._item_s = 0.0  # batch start -> an item's answer, mean per batch, weighted alike
        # The view gets only what it lends the policy (view.py never imports this module).
        self._view = CoreView(
            queue=self._queue, resident=self._resident, inflight=self._inflight,
            record_waits=self.metrics.queue_wait_s.record_many, estimate_service_s=self.service.estimate_s,
            requeue=self._requeue, set_cost=self._set_cost,
        )
        # Hooks the policy leaves as the base no-op are skipped on the per-item path.
        self._on_add = policy.on_add if _overrides(policy, "on_add") else None
        self._on_finish = policy.on_finish if _overrides(policy, "on_finish") else None
        # A window policy's batch-cost cap (it may move, e.g. an SLO controller's): the
        # wait estimate counts the queue in full batches of it (estimated_wait_s).
        self._batch_cap: Callable[[], float] | None = policy.cap if isinstance(policy, WindowPolicy) else None

    # ------------------------------------------------------------------ calls
    def add(self, item: WorkItem, now: float, listener: ItemListener | None = None) -> Handle:
        """Admit ``item`` or raise: ResourceExhausted (queue bound / tenant quota / too
        little slack for the estimated queue wait + service time, with a retry-after
        hint), DeadlineExceeded (deadline already passed), InvalidArgument
        (bad cost / deadline / priority, or a cost no bound could ever admit), or whatever
        the policy's ``on_add`` raises to refuse it (admission is then undone)."""
        cost = item.cost
        if not 0.0 <= cost < _INF:
            raise InvalidArgument(f"request {item.request_id}: cost {cost!r} must be a finite number >= 0")
        if not item.deadline > now:  # also catches a NaN deadline, which would corrupt the EDF heaps
            if item.deadline != item.deadline:
                raise InvalidArgument(f"request {item.request_id}: deadline {item.deadline!r} must be monotonic seconds (math.inf for none)")
            self.metrics.drops[DropReason.DEADLINE] += 1
            raise DeadlineExceeded(
                f"request {item.request_id} arrived {(now - item.deadline) * 1e3:.3f} ms after its deadline; not queued"
            )
        if type(item.priority) is not Priority:  # the queue indexes its heaps by it
            raise InvalidArgument(
                f"request {item.request_id}: priority {item.priority!r} is not a Priority; use Priority.parse()"
            )
        queue = self._queue
        service = self.service
        try:
            if item.deadline < _INF and service.count >= self.admission.config.shed_after_batches:  # a warm estimate only
                # The slack check (admission.py): shed the item if its slack is below the
                # estimated queue wait + service time, since it could only be run into
                # its deadline. Inlined: it runs for every caller with a deadline.
                wait_s, service_s = self.estimated_wait_s()
                # wait_s <= 0: it would start at once. Run it, whatever the estimate says:
                # a run is the estimate's only refresh, and a stale, too-high one that shed
                # an idle server's every request would never be corrected. Work whose
                # slack is short by nature (a tight cascade deadline) then answers degraded.
                if wait_s > 0.0:
                    parts = self._wait  # fresh: estimated_wait_s() just derived it
                    assert parts is not None
                    if cost != parts.estimate_cost:  # the fit's estimate, once per cost and batch event
                        parts.estimate_cost, parts.estimate_s = cost, service.estimate_s(cost)
                    # max(service_s, estimate, item.min_service_s), without the call
                    need_s = service_s
                    if parts.estimate_s > need_s:
                        need_s = parts.estimate_s
                    if item.min_service_s > need_s:
                        need_s = item.min_service_s
                    slack_s = item.deadline - now
                    if slack_s < wait_s + need_s and self.admission.config.shed_by_slack:
                        try:
                            self.admission.shed(item.request_id, slack_s, wait_s, need_s, queue.count)  # raises: the message and hint
                        except RecserveError:
                            self.shed += 1
                            raise
            quota = self.admission.admit(item.tenant, cost, queue.count, queue.cost, now)
        except RecserveError:
            self.metrics.drops[DropReason.REJECTED] += 1
            raise
        self._seq += 1
        handle = Handle(item, self._seq, cost, now, now, listener, quota=quota)
        if self._on_add is not None:
            try:
                self._on_add(handle, now)  # the policy may refuse the item (e.g. it can never fit its KV cache)
            except BaseException:
                self._seq -= 1
                self.admission.refund(quota, cost)
                self.metrics.drops[DropReason.REJECTED] += 1
                raise
        queue.push(handle, now)
        return handle

    def schedule(self, now: float, *, flush: bool = False) -> Batch | None:
        """Drop expired items, then let the policy form the next batch (None = wait).
        ``flush`` asks the policy not to wait for windows (draining)."""
        self.expire(now)
        if not self._queue.count and not self._resident:
            return None
        view = self._view
        view.begin(now, flush)
        try:
            self.policy.select(view, now)
        except BaseException:
            view.rollback()
            raise
        handles, cost, took_queued = view.finish()
        if not handles:
            return None
        queue = self._queue
        if took_queued and queue.count:
            # Leftovers have been waiting; their window runs from the oldest of them.
            head = queue.peek()
            queue.open_since = head.enqueued_at if head is not None else None
        self._batch_seq += 1
        batch = Batch(self._batch_seq, tuple(handles), cost, now)
        self._inflight[batch.batch_id] = batch
        self._running += len(handles)
        metrics = self.metrics
        metrics.batches += 1
        metrics.batch_size.record(len(handles))
        metrics.batch_cost.record(cost)
        a = self.service.alpha
        self._mean_size = len(handles) if metrics.batches == 1 else self._mean_size + a * (len(handles) - self._mean_size)
        self._wait = None  # one more batch running, a new mean size
        return batch

    def complete(self, batch: Batch, outcomes: Sequence[Any], now: float) -> None:
        """Apply one outcome per item (Done / Continue / Preempted / Failed). A count
        mismatch or a non-outcome fails the batch's items with INTERNAL; outcomes of items
        cancelled while running, or already answered through :meth:`resolve`, are
        discarded and their resources released here."""
        self._take_inflight(batch)
        handles = batch.handles
        try:
            count = len(outcomes)
        except TypeError:
            count = -1
        if count != len(handles):
            err = InternalError(
                f"batch {batch.batch_id}: the runner returned {count if count >= 0 else type(outcomes).__name__} "
                f"outcomes for {len(handles)} items; it must return exactly one per item"
            )
            log.error("%s", err.message)
            self._fail_handles(handles, err, now)
            return
        started = batch.started_at
        service_s = now - started
        self.service.observe(batch.cost, service_s)
        self.metrics.service_s.record(service_s)
        early = 0.0  # what early answers (resolve) saved, summed over the batch's items
        policy = self.policy
        on_finish = self._on_finish
        latencies: list[float] = []  # recorded once, in order, at the end
        latency = latencies.append
        release = Admission.release
        completed = 0
        i = -1
        try:
            for i, (handle, outcome) in enumerate(zip(handles, outcomes)):
                if handle.status is not _RUNNING:  # cancelled or resolved while running: discard, release
                    if handle.answered_at >= started:
                        early += now - handle.answered_at
                    # _release, inlined: a lookup window's every caller was resolved early.
                    if handle.quota is not None:
                        release(handle.quota, handle.cost)
                        handle.quota = None
                    if on_finish is not None:
                        on_finish(handle, now)
                    continue
                kind = type(outcome)
                if kind is Done:  # the hot path, inlined: one-shot batches finish every item here
                    handle.status = _DONE
                    output = handle.output = outcome.output
                    latency(now - handle.arrived_at)
                    completed += 1
                    listener = handle.listener
                    if listener is not None:
                        handle.listener = None  # terminal: no more results; breaks handle <-> listener cycles
                        try:
                            listener.on_done(handle, output)
                        except Exception:
                            log.exception("listener of request %s failed on done", handle.request_id)
                    if handle.quota is not None:
                        release(handle.quota, handle.cost)
                        handle.quota = None
                    if on_finish is not None:
                        on_finish(handle, now)
                elif kind is Continue:
                    self._continue(handle, outcome, now)
                elif kind is Preempted:
                    if outcome.state is not None:
                        handle.state = outcome.state
                    self._requeue(handle, now)
                    policy.on_requeue(handle, now)
                elif kind is Failed:
                    self._finish_error(handle, self._item_error(handle, outcome.error), ItemStatus.FAILED, now)
                else:
                    self._finish_error(handle, InternalError(
                        f"request {handle.request_id}: the runner returned {kind.__name__}; "
                        "expected Done, Continue, Preempted or Failed"
                    ), ItemStatus.FAILED, now)
        except BaseException as exc:  # a policy hook bug: no item may be left RUNNING (its caller would hang)
            err = InternalError(f"batch {batch.batch_id}: completing it raised {exc!r}; its unfinished items fail")
            if 0 <= i < len(handles) and handles[i].status is _RUNNING:
                self._finish_error(handles[i], err, ItemStatus.FAILED, now)
            self._fail_handles(handles[i + 1:], err, now)  # not reached yet: running or cancelled in flight
            raise
        finally:
            self.metrics.latency_s.record_many(latencies)
            self.metrics.completed += completed
        # When the batch's items got their answers, on average: its end, less what early
        # answers saved. A lookup window whose last caller waits for a late shard until
        # its deadline lasts 20 ms though most callers had theirs in 5.
        item_s = service_s - early / max(len(handles), 1)
        self._item_s = item_s if self.service.count == 1 else self._item_s + self.service.alpha * (item_s - self._item_s)
        self._wait = None
        policy.on_batch_done(batch, service_s, now)

    def resolve(self, handle: Handle, outcome: Resolution, now: float) -> bool:
        """Answer one RUNNING item early, while its batch still runs: ``Done(output)`` or
        ``Failed(error)`` reaches its listener now and the item becomes terminal. The
        batch's later ``complete`` / ``fail`` skips it (its outcome there is ignored) and
        only then releases its quota and policy resources, which the runner may still be
        using. Returns False if the item was already terminal (cancelled, dropped or
        resolved before); resolving an item that is not running is a runner bug."""
        status = handle.status
        if status is not _RUNNING:
            if status in TERMINAL:
                return False
            raise InternalError(f"request {handle.request_id}: resolve() needs a running item; it is {status.value}")
        kind = type(outcome)
        if kind is Done:
            self.resolve_done((handle,), (outcome.output,), now)  # type: ignore[union-attr]
        elif kind is Failed:
            handle.answered_at = now
            handle.status = ItemStatus.FAILED
            self.metrics.failed += 1
            self._notify_error(handle, self._item_error(handle, outcome.error))  # type: ignore[union-attr]
        else:
            raise InternalError(f"request {handle.request_id}: resolve() takes Done or Failed, not {kind.__name__}")
        return True

    def resolve_done(self, handles: Sequence[Handle], outputs: Sequence[Any], now: float) -> int:
        """:meth:`resolve` of ``Done(outputs[i])`` for each of ``handles``, in one call (a
        lookup window answers dozens of callers at once; this skips a ``Done`` and two
        calls per item). Items already terminal are skipped; returns how many were
        answered. Raises InternalError, like :meth:`resolve`, for an item that is
        neither running nor terminal (those before it stay answered)."""
        answered = 0
        latencies: list[float] = []  # recorded once, in order, at the end
        latency = latencies.append
        try:
            for handle, output in zip(handles, outputs):
                status = handle.status
                if status is not _RUNNING:
                    if status in TERMINAL:
                        continue
                    raise InternalError(f"request {handle.request_id}: resolve() needs a running item; it is {status.value}")
                # The one Done transition (resolve's too), inline: it runs for every caller of a window.
                handle.answered_at = now
                handle.status = _DONE
                handle.output = output
                latency(now - handle.arrived_at)
                listener = handle.listener
                if listener is not None:
                    handle.listener = None
                    try:
                        listener.on_done(handle, output)
                    except Exception:
                        log.exception("listener of request %s failed on done", handle.request_id)
                answered += 1
        finally:
            self.metrics.latency_s.record_many(latencies)
            self.metrics.completed += answered
        return answered

    def fail(self, batch: Batch, error: BaseException, now: float) -> None:
        """The runner failed: every item of the batch still running fails with ``error``
        (non-recserve exceptions are wrapped as INTERNAL); items already resolved keep
        their answer."""
        self._take_inflight(batch)
        if isinstance(error, RecserveError):
            err = error
        else:
            err = InternalError(f"batch {batch.batch_id} of {len(batch)} items failed in the runner: {error!r}")
            err.__cause__ = error
        self._fail_handles(batch.handles, err, now)

    def cancel(self, handle: Handle, now: float) -> bool:
        """Cancel an item. Queued / resident: removed now. Running: its outcome will be
        discarded and its resources released at the batch's complete. Returns False if
        the item had already finished."""
        status = handle.status
        if status is _QUEUED:
            handle.status = ItemStatus.CANCELLED
            self._queue.discard(handle)
            self._release(handle, now)
        elif status is _RESIDENT:
            del self._resident[handle.seq]
            handle.status = ItemStatus.CANCELLED
            self._release(handle, now)
        elif status is _RUNNING:
            handle.status = ItemStatus.CANCELLED
        else:
            return False
        self.metrics.drops[DropReason.CANCELLED] += 1
        self._notify_error(handle, Cancelled(f"request {handle.request_id} was cancelled"))
        return True

    def expire(self, now: float) -> int:
        """Drop queued and resident items whose deadline is <= now; returns how many."""
        dropped = 0
        queue = self._queue
        while (handle := queue.pop_expired(now)) is not None:
            self._drop(handle, now)
            dropped += 1
        if self._resident:
            for handle in [h for h in self._resident.values() if h.item.deadline <= now]:
                del self._resident[handle.seq]
                self._drop(handle, now)
                dropped += 1
        return dropped

    def next_deadline(self) -> float | None:
        """The earliest deadline among queued and resident items (when ``expire`` has work)."""
        best = self._queue.earliest_deadline()
        for handle in self._resident.values():
            best = min(best, handle.item.deadline)
        return best if best < math.inf else None

    def next_wakeup(self, now: float, *, flush: bool = False) -> float | None:
        """When the owner should next call ``schedule`` (a time <= now means now), or None
        if nothing is pending. The minimum of the policy's dispatch time and the earliest
        deadline (to drop it on time)."""
        if not self._queue.count and not self._resident:
            return None
        view = self._view
        view.begin(now, flush)
        try:
            due = self.policy.ready_at(view, now)
        finally:
            view.finish()
        deadline = self.next_deadline()
        if due is None:
            return deadline
        return due if deadline is None else min(due, deadline)

    def abort_pending(self, error: RecserveError, now: float) -> int:
        """Fail every queued and resident item with ``error`` (a closing loop that does not
        drain). Running items are left to their batches. Returns how many."""
        pending = list(self._queue) + list(self._resident.values())
        self._resident.clear()
        for handle in pending:
            if handle.status is _QUEUED:
                handle.status = ItemStatus.FAILED
                self._queue.discard(handle)
            self._finish_error(handle, error, ItemStatus.FAILED, now)
        return len(pending)

    def observe_queue_waits(self, observe_many: Callable[[list[float]], None]) -> None:
        """Also hand the queue-wait samples (seconds, one per item a batch takes from the
        queue) to ``observe_many``, a list per batch, e.g. a Prometheus histogram's
        (the serving loop's :meth:`~recserve.metrics.histogram.BatchHistogram.observe_many`)."""
        record_many = self.metrics.queue_wait_s.record_many

        def both(seconds: list[float]) -> None:
            record_many(seconds)
            observe_many(seconds)

        self._view.set_record_waits(both)

    # ------------------------------------------------------------------ reads
    @property
    def idle(self) -> bool:
        """Nothing queued, resident or running."""
        return not self._queue.count and not self._resident and not self._inflight

    @property
    def queued_count(self) -> int:
        return self._queue.count

    @property
    def inflight_batches(self) -> int:
        return len(self._inflight)

    def stats(self) -> SchedulerStats:
        m = self.metrics
        return SchedulerStats(
            queued_items=self._queue.count, queued_cost=self._queue.cost, running_items=self._running,
            resident_items=len(self._resident), inflight_batches=len(self._inflight),
            admitted=self._seq, completed=m.completed, failed=m.failed, preempted=m.preempted, batches=m.batches,
            drops={reason.value: n for reason, n in m.drops.items()},
            queue_wait_s=m.queue_wait_s.summary(), batch_size=m.batch_size.summary(), batch_cost=m.batch_cost.summary(),
            service_s=m.service_s.summary(), latency_s=m.latency_s.summary(), policy=self.policy.gauges(),
        )

    # ------------------------------------------------------------------ internals
    def _take_inflight(self, batch: Batch) -> None:
        if self._inflight.pop(batch.batch_id, None) is None:
            raise InternalError(f"batch {batch.batch_id} is not in flight (completed or failed twice?)")
        self._running -= len(batch.handles)
        self._wait = None  # one batch fewer running

    def _requeue(self, handle: Handle, now: float) -> None:
        handle.status = _QUEUED
        handle.enqueued_at = now
        self._queue.push(handle, now)
        self.metrics.preempted += 1

    def _continue(self, handle: Handle, outcome: Continue, now: float) -> None:
        if outcome.new_cost is not None:
            if not 0.0 <= outcome.new_cost < math.inf:
                self._finish_error(handle, InternalError(
                    f"request {handle.request_id}: the runner's Continue.new_cost {outcome.new_cost!r} must be a finite number >= 0"
                ), ItemStatus.FAILED, now)
                return
            self._set_cost(handle, outcome.new_cost)
        if outcome.state is not None:
            handle.state = outcome.state
        handle.status = _RESIDENT
        self._resident[handle.seq] = handle
        if outcome.partial_output is not None and handle.listener is not None:
            try:
                handle.listener.on_partial(handle, outcome.partial_output)
            except Exception:
                log.exception("listener of request %s failed on a partial output", handle.request_id)
        self.policy.on_continue(handle, now)

    def _set_cost(self, handle: Handle, cost: float) -> None:
        if not 0.0 <= cost < math.inf:
            raise InvalidArgument(f"request {handle.request_id}: new cost {cost!r} must be a finite number >= 0")
        delta = cost - handle.cost
        if handle.status is _QUEUED:
            self._queue.adjust_cost(delta)
        Admission.adjust(handle.quota, delta)
        handle.cost = cost

    def _drop(self, handle: Handle, now: float) -> None:
        handle.status = ItemStatus.DROPPED
        self.metrics.drops[DropReason.DEADLINE] += 1
        ran = f"after {handle.steps} steps it is not run again" if handle.steps else "it was not executed"
        self._notify_error(handle, DeadlineExceeded(
            f"request {handle.request_id} missed its deadline by {(now - handle.item.deadline) * 1e3:.3f} ms "
            f"({(now - handle.enqueued_at) * 1e3:.3f} ms since it was last queued); {ran}"
        ))
        self._release(handle, now)

    def _finish_error(self, handle: Handle, error: RecserveError, status: ItemStatus, now: float) -> None:
        handle.status = status
        self.metrics.failed += 1
        self._notify_error(handle, error)
        self._release(handle, now)

    def _fail_handles(self, handles: Sequence[Handle], error: RecserveError, now: float) -> None:
        for handle in handles:
            if handle.status is _RUNNING:
                self._finish_error(handle, error, ItemStatus.FAILED, now)
            else:  # cancelled or resolved while running: already notified
                self._release(handle, now)

    @staticmethod
    def _item_error(handle: Handle, error: BaseException) -> RecserveError:
        """A Failed outcome's error as the caller sees it: non-recserve errors become INTERNAL."""
        if isinstance(error, RecserveError):
            return error
        err = InternalError(f"request {handle.request_id} failed in the runner: {error!r}")
        err.__cause__ = error
        return err

    def _notify_error(self, handle: Handle, error: RecserveError) -> None:
        """Every error is terminal for the item: its last notification."""
        handle.error = error
        listener = handle.listener
        if listener is not None:
            handle.listener = None  # breaks handle <-> listener cycles (GC pauses otherwise)
            try:
                listener.on_error(handle, error)
            except Exception:
                log.exception("listener of request %s failed on an error", handle.request_id)

    def _release(self, handle: Handle, now: float) -> None:
        """The terminal transition's bookkeeping: quota back to the tenant, policy told."""
        Admission.release(handle.quota, handle.cost)
        handle.quota = None
        if self._on_finish is not None:
            self._on_finish(handle, now)

    def estimated_wait_s(self) -> tuple[float, float]:
        """``(queue wait, service)`` in seconds a request added now should expect: the
        batches ahead of it (queued items / mean batch size, plus those running) times
        the mean service time per batch, divided by :attr:`parallelism`, less the slots
        still free (with a free slot and nothing queued it starts at once: 0); and how
        long after its batch starts an item gets its answer (recent batches' mean: the
        batch's end, or earlier for items answered early through :meth:`resolve`).
        Conservative for a request whose deadline or priority puts it ahead of part of
        the queue (EDF): it counts the whole queue, which costs O(1), not a scan."""
        parts = self._wait
        if parts is None or parts.service_count != self.service.count:
            parts = self._wait = self._wait_parts()
        queue = self._queue
        count = queue.count
        queued = count / parts.size
        cap = self._batch_cap
        if cap is not None and count:  # nothing queued: 0 either way, no cap() call
            # A window policy puts everything queued into its next batch, up to its cap:
            # the queue is at most cost / cap batches, fewer than count / mean size when
            # more is waiting than a usual batch holds (at light load batches are small
            # because little waits, so the mean size alone would shed callers that all
            # fit the next window).
            per_batch = cap()  # it may move (an SLO controller's): asked every time
            by_cost = queue.cost / (1e-9 if 1e-9 > per_batch else per_batch)
            if by_cost < queued:
                queued = by_cost
        # Its batch starts once all but parallelism - 1 of those ahead (queued, plus
        # the running ones that hold the slots) have finished.
        ahead = queued + parts.running - parts.free_slots
        # The min / max above and here are spelt out as max() and min() decide them
        # (NaN included): this runs for every caller with a deadline.
        return parts.mean_s * (ahead if ahead > 0.0 else 0.0) / parts.parallelism, parts.service_s

    def _wait_parts(self) -> _WaitParts:
        """The inputs of :meth:`estimated_wait_s` that only a batch event moves."""
        service = self.service
        mean_s = service.mean_s()
        # Recent means (weighted as the service-time fit is), not all-time ones: after a
        # burst of big batches an all-time mean batch cost stayed high for the rest of
        # the process's life, and the fit evaluated there over-estimated every later
        # request's service (issue 9: a lookup client shed 7.5 % of callers at 2,500
        # req/s, a third of its knee, after a closed-loop warm-up's big windows).
        mean_size = self._mean_size
        return _WaitParts(
            service_count=service.count, mean_s=mean_s, size=mean_size if mean_size > 1.0 else 1.0,
            running=len(self._inflight), parallelism=self._parallelism,
            service_s=self._item_s if service.count else mean_s,
        )

    @property
    def parallelism(self) -> int:
        """Batches the owner runs at once (the serving loop's ``max_inflight``)."""
        return self._parallelism

    @parallelism.setter
    def parallelism(self, value: int) -> None:
        self._parallelism = value
        self._wait = None

    def _queue_drain_hint(self) -> float:
        """Retry-after hint for a full queue: batches ahead × mean service per batch."""
        sizes = self.metrics.batch_size
        mean_size = sizes.total / sizes.count if sizes.count else 1.0
        return self.service.mean_s() * max(1.0, self._queue.count / max(1.0, mean_size))
