"""The open-loop send schedule and the generator's own lag (no I/O, no clock of its own).

An open-loop load generator fixes every request's send time before the run starts
(Poisson arrivals, :func:`recserve.bench.arrivals.poisson_arrivals`) and never waits for
an answer before sending the next request. Two consequences this module makes explicit:

* a request's latency is measured from its **scheduled** send time, not from when the
  generator got round to sending it, so a stall that delays the generator (or the
  server) shows up in the percentiles instead of being "coordinated" away;
* when the generator itself falls behind its schedule (on a loaded 2-core box it can),
  the lag of every send is recorded and reported (:class:`GeneratorLag`), so a lower
  achieved rate is never passed off as the rate that was offered.

:class:`OpenLoopSchedule` is a synchronous state machine: the driver asks which requests
are due at ``now`` (:meth:`~OpenLoopSchedule.due`), sends them, and sleeps until
:meth:`~OpenLoopSchedule.next_send_s`. Tests drive it with a fake clock.

Example::

    s = OpenLoopSchedule(np.array([0.010, 0.020, 0.030]), start_s=100.0)
    s.due(100.025)        # range(0, 2): both sent 15 ms and 5 ms late
    s.next_send_s()       # 100.03
    s.due(100.030)        # range(2, 3), on time
    s.lag().max_ms        # 15.0
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from recserve.bench.knee import MIN_GENERATOR_FRACTION
from recserve.errors import FailedPrecondition, require

#: A send this much later than scheduled (p99 over the run) marks the generator as behind,
#: whatever its rate: on loopback a healthy asyncio generator sends within ~1-2 ms.
LAG_WARN_MS = 10.0


@dataclasses.dataclass(frozen=True)
class GeneratorLag:
    """How far behind its schedule the generator sent (actual - scheduled send time).

    ``offered_rps``: requests / the schedule's span (first scheduled send at 0 to the
    last); ``sent_rps``: requests / the actual span (to the last actual send). ``behind``
    is True when the p99 lag exceeds :data:`LAG_WARN_MS` or the generator sent at less
    than :data:`~recserve.bench.knee.MIN_GENERATOR_FRACTION` of the offered rate.
    """

    requests: int
    sent: int
    max_ms: float
    p99_ms: float
    mean_ms: float
    offered_rps: float
    sent_rps: float
    behind: bool

    @property
    def sent_fraction(self) -> float:
        return self.sent_rps / self.offered_rps if self.offered_rps > 0 else 0.0

    def describe(self) -> str:
        """One line for the report; says plainly when the generator fell behind."""
        head = f"generator lag: max {self.max_ms:.1f} ms, p99 {self.p99_ms:.1f} ms (sent {self.sent_rps:,.1f}/s of {self.offered_rps:,.1f}/s offered)"
        if not self.behind:
            return head
        if self.offered_rps > 0 and self.sent_fraction < MIN_GENERATOR_FRACTION:
            return head + (f"  ** the generator fell behind its schedule (by up to {self.max_ms:,.0f} ms) and sent at {self.sent_fraction:.0%} of the "
                           "offered rate: the system was offered less than asked, so these figures do not show the asked rate **")  # fmt: skip
        return head + (f"  ** the generator sent up to {self.max_ms:,.0f} ms late (the load generator's own process is short of CPU): the rate held, "
                       "but late sends arrive in bursts; latencies still count from the scheduled times **")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class OpenLoopSchedule:
    """Scheduled send times ``start_s + offsets_s`` (float64 [N], ascending, seconds on
    the driver's monotonic clock) and the lag of each send.

    ``due(now)`` hands out every not-yet-sent request whose time has come (all of them
    at once when the generator is late: it catches up by sending a burst, as a real
    population of users would have, rather than stretching the schedule).
    """

    def __init__(self, offsets_s: np.ndarray, *, start_s: float) -> None:
        offsets = np.asarray(offsets_s, dtype=np.float64).reshape(-1)
        require(bool(np.all(np.diff(offsets) >= 0)) if offsets.size > 1 else True, "OpenLoopSchedule.offsets_s", "unsorted",
                "give ascending send offsets (poisson_arrivals returns them sorted)")  # fmt: skip
        require(math.isfinite(start_s), "OpenLoopSchedule.start_s", start_s, "use a finite monotonic time")
        self.start_s = float(start_s)
        self.offsets_s = offsets
        self.scheduled_s = self.start_s + offsets  # [N] absolute send times
        self.sent_at_s = np.full(offsets.size, np.nan)  # [N] actual send times (NaN: not yet)
        self._next = 0

    @property
    def size(self) -> int:
        return int(self.offsets_s.size)

    @property
    def sent(self) -> int:
        return self._next

    @property
    def done(self) -> bool:
        return self._next >= self.offsets_s.size

    def next_send_s(self) -> float | None:
        """When the next request is due (None: all sent)."""
        return None if self.done else float(self.scheduled_s[self._next])

    def due(self, now_s: float) -> range:
        """The requests due at ``now_s`` (indices into the schedule), marked sent at
        ``now_s``. Empty when the next one is still in the future."""
        end = int(np.searchsorted(self.scheduled_s, now_s, side="right"))
        start = self._next
        if end <= start:
            return range(start, start)
        self.sent_at_s[start:end] = now_s
        self._next = end
        return range(start, end)

    def lag(self) -> GeneratorLag:
        """Lag of the sends so far (all of them once :attr:`done`)."""
        n = self._next
        lag_ms = (self.sent_at_s[:n] - self.scheduled_s[:n]) * 1e3
        span = float(self.offsets_s[-1]) if self.offsets_s.size else 0.0
        offered = self.offsets_s.size / span if span > 0 else 0.0
        sent_span = float(self.sent_at_s[n - 1] - self.start_s) if n else 0.0
        sent_rps = n / sent_span if sent_span > 0 else 0.0
        p99 = float(np.percentile(lag_ms, 99)) if n else 0.0
        behind = n > 0 and (p99 > LAG_WARN_MS or (offered > 0 and sent_rps < MIN_GENERATOR_FRACTION * offered))
        return GeneratorLag(
            requests=self.size, sent=n, max_ms=float(lag_ms.max()) if n else 0.0, p99_ms=p99, mean_ms=float(lag_ms.mean()) if n else 0.0,
            offered_rps=offered, sent_rps=sent_rps, behind=bool(behind),
        )  # fmt: skip

    def scheduled(self, i: int) -> float:
        """Scheduled send time of request ``i`` (the origin of its latency)."""
        if not 0 <= i < self.size:
            raise FailedPrecondition(f"request {i} is not in the schedule of {self.size}")
        return float(self.scheduled_s[i])
