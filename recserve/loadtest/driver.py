"""The I/O edge of the load generator: send on the open-loop schedule, record, drain.

:func:`run_open_loop` draws Poisson send offsets (:mod:`recserve.bench.arrivals`),
walks :class:`~recserve.loadtest.schedule.OpenLoopSchedule` on the event loop and starts
one task per request the moment it is due: it never waits for an answer before the next
send, so a slow server cannot slow the offered load. Each request's latency runs from its
scheduled send time to its answer; each request's deadline is its scheduled time plus
``timeout_s``. After the last send it waits for the requests still out (at most
``timeout_s`` + :data:`DRAIN_GRACE_S`); any left then are cancelled and counted
``CANCELLED``.

:func:`run_closed_loop` is the baseline that hides stalls (``concurrency`` workers, each
sending its next request when the previous one answered, latency from the actual send):
the stalled-server test shows the difference.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import numpy as np

from recserve.bench.arrivals import poisson_arrivals
from recserve.errors import require
from recserve.loadtest.record import LoadRecorder, LoadSummary
from recserve.loadtest.schedule import OpenLoopSchedule
from recserve.loadtest.targets import Target, status_name

DRAIN_GRACE_S = 1.0  # past the last request's own deadline
START_LEAD_S = 0.005  # the schedule starts this far ahead of now, so request 0 is not born late
PROGRESS_EVERY_S = 0.1

#: ``progress(schedule, recorder)``: called at most every PROGRESS_EVERY_S while sending.
Progress = Callable[[OpenLoopSchedule, LoadRecorder], None]


async def run_open_loop(
    target: Target,
    *,
    rate_rps: float,
    duration_s: float,
    slo_s: float,
    timeout_s: float,
    seed: int = 0,
    progress: Progress | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> LoadSummary:
    """One open-loop run against a started ``target`` (see the module docstring)."""
    require(duration_s > 0, "loadtest.duration_s", duration_s, "use a positive duration in seconds")
    require(slo_s > 0, "loadtest.slo_ms", slo_s * 1e3, "use a positive SLO in ms")
    require(timeout_s > 0, "loadtest.timeout_ms", timeout_s * 1e3, "use a positive timeout in ms")
    offsets = poisson_arrivals(rate_rps, duration_s=duration_s, rng=np.random.default_rng(seed))
    schedule = OpenLoopSchedule(offsets, start_s=clock() + START_LEAD_S)
    recorder = LoadRecorder(slo_s=slo_s)
    tasks: set[asyncio.Task[None]] = set()

    async def one(i: int, scheduled: float) -> None:
        try:
            degraded = await target.call(i, scheduled + timeout_s)
        except asyncio.CancelledError:
            recorder.on_error("CANCELLED", done_s=clock())
            raise
        except Exception as exc:  # every failure is an outcome, counted by status
            recorder.on_error(status_name(exc), done_s=clock(), message=str(exc) or type(exc).__name__)
            return
        now = clock()
        recorder.on_answer(now - scheduled, degraded=degraded, done_s=now)

    next_progress = clock()
    while not schedule.done:
        at = schedule.next_send_s()
        assert at is not None
        delay = at - clock()
        if delay > 0:
            await sleep(delay)  # the schedule itself, not synchronisation
        for i in schedule.due(clock()):
            recorder.on_send()
            task = asyncio.ensure_future(one(i, float(schedule.scheduled_s[i])))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if progress is not None and clock() >= next_progress:
            progress(schedule, recorder)
            next_progress = clock() + PROGRESS_EVERY_S
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=timeout_s + DRAIN_GRACE_S)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    if progress is not None:
        progress(schedule, recorder)
    return recorder.summary(schedule.lag(), start_s=schedule.start_s, duration_s=duration_s)


async def run_closed_loop(target: Target, *, concurrency: int, requests: int, slo_s: float, timeout_s: float,
                          clock: Callable[[], float] = time.monotonic) -> LoadSummary:  # fmt: skip
    """``requests`` requests from ``concurrency`` workers, each waiting for its answer
    before it sends again; latency from the actual send (what a closed loop measures)."""
    require(concurrency >= 1, "loadtest.concurrency", concurrency, "use at least 1 worker")
    recorder = LoadRecorder(slo_s=slo_s)
    counter = iter(range(requests))
    start = clock()

    async def worker() -> None:
        for i in counter:
            sent = clock()
            recorder.on_send()
            try:
                degraded = await target.call(i, sent + timeout_s)
            except Exception as exc:
                recorder.on_error(status_name(exc), done_s=clock(), message=str(exc) or type(exc).__name__)
                continue
            now = clock()
            recorder.on_answer(now - sent, degraded=degraded, done_s=now)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    span = clock() - start
    # A closed loop has no schedule: its "schedule" is what it happened to send.
    schedule = OpenLoopSchedule(np.linspace(0.0, span, max(requests, 1))[:requests], start_s=start)
    schedule.due(start + span)
    schedule.sent_at_s[:] = schedule.scheduled_s
    return recorder.summary(schedule.lag(), start_s=start, duration_s=max(span, 1e-9))
