"""The benchmarks' one arrival generator, ``recserve.bench.arrivals.poisson_arrivals``."""

from __future__ import annotations

import numpy as np
import pytest

from recserve.bench.arrivals import poisson_arrivals
from recserve.errors import InvalidArgument


def test_count_gives_exactly_that_many_sorted_offsets_from_one_exponential_per_arrival() -> None:
    got = poisson_arrivals(500.0, count=1000, rng=np.random.default_rng(3))
    assert got.shape == (1000,) and got[0] > 0 and bool(np.all(np.diff(got) > 0))
    # Reproducible and stream-compatible: exactly `count` exponential gaps from the rng.
    want = np.cumsum(np.random.default_rng(3).exponential(1 / 500.0, size=1000))
    np.testing.assert_array_equal(got, want)


def test_duration_keeps_every_arrival_before_it_at_the_offered_rate() -> None:
    rate, duration = 2000.0, 5.0
    got = poisson_arrivals(rate, duration_s=duration, rng=np.random.default_rng(1))
    assert got.size and got[-1] < duration and bool(np.all(np.diff(got) > 0))
    # N ~ Poisson(10,000): 5 sigma is 500.
    assert abs(got.size - rate * duration) < 500
    # Same stream, drawn long: the duration cut loses no arrival in [0, duration).
    long = np.cumsum(np.random.default_rng(1).exponential(1 / rate, size=20_000))
    np.testing.assert_array_equal(got, long[long < duration])


def test_count_caps_a_duration_and_bad_arguments_are_refused() -> None:
    capped = poisson_arrivals(1000.0, duration_s=10.0, count=50, rng=np.random.default_rng(0))
    assert capped.shape == (50,) and capped[-1] < 10.0
    assert poisson_arrivals(1000.0, duration_s=0.0, rng=np.random.default_rng(0)).size == 0
    with pytest.raises(InvalidArgument, match="rate_per_s"):
        poisson_arrivals(0.0, count=3, rng=np.random.default_rng(0))
    with pytest.raises(InvalidArgument, match="neither"):
        poisson_arrivals(10.0, rng=np.random.default_rng(0))
