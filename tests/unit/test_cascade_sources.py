"""L0's second candidate source and the merge (cascade/sources.py), on hand-made arrays
whose answers are worked out in the comments, plus a brute-force oracle on random ones."""

from __future__ import annotations

import numpy as np
import pytest

from cascade.sources import MergedCandidates, PopularByCategory, Source, merge_candidates, recent_categories
from recserve.errors import ConfigError, InvalidArgument

# item:          0  1  2  3  4  5    6  7  8
CATEGORY = np.array([0, 1, 0, 2, 1, 0, -1, 2, 0])
IMPRESSIONS = np.array([5, 3, 9, 1, 3, 9, 100, 7, 2])
# By category, impressions descending, ties to the smaller id:
#   0: 2 (9), 5 (9), 0 (5), 8 (2)     1: 1 (3), 4 (3)     2: 7 (7), 3 (1)     item 6 has none


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_per_category_table_is_top_by_impressions() -> None:
    popular = PopularByCategory(CATEGORY, IMPRESSIONS, per_category=3)
    np.testing.assert_array_equal(popular.table(), [[2, 5, 0], [1, 4, -1], [7, 3, -1]])


def test_table_matches_brute_force_on_random_catalog() -> None:
    rng = np.random.default_rng(0)
    cat, imp = rng.integers(0, 12, 2_000), rng.integers(0, 30, 2_000)
    popular = PopularByCategory(cat, imp, per_category=7, num_categories=14)
    table = popular.table()
    assert table.shape == (14, 7)
    for c in range(14):  # oracle: a plain sort per category
        members = np.flatnonzero(cat == c)
        want = sorted(members.tolist(), key=lambda i: (-imp[i], i))[:7]
        assert table[c, : len(want)].tolist() == want and np.all(table[c, len(want) :] == -1)


def test_candidates_interleave_categories_in_given_order() -> None:
    popular = PopularByCategory(CATEGORY, IMPRESSIONS, per_category=3)
    # Round 1: best of 2, 0, 1 -> 7, 2, 1; round 2: 3, 5, 4; round 3: only 0 has a third -> 0.
    np.testing.assert_array_equal(popular.candidates(i64(2, 0, 1), 10), [7, 2, 1, 3, 5, 4, 0])
    np.testing.assert_array_equal(popular.candidates(i64(2, 0, 1), 4), [7, 2, 1, 3])
    # Repeated and unknown categories are dropped, first mention kept in place.
    np.testing.assert_array_equal(popular.candidates(i64(1, 9, -1, 1, 2), 10), [1, 7, 4, 3])
    assert popular.candidates(i64(), 5).size == 0
    assert popular.candidates(i64(0), 0).size == 0
    with pytest.raises(InvalidArgument, match="n = -1"):
        popular.candidates(i64(0), -1)


def test_cold_start_global_top() -> None:
    popular = PopularByCategory(CATEGORY, IMPRESSIONS, per_category=2)
    # Item 6 has no category but is the most shown: the global list is over every item.
    np.testing.assert_array_equal(popular.global_top(4), [6, 2, 5, 7])
    assert popular.global_top(100).size == CATEGORY.size
    assert popular.global_top(0).size == 0


def test_popular_rejects_mismatched_counts() -> None:
    with pytest.raises(ConfigError, match="item_impressions"):
        PopularByCategory(CATEGORY, IMPRESSIONS[:-1])
    with pytest.raises(ConfigError, match="num_categories = 2"):
        PopularByCategory(CATEGORY, IMPRESSIONS, num_categories=2)


def test_recent_categories_by_frequency_then_recency() -> None:
    # History oldest first: 8 (cat 0), 3 (2), 1 (1), 4 (1), 7 (2), 0 (0), 2 (0).
    history = i64(8, 3, 1, 4, 7, 0, 2)
    # cat 0 three times, 2 twice (newest at 7), 1 twice (newest at 4, older than 7).
    np.testing.assert_array_equal(recent_categories(history, CATEGORY), [0, 2, 1])
    # Last 3 items (7, 0, 2): cat 0 twice, cat 2 once.
    np.testing.assert_array_equal(recent_categories(history, CATEGORY, last=3), [0, 2])
    np.testing.assert_array_equal(recent_categories(history, CATEGORY, max_categories=1), [0])
    # Ties on frequency go to the most recent: 1 (cat 1) then 3 (cat 2) -> 2 first.
    np.testing.assert_array_equal(recent_categories(i64(1, 3), CATEGORY), [2, 1])


def test_recent_categories_skips_unknown_items() -> None:
    # 6 has no category; 10**6 is past the export (a newly added item); -3 is malformed.
    np.testing.assert_array_equal(recent_categories(i64(6, 10**6, -3, 1), CATEGORY), [1])
    assert recent_categories(i64(), CATEGORY).size == 0
    with pytest.raises(InvalidArgument, match="last = 0"):
        recent_categories(i64(1), CATEGORY, last=0)


def test_merge_drops_padding_and_dedupes_primary_first() -> None:
    merged = merge_candidates(i64(4, 2, 9, -1, -1), np.array([0.9, 0.5, 0.1, -np.inf, -np.inf]), i64(2, 7, 4, 8), i64(), i64(), 10)
    assert isinstance(merged, MergedCandidates) and len(merged) == 5
    np.testing.assert_array_equal(merged.ids, [4, 2, 9, 7, 8])
    both, index, popular = int(Source.INDEX | Source.POPULAR), int(Source.INDEX), int(Source.POPULAR)
    np.testing.assert_array_equal(merged.sources, [both, both, index, popular, popular])
    np.testing.assert_array_equal(merged.scores, np.array([0.9, 0.5, 0.1, -np.inf, -np.inf], np.float32))
    assert -1 not in merged.ids


def test_merge_removes_exclude_and_seen() -> None:
    merged = merge_candidates(i64(4, 2, 9, 3), np.array([0.9, 0.5, 0.4, 0.1]), i64(2, 7, 8, 5), exclude=i64(9, 8), seen=i64(2, 5, 100), limit=10)
    np.testing.assert_array_equal(merged.ids, [4, 3, 7])
    np.testing.assert_array_equal(merged.scores, np.array([0.9, 0.1, -np.inf], np.float32))
    np.testing.assert_array_equal(merged.sources, [Source.INDEX, Source.INDEX, Source.POPULAR])


def test_merge_limit_and_secondary_share() -> None:
    primary, scores, secondary = i64(1, 2, 3, 4, 5), np.linspace(1, 0.5, 5), i64(3, 10, 11)
    np.testing.assert_array_equal(merge_candidates(primary, scores, secondary, i64(), i64(), 4).ids, [1, 2, 3, 4])
    # Two slots kept for popular-only items (3 is an index hit too, so it does not count).
    np.testing.assert_array_equal(merge_candidates(primary, scores, secondary, i64(), i64(), 4, secondary_min=2).ids, [1, 2, 10, 11])
    # Unused slots go to the other source either way.
    np.testing.assert_array_equal(merge_candidates(i64(1), np.ones(1), secondary, i64(), i64(), 4).ids, [1, 3, 10, 11])
    np.testing.assert_array_equal(merge_candidates(primary, scores, i64(), i64(), i64(), 3, secondary_min=2).ids, [1, 2, 3])
    assert len(merge_candidates(primary, scores, secondary, i64(), i64(), 0)) == 0


def test_merge_matches_brute_force_on_random_lists() -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        primary = rng.integers(-1, 40, 30)
        secondary, exclude, seen = rng.integers(0, 40, 15), rng.integers(0, 40, 5), rng.integers(0, 40, 5)
        got = merge_candidates(primary, rng.random(30), secondary, exclude, seen, 25).ids
        want: list[int] = []
        for i in [*primary.tolist(), *secondary.tolist()]:  # oracle: first occurrence, in order
            if i >= 0 and i not in want and i not in exclude and i not in seen:
                want.append(i)
        assert got.tolist() == want[:25]


def test_merge_rejects_malformed_input() -> None:
    with pytest.raises(InvalidArgument, match=r"primary_scores has shape \[1\]; expected \[2\]"):
        merge_candidates(i64(1, 2), np.ones(1), i64(), i64(), i64(), 5)
    with pytest.raises(InvalidArgument, match="exclude has dtype float64"):
        merge_candidates(i64(1), np.ones(1), i64(), np.array([1.5]), i64(), 5)
    with pytest.raises(InvalidArgument, match="limit = -1"):
        merge_candidates(i64(1), np.ones(1), i64(), i64(), i64(), -1)
