"""Replica routing and reliability (docs/architecture.md §9; reference §10.11).

One implementation of replica choice for every client in the repo (the cascade's calls
to rankers, the gateway's client, the decode path), all synchronous state machines with
the clock passed in and no I/O; gRPC appears only as status codes.

Modules: ``choice`` (power of two choices on a work signal, capacity weights; an ABC and
a factory keyed by :class:`ChoiceKind`), ``breaker`` (per-destination circuit breakers,
closed / open / half-open), ``budget`` (one retry + hedge budget, retryable statuses),
``latency`` (hedge delays, slow-destination ejection), ``affinity`` (consistent-hash
session affinity), ``load`` (:class:`DecodeLoad`, a generation stream's work signal:
active tokens plus KV occupancy), ``config`` (:class:`RoutingConfig`), ``router`` (the :class:`Router`
facade composing them for one replica set).

Core package: imports only ``recserve.errors``, ``recserve.config``, ``recserve.sharding``
and ``recserve.rpc`` (numpy and grpc status codes outside the repo).
"""

from recserve.routing.affinity import AffinityRing
from recserve.routing.breaker import Breakers, BreakerState
from recserve.routing.budget import RETRYABLE_CODES, HedgeBudget, RetryBudget, is_retryable
from recserve.routing.choice import ChoiceKind, ChoicePolicy, LeastLoaded, TwoChoices, WeightedRandom, make_choice_policy
from recserve.routing.config import RoutingConfig
from recserve.routing.latency import LatencyTracker
from recserve.routing.load import DecodeLoad
from recserve.routing.router import Router, RouterStats

__all__ = [
    "RETRYABLE_CODES",
    "AffinityRing",
    "BreakerState",
    "Breakers",
    "ChoiceKind",
    "ChoicePolicy",
    "DecodeLoad",
    "HedgeBudget",
    "LatencyTracker",
    "LeastLoaded",
    "Router",
    "RouterStats",
    "RetryBudget",
    "RoutingConfig",
    "TwoChoices",
    "WeightedRandom",
    "is_retryable",
    "make_choice_policy",
]
