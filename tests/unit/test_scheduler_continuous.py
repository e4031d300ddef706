"""A test-only continuous (iteration-level, decode-shaped) policy, written against the
public Policy interface and run on the unchanged core. The decode issue reuses this shape
(the policy and the toy model live in ``tests/utils.py``).

The toy model: a sequence has a prompt and a target length; each step appends one token
"<rid>:<i>". Cost = tokens held (prompt + generated), the KV-cache footprint. The policy
runs one step at a time over the running set, admits queued sequences at every step
while the token budget allows, and preempts the least urgent running sequence when the
set outgrows the budget. Oracle: the token sequence a sequence must produce, computed
without the scheduler (``expected_tokens``).
"""

from __future__ import annotations

from typing import Iterator

import pytest

from recserve.config.spec import TenantConfig
from recserve.scheduling import (
    AdmissionConfig,
    Handle,
    ItemStatus,
    PolicyKind,
    Priority,
    Scheduler,
    WorkItem,
    make_policy,
    register_policy,
)
from recserve.scheduling import policy_base
from tests.utils import Prompt, Recorder, ToyDecodePolicy, decode_step, expected_tokens


class Harness:
    def __init__(self, token_budget: float = 1e9, admission: AdmissionConfig = AdmissionConfig()) -> None:
        register_policy(PolicyKind.CONTINUOUS, lambda budget: ToyDecodePolicy(budget), replace=True)
        policy = make_policy(PolicyKind.CONTINUOUS, token_budget)  # the plug-in path
        assert isinstance(policy, ToyDecodePolicy)
        self.policy = policy
        self.sched = Scheduler(policy, admission)
        self.rec = Recorder()
        self.now = 0.0
        self.handles: dict[str, Handle] = {}

    def add(self, rid: str, prompt_tokens: int, length: int, *, deadline: float = 100.0,
            priority: Priority = Priority.STANDARD) -> Handle:
        item = WorkItem(rid, "t", priority, deadline, float(prompt_tokens), Prompt(prompt_tokens, length))
        handle = self.handles[rid] = self.sched.add(item, self.now, self.rec)
        return handle

    def step(self, preempt: frozenset[str] = frozenset()) -> list[str]:
        """Run one decode step; returns the ids in it."""
        batch = self.sched.schedule(self.now)
        assert batch is not None
        self.now += 0.01
        self.sched.complete(batch, decode_step(batch, preempt), self.now)
        return [h.request_id for h in batch.handles]


@pytest.fixture(autouse=True)
def _unregister() -> Iterator[None]:
    yield
    policy_base._REGISTRY.pop(PolicyKind.CONTINUOUS, None)


def test_admits_new_items_while_others_are_mid_run() -> None:
    h = Harness()
    h.add("a", 4, 6)
    assert h.step() == ["a"]
    assert h.step() == ["a"]
    h.add("b", 4, 3)
    assert h.step() == ["a", "b"]  # b joins at the next iteration, a keeps going
    assert h.handles["a"].steps == 3 and h.handles["b"].steps == 1


def test_finishes_one_item_while_others_continue() -> None:
    h = Harness()
    h.add("a", 4, 2)
    h.add("b", 4, 4)
    h.step()
    h.step()
    assert h.rec.done == {"a": expected_tokens("a", 2)}
    assert h.handles["a"].status is ItemStatus.DONE and h.handles["b"].status is ItemStatus.RESIDENT
    assert h.step() == ["b"]  # a's slot is free, b continues alone
    h.step()
    assert h.rec.done["b"] == expected_tokens("b", 4)
    assert h.policy.finished == [("a", ItemStatus.DONE), ("b", ItemStatus.DONE)]
    assert h.sched.idle


def test_streams_partial_outputs_in_order() -> None:
    h = Harness()
    h.add("a", 2, 5)
    h.add("b", 2, 3)
    while not h.sched.idle:
        h.step()
    # Every token but the last streams as a partial; the last comes with Done.
    assert h.rec.partials == {"a": expected_tokens("a", 4), "b": expected_tokens("b", 2)}
    assert h.rec.done == {"a": expected_tokens("a", 5), "b": expected_tokens("b", 3)}


def test_preempts_an_item_requeues_it_and_resumes_it_from_its_state() -> None:
    # Budget 14 tokens: a and b start at 4 each and grow by one per step.
    h = Harness(token_budget=14)
    h.add("a", 4, 8, deadline=10.0)
    h.add("b", 4, 6, deadline=20.0)  # the later deadline: the victim
    steps = []
    while not h.sched.idle:
        steps.append(h.step())
    assert h.policy.preempted == ["b"]
    b_index = [i for i, s in enumerate(steps) if "b" not in s]
    assert b_index and all("a" in steps[i] for i in b_index)  # while b waited, a ran
    assert h.rec.done == {"a": expected_tokens("a", 8), "b": expected_tokens("b", 6)}  # b resumed, not restarted
    assert h.rec.partials["b"] == expected_tokens("b", 5)  # no token streamed twice
    assert h.sched.stats().preempted == 1


def test_runner_preemption_requeues_with_state() -> None:
    h = Harness()
    h.add("a", 4, 3)
    h.step()
    h.step(preempt=frozenset({"a"}))
    a = h.handles["a"]
    assert a.status is ItemStatus.QUEUED and a.state == ["a:0"] and h.policy.requeued == ["a"]
    while not h.sched.idle:
        h.step()
    assert h.rec.done["a"] == expected_tokens("a", 3)


def test_cost_changes_between_steps_and_accounting_follows() -> None:
    adm = AdmissionConfig(tenants=(TenantConfig("t", max_concurrent_cost=100.0),))
    h = Harness(admission=adm)
    a = h.add("a", 10, 5)
    b = h.add("b", 20, 5)
    h.step()
    assert (a.cost, b.cost) == (11.0, 21.0)  # prompt + 1 generated token
    h.step()
    assert (a.cost, b.cost) == (12.0, 22.0)
    assert h.sched.admission.tenant_inflight_cost("t") == 34.0  # the tenant quota sees the growth
    while not h.sched.idle:
        h.step()
    assert h.sched.admission.tenant_inflight_cost("t") == 0.0  # and gets it all back


def test_cancel_a_running_sequence_discards_its_token_and_frees_it_after_the_step() -> None:
    h = Harness()
    a = h.add("a", 4, 5)
    h.step()
    batch = h.sched.schedule(h.now)
    assert batch is not None and batch.handles == (a,)
    h.sched.cancel(a, h.now)
    assert h.policy.finished == []  # the step still holds a's resources
    h.sched.complete(batch, decode_step(batch), h.now + 0.01)
    assert h.policy.finished == [("a", ItemStatus.CANCELLED)]
    assert h.rec.partials["a"] == ["a:0"] and h.sched.idle
