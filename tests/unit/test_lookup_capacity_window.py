"""``lookup.close_at_dispatch``: under load a window closes at dispatch, not at its timer.

Scheduler-level tests drive :class:`FeatureParallelPolicy` with a fake clock and count
windows per caller; the client-level test freezes the client's clock, so no window
timer ever ends: only a window that closes at dispatch can form at all.
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
from recserve.scheduling.types import Batch, Handle, Priority, WorkItem
from tests.unit.test_lookup_client import item_kjt
from recserve.sharding.plan import Tier
from tests.unit.test_lookup_fakes import FakeShards, make_config, make_plan, make_weights, tier_ids

T = TypeVar("T")
WINDOW_MS = 1.0
SERVICE_S = 0.003  # fake time a window takes from dispatch to completion


MAX_WINDOW_MS = 5.0  # the longest a window waits behind one in flight


def make_scheduler(close_at_dispatch: bool) -> tuple[Scheduler, FeatureParallelPolicy]:
    policy = FeatureParallelPolicy(FeatureParallelConfig(
        window_ms=WINDOW_MS, max_window_ms=MAX_WINDOW_MS, max_cost=1e9, dispatch_margin_ms=0.0, close_at_dispatch=close_at_dispatch,
    ))  # fmt: skip
    return Scheduler(policy, AdmissionConfig()), policy


def add(sched: Scheduler, caller: int, now: float) -> Handle:
    return sched.add(WorkItem(f"caller-{caller}", "default", Priority.STANDARD, math.inf, 1.0, caller), now, None)


def closed_loop(close_at_dispatch: bool, callers: int = 8, rounds: int = 5) -> tuple[dict[int, int], list[float]]:
    """Every caller resubmits the moment its window completes. Returns windows per caller
    and each window's wait (formed_at - its callers' arrival), in fake seconds."""
    sched, _ = make_scheduler(close_at_dispatch)
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


def test_a_window_collects_while_the_previous_one_is_in_flight_and_closes_when_it_is_done() -> None:
    sched, _ = make_scheduler(close_at_dispatch=True)
    warm = [add(sched, c, 0.0) for c in range(4)]
    batch = sched.schedule(WINDOW_MS / 1e3)  # idle client: the timer closed it
    assert batch is not None and list(batch.handles) == warm
    sched.complete(batch, [Done(None)] * 4, 4e-3)  # a measured window: 3 ms
    for c in range(4):  # closed loop: they resubmit at once, and go at once
        add(sched, c, 4e-3)
    first = sched.schedule(4e-3)
    assert first is not None and len(first) == 4
    # While the first window's RPCs are in flight, three callers arrive at 4.1, 4.5 and
    # 5.5 ms: they wait for it, past their own 1 ms timer (5.1 ms)...
    for c, t in zip(range(4, 7), (4.1e-3, 4.5e-3, 5.5e-3)):
        add(sched, c, t)
        assert sched.schedule(t) is None
    assert sched.schedule(6.9e-3) is None
    # ...and close the moment the first window is done, all three in one window.
    sched.complete(first, [Done(None)] * 4, 7e-3)
    second = sched.schedule(7e-3)
    assert second is not None and sorted(h.item.payload for h in second.handles) == [4, 5, 6]
    # The first window's callers resubmit at once: they wait for the second, then go together.
    for c in range(4):
        add(sched, c, 7e-3)
    assert sched.schedule(7.5e-3) is None
    sched.complete(second, [Done(None)] * 3, 10e-3)
    third = sched.schedule(10e-3)
    assert third is not None and sorted(h.item.payload for h in third.handles) == [0, 1, 2, 3]


def test_a_slow_window_in_flight_holds_the_queue_until_twice_its_measured_time_not_max_window_ms() -> None:
    sched, _ = make_scheduler(close_at_dispatch=True)
    add(sched, 0, 0.0)
    first = sched.schedule(1e-3)
    assert first is not None
    sched.complete(first, [Done(None)], 4e-3)  # a measured window: 3 ms
    add(sched, 1, 4e-3)
    stuck = sched.schedule(4e-3)  # busy (just finished): closes at dispatch
    assert stuck is not None
    add(sched, 2, 6e-3)
    assert sched.schedule(9e-3) is None  # still a plausible window in flight
    # Twice the measured 3 ms from the slow window's start: 10 ms. Then it goes, beside
    # the slow one.
    assert sched.next_wakeup(9e-3) == pytest.approx(4e-3 + 2 * 3e-3)
    beside = sched.schedule(10e-3)
    assert beside is not None and [h.item.payload for h in beside.handles] == [2]
    # With both in flight, a caller waits for the latest window's expected end (16 ms),
    # past max_window_ms after it arrived (15.5 ms): a window in flight is not cut
    # short by the cap, or every window would run beside another under open load.
    add(sched, 3, 10.5e-3)
    assert sched.next_wakeup(10.5e-3) == pytest.approx(10e-3 + 2 * 3e-3)
    assert sched.schedule(15.6e-3) is None


def open_loop(service_s: float, gap_s: float, callers: int) -> tuple[list[int], int]:
    """Callers arriving every ``gap_s`` while each window takes ``service_s`` of fake time,
    after one measured window. Returns each window's size and how many windows started
    while another was in flight."""
    sched, _ = make_scheduler(close_at_dispatch=True)
    add(sched, -1, 0.0)
    first = sched.schedule(WINDOW_MS / 1e3)
    assert first is not None
    now = WINDOW_MS / 1e3 + service_s
    sched.complete(first, [Done(None)], now)
    arrivals = [now + gap_s * (i + 1) for i in range(callers)]
    running: list[tuple[float, Batch]] = []  # (ends at, window)
    sizes: list[int] = []
    beside, i = 0, 0
    while i < len(arrivals) or running:
        wake = sched.next_wakeup(now)
        now = min([t for t in (arrivals[i] if i < len(arrivals) else None, wake, *(end for end, _ in running)) if t is not None])
        for end, batch in sorted((r for r in running if r[0] <= now), key=lambda r: r[0]):
            running.remove((end, batch))
            sched.complete(batch, [Done(None)] * len(batch), end)
        while i < len(arrivals) and arrivals[i] <= now:
            add(sched, i, arrivals[i])
            i += 1
        while (batch := sched.schedule(now)) is not None:
            beside += bool(running)
            sizes.append(len(batch))
            running.append((now + service_s, batch))
    return sizes, beside


def test_open_loop_arrivals_wait_for_the_window_in_flight_instead_of_running_beside_it() -> None:
    """Windows take 8 ms, longer than max_window_ms (5 ms), and a caller arrives every
    0.7 ms: each window waits for the one in flight and takes every caller that arrived
    meanwhile (11-12 of them), none runs beside another. With the cap, a window went
    beside every window in flight 5 ms after its first caller."""
    sizes, beside = open_loop(service_s=8e-3, gap_s=0.7e-3, callers=120)
    assert sum(sizes) == 120 and beside == 0
    assert min(sizes[1:-1]) >= 10  # full windows between the first and the tail
    # A window in flight past twice its expected time no longer holds the queue.
    sched, _ = make_scheduler(close_at_dispatch=True)
    add(sched, 0, 0.0)
    first = sched.schedule(WINDOW_MS / 1e3)
    assert first is not None
    sched.complete(first, [Done(None)], 9e-3)  # measured: 8 ms
    add(sched, 1, 9e-3)
    stuck = sched.schedule(9e-3)
    assert stuck is not None
    add(sched, 2, 9.5e-3)
    assert sched.next_wakeup(9.5e-3) == pytest.approx(9e-3 + 2 * 8e-3)


@pytest.mark.parametrize("close_at_dispatch", [True, False])
def test_client_windows_close_at_dispatch_under_load_not_at_their_timer(close_at_dispatch: bool) -> None:
    """The client's clock is frozen, so no window timer ever ends: the first window
    closes on its size cap (8 ids). Callers arriving while it is in flight form the next
    window the moment it is done only with close_at_dispatch; without it they wait for
    the frozen timer until aclose drains them."""
    plan, _ = make_plan()
    fake = FakeShards(plan, make_weights())
    lookup = LookupConfig(window_ms=50.0, max_window_ms=50.0, target_ids=8, close_at_dispatch=close_at_dispatch)
    client = LookupClient(make_config(lookup=lookup), plan, fake, clock=lambda: 0.0)
    cold = tier_ids(plan, "item", Tier.COLD)

    async def until(cond: Callable[[], bool]) -> bool:
        for _ in range(500):  # event-loop turns, not time
            if cond():
                return True
            await asyncio.sleep(0)
        return cond()

    async def body() -> tuple[int, bool, bool]:
        for shard in range(plan.num_shards):
            fake.set_blocked(shard)
        first = [asyncio.ensure_future(client.lookup(item_kjt(cold[2 * i : 2 * i + 2]), pooled=False, timeout_s=5.0)) for i in range(4)]
        assert await until(lambda: fake.rpcs() > 0)  # the first window's RPCs reached the blocked shards
        second = [asyncio.ensure_future(client.lookup(item_kjt(cold[8 + i : 9 + i]), pooled=False, timeout_s=5.0)) for i in range(3)]
        await until(lambda: client.stats.windows >= 2)
        windows_while_in_flight = client.stats.windows  # they collect, they do not split off
        for shard in range(plan.num_shards):
            fake.release(shard)
        results = await asyncio.gather(*first)
        served = await until(lambda: all(f.done() for f in second))
        await client.aclose()  # drains whatever still waits for a timer
        results += await asyncio.gather(*second)
        assert not any(r.degraded for r in results)
        return windows_while_in_flight, served, client.stats.windows == 2

    windows_while_in_flight, served, two_windows = asyncio.run(run_client(client, body))
    assert windows_while_in_flight == 1
    assert served == close_at_dispatch  # closed at dispatch: served before aclose
    assert two_windows  # 7 callers, 2 windows either way: nobody split off
    assert client.stats.callers == 7


async def run_client(client: LookupClient, body: Callable[[], Awaitable[T]]) -> T:
    await client.start()
    try:
        return await body()
    finally:
        await client.aclose()
