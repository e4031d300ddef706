"""Shared test helpers: factories and fakes used by more than one test module.

Scheduler helpers:
- :class:`Recorder` — an ``ItemListener`` that records every result by request id;
- the toy decode model (:class:`Prompt`, :func:`decode_step`, :func:`expected_tokens`) and
  :class:`ToyDecodePolicy`, a test-only continuous (iteration-level) policy written
  against the public Policy interface; the decode issue reuses this shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from recserve.errors import RecserveError
from recserve.scheduling import Batch, Continue, Done, Handle, ItemStatus, Policy, PolicyKind, Preempted, SchedulerView


class Recorder:
    """ItemListener that records every result by request id (and fails on a second
    terminal result for the same id)."""

    def __init__(self) -> None:
        self.partials: dict[str, list[Any]] = {}
        self.done: dict[str, Any] = {}
        self.errors: dict[str, RecserveError] = {}

    def on_partial(self, handle: Handle, output: Any) -> None:
        self.partials.setdefault(handle.request_id, []).append(output)

    def on_done(self, handle: Handle, output: Any) -> None:
        assert handle.request_id not in self.done, "on_done twice"
        self.done[handle.request_id] = output

    def on_error(self, handle: Handle, error: RecserveError) -> None:
        assert handle.request_id not in self.errors, "on_error twice"
        self.errors[handle.request_id] = error


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A toy decode request: ``prompt_tokens`` held from the start, ``length`` to generate."""

    prompt_tokens: int
    length: int


def expected_tokens(rid: str, length: int) -> list[str]:
    """The oracle: the tokens sequence ``rid`` must produce, computed without a scheduler."""
    return [f"{rid}:{i}" for i in range(length)]


def decode_step(batch: Batch, preempt: frozenset[str] = frozenset()) -> list[Any]:
    """The fake model: one token per sequence; state = tokens generated so far; cost =
    tokens held (prompt + generated), the KV-cache footprint. Sequences named in
    ``preempt`` are handed back (runner-side preemption) with their state."""
    outcomes: list[Any] = []
    for handle in batch.handles:
        prompt: Prompt = handle.item.payload
        generated: list[str] = list(handle.state or [])
        if handle.request_id in preempt:
            outcomes.append(Preempted(state=generated))
            continue
        generated.append(f"{handle.request_id}:{len(generated)}")
        if len(generated) == prompt.length:
            outcomes.append(Done(generated))
        else:
            outcomes.append(Continue(partial_output=generated[-1], new_cost=prompt.prompt_tokens + len(generated), state=generated))
    return outcomes


class ToyDecodePolicy(Policy):
    """One decode step in flight at a time; the running set's cost must fit ``token_budget``.

    At every step: preempt the least urgent running sequences while the set outgrows the
    budget, run the rest, then admit queued sequences while the budget allows (the first
    always, so an oversized one runs alone rather than blocking the queue)."""

    kind = PolicyKind.CONTINUOUS

    def __init__(self, token_budget: float) -> None:
        self.token_budget = token_budget
        self.finished: list[tuple[str, ItemStatus]] = []
        self.requeued: list[str] = []
        self.preempted: list[str] = []

    def ready_at(self, view: SchedulerView, now: float) -> float | None:
        if view.inflight_batches:
            return None  # the step's completion is the next event
        return now if view.resident_count or view.queued_count else None

    def select(self, view: SchedulerView, now: float) -> None:
        if view.inflight_batches:
            return
        running = sorted(view.resident, key=lambda h: (h.priority, h.deadline, h.seq))
        used = sum(h.cost for h in running)
        while used > self.token_budget and len(running) > 1:
            victim = running.pop()  # least urgent: lowest class, latest deadline
            view.preempt(victim)  # back to the queue; its generated tokens (state) are kept
            self.preempted.append(victim.request_id)
            used -= victim.cost
        for handle in running:
            view.run(handle)
        while (head := view.peek()) is not None and (used + head.cost <= self.token_budget or view.batch_size == 0):
            view.take()
            used += head.cost

    def on_requeue(self, handle: Handle, now: float) -> None:
        self.requeued.append(handle.request_id)

    def on_finish(self, handle: Handle, now: float) -> None:
        self.finished.append((handle.request_id, handle.status))
