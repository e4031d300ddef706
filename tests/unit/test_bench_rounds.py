"""Interleaved rounds (issue 9, "honest about its numbers"): the C=64 ratios of
``recserve bench lookup`` are the median of each round's own ratio, not the ratio of two
medians, so a contender measured in a slow phase of the box is compared with the other
contender in that same phase."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from recserve.bench.rounds import median_of, median_ratio, ratio_spread, with_ratios


def test_the_median_of_per_round_ratios_differs_from_the_ratio_of_medians() -> None:
    # The box slows 2.5x in round 2: both contenders slow with it, their ratio holds.
    rounds = [{"a": 10.0, "b": 5.0}, {"a": 4.0, "b": 2.0}, {"a": 9.0, "b": 3.0}]
    assert median_of(rounds, "a") == 9.0 and median_of(rounds, "b") == 3.0
    assert median_ratio(rounds, "a", "b") == 2.0  # ratios 2, 2, 3
    assert median_of(rounds, "a") / median_of(rounds, "b") == 3.0  # type: ignore[operator]  # what one long run each could read
    assert ratio_spread(rounds, "a", "b") == [2.0, 3.0]


def test_rounds_missing_a_side_are_left_out_and_all_missing_is_none() -> None:
    rounds = [{"a": 6.0, "b": None}, {"a": 8.0, "b": 2.0}, {"a": 9.0, "b": 0.0}, {"a": 3.0, "b": 1.0}]
    assert median_ratio(rounds, "a", "b") == 3.5  # ratios 4 and 3; None and 0 are not ratios
    assert median_of(rounds, "b") == 1.0  # 0, 1, 2
    assert median_ratio([{"a": 1.0, "b": None}], "a", "b") is None
    assert ratio_spread([], "a", "b") is None and median_of([], "a") is None
    assert median_of([{"a": None}], "a") is None


def test_with_ratios_adds_each_rounds_ratio_and_keeps_its_figures() -> None:
    rounds = [{"fp": 8.0, "r": 2.0, "d": 4.0}, {"fp": 3.0, "r": None, "d": 1.5}]
    out = with_ratios(rounds, {"vs_r": ("fp", "r"), "vs_d": ("fp", "d")})
    assert out == [{"fp": 8.0, "r": 2.0, "d": 4.0, "vs_r": 4.0, "vs_d": 2.0}, {"fp": 3.0, "r": None, "d": 1.5, "vs_r": None, "vs_d": 2.0}]
    assert rounds[0] == {"fp": 8.0, "r": 2.0, "d": 4.0}  # the input is not changed


@pytest.mark.parametrize("seed", range(5))
def test_random_rounds_agree_with_numpy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 8))
    a, b = rng.uniform(1, 100, n), rng.uniform(1, 100, n)
    rounds = [{"a": float(x), "b": float(y)} for x, y in zip(a, b)]
    assert median_ratio(rounds, "a", "b") == pytest.approx(float(np.median(a / b)))
    assert ratio_spread(rounds, "a", "b") == pytest.approx([float((a / b).min()), float((a / b).max())])
    assert median_of(rounds, "a") == pytest.approx(statistics.median(a.tolist()))
