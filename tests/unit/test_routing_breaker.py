"""Per-destination circuit breakers: closed -> open -> half-open (pure, fake clock)."""

from __future__ import annotations

import numpy as np
import pytest

from recserve.errors import ConfigError
from recserve.routing import Breakers, BreakerState

CLOSED, OPEN, HALF = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


def test_consecutive_failures_open_then_half_open_then_a_success_closes() -> None:
    br = Breakers(3, failures=3, open_s=0.5)
    br.on_failure(1, 10.0)
    br.on_failure(1, 10.0)
    br.on_success(1, 10.0)  # the run is broken: consecutive failures only
    br.on_failure(1, 10.0)
    br.on_failure(1, 10.0)
    assert br.state(1, 10.0) is CLOSED
    br.on_failure(1, 10.1)
    assert br.state(1, 10.1) is OPEN and br.opened == 1
    np.testing.assert_array_equal(br.states(10.1), [CLOSED, OPEN, CLOSED])
    np.testing.assert_array_equal(br.available(10.59), [True, False, True])
    assert br.state(1, 10.6) is HALF  # open_s after the opening failure
    assert br.acquire(1, 10.6)
    br.on_success(1, 10.61)
    assert br.state(1, 10.61) is CLOSED and br.available(10.61).all()


def test_a_failed_probe_reopens_for_another_open_period() -> None:
    br = Breakers(1, failures=2, open_s=1.0)
    br.on_failure(0, 0.0)
    br.on_failure(0, 0.0)
    assert br.acquire(0, 1.0)  # half-open probe
    br.on_failure(0, 1.2)
    assert br.state(0, 1.2) is OPEN and not br.acquire(0, 2.1)
    assert br.state(0, 2.2) is HALF
    assert br.opened == 2


def test_half_open_lets_a_limited_number_of_probes_through() -> None:
    br = Breakers(2, failures=1, open_s=1.0, half_open_probes=2)
    br.on_failure(0, 0.0)
    assert not br.acquire(0, 0.5)  # open: refused
    np.testing.assert_array_equal(br.available_at(0.5), [1.0, 0.5])
    assert br.acquire(0, 1.0) and br.acquire(0, 1.0)
    assert not br.acquire(0, 1.0)  # both probes out
    np.testing.assert_array_equal(br.available(1.0), [False, True])
    np.testing.assert_array_equal(br.available_at(1.0), [2.0, 1.0])  # permits expire at 2.0
    # The lookup client's view ignores probe counting: the open period is over.
    np.testing.assert_array_equal(br.live(1.0), [True, True])
    # A probe permit with no result for open_s is presumed lost and given back.
    assert not br.acquire(0, 1.9)
    assert br.available(2.0)[0] and br.acquire(0, 2.0)
    assert br.acquire(1, 2.0) and br.acquire(1, 2.0) and br.acquire(1, 2.0)  # closed: no limit


def test_resize_keeps_states_and_new_destinations_start_closed() -> None:
    br = Breakers(2, failures=1, open_s=1.0)
    br.on_failure(1, 0.0)
    br.resize(4)
    np.testing.assert_array_equal(br.states(0.5), [CLOSED, OPEN, CLOSED, CLOSED])
    br.resize(1)
    assert br.num_destinations == 1 and br.state(0, 0.5) is CLOSED


def test_bad_settings_name_the_field_and_value() -> None:
    with pytest.raises(ConfigError, match=r"breakers.failures = 0"):
        Breakers(2, failures=0, open_s=1.0)
    with pytest.raises(ConfigError, match=r"breakers.half_open_probes = 0"):
        Breakers(2, failures=1, open_s=1.0, half_open_probes=0)
