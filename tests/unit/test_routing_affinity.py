"""Session affinity on a consistent-hash ring of replicas (pure, array operations)."""

from __future__ import annotations

import numpy as np
import pytest

from recserve.errors import ConfigError
from recserve.routing import AffinityRing

NAMES = [f"ranker-{i}:7000" for i in range(5)]
KEYS = np.arange(40_000, dtype=np.int64) * 7919  # user ids


def owner_names(ring: AffinityRing, keys: np.ndarray) -> np.ndarray:
    return np.asarray(ring.replicas)[ring.owners(keys)]


def test_a_key_maps_to_one_replica_whatever_the_list_order() -> None:
    a, b = AffinityRing(NAMES), AffinityRing(NAMES[::-1])
    np.testing.assert_array_equal(owner_names(a, KEYS), owner_names(b, KEYS))
    share = np.bincount(a.owners(KEYS), minlength=5) / KEYS.size
    np.testing.assert_allclose(share, 0.2, atol=0.05)  # every replica gets its part
    assert a.choose("conversation-17", np.ones(5, dtype=bool)) == a.choose("conversation-17", np.ones(5, dtype=bool))
    other_seed = AffinityRing(NAMES, seed=1)
    assert (owner_names(other_seed, KEYS) != owner_names(a, KEYS)).mean() > 0.5


def test_adding_a_replica_moves_about_one_in_n_plus_one_keys_all_to_it() -> None:
    before = owner_names(AffinityRing(NAMES), KEYS)
    grown = NAMES + ["ranker-5:7000"]
    after = owner_names(AffinityRing(grown), KEYS)
    moved = before != after
    assert moved.mean() == pytest.approx(1 / 6, abs=0.05)  # mod-n hashing would move 5/6
    assert set(after[moved].tolist()) == {"ranker-5:7000"}  # nobody else's keys move


def test_removing_a_replica_moves_only_its_keys() -> None:
    before = owner_names(AffinityRing(NAMES), KEYS)
    after = owner_names(AffinityRing([n for n in NAMES if n != "ranker-2:7000"]), KEYS)
    moved = before != after
    np.testing.assert_array_equal(moved, before == "ranker-2:7000")
    assert moved.mean() == pytest.approx(1 / 5, abs=0.05)


def test_an_open_replica_sends_its_keys_to_the_next_on_the_ring_only() -> None:
    ring = AffinityRing(NAMES)
    all_up = np.ones(5, dtype=bool)
    pref = ring.owners(KEYS)
    down = all_up.copy()
    down[3] = False
    chosen = ring.choose_many(KEYS, down)
    kept = pref != 3
    np.testing.assert_array_equal(chosen[kept], pref[kept])  # other keys stay put
    assert not (chosen == 3).any()
    # The fallback is the replica that owns the key when replica 3 leaves the ring.
    without = AffinityRing([n for i, n in enumerate(NAMES) if i != 3])
    np.testing.assert_array_equal(np.asarray(ring.replicas)[chosen], owner_names(without, KEYS))
    np.testing.assert_array_equal(ring.choose_many(KEYS[:50], np.zeros(5, dtype=bool)), -1)
    assert [ring.choose(int(k), down) for k in KEYS[:20]] == chosen[:20].tolist()


def test_bad_rings_are_refused_with_the_value() -> None:
    with pytest.raises(ConfigError, match="affinity.replicas"):
        AffinityRing(["a", "a"])
    with pytest.raises(ConfigError, match="eligible has shape"):
        AffinityRing(NAMES).choose(1, np.ones(3, dtype=bool))
