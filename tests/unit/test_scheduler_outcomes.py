"""The two newer outcomes of the scheduler core: ``Failed(error)`` for one item of a batch,
and early per-item resolution (``Scheduler.resolve`` / ``ServingLoop.resolve``) while the
batch still runs. Fake clock for the core; the loop test runs on a real asyncio loop,
synchronised with events, never sleeps."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from recserve.config.spec import TenantConfig
from recserve.errors import Cancelled, InternalError, InvalidArgument, ResourceExhausted, Unavailable
from recserve.scheduling import (
    AdmissionConfig,
    Batch,
    Continue,
    Done,
    Failed,
    FeatureParallelConfig,
    FeatureParallelPolicy,
    Handle,
    ItemStatus,
    Priority,
    Scheduler,
    ServingLoop,
    WorkItem,
)
from tests.unit.test_scheduler_loop import run, window_scheduler
from tests.utils import Prompt, Recorder, ToyDecodePolicy


def item(rid: str, *, cost: float = 1.0, tenant: str = "t", deadline: float = 100.0, payload: Any = None) -> WorkItem:
    return WorkItem(rid, tenant, Priority.STANDARD, deadline, cost, payload=payload)


class FinishCounter(FeatureParallelPolicy):
    """Counts ``on_finish`` per request: resources must be released exactly once."""

    def __init__(self) -> None:
        super().__init__(FeatureParallelConfig(window_ms=0.0, dispatch_margin_ms=0.0))
        self.finished: dict[str, int] = {}

    def on_finish(self, handle: Handle, now: float) -> None:
        self.finished[handle.request_id] = self.finished.get(handle.request_id, 0) + 1


def scheduled(sched: Scheduler, rec: Recorder, *rids: str, now: float = 0.0) -> tuple[Batch, dict[str, Handle]]:
    handles = {rid: sched.add(item(rid), now, rec) for rid in rids}
    batch = sched.schedule(now)
    assert batch is not None and [h.request_id for h in batch.handles] == list(rids)
    return batch, handles


# ---------------------------------------------------------------------------- Failed
def test_failed_outcome_fails_that_item_alone() -> None:
    policy = FinishCounter()
    sched, rec = Scheduler(policy), Recorder()
    batch, _ = scheduled(sched, rec, "a", "b", "c")
    bad = InvalidArgument("sequence b produced a NaN logit")
    sched.complete(batch, [Done("out-a"), Failed(bad), Done("out-c")], 1.0)
    assert rec.done == {"a": "out-a", "c": "out-c"}
    assert rec.errors == {"b": bad}
    stats = sched.stats()
    assert (stats.completed, stats.failed) == (2, 1)
    assert policy.finished == {"a": 1, "b": 1, "c": 1}
    assert sched.idle


def test_failed_with_a_foreign_exception_becomes_internal_with_its_cause() -> None:
    sched, rec = window_scheduler(), Recorder()
    batch, handles = scheduled(sched, rec, "a", "b")
    cause = ZeroDivisionError("division by zero")
    sched.complete(batch, [Failed(cause), Done(1)], 1.0)
    err = rec.errors["a"]
    assert isinstance(err, InternalError) and err.__cause__ is cause and "request a" in err.message
    assert handles["a"].status is ItemStatus.FAILED and rec.done == {"b": 1}


def test_failed_in_a_decode_step_leaves_the_other_sequences_running() -> None:
    sched, rec = Scheduler(ToyDecodePolicy(token_budget=100.0)), Recorder()
    for rid in ("s0", "s1", "s2"):
        sched.add(WorkItem(rid, "t", Priority.STANDARD, 100.0, 4.0, payload=Prompt(4, 3)), 0.0, rec)
    batch = sched.schedule(0.0)
    assert batch is not None and len(batch) == 3
    sched.complete(batch, [Continue("x"), Failed(InvalidArgument("s1 went bad")), Continue("y")], 1.0)
    assert set(rec.errors) == {"s1"}
    nxt = sched.schedule(1.0)
    assert nxt is not None and sorted(h.request_id for h in nxt.handles) == ["s0", "s2"]
    sched.complete(nxt, [Done("s0-out"), Done("s2-out")], 2.0)
    assert rec.done == {"s0": "s0-out", "s2": "s2-out"} and sched.idle


# ---------------------------------------------------------------------------- resolve
def test_resolve_answers_early_and_complete_skips_the_item() -> None:
    policy = FinishCounter()
    sched, rec = Scheduler(policy), Recorder()
    batch, handles = scheduled(sched, rec, "a", "b")
    assert sched.resolve(handles["a"], Done("early-a"), 0.5) is True
    assert rec.done == {"a": "early-a"} and handles["a"].status is ItemStatus.DONE
    assert policy.finished == {}  # resources stay with the running batch until it completes
    assert sched.stats().running_items == 2
    sched.complete(batch, [Done("ignored"), Done("late-b")], 1.0)  # Recorder fails on a second on_done
    assert rec.done == {"a": "early-a", "b": "late-b"}
    assert policy.finished == {"a": 1, "b": 1}
    assert sched.stats().completed == 2 and sched.idle


def test_resolve_failed_early_and_the_batch_goes_on() -> None:
    sched, rec = window_scheduler(), Recorder()
    batch, handles = scheduled(sched, rec, "a", "b")
    err = InvalidArgument("caller a asked for table 'nope'")
    assert sched.resolve(handles["a"], Failed(err), 0.1) is True
    assert rec.errors == {"a": err}
    sched.complete(batch, [Done("ignored"), Done("b")], 1.0)
    assert rec.done == {"b": "b"} and set(rec.errors) == {"a"}
    assert (sched.stats().completed, sched.stats().failed) == (1, 1)


def test_resolve_refuses_terminal_items_and_rejects_non_running_ones() -> None:
    sched, rec = window_scheduler(), Recorder()
    batch, handles = scheduled(sched, rec, "a", "b")
    assert sched.resolve(handles["a"], Done(1), 0.1) is True
    assert sched.resolve(handles["a"], Done(2), 0.2) is False  # resolved before
    assert sched.cancel(handles["b"], 0.3) is True
    assert sched.resolve(handles["b"], Done(3), 0.4) is False  # cancelled while running
    assert rec.done == {"a": 1} and isinstance(rec.errors["b"], Cancelled)
    queued = sched.add(item("q"), 0.5, rec)
    with pytest.raises(InternalError, match="request q: resolve\\(\\) needs a running item; it is queued"):
        sched.resolve(queued, Done(None), 0.5)
    with pytest.raises(InternalError, match="takes Done or Failed, not Continue"):
        running = sched.schedule(0.6)
        assert running is not None
        sched.resolve(running.handles[0], Continue(), 0.6)  # type: ignore[arg-type]
    sched.complete(batch, [Done(None), Done(None)], 1.0)
    assert rec.done == {"a": 1}


def test_quota_of_a_resolved_item_is_released_at_complete_not_before() -> None:
    adm = AdmissionConfig(tenants=(TenantConfig("t", max_concurrent_cost=2.0),))
    sched, rec = Scheduler(FeatureParallelPolicy(FeatureParallelConfig(window_ms=0.0)), adm), Recorder()
    batch, handles = scheduled(sched, rec, "a", "b")
    sched.resolve(handles["a"], Done("a"), 0.1)
    with pytest.raises(ResourceExhausted):  # the runner may still use a's share
        sched.add(item("c"), 0.2, rec)
    sched.complete(batch, [Done(None), Done("b")], 0.3)
    sched.add(item("c"), 0.4, rec)  # admitted once the batch has finished


def test_fail_after_resolve_keeps_the_early_answer() -> None:
    policy = FinishCounter()
    sched, rec = Scheduler(policy), Recorder()
    batch, handles = scheduled(sched, rec, "a", "b")
    sched.resolve(handles["a"], Done("a"), 0.1)
    sched.fail(batch, Unavailable("shard 3 went away"), 0.2)
    assert rec.done == {"a": "a"} and isinstance(rec.errors["b"], Unavailable)
    assert policy.finished == {"a": 1, "b": 1} and sched.idle


def test_serving_loop_resolve_answers_callers_while_the_batch_runs() -> None:
    async def body() -> None:
        release = asyncio.Event()
        loop_ref: list[ServingLoop] = []

        async def runner(batch: Batch) -> list[Any]:
            first, *_ = batch.handles
            assert loop_ref[0].resolve(first, Done(f"early-{first.item.payload}"))
            await release.wait()
            return [Done(None)] + [Done(f"late-{h.item.payload}") for h in batch.handles[1:]]

        loop = ServingLoop(window_scheduler(), runner)
        loop_ref.append(loop)
        async with loop:
            first = loop.submit_nowait("x")
            second = loop.submit_nowait("y")
            assert await first == "early-x"  # answered while the batch is still blocked
            assert not second.done()
            release.set()
            assert await second == "late-y"

    run(body)
