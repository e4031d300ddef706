"""The cascade's door (issue 17, "shedding at the door"): Recommend calls run at most
``cascade.max_concurrent`` at once through the scheduler core; a call whose slack is
below the queue wait ahead plus a call's measured duration is shed at once with
RESOURCE_EXHAUSTED and a retry hint; expired calls never run; a cancelled call cancels
its ranker calls in flight; each call runs in its own caller's context (the API key it
forwards); an idle door runs even a tight call (answered degraded).

A fake ranking client with explicit setters holds the rank stages on an event or
delays them; the oracle is which calls reached the client."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import re
import time
from typing import Any

import numpy as np
import pytest

from cascade.service import CascadeCore
from recserve.errors import DeadlineExceeded, ResourceExhausted
from tests.unit.test_cascade_core import FakeRankingClient, core

RANK_S = 0.05  # each Rank of the slow fake takes 50 ms


class GatedClient(FakeRankingClient):
    """FakeRankingClient whose Rank sleeps ``delay_s`` and, with a gate set, waits for it."""

    delay_s = 0.0
    gate: asyncio.Event | None = None

    def set_delay(self, seconds: float) -> None:
        self.delay_s = seconds

    def set_gate(self, gate: asyncio.Event | None) -> None:
        self.gate = gate

    cancelled = 0  # Rank calls cancelled while held at the gate

    async def rank(self, user_id: int, candidate_ids: np.ndarray, *, model: str = "", **kw: Any) -> Any:
        if self.gate is not None:
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return await super().rank(user_id, candidate_ids, model=model, **kw)


def door_core(max_concurrent: int = 1) -> tuple[CascadeCore, GatedClient]:
    c, plain, _ = core(np.random.default_rng(7))
    client = GatedClient(plain.vector, plain.item_scores)
    c.client = client  # type: ignore[assignment]
    c.config = dataclasses.replace(c.config, max_concurrent=max_concurrent)
    c.door = c._new_door()
    return c, client


def ask(c: CascadeCore, slack_s: float, user: int = 1) -> Any:
    q = c.query(user, 10, np.zeros(0, np.int64), np.zeros(0, np.int64), deadline=time.monotonic() + slack_s)
    return c.recommend(q)


async def warm(c: CascadeCore) -> None:
    """The admission's shed_after_batches calls, so the door knows a call's duration."""
    for _ in range(c.door.scheduler.admission.config.shed_after_batches):
        await ask(c, 10.0)


def test_a_call_with_less_slack_than_the_queue_ahead_is_shed_at_once_with_a_retry_hint() -> None:
    async def main() -> None:
        c, client = door_core(max_concurrent=1)
        client.set_delay(RANK_S)  # L2 + L3: ~100 ms per call
        await warm(c)
        gate = asyncio.Event()
        client.set_gate(gate)
        running = asyncio.ensure_future(ask(c, 10.0))  # takes the only slot, held at L2
        await asyncio.sleep(0.01)
        queued = asyncio.ensure_future(ask(c, 10.0))  # roomy: queued behind it
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted) as shed:  # ~100 ms of slack < 2 calls ahead + its own
            await ask(c, 0.1)
        assert shed.value.retry_after_s is not None and shed.value.retry_after_s > 0
        assert "slack" in shed.value.message and c.door.scheduler.shed == 1
        gate.set()
        a, b = await running, await queued
        assert len(a.item_ids) == len(b.item_ids) == 10 and not a.degraded and not b.degraded
        await c.aclose()

    asyncio.run(main())


def test_an_idle_door_runs_a_tight_call_which_answers_degraded_instead_of_being_shed() -> None:
    async def main() -> None:
        c, client = door_core(max_concurrent=1)
        client.set_delay(RANK_S)
        await warm(c)
        res = await ask(c, 0.03)  # 30 ms < one call's ~100 ms, but nothing is ahead of it
        assert res.degraded and c.door.scheduler.shed == 0
        await c.aclose()

    asyncio.run(main())


def test_a_call_whose_deadline_passes_in_the_queue_never_runs() -> None:
    async def main() -> None:
        c, client = door_core(max_concurrent=1)
        gate = asyncio.Event()
        client.set_gate(gate)
        running = asyncio.ensure_future(ask(c, 10.0, user=1))
        await asyncio.sleep(0.01)
        calls_before = len(client.calls)
        with pytest.raises(DeadlineExceeded):  # the door is cold (no shedding yet): it queues, then expires
            await ask(c, 0.05, user=2)
        gate.set()
        await running
        # The running call's L2 and L3 only: the expired one reached no stage.
        assert [m for m, _ in client.calls[calls_before:]] == ["dlrm", "l3"]
        assert c.requests == 1
        await c.aclose()

    asyncio.run(main())


def test_a_cancelled_call_cancels_its_ranker_call_in_flight() -> None:
    async def main() -> None:
        c, client = door_core(max_concurrent=2)
        gate = asyncio.Event()
        client.set_gate(gate)
        call = asyncio.ensure_future(ask(c, 10.0))
        await asyncio.sleep(0.01)  # now waiting in L2's Rank
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0.01)
        assert client.cancelled == 1  # the Rank it was waiting on was cancelled, not left running
        gate.set()
        other = await ask(c, 10.0)  # a live call still runs every stage
        models = [m for m, _ in client.calls]
        assert models == ["dlrm", "l3"], models  # the cancelled call's Rank never completed, its L3 never ran
        assert len(other.item_ids) == 10 and c.requests == 1 and c.door.scheduler.queued_count == 0
        await c.aclose()

    asyncio.run(main())


CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="")


class ContextClient(GatedClient):
    """Records, per Rank, the caller context variable it runs under (what the real
    client reads for the caller's API key: recserve.rpc.auth.CALLER_API_KEY)."""

    seen: list[tuple[int, str]]

    async def rank(self, user_id: int, candidate_ids: np.ndarray, *, model: str = "", **kw: Any) -> Any:
        self.seen.append((user_id, CALLER.get()))
        return await super().rank(user_id, candidate_ids, model=model, **kw)


def test_each_call_runs_in_its_own_callers_context_not_the_first_callers() -> None:
    async def caller(c: CascadeCore, user: int, key: str) -> Any:
        CALLER.set(key)  # as the gRPC edge binds the caller's key before calling the core
        return await ask(c, 10.0, user=user)

    async def main() -> None:
        c, plain = door_core(max_concurrent=2)
        client = ContextClient(plain.vector, plain.item_scores)
        client.seen = []
        c.client = client  # type: ignore[assignment]
        await asyncio.create_task(caller(c, 1, "key-of-1"))  # the first call starts the door
        await asyncio.gather(*(asyncio.create_task(caller(c, u, f"key-of-{u}")) for u in (2, 3, 4)))
        await asyncio.create_task(caller(c, 5, ""))  # a caller without a key sends none
        assert sorted(set(client.seen)) == [(1, "key-of-1"), (2, "key-of-2"), (3, "key-of-3"), (4, "key-of-4"), (5, "")]
        await c.aclose()

    asyncio.run(main())


def test_max_concurrent_bounds_the_calls_running_at_once() -> None:
    async def main() -> None:
        c, client = door_core(max_concurrent=2)
        gate = asyncio.Event()
        client.set_gate(gate)
        calls = [asyncio.ensure_future(ask(c, 10.0, user=u)) for u in range(5)]
        await asyncio.sleep(0.02)
        assert len(client.calls) == 0 and c.door.scheduler.queued_count == 3  # 2 held in L2, 3 queued
        gate.set()
        done = await asyncio.gather(*calls)
        assert all(len(r.item_ids) == 10 for r in done) and c.requests == 5
        await c.aclose()

    asyncio.run(main())


def test_a_queued_call_needs_slack_for_a_whole_undegraded_call_not_the_measured_one() -> None:
    """Calls that degrade are short, so the door's measured call time under overload
    understates what an undegraded call needs: the door also checks the stages' cost
    model (StagePlanner.full_service_s) and sheds a would-be-queued call whose slack
    after the wait cannot cover it, though the scheduler's own check would admit it."""
    from cascade.budget import Stage, stage_sizes_for

    async def main() -> None:
        c, client = door_core(max_concurrent=1)
        await warm(c)  # fast fake calls: the door measures ~ms per call
        for _ in range(50):  # L2 (100 candidates) is known to take 200 ms when it runs whole
            c.planner.models[Stage.L2].observe(100, 0.2)
        need = c.planner.full_service_s(stage_sizes_for(c.config, c.view.num_items, 10))
        assert need > 0.2 / c.config.budget_shares[2] * sum(c.config.budget_shares[2:]) * 0.99
        gate = asyncio.Event()
        client.set_gate(gate)
        running = asyncio.ensure_future(ask(c, 10.0))
        await asyncio.sleep(0.01)
        wait_s, service_s = c.door.scheduler.estimated_wait_s()
        slack = need * 0.8  # more than the measured wait + call (ms), less than an undegraded call needs
        assert 0 < wait_s + service_s < slack
        with pytest.raises(ResourceExhausted) as shed:
            await ask(c, slack)
        # The check's service time was the undegraded call's (the running call's L0/L1 moved the fit a little since).
        service_ms = float(re.search(r"service ([0-9.]+) ms", shed.value.message).group(1))  # type: ignore[union-attr]
        assert service_ms == pytest.approx((need + c.config.reply_margin_ms / 1e3) * 1e3, rel=0.01) and c.door.scheduler.shed == 1
        with pytest.raises(DeadlineExceeded):  # a deadline already past is that, not a shed, even at a busy door
            await ask(c, -0.001)
        queued = asyncio.ensure_future(ask(c, need * 3))  # enough for the wait and a whole call: queued
        await asyncio.sleep(0)
        assert c.door.scheduler.queued_count == 1
        gate.set()
        await running
        await queued
        await c.aclose()

    asyncio.run(main())

