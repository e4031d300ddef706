"""The shared knee finder (``recserve.bench.knee``), driven by fake systems on a fake
clock: their capacity is known, so the knee the bisection reports can be checked."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from recserve.bench.arrivals import poisson_arrivals
from recserve.bench.knee import KneeSearch, KneeStatus, ProbeResult, find_knee, find_knee_async
from recserve.errors import ConfigError, InvalidArgument

DURATION_S = 4.0


def step_system(capacity_per_s: float, *, bad: str = "late", bad_fraction: float = 0.05, duration_s: float = DURATION_S):
    """A fluid fake: at or below ``capacity_per_s`` every request is OK; above it
    ``bad_fraction`` of them end as outcome ``bad``. Its knee is exactly the capacity."""

    def probe(rate: float) -> ProbeResult:
        n = int(round(rate * duration_s))
        worse = int(math.ceil(bad_fraction * n)) if rate > capacity_per_s else 0
        return ProbeResult(offered_per_s=rate, achieved_per_s=rate, requests=n, ok=n - worse, **{bad: worse})

    return probe


class FakeClockSystem:
    """A server on a fake clock: one worker serving each request in ``1 / capacity``
    s (virtual), FIFO, shedding at admission any request that would wait longer than
    ``max_wait_s``; fed by a load generator that issues at most ``generator_max_per_s``
    requests per second, so above that it falls behind its Poisson schedule. Latency
    is measured from the *scheduled* arrival, as the benchmarks do."""

    def __init__(self, capacity_per_s: float, *, slo_s: float, max_wait_s: float, generator_max_per_s: float = math.inf, seed: int = 0) -> None:
        self.service_s = 1.0 / capacity_per_s
        self.slo_s, self.max_wait_s = slo_s, max_wait_s
        self.generator_max_per_s = generator_max_per_s
        self.seed = seed
        self.rates: list[float] = []

    def probe(self, rate: float) -> ProbeResult:
        self.rates.append(rate)
        scheduled = poisson_arrivals(rate, duration_s=DURATION_S, rng=np.random.default_rng(self.seed + len(self.rates)))
        n = scheduled.shape[0]
        # The generator sends i at max(scheduled_i, sent_{i-1} + 1/G): a running max, vectorised.
        gap = 0.0 if math.isinf(self.generator_max_per_s) else 1.0 / self.generator_max_per_s
        steps = np.arange(n) * gap
        sent = steps + np.maximum.accumulate(scheduled - steps)
        latency = np.full(n, np.nan)
        shed = np.zeros(n, dtype=bool)
        free_at = 0.0  # virtual time the worker is next free
        for i in range(n):  # a queue recurrence; test fake only, a few thousand requests
            start = max(sent[i], free_at)
            if start - sent[i] > self.max_wait_s:
                shed[i] = True
                continue
            free_at = start + self.service_s
            latency[i] = free_at - scheduled[i]
        return ProbeResult.from_requests(
            n / scheduled[-1], achieved_per_s=n / sent[-1], latency_s=latency, slo_s=self.slo_s, shed=shed
        )


@pytest.mark.parametrize("capacity", [137.0, 950.0, 7_300.0])
def test_knee_lands_within_tolerance_below_a_known_capacity(capacity: float) -> None:
    result = find_knee(step_system(capacity), lo_rps=50.0, hi_rps=20_000.0)
    assert result.status is KneeStatus.FOUND, result.reason
    assert result.knee_per_s is not None
    # Bisection to 5%: the knee passed, so it is <= capacity; the lowest failing probe
    # is above capacity and at most 5% above the knee.
    assert capacity / 1.05 <= result.knee_per_s <= capacity
    failing = min(p.rate_per_s for p in result.probes if p.passed is False)
    assert capacity < failing <= result.knee_per_s * 1.05
    assert all(p.valid for p in result.probes) and len(result.probes) <= 12
    assert result.to_dict()["knee_per_s"] == result.knee_per_s and len(result.to_dict()["probes"]) == len(result.probes)


@pytest.mark.parametrize("bad", ["late", "degraded", "shed", "failed"])
def test_every_kind_of_bad_outcome_counts_against_the_knee(bad: str) -> None:
    # 2% of requests go wrong above 800/s (all answered, in time unless `bad` says so):
    # 98% OK is below the 99% target, so the knee is at 800/s, whatever the kind.
    result = find_knee(step_system(800.0, bad=bad, bad_fraction=0.02), lo_rps=100.0, hi_rps=5_000.0)
    assert result.status is KneeStatus.FOUND
    assert result.knee_per_s is not None and 800.0 / 1.05 <= result.knee_per_s <= 800.0
    # Just below the target still fails: 1.5% bad.
    near = find_knee(step_system(800.0, bad=bad, bad_fraction=0.015), lo_rps=100.0, hi_rps=5_000.0)
    assert near.knee_per_s is not None and near.knee_per_s <= 800.0


def test_fake_clock_server_knee_is_within_five_percent_of_its_capacity() -> None:
    capacity = 1_000.0
    system = FakeClockSystem(capacity, slo_s=0.150, max_wait_s=0.100)
    result = find_knee(system.probe, lo_rps=100.0, hi_rps=10_000.0)
    assert result.status is KneeStatus.FOUND, result.reason
    assert result.knee_per_s is not None and 0.95 * capacity <= result.knee_per_s <= 1.05 * capacity
    # The failing probes failed by shedding, which from_requests counted.
    assert all(p.result.shed > 0 for p in result.probes if p.passed is False)
    assert system.rates == [p.rate_per_s for p in result.probes]


def test_probes_the_generator_could_not_offer_are_invalid_and_not_counted() -> None:
    # The server could take 1,000/s but the generator tops out near 600/s.
    system = FakeClockSystem(1_000.0, slo_s=0.150, max_wait_s=0.100, generator_max_per_s=600.0)
    result = find_knee(system.probe, lo_rps=100.0, hi_rps=10_000.0)
    invalid = [p for p in result.probes if not p.valid]
    assert invalid, "the generator limit produced no invalid probe"
    assert all(p.passed is None and p.result.generator_fraction < 0.98 for p in invalid)
    # Invalid probes served nearly everything OK (the system saw less load than offered),
    # yet they did not count as passes: the knee stays at the generator's limit.
    assert any(p.ok_fraction >= 0.99 for p in invalid)
    assert result.status is KneeStatus.GENERATOR_LIMITED, result.reason
    # A probe is valid while the generator reaches 98% of it: up to about 600 / 0.98.
    assert result.knee_per_s is not None and 0.9 * 600.0 <= result.knee_per_s <= 600.0 / 0.98
    assert result.knee_per_s == max(p.rate_per_s for p in result.probes if p.passed)
    # Each invalid rate was retried once before it was taken as the generator's limit.
    rates = [p.rate_per_s for p in result.probes]
    assert all(rates.count(p.rate_per_s) == 2 for p in invalid)
    assert "load generator" in result.reason


def test_range_edges_and_an_unusable_generator() -> None:
    below = find_knee(step_system(40.0), lo_rps=50.0, hi_rps=1_000.0)
    assert below.status is KneeStatus.BELOW_RANGE and below.knee_per_s is None and len(below.probes) == 1
    above = find_knee(step_system(1e6), lo_rps=50.0, hi_rps=1_000.0)
    assert above.status is KneeStatus.ABOVE_RANGE and above.knee_per_s == 1_000.0 and len(above.probes) == 2

    def stalled(rate: float) -> ProbeResult:
        return ProbeResult(offered_per_s=rate, achieved_per_s=0.5 * rate, requests=100, ok=100)

    none = find_knee(stalled, lo_rps=50.0, hi_rps=1_000.0, invalid_retries=2)
    assert none.status is KneeStatus.NO_VALID_PROBE and none.knee_per_s is None
    assert [p.rate_per_s for p in none.probes] == [50.0, 50.0, 50.0]


def test_async_probe_gives_the_same_search() -> None:
    probe = step_system(950.0)

    async def aprobe(rate: float) -> ProbeResult:
        return probe(rate)

    got = asyncio.run(find_knee_async(aprobe, lo_rps=50.0, hi_rps=20_000.0))
    want = find_knee(probe, lo_rps=50.0, hi_rps=20_000.0)
    assert got.knee_per_s == want.knee_per_s and [p.rate_per_s for p in got.probes] == [p.rate_per_s for p in want.probes]


def test_from_requests_classifies_with_shed_then_failed_then_late_then_degraded() -> None:
    lat = np.array([0.010, 0.200, np.nan, 0.020, 0.300, 0.010])
    degraded = np.array([False, True, False, True, False, False])
    shed = np.array([False, False, False, False, False, True])
    r = ProbeResult.from_requests(100.0, achieved_per_s=99.0, latency_s=lat, slo_s=0.050, degraded=degraded, shed=shed)
    assert (r.requests, r.ok, r.late, r.failed, r.degraded, r.shed) == (6, 1, 2, 1, 1, 1)
    assert r.ok_fraction == pytest.approx(1 / 6) and r.generator_fraction == pytest.approx(0.99)
    with pytest.raises(InvalidArgument, match="degraded 2"):
        ProbeResult.from_requests(100.0, achieved_per_s=99.0, latency_s=lat, slo_s=0.05, degraded=degraded[:2])


def test_bad_arguments_and_misuse_are_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="ProbeResult.requests"):
        ProbeResult(offered_per_s=10.0, achieved_per_s=10.0, requests=5, ok=4, late=2)
    with pytest.raises(ConfigError, match="knee.hi_rps"):
        KneeSearch(lo_rps=100.0, hi_rps=50.0)
    search = KneeSearch(lo_rps=10.0, hi_rps=100.0)
    with pytest.raises(InvalidArgument, match="not finished"):
        search.result()
    assert search.next_rate() == 10.0


def test_max_probes_stops_the_bisection_and_says_so() -> None:
    result = find_knee(step_system(950.0), lo_rps=50.0, hi_rps=20_000.0, max_probes=4)
    assert len(result.probes) == 4 and result.status is KneeStatus.FOUND
    assert "max_probes = 4" in result.reason
    failing = min(p.rate_per_s for p in result.probes if p.passed is False)
    assert result.knee_per_s is not None and result.knee_per_s <= 950.0 < failing
    assert failing > result.knee_per_s * 1.05  # not converged: the reason says how wide


def test_a_single_failed_probe_does_not_set_the_knee_with_fail_retries() -> None:
    """One tail event on the first probe at 1,000/s (the system's capacity): without
    retries 1,000/s counts as failed and the knee lands below it; with one retry the rate is probed again, passes,
    and the knee is the real capacity."""
    seen: dict[float, int] = {}
    good = step_system(1000.0)

    def flaky(rate: float) -> ProbeResult:
        seen[rate] = seen.get(rate, 0) + 1
        if rate == 1000.0 and seen[rate] == 1:  # the first probe at the capacity hits a stall
            return ProbeResult(offered_per_s=rate, achieved_per_s=rate, requests=100, ok=50, late=50)
        return good(rate)

    strict = find_knee(flaky, lo_rps=100.0, hi_rps=10_000.0)
    seen.clear()
    lenient = find_knee(flaky, lo_rps=100.0, hi_rps=10_000.0, fail_retries=1)
    assert strict.knee_per_s is not None and lenient.knee_per_s is not None
    assert strict.knee_per_s < 1000.0 == lenient.knee_per_s and "1,000/s did not" in strict.reason
    assert seen[1000.0] == 2  # the failed rate was probed twice
