"""The device bulkhead: which job runs next on a device shared by rankers and decode
(docs/architecture.md §6, "Shared device"; reference §10.12 on bulkheads and priorities).

When a ranker and a decoder run in one process on one device (``[generation] co_locate``),
their work — ranker forwards (one per batch) and decode steps (one per iteration) — goes
through one :class:`~recserve.scheduling.device.DeviceExecutor`, which runs one job at a
time and asks this state machine which one. Two lanes:

- :attr:`Lane.CRITICAL` — ranker batches, deadline-bound: they go first;
- :attr:`Lane.BEST_EFFORT` — decode steps: they run whenever the rankers have no work,
  and while they do, decode still gets a guaranteed minimum share ``min_device_share``
  (``s``, default 0.2) of the time, so it never starves.

"The rankers have work" means a forward is queued or running, or — with
``yield_to_announced`` (the default) — a batch has been **announced**: it is in flight
(its embedding lookups are out) and will want the device within milliseconds
(:meth:`DeviceBulkhead.announce` / :meth:`~DeviceBulkhead.withdraw`, which the ranker
calls around each batch). Yielding to announced work keeps decode from taking the
device — and, on a CPU, the cores and the interpreter the ranker's lookups need —
just before a batch's forward arrives.

The share is kept with a **credit** in seconds, integrated exactly over the time
between calls (the state is constant in between): while decode has work (queued or
running) *and* the rankers have work (*contention*), decode earns ``s`` per second and
spends 1 per second it runs. So under sustained contention decode runs a fraction ``s``
of the time. Decisions, when the device is free:

- both lanes queued: decode if its credit is > 0, else the ranker batch (so with no
  credit the rankers go first);
- only decode queued, rankers announced: decode if its credit is >= 0, else the device
  idles until the credit is back to 0 (:meth:`~DeviceBulkhead.next_wakeup`) — a duty
  cycle of ``s`` while a batch is on its way;
- only one lane with any work: it runs (uncontended time costs nothing; the device is
  never held back for a lane that has nothing coming).

The credit stays within ``±max_credit_ms``, so a long ranker burst banks no long decode
burst, and one long decode step (a prefill) does not shut decode out for long. Jobs run
to completion (a forward or a decode step is one kernel sequence); FIFO within a lane
(the serving loops already order their batches by deadline). Pure and synchronous: the
caller passes ``now`` (monotonic seconds) to every call, so tests drive it with a fake
clock.

Example::

    b = DeviceBulkhead(BulkheadConfig(min_device_share=0.2))
    b.push(Lane.BEST_EFFORT, "step-1", now=0.0)
    b.push(Lane.CRITICAL, "rank-1", now=0.0)
    job = b.pop(now=0.0)          # the ranker batch: decode has no credit yet
    b.done(job, now=0.005)        # 5 ms while decode waited: decode earned 1 ms
    b.pop(now=0.005).payload      # "step-1"
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Generic, TypeVar

from recserve.errors import FailedPrecondition, require

T = TypeVar("T")
EPS_S = 1e-9  # credit this close to 0 counts as paid back (float sums of time slices)


class Lane(enum.IntEnum):
    """A bulkhead lane; the value indexes the per-lane arrays."""

    CRITICAL = 0  # ranker batches
    BEST_EFFORT = 1  # decode steps


@dataclasses.dataclass(frozen=True)
class BulkheadConfig:
    """``min_device_share``: best effort's guaranteed fraction of the time while the
    rankers have work (0 = strict priority: decode runs only when they have none).
    ``max_credit_ms``: the credit stays within ± this: best effort banks at most this much
    device time (its burst ahead of waiting ranker batches) and owes at most this much
    after a long step. ``yield_to_announced``: announced (in-flight) ranker batches count
    as ranker work (see the module doc); False: only queued and running forwards do."""

    min_device_share: float = 0.2
    max_credit_ms: float = 10.0
    yield_to_announced: bool = True

    def __post_init__(self) -> None:
        s = self.min_device_share
        require(isinstance(s, (int, float)) and 0.0 <= s <= 0.9, "generation.min_device_share", s,
                "use a fraction of device time in 0..0.9 (0 = rankers strictly first; the rest of the time is the rankers')")  # fmt: skip
        require(self.max_credit_ms > 0, "bulkhead.max_credit_ms", self.max_credit_ms, "use a positive duration in ms")


@dataclasses.dataclass
class Job(Generic[T]):
    """One queued or running job: its lane, payload and times (monotonic seconds)."""

    lane: Lane
    payload: T
    queued_at: float
    started_at: float = -1.0


@dataclasses.dataclass(frozen=True)
class LaneStats:
    """One lane's totals: jobs run, device seconds, seconds run under contention, queue
    wait (sum and max, seconds), jobs queued now and (critical) batches announced now."""

    jobs: int
    busy_s: float
    contended_s: float
    wait_s: float
    max_wait_s: float
    queued: int
    announced: int


@dataclasses.dataclass(frozen=True)
class BulkheadStats:
    """Both lanes' :class:`LaneStats`, the best-effort credit and the seconds the device
    was held idle for announced ranker work (``paced_s``)."""

    critical: LaneStats
    best_effort: LaneStats
    credit_s: float
    paced_s: float

    @property
    def best_effort_contended_share(self) -> float | None:
        """Best effort's fraction of the device time run under contention (None before any)."""
        total = self.critical.contended_s + self.best_effort.contended_s
        return self.best_effort.contended_s / total if total > 0 else None


class DeviceBulkhead(Generic[T]):
    """Orders jobs of two lanes onto one serial device (see the module doc)."""

    def __init__(self, config: BulkheadConfig = BulkheadConfig()) -> None:
        self.config = config
        self._share = float(config.min_device_share)
        self._max_credit_s = config.max_credit_ms / 1e3
        self._queues: tuple[collections.deque[Job[T]], collections.deque[Job[T]]] = (collections.deque(), collections.deque())
        self._announced = 0  # critical batches in flight that will want the device
        self._running: Job[T] | None = None
        self._last: float | None = None  # the time the state below was last brought up to
        self.credit_s = 0.0
        self._jobs = [0, 0]
        self._busy = [0.0, 0.0]
        self._contended = [0.0, 0.0]
        self._wait = [0.0, 0.0]
        self._max_wait = [0.0, 0.0]
        self._paced = 0.0

    # ---- queries --------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """A job is running (the device takes one at a time)."""
        return self._running is not None

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing running."""
        return self._running is None and not self._queues[0] and not self._queues[1]

    def queued(self, lane: Lane) -> int:
        return len(self._queues[lane])

    @property
    def paced_s(self) -> float:
        """Seconds the device idled so far only because decode was held back (announced batches)."""
        return self._paced

    def stats(self) -> BulkheadStats:
        lanes = [LaneStats(self._jobs[k], self._busy[k], self._contended[k], self._wait[k], self._max_wait[k], len(self._queues[k]),
                           self._announced if k is Lane.CRITICAL else 0) for k in Lane]  # fmt: skip
        return BulkheadStats(critical=lanes[Lane.CRITICAL], best_effort=lanes[Lane.BEST_EFFORT], credit_s=self.credit_s, paced_s=self._paced)

    def _has_work(self, lane: Lane) -> bool:
        running = self._running is not None and self._running.lane is lane
        announced = lane is Lane.CRITICAL and self.config.yield_to_announced and self._announced > 0
        return running or announced or bool(self._queues[lane])

    def next_wakeup(self, now: float) -> float | None:
        """When a held-back decode job may start (its credit back to 0), if the device is
        idle only for pacing; None otherwise (the next push, done or withdraw decides)."""
        self._advance(now)
        if self._running is not None or self._queues[Lane.CRITICAL] or not self._queues[Lane.BEST_EFFORT]:
            return None
        if not self._has_work(Lane.CRITICAL) or self.credit_s >= -EPS_S or self._share <= 0:
            return None
        return now + (-self.credit_s) / self._share

    # ---- transitions ----------------------------------------------------------------

    def _advance(self, now: float) -> None:
        """Integrate the credit and the per-lane times from the last call to ``now`` (the
        state was constant in between)."""
        last, self._last = self._last, now
        if last is None or now <= last:
            return
        dt = now - last
        running = self._running.lane if self._running is not None else None
        if self._has_work(Lane.BEST_EFFORT) and self._has_work(Lane.CRITICAL):
            earned = self._share * dt - (dt if running is Lane.BEST_EFFORT else 0.0)
            self.credit_s = min(self._max_credit_s, max(-self._max_credit_s, self.credit_s + earned))
            if running is not None:
                self._contended[running] += dt
            elif self._queues[Lane.BEST_EFFORT]:
                self._paced += dt  # idle only because decode was held back

    def push(self, lane: Lane, payload: T, now: float) -> Job[T]:
        """Queue ``payload`` on ``lane`` at ``now``; returns its job."""
        self._advance(now)
        job = Job(Lane(lane), payload, now)
        self._queues[job.lane].append(job)
        return job

    def announce(self, now: float) -> None:
        """A ranker batch is in flight and will want the device (see the module doc)."""
        self._advance(now)
        self._announced += 1

    def withdraw(self, now: float) -> None:
        """An announced batch is done with the device (or gave up)."""
        self._advance(now)
        if self._announced <= 0:
            raise FailedPrecondition("bulkhead: withdraw without a matching announce")
        self._announced -= 1

    def pop(self, now: float) -> Job[T] | None:
        """The job to run now, marked running; None while one runs, nothing is queued, or
        decode is held back for announced ranker work (then see :meth:`next_wakeup`)."""
        self._advance(now)
        if self._running is not None:
            return None
        crit, best = self._queues
        if crit and best:
            lane = Lane.BEST_EFFORT if self.credit_s > 0 else Lane.CRITICAL
        elif crit:
            lane = Lane.CRITICAL
        elif best:
            if self._has_work(Lane.CRITICAL) and self.credit_s < -EPS_S:
                return None  # a ranker batch is on its way and decode has used its share
            lane = Lane.BEST_EFFORT
        else:
            return None
        job = self._queues[lane].popleft()
        job.started_at = now
        wait = max(0.0, now - job.queued_at)
        self._wait[lane] += wait
        self._max_wait[lane] = max(self._max_wait[lane], wait)
        self._running = job
        return job

    def done(self, job: Job[T], now: float) -> None:
        """``job`` (the one :meth:`pop` returned) finished at ``now``."""
        if job is not self._running:
            raise FailedPrecondition(f"bulkhead: job {job.payload!r} on lane {job.lane.name} is not the running job")
        self._advance(now)
        self._running = None
        self._jobs[job.lane] += 1
        self._busy[job.lane] += max(0.0, now - job.started_at)

    def discard(self, job: Job[T], now: float) -> bool:
        """Drop a queued ``job`` (its caller went away); False if it is not queued."""
        self._advance(now)
        try:
            self._queues[job.lane].remove(job)
        except ValueError:
            return False
        return True
