"""Replica choice on a caller-supplied work signal, with capacity weights (pure).

Reference §10.11.3–10.11.5. Random assignment piles work on unlucky replicas; polling
every replica per request costs a full scan of (stale) state. *Power of two choices*
samples two replicas and sends the request to the one with less work *per unit of
capacity*:

* candidates are drawn **with replacement, in proportion to capacity weight** ``w``, so
  a replica with twice the capacity is probed twice as often;
* each candidate's post-admission load is ``u = (W + c) / w``, where ``W`` is the work
  signal the caller supplies (in-flight candidates for rankers, active tokens or KV
  occupancy for decoders: the quantity that predicts queueing there) and ``c`` the cost
  of this request; the smaller ``u`` wins, ties go to the first draw (itself random, so
  ties stay unbiased);
* only *eligible* replicas are drawn (the caller passes its breakers' view): an open
  breaker's replica is never chosen.

With equal work, this is weighted random assignment, so traffic splits by weight; with
unequal work the lighter replica wins whenever it is drawn. Each choice is one cumulative
sum over the R replicas and two ``searchsorted`` probes: vectorised, no Python loop over
replicas.

Pluggable: :class:`ChoicePolicy` is a small ABC and :func:`make_choice_policy` the one
factory, keyed by :class:`ChoiceKind` (two choices; weighted random and least-loaded as
baselines for benchmarks). The random generator is injected, so tests fix its seed.
"""

from __future__ import annotations

import abc
import enum
from typing import ClassVar

import numpy as np

from recserve.errors import ConfigError, Unavailable

__all__ = ["ChoiceKind", "ChoicePolicy", "LeastLoaded", "TwoChoices", "WeightedRandom", "make_choice_policy"]


class ChoiceKind(enum.Enum):
    TWO_CHOICES = "two_choices"
    WEIGHTED_RANDOM = "weighted_random"
    LEAST_LOADED = "least_loaded"


class ChoicePolicy(abc.ABC):
    """Chooses one replica index from arrays describing the replica set.

    Arguments of :meth:`choose` (R = replicas):
        work: float [R] — the work signal (>= 0; any unit, the same for all replicas).
        weights: float [R] — capacity weights, > 0.
        eligible: bool [R] — replicas that may be chosen (breaker closed or probing).
        cost: this request's work, in the unit of ``work``.
    Returns the chosen index (always an eligible one); raises :class:`Unavailable` when
    none is eligible.
    """

    kind: ClassVar[ChoiceKind]

    @abc.abstractmethod
    def choose(self, work: np.ndarray, weights: np.ndarray, eligible: np.ndarray, cost: float = 0.0) -> int: ...


def _eligible_indices(eligible: np.ndarray) -> np.ndarray:
    idx = np.flatnonzero(eligible)
    if idx.size == 0:
        raise Unavailable(f"no eligible replica among {eligible.shape[0]}: every breaker is open")
    return idx


class _Sampling(ChoicePolicy):
    def __init__(self, rng: np.random.Generator | None = None) -> None:
        self.rng = rng if rng is not None else np.random.default_rng()

    def _draw(self, idx: np.ndarray, weights: np.ndarray, k: int) -> np.ndarray:
        """k replica indices drawn with replacement from ``idx`` by weight."""
        cum = np.cumsum(np.take(weights, idx))
        # u in [0, total) -> first cum > u; the clip guards float rounding at the top.
        at = np.searchsorted(cum, self.rng.random(k) * cum[-1], side="right")
        return np.take(idx, np.minimum(at, idx.size - 1))


class TwoChoices(_Sampling):
    """Power of two choices, capacity-weighted (reference §10.11.3, algorithm 4)."""

    kind = ChoiceKind.TWO_CHOICES

    def choose(self, work: np.ndarray, weights: np.ndarray, eligible: np.ndarray, cost: float = 0.0) -> int:
        idx = _eligible_indices(eligible)
        if idx.size == 1:
            return int(idx[0])
        a, b = self._draw(idx, weights, 2).tolist()
        # Strict <: on a tie the first draw wins, and the draws are exchangeable.
        return int(b) if (work[b] + cost) / weights[b] < (work[a] + cost) / weights[a] else int(a)


class WeightedRandom(_Sampling):
    """One draw by capacity weight, ignoring work (the baseline of reference §10.11.2)."""

    kind = ChoiceKind.WEIGHTED_RANDOM

    def choose(self, work: np.ndarray, weights: np.ndarray, eligible: np.ndarray, cost: float = 0.0) -> int:
        idx = _eligible_indices(eligible)
        return int(self._draw(idx, weights, 1)[0])


class LeastLoaded(ChoicePolicy):
    """Full scan: the eligible replica with the least work per weight (lowest index on
    ties). Exact but sees every replica's state: a baseline, not the default."""

    kind = ChoiceKind.LEAST_LOADED

    def choose(self, work: np.ndarray, weights: np.ndarray, eligible: np.ndarray, cost: float = 0.0) -> int:
        idx = _eligible_indices(eligible)
        load = (np.take(work, idx) + cost) / np.take(weights, idx)
        return int(idx[int(np.argmin(load))])


def make_choice_policy(kind: ChoiceKind | str, rng: np.random.Generator | None = None) -> ChoicePolicy:
    """The one factory: ``make_choice_policy(ChoiceKind.TWO_CHOICES, np.random.default_rng(0))``."""
    try:
        kind = ChoiceKind(kind)
    except ValueError:
        raise ConfigError(f"routing.policy = {kind!r} is invalid: use one of {[k.value for k in ChoiceKind]}") from None
    if kind is ChoiceKind.TWO_CHOICES:
        return TwoChoices(rng)
    if kind is ChoiceKind.WEIGHTED_RANDOM:
        return WeightedRandom(rng)
    return LeastLoaded()
