"""What a load test saw: outcome counts, errors by status and an HDR latency histogram.

Every request ends in exactly one outcome, with the precedence of
:meth:`recserve.bench.knee.ProbeResult.from_requests` (so ``recserve loadtest`` and the
knee finder agree on what counts):

* **shed** — refused: status ``RESOURCE_EXHAUSTED`` (admission, a full queue);
* **failed** — any other error, or no answer (``DEADLINE_EXCEEDED``, ``UNAVAILABLE``, ...);
* **late** — answered, but after the SLO (measured from the *scheduled* send time);
* **degraded** — answered within the SLO, degraded (partial rows, a skipped stage);
* **ok** — answered within the SLO and not degraded: the goodput.

Latencies of answered requests go into an ``hdrh`` histogram (microseconds, 3
significant digits: 0.1% relative error, constant memory however long the run), never a
sorted list. Errors are counted by their gRPC status name; ``errors`` in the report holds
every request without an answer (the shed ones too, under ``RESOURCE_EXHAUSTED``).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from hdrh.histogram import HdrHistogram

from recserve.bench.knee import ProbeResult
from recserve.loadtest.schedule import GeneratorLag

SHED_STATUSES = frozenset({"RESOURCE_EXHAUSTED"})
_HIST_MAX_US = 3_600_000_000  # one hour: anything longer is clamped (and would be failed anyway)


@dataclasses.dataclass(frozen=True)
class LoadSummary:
    """The report of one open-loop run (the issue's keys first; rates per second of
    ``span_s``: the schedule's duration, or until the last answer if later)."""

    offered_rps: float  # requests scheduled / the asked duration (the Poisson draw's own rate)
    completed_rps: float  # answered (any reply, late or degraded included) / span_s
    goodput_rps: float  # ok (in the SLO, not degraded) / span_s
    shed: int
    late: int
    degraded_fraction: float  # degraded answers / answers (late ones included)
    errors: dict[str, int]  # requests with no answer, by status name
    p50_ms: float | None  # of answered requests, from the scheduled send time
    p99_ms: float | None
    p999_ms: float | None
    generator_lag_ms: float  # the largest (actual - scheduled) send time
    requests: int
    sent: int
    answered: int
    ok: int
    degraded: int  # answered in the SLO but degraded
    failed: int
    in_flight: int  # sent, not finished when the summary was taken
    max_ms: float | None
    span_s: float
    slo_ms: float
    generator: GeneratorLag
    error_samples: dict[str, str] = dataclasses.field(default_factory=dict)  # status -> its first message

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["generator"] = self.generator.to_dict()
        return out

    def probe(self) -> ProbeResult:
        """This run as one knee probe (:mod:`recserve.bench.knee`): offered = the
        schedule's rate, achieved = the generator's send rate."""
        g = self.generator
        return ProbeResult(
            offered_per_s=g.offered_rps if g.offered_rps > 0 else max(self.offered_rps, 1e-9), achieved_per_s=g.sent_rps,
            requests=self.requests, ok=self.ok, late=self.late, degraded=self.degraded, shed=self.shed, failed=self.failed,
        )  # fmt: skip


class LoadRecorder:
    """Accumulates outcomes as requests finish (call from one event loop; no locks)."""

    def __init__(self, *, slo_s: float) -> None:
        self.slo_s = slo_s
        self.histogram = HdrHistogram(1, _HIST_MAX_US, 3)
        self.sent = 0
        self.in_flight = 0
        self.answered = 0
        self.ok = 0
        self.late = 0
        self.degraded_in_slo = 0
        self.degraded_answers = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.error_samples: dict[str, str] = {}  # status -> the first message seen with it
        self.last_done_s: float | None = None

    def on_send(self) -> None:
        self.sent += 1
        self.in_flight += 1

    def on_answer(self, latency_s: float, *, degraded: bool, done_s: float) -> None:
        """An answer ``latency_s`` after its scheduled send time."""
        self.in_flight -= 1
        self.answered += 1
        self.histogram.record_value(min(max(int(round(latency_s * 1e6)), 1), _HIST_MAX_US))
        self.degraded_answers += degraded
        if latency_s > self.slo_s:
            self.late += 1
        elif degraded:
            self.degraded_in_slo += 1
        else:
            self.ok += 1
        self._done(done_s)

    def on_error(self, status: str, *, done_s: float, message: str = "") -> None:
        """No answer: ``status`` is the gRPC status name (``"DEADLINE_EXCEEDED"``)."""
        self.in_flight -= 1
        self.errors[status] += 1
        self.error_samples.setdefault(status, message[:500])
        self._done(done_s)

    def _done(self, done_s: float) -> None:
        self.last_done_s = done_s if self.last_done_s is None else max(self.last_done_s, done_s)

    @property
    def shed(self) -> int:
        return sum(n for s, n in self.errors.items() if s in SHED_STATUSES)

    def percentile_ms(self, q: float) -> float | None:
        if self.histogram.get_total_count() == 0:
            return None
        return self.histogram.get_value_at_percentile(q) / 1e3

    def summary(self, lag: GeneratorLag, *, start_s: float, duration_s: float) -> LoadSummary:
        """The report; ``start_s`` is the schedule's origin, ``duration_s`` the asked
        duration (the span is at least that)."""
        span = max(duration_s, (self.last_done_s - start_s) if self.last_done_s is not None else 0.0)
        shed = self.shed
        failed = sum(self.errors.values()) - shed
        per_s = (lambda n: n / span) if span > 0 else (lambda n: 0.0)
        return LoadSummary(
            offered_rps=lag.requests / duration_s if duration_s > 0 else 0.0,
            completed_rps=per_s(self.answered), goodput_rps=per_s(self.ok), shed=shed, late=self.late,
            degraded_fraction=self.degraded_answers / self.answered if self.answered else 0.0,
            errors=dict(sorted(self.errors.items())), p50_ms=self.percentile_ms(50), p99_ms=self.percentile_ms(99), p999_ms=self.percentile_ms(99.9),
            generator_lag_ms=lag.max_ms, requests=lag.requests, sent=self.sent, answered=self.answered, ok=self.ok,
            degraded=self.degraded_in_slo, failed=failed, in_flight=self.in_flight,
            max_ms=self.histogram.get_max_value() / 1e3 if self.answered else None, span_s=span, slo_ms=self.slo_s * 1e3, generator=lag,
            error_samples=dict(sorted(self.error_samples.items())),
        )  # fmt: skip
