"""Latency tracker, hedge budget, breakers and the near cache (pure, fake clock)."""

from __future__ import annotations

import numpy as np
import pytest

from recserve.lookup.health import Breakers, HedgeBudget, LatencyTracker
from recserve.lookup.near_cache import NearCache


def test_hedge_delay_is_the_percentile_of_recent_latency() -> None:
    t = LatencyTracker(2, percentile=90.0, min_delay_s=0.001, default_delay_s=0.05)
    assert t.hedge_delay(0) == 0.05  # nothing measured yet
    for ms in range(1, 101):
        t.record(0, ms / 1000.0, 0.0)
    samples = sorted(np.arange(1, 101) / 1000)
    assert t.hedge_delay(0) == pytest.approx(samples[int(np.ceil(0.9 * 100)) - 1])  # nearest rank: 90 ms
    for _ in range(200):
        t.record(1, 0.0001, 0.0)
    assert t.hedge_delay(1) == 0.001  # floored


def test_a_shard_far_above_the_median_is_slow() -> None:
    t = LatencyTracker(3, min_delay_s=0.001)
    for _ in range(20):
        t.record(0, 0.002, 0.0)
        t.record(1, 0.0025, 0.0)
        t.record(2, 0.002, 0.0)
    assert not t.slow(0.0).any()
    for _ in range(10):
        t.record(2, 0.2, 1.0)
    np.testing.assert_array_equal(t.slow(1.5), [False, False, True])
    # No sample for slow_ttl_s: no longer avoided, so traffic re-measures it.
    assert not t.slow(2.5).any()
    for _ in range(60):
        t.record(2, 0.002, 3.0)
    assert not t.slow(3.0).any()  # recovered


def test_consecutive_late_calls_eject_a_shard_for_a_while() -> None:
    t = LatencyTracker(3, slow_ttl_s=1.0, late_strikes=2)
    t.on_late(1, 0.0)
    assert not t.slow(0.0).any()  # one late call is the expected tail
    t.on_time(1)
    t.on_late(1, 0.1)
    assert not t.slow(0.1).any()  # the run was broken by an on-time answer
    t.on_late(1, 0.2)
    np.testing.assert_array_equal(t.slow(0.3), [False, True, False])
    assert not t.slow(1.3).any()  # re-probed after the ejection period
    assert t.ejections == 1


def test_budget_allows_ratio_of_primaries_plus_burst() -> None:
    b = HedgeBudget(0.05, burst=3)
    allowed = 0
    for i in range(1000):
        b.on_primary()
        allowed += b.try_spend()
    assert allowed <= 0.05 * 1000 + 3
    assert allowed >= 0.05 * 1000 - 1
    assert b.denied == 1000 - allowed


def test_breaker_opens_after_consecutive_failures_and_half_opens() -> None:
    br = Breakers(2, failures=3, open_s=0.5)
    now = 10.0
    for _ in range(2):
        br.on_failure(0, now)
    assert br.live(now)[0]
    br.on_failure(0, now)
    assert not br.live(now)[0] and br.live(now)[1]
    assert br.live(now + 0.5)[0]  # half-open: try it again
    br.on_failure(0, now + 0.5)  # a failure re-opens at once
    assert not br.live(now + 0.6)[0]
    br.on_success(0)
    assert br.live(now + 0.6)[0]


def test_near_cache_staleness_bound_and_versions() -> None:
    ids = np.array([3, 7, 11])
    cache = NearCache({"t": (ids, 2)}, staleness_s=0.1)
    want = np.array([3, 5, 7, 11])
    hit, rows, slot = cache.get("t", want, now=0.0)
    assert not hit.any()
    np.testing.assert_array_equal(slot, [0, -1, 1, 2])
    ver = cache.versions("t", slot)
    fetched = np.arange(8, dtype=np.float32).reshape(4, 2)
    keep = slot >= 0
    assert cache.fill("t", slot[keep], ver[keep], fetched[keep], now=0.0) == 3
    hit, rows, _ = cache.get("t", want, now=0.05)
    np.testing.assert_array_equal(hit, [True, False, True, True])
    np.testing.assert_array_equal(rows, fetched[[0, 2, 3]])
    hit, _, _ = cache.get("t", want, now=0.11)  # older than the bound: not served
    assert not hit.any()
    # A fetch sent before an invalidation must not re-insert the old row.
    ver = cache.versions("t", slot)
    cache.invalidate("t", np.array([7]))
    assert cache.fill("t", slot[keep], ver[keep], fetched[keep], now=0.2) == 2
    hit, _, _ = cache.get("t", want, now=0.2)
    np.testing.assert_array_equal(hit, [True, False, False, True])
    assert cache.unique_hit_rate == pytest.approx(5 / 16)
    assert cache.hit_rate == pytest.approx(5 / 16)  # no repeats given: the same
    cache.get("t", np.array([3]), now=0.2, occurrences=np.array([4]))
    assert cache.hit_rate == pytest.approx(9 / 20) and cache.unique_hit_rate == pytest.approx(6 / 17)


def test_a_slow_shards_hedge_delay_is_capped_by_the_others_so_its_probes_hedge_early() -> None:
    """A shard slow by 200 ms has a 200 ms percentile: a call sent to it (its re-probe
    after slow_ttl_s) would wait that long before hedging. fleet_hedge_delay caps it at
    slow_factor x the other shards' median (4 x 3 ms), and leaves the fast ones alone."""
    for n in (2, 3):
        t = LatencyTracker(n, min_delay_s=0.001, slow_factor=4.0)
        for _ in range(40):
            for s in range(n - 1):
                t.record(s, 0.003, 0.0)
            t.record(n - 1, 0.2, 0.0)
        assert t.hedge_delay(n - 1) == pytest.approx(0.2)  # its own percentile: its slowness
        assert t.fleet_hedge_delay(n - 1) == pytest.approx(0.012)
        assert all(t.fleet_hedge_delay(s) == pytest.approx(0.003) for s in range(n - 1))  # not capped
    lone = LatencyTracker(1)
    for _ in range(40):
        lone.record(0, 0.2, 0.0)
    assert lone.fleet_hedge_delay(0) == pytest.approx(0.2)  # no other shard to compare with
