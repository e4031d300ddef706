"""The consistent-hash ring: balanced token placement, vectorised lookup, successors."""

from __future__ import annotations

import bisect

import numpy as np
import pytest

from recserve.errors import ConfigError
from recserve.sharding.ring import RING_SPAN, Ring, add_slot_tokens, balanced_tokens


def shares(tokens: np.ndarray) -> np.ndarray:
    """Fraction of the ring each slot owns, from the tokens with Python ints: the arc
    (previous token, token] belongs to the token's slot."""
    pairs = sorted((int(t), slot) for slot, row in enumerate(tokens) for t in row)
    out = [0] * tokens.shape[0]
    for j, (tok, slot) in enumerate(pairs):
        out[slot] += (tok - pairs[j - 1][0]) % RING_SPAN or RING_SPAN
    return np.array(out, dtype=float) / RING_SPAN


@pytest.mark.parametrize("vnodes", [4, 64])
def test_every_shard_owns_its_fair_share_within_one_vnode(vnodes: int) -> None:
    for n in range(1, 13):
        s = shares(balanced_tokens(n, vnodes, seed=n))
        assert s.sum() == pytest.approx(1.0)
        assert np.abs(s * n - 1).max() <= 1.0 / vnodes, (n, s)


def test_adding_a_slot_keeps_old_tokens_and_takes_one_over_n_plus_one() -> None:
    old = balanced_tokens(5, 32, seed=3)
    new_row = add_slot_tokens(old, 32, seed=3)
    assert new_row.shape == (32,) and new_row.dtype == np.uint64
    assert not np.isin(new_row, old).any()
    s = shares(np.vstack([old, new_row[None, :]]))
    assert s[5] == pytest.approx(1 / 6, rel=1e-6)


def test_tokens_are_deterministic_per_seed() -> None:
    np.testing.assert_array_equal(balanced_tokens(4, 8, seed=1), balanced_tokens(4, 8, seed=1))
    assert not np.array_equal(balanced_tokens(4, 8, seed=1), balanced_tokens(4, 8, seed=2))


def test_positions_match_bisect_including_edges() -> None:
    ring = Ring(balanced_tokens(7, 16, seed=0))
    toks = ring.sorted_tokens.tolist()
    rng = np.random.default_rng(0)
    points = [0, RING_SPAN - 1, toks[0], toks[0] + 1, toks[-1], toks[-1] + 1, toks[10] - 1]
    points += [int(x) for x in rng.integers(0, 2**63, 2_000, dtype=np.uint64) * np.uint64(2)]
    got = ring.positions(np.array(points, dtype=np.uint64))
    want = [bisect.bisect_left(toks, p) for p in points]  # T means "wrapped to token 0"
    np.testing.assert_array_equal(got, want)
    assert ring.owners[ring.num_tokens] == ring.owners[0]


def test_successors_are_the_distinct_clockwise_walk() -> None:
    ring = Ring(balanced_tokens(6, 8, seed=5))
    owners = ring.owners[: ring.num_tokens].tolist()
    succ = ring.successors(4)
    assert succ.shape == (ring.num_tokens + 1, 4)
    for p in range(ring.num_tokens):
        walk: list[int] = []
        j = p
        while len(walk) < 4:
            if owners[j % len(owners)] not in walk:
                walk.append(owners[j % len(owners)])
            j += 1
        assert succ[p].tolist() == walk
    np.testing.assert_array_equal(succ[-1], succ[0])
    with pytest.raises(ConfigError, match="7 distinct ring successors"):
        ring.successors(7)


def test_ring_rejects_bad_tokens() -> None:
    with pytest.raises(ConfigError, match="distinct"):
        Ring(np.array([[5, 9], [9, 12]], dtype=np.uint64))
    with pytest.raises(ConfigError, match="non-empty"):
        Ring(np.zeros((0, 4), dtype=np.uint64))


def test_slot_successors_give_every_column_a_fair_share() -> None:
    tokens = balanced_tokens(8, 64, seed=0)
    ring = Ring(tokens)
    slots = ring.slot_successors(3)
    assert slots.shape == (ring.num_tokens + 1, 3)
    np.testing.assert_array_equal(slots[:, 0], ring.owners)
    np.testing.assert_array_equal(slots[:, 2], (ring.owners + 2) % 8)
    toks = [int(t) for t in ring.sorted_tokens]
    arcs = np.array([(toks[j] - toks[j - 1]) % RING_SPAN for j in range(len(toks))], dtype=float) / RING_SPAN
    for r in range(3):
        share = np.bincount(slots[:-1, r], weights=arcs, minlength=8)
        assert np.abs(share * 8 - 1).max() <= 1 / 64, (r, share)
    with pytest.raises(ConfigError, match="asked for 9 distinct shards"):
        ring.slot_successors(9)
