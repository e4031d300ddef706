"""KV-block admission decided by a continuous policy at every step, on the unchanged core.

Shows that the public Policy interface is enough for a paged-KV decode scheduler (the
decode issue adds one without editing core files): the policy owns a pool of fixed-size
blocks, reserves a sequence's blocks when it takes it from the queue (in ``select``),
grows them for the next token before each step, preempts the least urgent sequence when
the pool runs dry, refuses at ``add`` a prompt that could never fit, and gets every block
back through the lifecycle hooks — done, runner preemption, cancellation in flight (at
the next complete), deadline drop, failed step.

Oracles from outside the scheduler: the token sequence each request must produce
(``expected_tokens``) and block conservation (free + held == pool size) checked after
every step. Fake clock, no sleeps.
"""

from __future__ import annotations

import math
import random
from typing import Any

import grpc
import pytest

from recserve.config.spec import TenantConfig
from recserve.errors import InvalidArgument
from recserve.rpc.status import grpc_code
from recserve.scheduling import AdmissionConfig, Handle, Policy, PolicyKind, Priority, Scheduler, SchedulerView, WorkItem
from tests.utils import Prompt, Recorder, decode_step, expected_tokens

BLOCK_TOKENS = 4


def blocks_for(tokens: float) -> int:
    return math.ceil(tokens / BLOCK_TOKENS)


class KvBlockPolicy(Policy):
    """One decode step in flight; a sequence holding ``cost`` tokens needs
    ``blocks_for(cost + 1)`` blocks to produce its next token. Blocks held per sequence
    live in ``handle.policy_data``."""

    kind = PolicyKind.CONTINUOUS

    def __init__(self, total_blocks: int) -> None:
        self.total = total_blocks
        self.free = total_blocks
        self.step = 0
        self.preempted: list[str] = []
        self.admitted_at_step: dict[str, int] = {}

    @staticmethod
    def held(handle: Handle) -> int:
        return int(handle.policy_data or 0)

    def _reserve(self, handle: Handle, blocks: int) -> None:
        self.free -= blocks - self.held(handle)
        assert self.free >= 0, "reserved more blocks than the pool has"
        handle.policy_data = blocks

    def _release(self, handle: Handle) -> None:
        self.free += self.held(handle)
        handle.policy_data = 0

    def on_add(self, handle: Handle, now: float) -> None:
        need = blocks_for(handle.cost + 1)
        if need > self.total:
            raise InvalidArgument(
                f"request {handle.request_id}: a {handle.cost:g}-token prompt needs {need} KV blocks; the cache has {self.total}"
            )

    def ready_at(self, view: SchedulerView, now: float) -> float | None:
        if view.inflight_batches:
            return None
        return now if view.resident_count or view.queued_count else None

    def select(self, view: SchedulerView, now: float) -> None:
        if view.inflight_batches:
            return
        self.step += 1
        running = sorted(view.resident, key=lambda h: (h.priority, h.deadline, h.seq))

        def growth(h: Handle) -> int:
            return max(0, blocks_for(h.cost + 1) - self.held(h))

        while running and sum(growth(h) for h in running) > self.free:
            victim = running.pop()  # least urgent
            self._release(victim)
            view.preempt(victim)
            self.preempted.append(victim.request_id)
        for handle in running:
            self._reserve(handle, blocks_for(handle.cost + 1))
            view.run(handle)
        while (head := view.peek()) is not None and blocks_for(head.cost + 1) <= self.free:
            view.take()
            self._reserve(head, blocks_for(head.cost + 1))
            self.admitted_at_step.setdefault(head.request_id, self.step)

    def on_requeue(self, handle: Handle, now: float) -> None:
        self._release(handle)  # the runner handed it back: its cache is dropped

    def on_finish(self, handle: Handle, now: float) -> None:
        self._release(handle)


class Harness:
    def __init__(self, total_blocks: int, admission: AdmissionConfig = AdmissionConfig()) -> None:
        self.policy = KvBlockPolicy(total_blocks)
        self.sched = Scheduler(self.policy, admission)
        self.rec = Recorder()
        self.now = 0.0
        self.handles: dict[str, Handle] = {}

    def add(self, rid: str, prompt_tokens: int, length: int, *, deadline: float = 100.0, tenant: str = "t") -> Handle:
        item = WorkItem(rid, tenant, Priority.STANDARD, deadline, float(prompt_tokens), Prompt(prompt_tokens, length))
        handle = self.handles[rid] = self.sched.add(item, self.now, self.rec)
        return handle

    def check_blocks(self) -> None:
        held = sum(self.policy.held(h) for h in self.handles.values())
        assert self.policy.free + held == self.policy.total, (self.policy.free, held)
        for h in self.handles.values():
            if h.status.value in ("queued", "done", "failed", "dropped"):
                assert self.policy.held(h) == 0, (h.request_id, h.status)
            if h.status.value == "resident":
                assert self.policy.held(h) * BLOCK_TOKENS >= h.cost  # its cache fits in its blocks

    def step(self, preempt: frozenset[str] = frozenset()) -> list[str]:
        batch = self.sched.schedule(self.now)
        assert batch is not None
        for h in batch.handles:
            assert self.policy.held(h) * BLOCK_TOKENS >= h.cost + 1  # room for this step's token
        self.now += 0.01
        self.sched.complete(batch, decode_step(batch, preempt), self.now)
        self.check_blocks()
        return [h.request_id for h in batch.handles]


def test_a_queued_sequence_waits_for_blocks_and_is_admitted_at_the_step_they_free() -> None:
    h = Harness(total_blocks=6)  # 24 tokens
    h.add("a", 12, 3)  # 13 tokens for its first step: 4 blocks
    h.add("b", 8, 2)  # 9 tokens: 3 blocks; only 2 are left while a runs
    steps = [h.step() for _ in range(5)]
    assert steps == [["a"], ["a"], ["a"], ["b"], ["b"]]
    assert h.policy.admitted_at_step == {"a": 1, "b": 4}  # the step after a's blocks came back
    assert h.rec.done == {"a": expected_tokens("a", 3), "b": expected_tokens("b", 2)}
    assert h.policy.free == 6 and h.sched.idle


def test_a_dry_pool_preempts_the_least_urgent_sequence_which_resumes_from_its_state() -> None:
    h = Harness(total_blocks=6)
    h.add("a", 8, 10, deadline=10.0)
    h.add("b", 8, 6, deadline=20.0)  # later deadline: the victim
    steps = []
    while not h.sched.idle:
        steps.append(h.step())
    # Both start at 3 blocks each; at 12 tokens both need a 4th block and none is free.
    assert steps[:4] == [["a", "b"]] * 4 and steps[4] == ["a"]
    assert h.policy.preempted == ["b"]
    assert h.rec.done == {"a": expected_tokens("a", 10), "b": expected_tokens("b", 6)}
    assert h.rec.partials["b"] == expected_tokens("b", 5)  # resumed, no token twice
    assert h.policy.free == 6


def test_the_policy_refuses_at_add_a_prompt_that_can_never_fit_and_admission_is_undone() -> None:
    adm = AdmissionConfig(tenants=(TenantConfig("t", rate_per_s=1.0, max_concurrent_cost=100.0),), rate_burst_s=1.0)
    h = Harness(total_blocks=2, admission=adm)  # 8 tokens; the bucket holds 1 request
    with pytest.raises(InvalidArgument) as info:
        h.add("huge", 8, 1)  # 9 tokens for its first step: 3 blocks
    assert grpc_code(info.value) == grpc.StatusCode.INVALID_ARGUMENT and "needs 3 KV blocks" in info.value.message
    st = h.sched.stats()
    assert (st.queued_items, st.admitted, st.drops["rejected"]) == (0, 0, 1)
    assert h.sched.admission.tenant_inflight_cost("t") == 0.0
    h.add("ok", 3, 1)  # same instant: the refused request's rate token was given back
    assert h.step() == ["ok"] and h.rec.done == {"ok": expected_tokens("ok", 1)}


def test_cancel_in_flight_keeps_the_blocks_until_the_step_completes() -> None:
    h = Harness(total_blocks=4)
    a = h.add("a", 6, 5)
    h.step()
    batch = h.sched.schedule(h.now)
    assert batch is not None
    assert h.sched.cancel(a, h.now)
    assert h.policy.held(a) == 2 and h.policy.free == 2  # the model is still writing into them
    h.sched.complete(batch, decode_step(batch), h.now + 0.01)
    assert h.policy.held(a) == 0 and h.policy.free == 4
    assert h.rec.partials["a"] == ["a:0"]  # the in-flight step's token was discarded


@pytest.mark.parametrize("seed", range(4))
def test_blocks_are_conserved_through_every_exit_under_random_traffic(seed: int) -> None:
    """Random arrivals, cancellations (queued, resident, in flight), runner preemptions,
    failed steps and deadline drops; block conservation after every step; every finished
    sequence equals its oracle."""
    rng = random.Random(seed)
    # No shedding at add: the backlog must reach the queue so that deadlines pass there.
    h = Harness(total_blocks=8, admission=AdmissionConfig(shed_by_slack=False))  # 32 tokens
    lengths: dict[str, int] = {}
    for i in range(300):
        if rng.random() < 0.7:  # more than the pool can serve: a backlog, so deadlines pass
            rid = f"s{i}"
            lengths[rid] = rng.randint(1, 8)
            h.add(rid, rng.randint(1, 12), lengths[rid], deadline=h.now + rng.uniform(0.02, 0.6))
        live = [x for x in h.handles.values() if not x.done]
        if live and rng.random() < 0.05:
            h.sched.cancel(rng.choice(live), h.now)
        batch = h.sched.schedule(h.now)
        if batch is None:
            assert h.sched.idle, "work is pending but the policy formed no step"
            h.now += 0.01
            continue
        if rng.random() < 0.1:
            h.sched.cancel(rng.choice(batch.handles), h.now)  # in flight
        h.now += 0.01
        outcome: Any = rng.random()
        if outcome < 0.05:
            h.sched.fail(batch, RuntimeError("step failed"), h.now)
        else:
            preempt = frozenset(x.request_id for x in batch.handles if rng.random() < 0.1)
            h.sched.complete(batch, decode_step(batch, preempt), h.now)
        h.check_blocks()
    while not h.sched.idle:
        batch = h.sched.schedule(h.now)
        h.now += 0.01
        if batch is not None:
            h.sched.complete(batch, decode_step(batch), h.now)
        h.check_blocks()
    assert h.policy.free == h.policy.total
    assert h.rec.done and all(out == expected_tokens(rid, lengths[rid]) for rid, out in h.rec.done.items())
    for rid, partials in h.rec.partials.items():
        assert partials == expected_tokens(rid, len(partials))  # in order, no token twice
    kinds = {type(e).__name__ for e in h.rec.errors.values()}
    assert {"Cancelled", "DeadlineExceeded", "InternalError"} <= kinds  # every exit was exercised
    assert h.policy.preempted or h.sched.stats().preempted
