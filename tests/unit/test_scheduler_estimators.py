"""Arrival-rate and service-time estimators the policies read (fake clock)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from recserve.errors import ConfigError
from recserve.scheduling.estimators import RateEstimator, ServiceTimeEstimator
from recserve.scheduling.metrics import Summary


def test_rate_estimator_converges_to_a_poisson_rate_and_decays_when_idle() -> None:
    rng = random.Random(1)
    est = RateEstimator(tau_s=0.5)
    now = 0.0
    while now < 5.0:  # 10 tau of Poisson arrivals at 2,000 items/s
        now += rng.expovariate(2000.0)
        est.observe(1.0, now)
    assert est.rate(now) == pytest.approx(2000.0, rel=0.1)
    assert est.rate(now + 0.5) == pytest.approx(est.rate(now) * math.exp(-1.0))
    assert est.last_rate() == est.rate(now)  # between arrivals the policies use this one


def test_service_estimator_recovers_fixed_plus_per_unit_cost() -> None:
    est = ServiceTimeEstimator(alpha=0.05)
    assert est.estimate_s(100) == 0.0  # no data: no guess
    rng = random.Random(2)
    for _ in range(500):  # 0.6 ms per batch + 2 us per unit
        cost = rng.randint(1, 512)
        est.observe(cost, 0.0006 + 2e-6 * cost)
    assert est.estimate_s(0) == pytest.approx(0.0006, rel=1e-6)
    assert est.estimate_s(1000) == pytest.approx(0.0026, rel=1e-6)


def test_service_estimator_with_one_batch_size_errs_long_for_bigger_batches() -> None:
    est = ServiceTimeEstimator()
    for _ in range(20):
        est.observe(64, 0.004)
    assert est.estimate_s(64) == pytest.approx(0.004)
    assert est.estimate_s(8) == pytest.approx(0.004)  # the fixed part is unknown: not less
    assert est.estimate_s(128) == pytest.approx(0.008)  # scaled up, never down


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: RateEstimator(tau_s=0.0), "RateEstimator.tau_s = 0.0"),
        (lambda: RateEstimator(tau_s=math.nan), "RateEstimator.tau_s = nan"),
        (lambda: ServiceTimeEstimator(alpha=1.5), "ServiceTimeEstimator.alpha = 1.5"),
        (lambda: Summary(window=1000), "Summary.window = 1000"),
    ],
)
def test_bad_estimator_and_summary_arguments_raise_config_errors_naming_the_field(build: Callable[[], object], field: str) -> None:
    # One error hierarchy: a bad argument is a RecserveError (ConfigError), not a bare ValueError.
    with pytest.raises(ConfigError) as info:
        build()
    assert info.value.message.startswith(field)
