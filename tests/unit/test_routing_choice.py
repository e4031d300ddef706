"""Replica choice: power of two choices on work / capacity weight (pure, seeded RNG)."""

from __future__ import annotations

import numpy as np
import pytest

from recserve.errors import ConfigError, Unavailable
from recserve.routing import ChoiceKind, LeastLoaded, TwoChoices, WeightedRandom, make_choice_policy


def shares(picks: list[int], n: int) -> np.ndarray:
    return np.bincount(np.asarray(picks), minlength=n) / len(picks)


def test_the_lighter_of_the_two_draws_wins() -> None:
    # Two equal-weight replicas, replica 0 carrying more work: two choices sends to 0
    # only when both draws hit it (p = 1/4); random would send half, least-loaded none.
    policy = TwoChoices(np.random.default_rng(1))
    work, weights, eligible = np.array([10.0, 0.0]), np.ones(2), np.ones(2, dtype=bool)
    picks = [policy.choose(work, weights, eligible, cost=1.0) for _ in range(4000)]
    assert shares(picks, 2)[0] == pytest.approx(0.25, abs=0.03)


def test_work_is_compared_per_unit_of_capacity() -> None:
    # Replica 1 has more work but 4x the capacity: 8/4 < 3/1, so it is the lighter one.
    policy = TwoChoices(np.random.default_rng(2))
    work, weights = np.array([3.0, 8.0]), np.array([1.0, 4.0])
    picks = [policy.choose(work, weights, np.ones(2, dtype=bool)) for _ in range(2000)]
    # 1 loses only when both draws are 0: (1/5)^2 = 4 %.
    assert shares(picks, 2)[0] == pytest.approx(0.04, abs=0.015)


def test_with_equal_work_traffic_splits_by_capacity_weight() -> None:
    policy = TwoChoices(np.random.default_rng(3))
    weights = np.array([1.0, 2.0, 5.0])
    picks = [policy.choose(np.zeros(3), weights, np.ones(3, dtype=bool)) for _ in range(20000)]
    np.testing.assert_allclose(shares(picks, 3), weights / weights.sum(), atol=0.015)


def test_in_flight_feedback_keeps_work_per_weight_balanced() -> None:
    # Work = what was sent (no departures): two choices keeps W / w level, so the split
    # follows the weights closely and the worst replica stays near its fair share.
    policy = TwoChoices(np.random.default_rng(4))
    weights = np.array([3.0, 1.0, 1.0, 1.0, 2.0])
    work = np.zeros(5)
    for _ in range(4000):
        work[policy.choose(work, weights, np.ones(5, dtype=bool), cost=1.0)] += 1.0
    np.testing.assert_allclose(work / work.sum(), weights / weights.sum(), atol=0.01)
    # Weighted random placement of the same 4000 calls is far less even.
    rand = WeightedRandom(np.random.default_rng(4))
    rwork = np.zeros(5)
    for _ in range(4000):
        rwork[rand.choose(rwork, weights, np.ones(5, dtype=bool))] += 1.0
    assert np.max(work / weights) - np.min(work / weights) < 0.5 * (np.max(rwork / weights) - np.min(rwork / weights))


def test_ineligible_replicas_are_never_chosen() -> None:
    eligible = np.array([True, False, True, False])
    work = np.array([5.0, 0.0, 5.0, 0.0])  # the open ones look idle: still skipped
    for kind in ChoiceKind:
        policy = make_choice_policy(kind, np.random.default_rng(5))
        picks = [policy.choose(work, np.ones(4), eligible) for _ in range(500)]
        counts = np.bincount(picks, minlength=4)
        assert counts[1] == 0 and counts[3] == 0, (kind, counts)
        assert counts[0] > 0 or kind is ChoiceKind.LEAST_LOADED
    with pytest.raises(Unavailable, match="no eligible replica among 4"):
        TwoChoices(np.random.default_rng(0)).choose(work, np.ones(4), np.zeros(4, dtype=bool))


def test_factory_and_least_loaded_baseline() -> None:
    assert isinstance(make_choice_policy("least_loaded"), LeastLoaded)
    assert isinstance(make_choice_policy(ChoiceKind.WEIGHTED_RANDOM), WeightedRandom)
    ll = LeastLoaded()
    assert ll.choose(np.array([4.0, 3.0, 1.0]), np.array([1.0, 1.0, 0.1]), np.ones(3, dtype=bool)) == 1
    with pytest.raises(ConfigError, match="routing.policy = 'round_robin'"):
        make_choice_policy("round_robin")


def test_the_specs_routing_policy_names_are_the_choice_kinds() -> None:
    from recserve.config.spec import ROUTING_POLICIES
    from recserve.routing import ChoiceKind

    assert sorted(ROUTING_POLICIES) == sorted(k.value for k in ChoiceKind)
