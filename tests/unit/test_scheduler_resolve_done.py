"""Scheduler.resolve_done (issue 9's lean caller path): answering a group in one call
is resolve(Done) of each — same outputs, statuses, counts and latency samples — and
skips items already terminal."""

from __future__ import annotations

import pytest

from recserve.errors import InternalError
from recserve.scheduling import Batch, Done, FeatureParallelConfig, FeatureParallelPolicy, Priority, Scheduler
from recserve.scheduling.admission import AdmissionConfig
from recserve.scheduling.types import Handle, ItemStatus, WorkItem


class _Listener:
    def __init__(self) -> None:
        self.done: dict[str, object] = {}

    def on_done(self, handle: Handle, output: object) -> None:
        self.done[handle.request_id] = output

    def on_error(self, handle: Handle, error: Exception) -> None:
        raise AssertionError(f"{handle.request_id} failed: {error}")

    def on_partial(self, handle: Handle, output: object) -> None:
        pass


def _running(n: int) -> tuple[Scheduler, Batch, _Listener]:
    sched = Scheduler(FeatureParallelPolicy(FeatureParallelConfig(window_ms=0.0, max_cost=1e9)), AdmissionConfig())
    listener = _Listener()
    for i in range(n):
        sched.add(WorkItem(f"r{i}", "default", Priority.STANDARD, 100.0, 1.0, None), 1.0 + i, listener)
    batch = sched.schedule(10.0, flush=True)
    assert batch is not None and len(batch) == n
    return sched, batch, listener


def test_resolve_done_equals_resolving_each_item() -> None:
    bulk, bulk_batch, bulk_seen = _running(5)
    each, each_batch, each_seen = _running(5)
    outputs = [f"out{i}" for i in range(5)]
    assert bulk.resolve_done(bulk_batch.handles[:3], outputs[:3], 12.0) == 3
    for h, out in zip(each_batch.handles[:3], outputs[:3]):
        assert each.resolve(h, Done(out), 12.0)
    for a, b in zip(bulk_batch.handles, each_batch.handles):
        assert (a.status, a.output, a.answered_at) == (b.status, b.output, b.answered_at)
    assert bulk_seen.done == each_seen.done == {"r0": "out0", "r1": "out1", "r2": "out2"}
    assert bulk.metrics.completed == each.metrics.completed == 3
    assert sorted(bulk.metrics.latency_s.recent()) == sorted(each.metrics.latency_s.recent()) == [9.0, 10.0, 11.0]
    # Already answered or cancelled: skipped, not answered twice.
    bulk.cancel(bulk_batch.handles[3], 12.5)
    assert bulk.resolve_done(bulk_batch.handles, ["x"] * 5, 13.0) == 1
    assert bulk_batch.handles[3].status is ItemStatus.CANCELLED and bulk_batch.handles[4].output == "x"
    assert bulk_seen.done["r0"] == "out0"


def test_resolve_done_refuses_an_item_that_is_not_running() -> None:
    sched, batch, _ = _running(1)
    sched.add(WorkItem("queued", "default", batch.handles[0].item.priority, 100.0, 1.0, None), 11.0)
    queued = sched._queue.peek()
    assert queued is not None
    with pytest.raises(InternalError, match="needs a running item; it is queued"):
        sched.resolve_done([queued], ["x"], 12.0)


def test_handle_done_is_exactly_the_terminal_statuses() -> None:
    from recserve.scheduling.types import TERMINAL

    h = Handle(WorkItem("r", "default", Priority.STANDARD, 1.0, 1.0, None), 1, 1.0, 0.0, 0.0)
    for status in ItemStatus:
        h.status = status
        assert h.done is (status in TERMINAL), status
