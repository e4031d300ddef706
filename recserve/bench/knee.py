"""The shared knee finder: the highest offered rate a system serves well.

The *knee* is the highest offered Poisson rate at which at least ``ok_target`` (99%) of
the offered requests complete **OK**: answered, within the SLO, and not degraded. Shed,
failed, late, degraded and unanswered requests all count against it. It is found by
bisection between ``lo_rps`` and ``hi_rps`` until the bracket is within ``tolerance``
(5%): the reported knee is the highest rate that passed, and the lowest rate that did
not pass is at most ``(1 + tolerance)`` times it.

A probe whose load generator achieved less than ``min_generator_fraction`` (98%) of the
rate it was asked for is **invalid**: on 2 shared cores the generator itself can fall
behind, and then the system was never offered the rate. An invalid probe is reported
(``valid=False``) and not counted: the same rate is retried up to ``invalid_retries``
times, and if it stays invalid the search treats it as the top of what can be
measured. When the bracket ends at such a rate the status is ``GENERATOR_LIMITED`` and
the knee is a lower bound.

The search itself is :class:`KneeSearch`, a synchronous state machine with no I/O
(``next_rate()`` / ``record(result)``); :func:`find_knee` and :func:`find_knee_async`
drive it with a blocking or an awaitable probe. Every benchmark that reports a knee
(lookup, rank, loadtest, faults) uses this module, so "knee" means the same everywhere.

Example::

    def probe(rate: float) -> ProbeResult:      # run the system at `rate` for a few s
        ...
        return ProbeResult.from_requests(rate, achieved_per_s=..., latency_s=lat,
                                         degraded=deg, shed=shed, slo_s=0.050)

    result = find_knee(probe, lo_rps=100, hi_rps=20_000)
    result.knee_per_s, result.status, [p.rate_per_s for p in result.probes]
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from recserve.errors import InvalidArgument, require

OK_TARGET = 0.99  # fraction of offered requests that must complete OK
TOLERANCE = 0.05  # bisection stops when hi / lo <= 1 + TOLERANCE
MIN_GENERATOR_FRACTION = 0.98  # a probe whose generator achieved less is invalid


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What one probe at one offered rate saw.

    ``offered_per_s``: the rate the generator was asked to hold (the nominal rate, or
    better the realised rate of its Poisson schedule, ``N / last scheduled offset``, so
    a short probe's Poisson noise does not read as the generator falling behind);
    ``achieved_per_s``: the rate it actually issued requests at (``N / last actual send
    offset``) — the *send* rate, not :func:`recserve.bench.sweep.summarise`'s
    ``achieved_per_s`` (answers per second): an overloaded system answers slower than it
    is offered, and passing that here would mark its failing probes invalid instead of
    failed. ``requests``: requests offered; the outcome counts partition them, and
    any request in no count (lost, never answered) counts against the knee like a
    failure.
    """

    offered_per_s: float
    achieved_per_s: float
    requests: int
    ok: int  # answered within the SLO, not degraded
    late: int = 0  # answered after the SLO
    degraded: int = 0  # answered in time, but degraded (partial rows, a fallback)
    shed: int = 0  # refused at admission (RESOURCE_EXHAUSTED, queue full, dropped at deadline)
    failed: int = 0  # an error or no answer

    def __post_init__(self) -> None:
        counts = {"ok": self.ok, "late": self.late, "degraded": self.degraded, "shed": self.shed, "failed": self.failed}
        for name, value in counts.items():
            require(value >= 0, f"ProbeResult.{name}", value, "use a count >= 0")
        require(sum(counts.values()) <= self.requests, "ProbeResult.requests", self.requests,
                f"use at least the sum of the outcome counts ({sum(counts.values())})")
        require(self.offered_per_s > 0, "ProbeResult.offered_per_s", self.offered_per_s, "use a positive rate")
        require(self.achieved_per_s >= 0, "ProbeResult.achieved_per_s", self.achieved_per_s, "use a rate >= 0")

    @property
    def ok_fraction(self) -> float:
        """OK requests / offered requests (0.0 for an empty probe: nothing was shown to work)."""
        return self.ok / self.requests if self.requests else 0.0

    @property
    def generator_fraction(self) -> float:
        """Achieved / offered rate of the load generator."""
        return self.achieved_per_s / self.offered_per_s

    @classmethod
    def from_requests(
        cls,
        offered_per_s: float,
        *,
        achieved_per_s: float,
        latency_s: np.ndarray,
        slo_s: float,
        degraded: np.ndarray | None = None,
        shed: np.ndarray | None = None,
    ) -> ProbeResult:
        """Classify N requests at once (no loop per request).

        ``latency_s``: float [N], scheduled arrival to answer, NaN for no answer;
        ``degraded`` / ``shed``: bool [N] (default all False). Precedence: shed, then
        failed (no answer), then late (``latency > slo_s``), then degraded, else OK.

        Example: latencies ``[0.01, 0.2, nan]`` with a 50 ms SLO -> ok 1, late 1, failed 1.
        """
        lat = np.asarray(latency_s, dtype=np.float64).reshape(-1)
        n = lat.shape[0]
        shed_m = np.zeros(n, dtype=bool) if shed is None else np.asarray(shed, dtype=bool).reshape(-1)
        deg_m = np.zeros(n, dtype=bool) if degraded is None else np.asarray(degraded, dtype=bool).reshape(-1)
        if shed_m.shape[0] != n or deg_m.shape[0] != n:
            raise InvalidArgument(f"ProbeResult.from_requests: latency_s has {n} entries, degraded {deg_m.shape[0]}, shed {shed_m.shape[0]}; give one per request")
        failed_m = ~shed_m & np.isnan(lat)
        answered = ~shed_m & ~failed_m
        late_m = answered & (lat > slo_s)
        deg_m = answered & ~late_m & deg_m
        ok_m = answered & ~late_m & ~deg_m
        return cls(
            offered_per_s=offered_per_s,
            achieved_per_s=achieved_per_s,
            requests=n,
            ok=int(np.count_nonzero(ok_m)),
            late=int(np.count_nonzero(late_m)),
            degraded=int(np.count_nonzero(deg_m)),
            shed=int(np.count_nonzero(shed_m)),
            failed=int(np.count_nonzero(failed_m)),
        )


@dataclasses.dataclass(frozen=True)
class ProbeRecord:
    """One probe as the search saw it. ``passed`` is None for an invalid probe."""

    rate_per_s: float
    valid: bool
    ok_fraction: float
    passed: bool | None
    result: ProbeResult

    def to_dict(self) -> dict[str, Any]:
        return {"rate_per_s": self.rate_per_s, "valid": self.valid, "ok_fraction": self.ok_fraction, "passed": self.passed,
                **dataclasses.asdict(self.result)}


class KneeStatus(enum.Enum):
    FOUND = "found"  # bracketed: knee passed, a rate <= knee * (1 + tolerance) failed
    ABOVE_RANGE = "above_range"  # hi_rps itself passed: the knee is at least hi_rps
    BELOW_RANGE = "below_range"  # lo_rps already failed: no knee in the range
    GENERATOR_LIMITED = "generator_limited"  # the bracket ends where the generator fell behind: a lower bound
    NO_VALID_PROBE = "no_valid_probe"  # the generator could not even offer lo_rps


@dataclasses.dataclass(frozen=True)
class KneeResult:
    """``knee_per_s``: the highest offered rate that passed (None for BELOW_RANGE and
    NO_VALID_PROBE); ``reason`` says in words how the search ended; ``probes`` lists
    every probe in the order run, invalid ones included."""

    knee_per_s: float | None
    status: KneeStatus
    reason: str
    probes: tuple[ProbeRecord, ...]
    ok_target: float
    tolerance: float
    min_generator_fraction: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "knee_per_s": self.knee_per_s,
            "status": self.status.value,
            "reason": self.reason,
            "ok_target": self.ok_target,
            "tolerance": self.tolerance,
            "min_generator_fraction": self.min_generator_fraction,
            "probes": [p.to_dict() for p in self.probes],
        }


class KneeSearch:
    """The bisection as a state machine: call :meth:`next_rate`, probe that rate, pass
    the result to :meth:`record`; repeat until ``next_rate()`` is None, then read
    :meth:`result`. Rates are bisected geometrically (``sqrt(lo * hi)``): the stop rule
    is a ratio, so each probe halves the bracket's log-width."""

    def __init__(
        self,
        *,
        lo_rps: float,
        hi_rps: float,
        tolerance: float = TOLERANCE,
        ok_target: float = OK_TARGET,
        min_generator_fraction: float = MIN_GENERATOR_FRACTION,
        invalid_retries: int = 1,
        fail_retries: int = 0,
        max_probes: int = 40,
    ) -> None:
        require(math.isfinite(lo_rps) and lo_rps > 0, "knee.lo_rps", lo_rps, "use a positive, finite rate")
        require(math.isfinite(hi_rps) and hi_rps > lo_rps, "knee.hi_rps", hi_rps, f"use a finite rate above lo_rps ({lo_rps:g})")
        require(0 < tolerance < 1, "knee.tolerance", tolerance, "use a relative tolerance in (0, 1), e.g. 0.05")
        require(0 < ok_target <= 1, "knee.ok_target", ok_target, "use a fraction in (0, 1], e.g. 0.99")
        require(0 < min_generator_fraction <= 1, "knee.min_generator_fraction", min_generator_fraction, "use a fraction in (0, 1], e.g. 0.98")
        require(invalid_retries >= 0, "knee.invalid_retries", invalid_retries, "use >= 0 retries")
        require(fail_retries >= 0, "knee.fail_retries", fail_retries, "use >= 0 retries")
        require(max_probes >= 2, "knee.max_probes", max_probes, "use at least 2 probes (lo and hi)")
        self.lo_rps, self.hi_rps = float(lo_rps), float(hi_rps)
        self.tolerance, self.ok_target, self.min_generator_fraction = tolerance, ok_target, min_generator_fraction
        self.invalid_retries, self.max_probes = invalid_retries, max_probes
        # A failed rate is re-probed this many times and fails only if every try fails: on
        # a shared box one tail event from another tenant must not set the knee. It is a
        # best-of rule, so compare knees found with the same value only.
        self.fail_retries = fail_retries
        self._fails = 0  # failed probes in a row at _pending
        self.probes: list[ProbeRecord] = []
        self._pass: float | None = None  # highest rate that passed
        self._top: float | None = None  # lowest rate above it that did not pass (failed or unmeasurable)
        self._top_failed = False  # whether _top is a real failure (vs the generator's limit)
        self._pending: float | None = self.lo_rps
        self._tries = 0  # invalid probes in a row at _pending
        self._done: KneeResult | None = None

    def next_rate(self) -> float | None:
        """The rate to probe next, or None when the search is over."""
        return None if self._done is not None else self._pending

    def record(self, result: ProbeResult) -> None:
        """Take the result of probing :meth:`next_rate`'s rate."""
        rate = self._pending
        if rate is None or self._done is not None:
            raise InvalidArgument("knee search: record() called with no probe pending; call next_rate() first")
        valid = result.generator_fraction >= self.min_generator_fraction
        passed = result.ok_fraction >= self.ok_target if valid else None
        self.probes.append(ProbeRecord(rate, valid, result.ok_fraction, passed, result))
        if not valid:
            self._tries += 1
            if self._tries <= self.invalid_retries and len(self.probes) < self.max_probes:
                return  # retry the same rate: the generator may have hiccuped once
            self._tries = 0
            if self._pass is None:
                return self._finish(None, KneeStatus.NO_VALID_PROBE,
                                    f"the load generator could not offer {rate:,.0f}/s (achieved {result.achieved_per_s:,.0f}/s, "
                                    f"below {self.min_generator_fraction:.0%} of the offered rate): nothing was measured")
            self._top, self._top_failed = rate, False
        else:
            self._tries = 0
            if passed:
                self._fails = 0
                self._pass = rate
            else:
                self._fails += 1
                if self._fails <= self.fail_retries and len(self.probes) < self.max_probes:
                    return  # re-probe the same rate before calling it a failure
                self._fails = 0
                if self._pass is None:
                    return self._finish(None, KneeStatus.BELOW_RANGE,
                                        f"already at lo_rps {rate:,.0f}/s only {result.ok_fraction:.2%} completed OK "
                                        f"(target {self.ok_target:.0%}): the knee is below the search range")
                self._top, self._top_failed = rate, True
        self._advance()

    def _advance(self) -> None:
        assert self._pass is not None
        if self._top is None:
            if self._pass >= self.hi_rps:
                return self._finish(self._pass, KneeStatus.ABOVE_RANGE,
                                    f"hi_rps {self.hi_rps:,.0f}/s passed: the knee is at least that; raise hi_rps to find it")
            self._pending = self.hi_rps
        elif self._top <= self._pass * (1.0 + self.tolerance):
            self._conclude()
            return
        else:
            self._pending = math.sqrt(self._pass * self._top)
        if len(self.probes) >= self.max_probes and self._top is not None:
            self._conclude(out_of_probes=True)  # hi is always probed; the cap bounds the bisection

    def _conclude(self, *, out_of_probes: bool = False) -> None:
        assert self._pass is not None and self._top is not None
        gap = f"{self._pass:,.0f}/s passed and {self._top:,.0f}/s"
        if out_of_probes:
            note = f" (stopped after max_probes = {self.max_probes}, bracket {self._top / self._pass - 1:.1%} wide)"
        else:
            note = f" (within {self.tolerance:.0%})"
        if self._top_failed:
            self._finish(self._pass, KneeStatus.FOUND, f"{gap} did not{note}")
        else:
            self._finish(self._pass, KneeStatus.GENERATOR_LIMITED,
                         f"{gap} could not be offered by the load generator{note}: the knee is at least {self._pass:,.0f}/s")

    def _finish(self, knee: float | None, status: KneeStatus, reason: str) -> None:
        self._pending = None
        self._done = KneeResult(knee, status, reason, tuple(self.probes), self.ok_target, self.tolerance, self.min_generator_fraction)

    def result(self) -> KneeResult:
        if self._done is None:
            raise InvalidArgument(f"knee search is not finished: probe {self._pending:,.0f}/s next")
        return self._done


def find_knee(
    probe: Callable[[float], ProbeResult],
    *,
    lo_rps: float,
    hi_rps: float,
    tolerance: float = TOLERANCE,
    ok_target: float = OK_TARGET,
    min_generator_fraction: float = MIN_GENERATOR_FRACTION,
    invalid_retries: int = 1,
    fail_retries: int = 0,
    max_probes: int = 40,
) -> KneeResult:
    """Bisect for the knee with a blocking ``probe(rate_per_s) -> ProbeResult`` (the
    arguments are :class:`KneeSearch`'s)."""
    search = KneeSearch(lo_rps=lo_rps, hi_rps=hi_rps, tolerance=tolerance, ok_target=ok_target, min_generator_fraction=min_generator_fraction,
                        invalid_retries=invalid_retries, fail_retries=fail_retries, max_probes=max_probes)
    while (rate := search.next_rate()) is not None:
        search.record(probe(rate))
    return search.result()


async def find_knee_async(
    probe: Callable[[float], Awaitable[ProbeResult]],
    *,
    lo_rps: float,
    hi_rps: float,
    tolerance: float = TOLERANCE,
    ok_target: float = OK_TARGET,
    min_generator_fraction: float = MIN_GENERATOR_FRACTION,
    invalid_retries: int = 1,
    fail_retries: int = 0,
    max_probes: int = 40,
) -> KneeResult:
    """:func:`find_knee` for an awaitable probe (benchmarks that run on an event loop)."""
    search = KneeSearch(lo_rps=lo_rps, hi_rps=hi_rps, tolerance=tolerance, ok_target=ok_target, min_generator_fraction=min_generator_fraction,
                        invalid_retries=invalid_retries, fail_retries=fail_retries, max_probes=max_probes)
    while (rate := search.next_rate()) is not None:
        search.record(await probe(rate))
    return search.result()
