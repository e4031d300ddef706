"""Scheduler core: ordering, deadline drops, cancellation, failures, wake-ups, metrics.
Fake clock (plain floats), no sleeps, no threads."""

from __future__ import annotations

import math
import random
from typing import Any

import grpc
import pytest

from recserve.errors import Cancelled, DeadlineExceeded, InternalError, InvalidArgument, RecserveError, ResourceExhausted, Unavailable
from recserve.rpc.status import grpc_code
from recserve.scheduling import (
    AdmissionConfig,
    Continue,
    Done,
    FeatureParallelConfig,
    FeatureParallelPolicy,
    Handle,
    ItemStatus,
    Policy,
    Preempted,
    Priority,
    Scheduler,
    SchedulerView,
    WorkItem,
)
from recserve.config.spec import TenantConfig
from tests.utils import Recorder


def item(rid: str, *, deadline: float = 100.0, cost: float = 1.0, priority: Priority = Priority.STANDARD,
         tenant: str = "t") -> WorkItem:
    return WorkItem(rid, tenant, priority, deadline, cost, payload=f"payload-{rid}")


def fp_scheduler(window_ms: float = 0.0, max_cost: float = 1e9, admission: AdmissionConfig = AdmissionConfig()) -> Scheduler:
    policy = FeatureParallelPolicy(FeatureParallelConfig(window_ms=window_ms, max_cost=max_cost, dispatch_margin_ms=0.0))
    return Scheduler(policy, admission)


def ids(batch: Any) -> list[str]:
    return [h.request_id for h in batch.handles]


def test_edf_order_within_a_class_and_fifo_on_ties() -> None:
    sched = fp_scheduler()
    rng = random.Random(7)
    deadlines = [rng.choice([5.0, 3.0, 9.0, 1.0, 7.0]) for _ in range(40)]
    for i, d in enumerate(deadlines):
        sched.add(item(f"r{i}", deadline=d), now=0.0)
    batch = sched.schedule(0.0)
    assert batch is not None
    expected = [f"r{i}" for i, _ in sorted(enumerate(deadlines), key=lambda p: (p[1], p[0]))]
    assert ids(batch) == expected


def test_higher_priority_classes_first_even_with_later_deadlines() -> None:
    sched = fp_scheduler(max_cost=1.0)  # one item per batch: the dispatch order is the schedule order
    specs = [("b1", Priority.BEST_EFFORT, 1.0), ("s1", Priority.STANDARD, 8.0), ("c1", Priority.CRITICAL, 9.0),
             ("s2", Priority.STANDARD, 2.0), ("b2", Priority.BEST_EFFORT, 0.5), ("c2", Priority.CRITICAL, 3.0)]
    for rid, prio, d in specs:
        sched.add(item(rid, priority=prio, deadline=d), now=0.0)
    order = []
    while (batch := sched.schedule(0.0)) is not None:
        order += ids(batch)
        sched.complete(batch, [Done(None)], 0.0)
    assert order == ["c2", "c1", "s2", "s1", "b2", "b1"]


def test_expired_item_is_dropped_and_never_executed() -> None:
    sched = fp_scheduler()
    rec = Recorder()
    late = sched.add(item("late", deadline=1.0), 0.0, rec)
    sched.add(item("ok", deadline=5.0), 0.0, rec)
    batch = sched.schedule(2.0)
    assert batch is not None and ids(batch) == ["ok"]
    assert late.status is ItemStatus.DROPPED
    assert isinstance(rec.errors["late"], DeadlineExceeded)
    assert grpc_code(rec.errors["late"]) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert sched.stats().drops["deadline"] == 1
    sched.complete(batch, [Done("out")], 2.5)
    assert sched.schedule(3.0) is None  # the dropped item never comes back
    assert rec.done == {"ok": "out"}


def test_item_already_past_its_deadline_is_refused_at_add() -> None:
    sched = fp_scheduler()
    with pytest.raises(DeadlineExceeded):
        sched.add(item("x", deadline=1.0), now=1.0)
    assert sched.queued_count == 0
    assert sched.stats().drops["deadline"] == 1


def test_resident_item_whose_deadline_passes_is_dropped() -> None:
    sched = fp_scheduler()
    rec = Recorder()
    h = sched.add(item("x", deadline=1.0), 0.0, rec)
    batch = sched.schedule(0.0)
    assert batch is not None
    sched.complete(batch, [Continue("p1")], 0.5)
    assert h.status is ItemStatus.RESIDENT
    assert sched.next_deadline() == 1.0
    assert sched.schedule(1.0) is None
    assert h.status is ItemStatus.DROPPED and isinstance(rec.errors["x"], DeadlineExceeded)


def test_cancel_queued_item_removes_it_and_frees_its_quota_now() -> None:
    adm = AdmissionConfig(tenants=(TenantConfig("t", max_concurrent_cost=3.0),))
    sched = fp_scheduler(admission=adm)
    rec = Recorder()
    handles = [sched.add(item(f"r{i}"), 0.0, rec) for i in range(3)]
    with pytest.raises(ResourceExhausted):
        sched.add(item("r3"), 0.0)
    assert sched.cancel(handles[1], 0.1) is True
    assert sched.cancel(handles[1], 0.1) is False  # already gone
    assert isinstance(rec.errors["r1"], Cancelled)
    assert sched.queued_count == 2
    sched.add(item("r3"), 0.1, rec)  # the cancelled item's cost went back to the tenant
    batch = sched.schedule(0.2)
    assert batch is not None and ids(batch) == ["r0", "r2", "r3"]
    assert sched.stats().drops["cancelled"] == 1


def test_cancel_in_flight_discards_outcome_and_releases_at_complete() -> None:
    adm = AdmissionConfig(tenants=(TenantConfig("t", max_concurrent_cost=2.0),))
    sched = fp_scheduler(admission=adm)
    rec = Recorder()
    a = sched.add(item("a"), 0.0, rec)
    sched.add(item("b"), 0.0, rec)
    batch = sched.schedule(0.0)
    assert batch is not None and len(batch) == 2
    assert sched.cancel(a, 0.1) is True
    assert isinstance(rec.errors["a"], Cancelled)  # the caller learns at once
    with pytest.raises(ResourceExhausted):  # ... but the runner still holds a's resources
        sched.add(item("c"), 0.1)
    sched.complete(batch, [Done("A"), Done("B")], 0.2)
    assert "a" not in rec.done and rec.done == {"b": "B"}
    assert a.status is ItemStatus.CANCELLED and a.output is None
    sched.add(item("c"), 0.2)  # released at complete
    assert sched.admission.tenant_inflight_cost("t") == 1.0


def test_failed_batch_fails_every_item() -> None:
    sched = fp_scheduler()
    rec = Recorder()
    for i in range(5):
        sched.add(item(f"r{i}"), 0.0, rec)
    batch = sched.schedule(0.0)
    assert batch is not None
    boom = RuntimeError("cuda error")
    sched.fail(batch, boom, 0.1)
    assert sorted(rec.errors) == [f"r{i}" for i in range(5)]
    for err in rec.errors.values():
        assert isinstance(err, InternalError) and err.__cause__ is boom
    assert all(h.status is ItemStatus.FAILED for h in batch.handles)
    assert sched.stats().failed == 5 and sched.idle


def test_failed_batch_keeps_a_recserve_error_as_is() -> None:
    sched = fp_scheduler()
    rec = Recorder()
    sched.add(item("a"), 0.0, rec)
    sched.add(item("b"), 0.0, rec)
    batch = sched.schedule(0.0)
    assert batch is not None
    err = Unavailable("shard 3 is down")
    sched.fail(batch, err, 0.1)
    assert rec.errors["a"] is err and rec.errors["b"] is err


def test_outcome_count_mismatch_fails_the_batch() -> None:
    sched = fp_scheduler()
    rec = Recorder()
    for i in range(3):
        sched.add(item(f"r{i}"), 0.0, rec)
    batch = sched.schedule(0.0)
    assert batch is not None
    sched.complete(batch, [Done(1), Done(2)], 0.1)
    assert rec.done == {}
    assert len(rec.errors) == 3 and all(isinstance(e, InternalError) for e in rec.errors.values())
    assert "2 outcomes for 3 items" in rec.errors["r0"].message


def test_a_non_outcome_fails_only_that_item() -> None:
    sched = fp_scheduler()
    rec = Recorder()
    sched.add(item("a"), 0.0, rec)
    sched.add(item("b"), 0.0, rec)
    batch = sched.schedule(0.0)
    assert batch is not None
    sched.complete(batch, [Done("A"), "not an outcome"], 0.1)
    assert rec.done == {"a": "A"}
    assert isinstance(rec.errors["b"], InternalError)


def test_completing_a_batch_twice_is_an_error() -> None:
    sched = fp_scheduler()
    sched.add(item("a"), 0.0)
    batch = sched.schedule(0.0)
    assert batch is not None
    sched.complete(batch, [Done(None)], 0.1)
    with pytest.raises(InternalError):
        sched.complete(batch, [Done(None)], 0.2)


def test_preempted_item_goes_back_to_the_queue_with_its_state() -> None:
    sched = fp_scheduler()
    rec = Recorder()
    h = sched.add(item("a"), 0.0, rec)
    batch = sched.schedule(0.0)
    assert batch is not None
    sched.complete(batch, [Preempted(state={"tokens": 3})], 0.1)
    assert h.status is ItemStatus.QUEUED and h.state == {"tokens": 3}
    batch = sched.schedule(0.2)
    assert batch is not None and batch.handles == (h,) and h.steps == 2
    assert sched.stats().preempted == 1


def test_next_wakeup_is_the_window_end_or_the_earliest_deadline() -> None:
    sched = fp_scheduler(window_ms=10.0)
    assert sched.next_wakeup(0.0) is None
    sched.add(item("a", deadline=1.0), 0.0)
    assert sched.next_wakeup(0.001) == pytest.approx(0.010)
    assert sched.schedule(0.009) is None
    sched.add(item("b", deadline=0.004), 0.002)  # slack: its deadline comes before the window end
    assert sched.next_wakeup(0.002) == pytest.approx(0.004)
    batch = sched.schedule(0.004)  # at the deadline b is dropped, a still waits for the window
    assert batch is None and sched.queued_count == 1
    assert sched.next_wakeup(0.004) == pytest.approx(0.010)
    batch = sched.schedule(0.010)
    assert batch is not None and ids(batch) == ["a"]


def test_many_cancellations_keep_order_and_counts() -> None:
    sched = fp_scheduler()
    rng = random.Random(3)
    handles = [sched.add(item(f"r{i}", deadline=rng.uniform(1, 100)), 0.0) for i in range(2000)]
    cancelled = set(rng.sample(range(2000), 1700))
    for i in sorted(cancelled):
        sched.cancel(handles[i], 0.0)
    assert sched.queued_count == 300
    assert sched.stats().queued_cost == pytest.approx(300.0)
    batch = sched.schedule(0.0)
    assert batch is not None
    live = [handles[i] for i in range(2000) if i not in cancelled]
    assert list(batch.handles) == sorted(live, key=lambda h: (h.deadline, h.seq))


def test_metrics_queue_wait_batch_size_service_time_and_drops() -> None:
    sched = fp_scheduler(admission=AdmissionConfig(max_queued_items=3))
    sched.add(item("a"), 0.0)
    sched.add(item("b"), 0.002)
    sched.add(item("c", deadline=0.001), 0.0)
    with pytest.raises(ResourceExhausted):
        sched.add(item("d"), 0.0)
    batch = sched.schedule(0.004)
    assert batch is not None and ids(batch) == ["a", "b"]
    sched.complete(batch, [Done(None), Done(None)], 0.010)
    st = sched.stats()
    assert st.queue_wait_s.count == 2 and st.queue_wait_s.mean == pytest.approx((0.004 + 0.002) / 2)
    assert st.queue_wait_s.max == pytest.approx(0.004)
    assert st.batch_size.mean == 2 and st.batch_cost.mean == 2.0
    assert st.service_s.count == 1 and st.service_s.p50 == pytest.approx(0.006)
    assert st.latency_s.max == pytest.approx(0.010) and st.latency_s.p50 == pytest.approx(0.008)
    assert st.drops == {"deadline": 1, "cancelled": 0, "rejected": 1}
    assert (st.admitted, st.completed, st.batches, st.queued_items) == (3, 2, 1, 0)


class _ExplodingPolicy(Policy):
    """Takes two items then raises on its first select; later selects take everything."""

    def __init__(self) -> None:
        self.exploded = False

    def ready_at(self, view: SchedulerView, now: float) -> float | None:
        return now

    def select(self, view: SchedulerView, now: float) -> None:
        if not self.exploded:
            self.exploded = True
            view.take()
            view.take()
            raise ValueError("policy bug")
        view.take_while(math.inf)


def test_a_policy_that_raises_mid_select_leaves_items_queued() -> None:
    sched = Scheduler(_ExplodingPolicy())
    handles = [sched.add(item(f"r{i}", deadline=float(i + 1)), 0.0) for i in range(3)]
    with pytest.raises(ValueError):
        sched.schedule(0.0)
    assert sched.queued_count == 3 and sched.inflight_batches == 0
    assert all(h.status is ItemStatus.QUEUED for h in handles)
    batch = sched.schedule(0.0)
    assert batch is not None and ids(batch) == ["r0", "r1", "r2"]


def test_abort_pending_fails_queued_and_resident_items() -> None:
    sched = fp_scheduler()
    rec = Recorder()
    sched.add(item("resident"), 0.0, rec)
    batch = sched.schedule(0.0)
    assert batch is not None
    sched.complete(batch, [Continue(None)], 0.1)
    sched.add(item("queued"), 0.1, rec)
    err = Unavailable("closing")
    assert sched.abort_pending(err, 0.2) == 2
    assert rec.errors == {"resident": err, "queued": err}
    assert sched.idle and sched.queued_count == 0


def test_bad_costs_are_invalid_arguments() -> None:
    sched = fp_scheduler()
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(RecserveError) as info:
            sched.add(item("x", cost=bad), 0.0)
        assert grpc_code(info.value) == grpc.StatusCode.INVALID_ARGUMENT


def test_bad_deadline_and_priority_are_invalid_arguments_naming_the_value() -> None:
    sched = fp_scheduler()
    with pytest.raises(InvalidArgument, match="deadline nan"):
        sched.add(item("x", deadline=math.nan), 0.0)  # would corrupt the EDF heaps
    with pytest.raises(InvalidArgument, match="priority 'urgent'"):
        sched.add(WorkItem("y", "t", "urgent", 10.0, 1.0), 0.0)  # type: ignore[arg-type]
    assert sched.queued_count == 0 and sched.stats().admitted == 0
    sched.add(item("z"), 0.0)  # still serving


class _HookBombPolicy(FeatureParallelPolicy):
    """A policy whose on_finish raises for one request (a policy bug)."""

    def __init__(self, bad: str) -> None:
        super().__init__(FeatureParallelConfig(window_ms=0.0, max_cost=1e9))
        self.bad = bad

    def on_finish(self, handle: Handle, now: float) -> None:
        if handle.request_id == self.bad:
            raise ValueError("policy bug")


def test_a_policy_hook_that_raises_in_complete_leaves_no_item_running() -> None:
    sched = Scheduler(_HookBombPolicy(bad="b"))
    rec = Recorder()
    for rid in "abcd":
        sched.add(item(rid), 0.0, rec)
    batch = sched.schedule(0.0)
    assert batch is not None and ids(batch) == ["a", "b", "c", "d"]
    with pytest.raises(ValueError):
        sched.complete(batch, [Done(rid.upper()) for rid in "abcd"], 0.1)
    assert rec.done == {"a": "A", "b": "B"}  # resolved before the hook raised
    assert sorted(rec.errors) == ["c", "d"] and all(isinstance(e, InternalError) for e in rec.errors.values())
    assert sched.idle and sched.stats().running_items == 0
    sched.add(item("e"), 0.2, rec)  # the scheduler keeps serving
    batch = sched.schedule(0.2)
    assert batch is not None and ids(batch) == ["e"]
