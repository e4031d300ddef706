"""``lookup.close_at_dispatch``: under load a window closes at dispatch, not at its timer.

Scheduler-level tests drive :class:`FeatureParallelPolicy` with a fake clock and count
windows per caller; the client-level test freezes the client's clock, so only a window
that closes at dispatch can form at all while the first window's RPCs are in flight.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from recserve.config.spec import LookupConfig
from recserve.lookup.client import LookupClient
from recserve.scheduling import Done, FeatureParallelConfig, FeatureParallelPolicy, Scheduler
from recserve.scheduling.admission import AdmissionConfig
from recserve.scheduling.types import Handle, Priority, WorkItem
from tests.unit.test_lookup_client import item_kjt
from recserve.sharding.plan import Tier
from tests.unit.test_lookup_fakes import FakeShards, make_config, make_plan, make_weights, tier_ids

T = TypeVar("T")
WINDOW_MS = 1.0
SERVICE_S = 0.003  # fake time a window takes from dispatch to completion


def make_scheduler(close_at_dispatch: bool) -> tuple[Scheduler, FeatureParallelPolicy]:
    policy = FeatureParallelPolicy(FeatureParallelConfig(window_ms=WINDOW_MS, max_cost=1e9, dispatch_margin_ms=0.0, close_at_dispatch=close_at_dispatch))
    return Scheduler(policy, AdmissionConfig()), policy


def add(sched: Scheduler, caller: int, now: float) -> Handle:
    return sched.add(WorkItem(f"caller-{caller}", "default", Priority.STANDARD, math.inf, 1.0, caller), now, None)


def closed_loop(close_at_dispatch: bool, callers: int = 8, rounds: int = 5) -> tuple[dict[int, int], list[float]]:
    """Every caller resubmits the moment its window completes. Returns windows per caller
    and each window's wait (formed_at - its callers' arrival), in fake seconds."""
    sched, policy = make_scheduler(close_at_dispatch)
    now = 0.0
    windows_of = {c: 0 for c in range(callers)}
    waits = []
    for _ in range(rounds):
        arrived = now
        for c in range(callers):
            add(sched, c, now)
        batch = sched.schedule(now)
        if batch is None:  # not ready now: jump the fake clock to when the policy says
            wake = sched.next_wakeup(now)
            assert wake is not None and wake > now
            now = wake
            batch = sched.schedule(now)
        assert batch is not None
        waits.append(now - arrived)
        for h in batch.handles:
            windows_of[h.item.payload] += 1
        policy.on_dispatched(now)  # the window's RPCs are sent at once
        now += SERVICE_S
        sched.complete(batch, [Done(None)] * len(batch), now)
    return windows_of, waits


def test_closed_loop_windows_close_at_dispatch_not_at_their_timer() -> None:
    windows_of, waits = closed_loop(close_at_dispatch=True)
    # One window per caller per round: nobody is split off into an extra window...
    assert set(windows_of.values()) == {5}
    # ...and only the first window, opened on an idle client, waited its timer.
    assert waits[0] == pytest.approx(WINDOW_MS / 1e3)
    assert waits[1:] == [0.0] * 4


def test_without_close_at_dispatch_every_window_waits_its_timer() -> None:
    windows_of, waits = closed_loop(close_at_dispatch=False)
    assert set(windows_of.values()) == {5}
    assert waits == [pytest.approx(WINDOW_MS / 1e3)] * 5


def test_a_window_collects_while_the_previous_one_prepares_and_closes_when_it_is_sent() -> None:
    sched, policy = make_scheduler(close_at_dispatch=True)
    for c in range(4):
        add(sched, c, 0.0)
    first = sched.schedule(WINDOW_MS / 1e3)  # idle client: the timer closed it
    assert first is not None and len(first) == 4
    # While the first window still prepares its RPCs, three callers arrive: they wait for
    # its dispatch, with no timer of their own (no wake-up time at all)...
    t = 1.1e-3
    for c in range(4, 7):
        add(sched, c, t)
    assert sched.schedule(t) is None and sched.next_wakeup(t) is None
    assert sched.schedule(10e-3) is None  # long past their timer (2.1 ms): still collecting
    # ...and close the moment the first window is sent, all three in one window.
    policy.on_dispatched(10.5e-3)
    second = sched.schedule(10.5e-3)
    assert second is not None and sorted(h.item.payload for h in second.handles) == [4, 5, 6]
    # A caller arriving while the second prepares (the first still in flight) waits for it.
    add(sched, 7, 11e-3)
    assert sched.schedule(11e-3) is None
    policy.on_dispatched(11.2e-3)
    third = sched.schedule(11.2e-3)
    assert third is not None and [h.item.payload for h in third.handles] == [7]


def test_an_idle_client_waits_the_timer_again() -> None:
    sched, policy = make_scheduler(close_at_dispatch=True)
    add(sched, 0, 0.0)
    batch = sched.schedule(1e-3)
    assert batch is not None
    policy.on_dispatched(1e-3)
    sched.complete(batch, [Done(None)], 2e-3)
    # Arriving within a window of the last completion: the client is still busy.
    add(sched, 1, 2.5e-3)
    batch = sched.schedule(2.5e-3)
    assert batch is not None
    policy.on_dispatched(2.5e-3)
    sched.complete(batch, [Done(None)], 3e-3)
    # Arriving 10 ms after the client went idle: the window's timer applies.
    add(sched, 2, 13e-3)
    assert sched.schedule(13e-3) is None
    assert sched.next_wakeup(13e-3) == pytest.approx(14e-3)


@pytest.mark.parametrize("close_at_dispatch", [True, False])
def test_client_next_window_forms_while_the_first_is_in_flight_only_at_dispatch(close_at_dispatch: bool) -> None:
    """The client's clock is frozen, so no window timer ever expires: the first window
    closes on its size cap (8 ids), and a second window can only form at dispatch."""
    plan, _ = make_plan()
    fake = FakeShards(plan, make_weights())
    lookup = LookupConfig(window_ms=50.0, max_window_ms=50.0, target_ids=8, close_at_dispatch=close_at_dispatch)
    client = LookupClient(make_config(lookup=lookup), plan, fake, clock=lambda: 0.0)
    cold = tier_ids(plan, "item", Tier.COLD)

    async def body() -> tuple[int, int, int]:
        for shard in range(plan.num_shards):
            fake.set_blocked(shard)
        first = [asyncio.ensure_future(client.lookup(item_kjt(cold[2 * i : 2 * i + 2]), pooled=False, timeout_s=5.0)) for i in range(4)]
        for _ in range(200):  # until the first window's RPCs reached the (blocked) shards
            if fake.rpcs():
                break
            await asyncio.sleep(0)
        rpcs_first = fake.rpcs()
        second = [asyncio.ensure_future(client.lookup(item_kjt(cold[8 + i : 9 + i]), pooled=False, timeout_s=5.0)) for i in range(3)]
        for _ in range(200):
            if client.stats.windows >= 2:
                break
            await asyncio.sleep(0)
        windows_while_blocked = client.stats.windows
        for shard in range(plan.num_shards):
            fake.release(shard)
        results = await asyncio.gather(*first)
        second_done = all(f.done() for f in second)
        # Without close_at_dispatch the second window waits for a timer that the frozen
        # clock never ends: aclose (which drains, closing every window) serves it.
        await client.aclose()
        results += await asyncio.gather(*second)
        assert not any(r.degraded for r in results)
        return rpcs_first, windows_while_blocked, int(second_done)

    rpcs_first, windows_while_blocked, second_done = asyncio.run(run_client(client, body))
    assert rpcs_first >= 1
    # With close_at_dispatch the 3 new callers formed one window at once, in flight beside
    # the first, and were served before aclose.
    assert windows_while_blocked == (2 if close_at_dispatch else 1)
    assert second_done == int(close_at_dispatch)
    assert client.stats.windows == 2 and client.stats.callers == 7


async def run_client(client: LookupClient, body: Callable[[], Awaitable[T]]) -> T:
    await client.start()
    try:
        return await body()
    finally:
        await client.aclose()
