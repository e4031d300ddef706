"""The checker behind ``tests/integration/test_no_crossing.py``: every caller's answer
is compared with that caller's own oracle, and an answer that belongs to another caller
is named as a crossing.

These unit tests prove the checker can fail: a deliberately swapped pair of answers, a
perturbed value and a wrong shape are each caught; a cancelled caller (``None``) is
skipped, not silently counted as checked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Caller ``index`` got an answer unlike its oracle; ``belongs_to`` is the caller
    whose oracle it does match (a crossing), or None (merely wrong)."""

    index: int
    belongs_to: int | None


def mismatches(got: Sequence[np.ndarray | None], want: Sequence[np.ndarray], *, atol: float = 0.0) -> list[Mismatch]:
    """Compare each caller's answer ``got[i]`` (any shape; None: cancelled, skipped)
    with its own oracle ``want[i]`` (same shape), elementwise within ``atol``.

    For every mismatch, look for the other caller whose oracle the answer matches: the
    war story of reference §10.11.6 is exactly that (a reply delivered to the wrong
    caller). The search is O(n²) over callers, but only over the mismatches, which a
    passing run has none of.
    """
    if len(got) != len(want):
        raise ValueError(f"got {len(got)} answers for {len(want)} oracles")

    def same(a: np.ndarray, b: np.ndarray) -> bool:
        return a.shape == b.shape and bool(np.allclose(a, b, rtol=0.0, atol=atol))

    out = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g is None or same(g, w):
            continue
        owner = next((j for j, o in enumerate(want) if j != i and same(g, o)), None)
        out.append(Mismatch(i, owner))
    return out


def _oracles(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(n)]


def test_matching_answers_pass_and_cancelled_ones_are_skipped() -> None:
    want = _oracles(4)
    got: list[np.ndarray | None] = [w.copy() for w in want]
    got[2] = None
    assert mismatches(got, want) == []


def test_a_swapped_pair_of_answers_is_caught_as_a_crossing() -> None:
    want = _oracles(4)
    got: list[np.ndarray | None] = [w.copy() for w in want]
    got[1], got[3] = got[3], got[1]
    assert mismatches(got, want) == [Mismatch(1, 3), Mismatch(3, 1)]


def test_a_wrong_value_or_shape_is_caught_without_an_owner() -> None:
    want = _oracles(3)
    bumped = want[0].copy()
    bumped[2, 1] += 1e-3
    got: list[np.ndarray | None] = [bumped, want[1][:2], want[2].copy()]
    assert mismatches(got, want, atol=1e-4) == [Mismatch(0, None), Mismatch(1, None)]
    assert mismatches(got[:1], want[:1], atol=1e-2) == []  # within the stated tolerance


def test_the_shared_no_secrets_log_check_names_each_leak() -> None:
    from recserve.logs import secrets_in

    logs = {"gateway": "POST /v1/rank -> 200\n", "shard-0": "upsert by key-123 ok\n"}
    assert secrets_in(logs, {"alpha key": "key-123", "admin token": "tok-9"}) == [("shard-0", "alpha key")]
    assert secrets_in(logs, {"admin token": "tok-9"}) == []
