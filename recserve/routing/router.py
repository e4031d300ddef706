"""One replica set's router: two choices, breakers, one retry budget, session affinity.

A synchronous state machine with no I/O: the caller does the RPC and reports what came
back, passing the clock (monotonic seconds) into every call, so tests drive it with a
fake clock. It composes the parts of this package for one replica set:

* :meth:`Router.pick` — a replica for a call: by session affinity when a ``key`` is
  given (:class:`~recserve.routing.affinity.AffinityRing`), else by the choice policy
  (power of two choices on work / capacity weight); replicas whose breaker is open are
  skipped, a half-open one gets ``half_open_probes`` calls at a time. When no replica can
  take the call it raises :class:`~recserve.errors.Unavailable` naming each replica's
  state, with ``retry_after_s`` = time to the first re-probe: failing fast is all a
  router can do then (shedding belongs to admission control).
* :meth:`Router.on_result` — the call's status: retryable failures feed the replica's
  breaker, answers close it; latencies feed the hedge delay.
* :meth:`Router.can_retry` / :meth:`Router.can_hedge` — one token from the shared
  :class:`~recserve.routing.budget.RetryBudget` (retryable statuses only).

The work signal is the router's own in-flight work per replica (the ``cost`` of each
call picked and not yet reported: candidates for a ranker, tokens for a decoder), plus
whatever the replicas report through :meth:`Router.set_reported_load` (work this router
did not send: other routers' share, queued decode tokens). A streaming call's cost may
change while it runs (:meth:`Router.add_inflight`: a generation stream's active tokens
and KV occupancy, :class:`~recserve.routing.load.DecodeLoad`), and its first message
closes the replica's breaker before the stream ends (:meth:`Router.on_answer`). The
same router serves ranker and generation replica sets; only the cost differs.

Example (fake clock)::

    router = Router(["r0:7000", "r1:7000"], RoutingConfig(), rng=np.random.default_rng(0))
    now = 0.0
    replica = router.pick(now, cost=500)                    # 500 candidates
    code = grpc.StatusCode.UNAVAILABLE                      # ... the RPC failed
    router.on_result(replica, code, 0.004, now, cost=500)
    if router.can_retry(code):
        retry = router.pick(now, cost=500, retry_of=replica)  # another replica
        router.on_result(retry, grpc.StatusCode.OK, 0.003, now, cost=500)

Membership changes through :meth:`Router.set_replicas` (a headless Service re-resolved:
:mod:`recserve.routing.resolve`): replicas that stay keep their breaker, latency and
in-flight state; new ones start fresh; a removed replica's calls still out report into
nothing (their results are dropped, not errors). The affinity ring of the new set moves
only the keys it must.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grpc
import numpy as np

from recserve.errors import InternalError, NotFound, Unavailable, require
from recserve.routing.affinity import AffinityRing
from recserve.routing.breaker import Breakers, BreakerState
from recserve.routing.budget import RetryBudget, is_retryable
from recserve.routing.choice import ChoicePolicy, make_choice_policy
from recserve.routing.config import RoutingConfig
from recserve.routing.latency import LatencyTracker

__all__ = ["Router", "RouterStats"]


@dataclasses.dataclass
class RouterStats:
    """Counters since the router was built."""

    picks: int = 0
    primaries: int = 0
    retries_picked: int = 0  # picks with ``retry_of`` (retries and hedges)
    failures: int = 0  # retryable failures reported
    unavailable: int = 0  # picks refused: no replica could take the call


class Router:
    """Routes calls over one fixed replica set (see the module docstring).

    Args:
        replicas: distinct replica names (addresses).
        config: the validated :class:`RoutingConfig`.
        weights: capacity weight per replica (> 0; default all 1): a replica with twice
            the weight is sampled twice as often and counts its work half as much.
        rng: random generator for the choice policy (inject a seeded one in tests).
        budget: a retry budget to share with other routers (default: this router's own).
        policy: a choice policy overriding ``config.policy`` (e.g. a test double).
    """

    def __init__(
        self,
        replicas: Sequence[str],
        config: RoutingConfig | None = None,
        *,
        weights: Sequence[float] | np.ndarray | None = None,
        rng: np.random.Generator | None = None,
        budget: RetryBudget | None = None,
        policy: ChoicePolicy | None = None,
    ) -> None:
        self.config = config if config is not None else RoutingConfig()
        cfg = self.config
        self.affinity = AffinityRing(replicas, virtual_nodes=cfg.affinity_virtual_nodes, seed=cfg.affinity_seed)
        self.replicas = self.affinity.replicas
        n = len(self.replicas)
        self._index = {name: i for i, name in enumerate(self.replicas)}
        w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
        require(w.shape == (n,), "routing.weights", w.tolist(), f"give one weight per replica ({n})")
        require(bool(np.all(np.isfinite(w) & (w > 0))), "routing.weights", w.tolist(), "use positive, finite capacity weights")
        self.weights = w
        self.policy = policy if policy is not None else make_choice_policy(cfg.policy, rng)
        self.breakers = Breakers(n, failures=cfg.breaker_failures, open_s=cfg.breaker_open_ms / 1e3, half_open_probes=cfg.half_open_probes)
        self.budget = budget if budget is not None else RetryBudget(cfg.retry_budget, cfg.retry_burst)
        self.latency = LatencyTracker(n, percentile=cfg.hedge_percentile, min_delay_s=cfg.hedge_min_ms / 1e3)
        self.inflight = np.zeros(n)  # float [R]: cost picked here and not yet reported
        self.reported = np.zeros(n)  # float [R]: work the replicas report beyond ours
        # int64 [R]: calls granted while the breaker was closed (no probe permit held) and
        # not yet reported. A result is charged to these first, so a cancelled pre-outage
        # call never frees a half-open probe permit it did not hold (an unattributed
        # cancelled probe keeps its permit until the breaker's lost-probe expiry).
        self._unpermitted = np.zeros(n, dtype=np.int64)
        self._retired: set[str] = set()  # removed by set_replicas: their late results are dropped
        self.stats = RouterStats()

    # ---- membership ---------------------------------------------------------------

    def set_replicas(self, replicas: Sequence[str]) -> None:
        """Route over ``replicas`` from now on (the resolver's new answer). State is kept
        per replica name: a replica that stays keeps its breaker, latency window,
        in-flight and reported work; a new one starts closed and idle. Runs once per
        membership change (not per call), so its loop over replica names is fine."""
        new = tuple(replicas)
        if new == self.replicas:
            return
        cfg = self.config
        affinity = AffinityRing(new, virtual_nodes=cfg.affinity_virtual_nodes, seed=cfg.affinity_seed)  # validates the names
        n = len(affinity.replicas)
        pairs = [(j, self._index[name]) for j, name in enumerate(affinity.replicas) if name in self._index]
        new_pos = np.array([j for j, _ in pairs], dtype=np.int64)
        old_pos = np.array([i for _, i in pairs], dtype=np.int64)
        breakers = Breakers(n, failures=cfg.breaker_failures, open_s=cfg.breaker_open_ms / 1e3, half_open_probes=cfg.half_open_probes)
        latency = LatencyTracker(n, percentile=cfg.hedge_percentile, min_delay_s=cfg.hedge_min_ms / 1e3)
        old_n = len(self.replicas)
        for fresh, old in ((breakers, self.breakers), (latency, self.latency)):
            _carry_rows(old, fresh, old_n, old_pos, new_pos)
        weights = np.ones(n)
        weights[new_pos] = self.weights[old_pos]  # a new replica gets weight 1
        arrays = {}
        for name in ("inflight", "reported", "_unpermitted"):
            old_arr = getattr(self, name)
            arr = np.zeros(n, dtype=old_arr.dtype)
            arr[new_pos] = old_arr[old_pos]
            arrays[name] = arr
        self._retired = (self._retired | set(self.replicas)) - set(affinity.replicas)
        self.affinity, self.replicas = affinity, affinity.replicas
        self._index = {name: i for i, name in enumerate(self.replicas)}
        self.weights, self.breakers, self.latency = weights, breakers, latency
        self.inflight, self.reported, self._unpermitted = arrays["inflight"], arrays["reported"], arrays["_unpermitted"]

    def _slot(self, replica: str) -> int | None:
        """The replica's index, or None for one removed by :meth:`set_replicas` (a call
        to it ended after it left: nothing to account)."""
        if replica in self._retired:
            return None
        return self.index(replica)

    # ---- choosing -----------------------------------------------------------------

    def index(self, replica: str) -> int:
        i = self._index.get(replica)
        if i is None:
            raise NotFound(f"replica {replica!r} is not in this router's set {list(self.replicas)}")
        return i

    @property
    def work(self) -> np.ndarray:
        """float [R]: the work signal two choices compares (before dividing by weight)."""
        return self.inflight + self.reported

    def pick(self, now: float, *, key: int | str | None = None, cost: float = 1.0, retry_of: str | None = None) -> str:
        """The replica for one call at ``now``.

        Args:
            key: a session key (user id, conversation id): the same key reaches the same
                replica while it is available, else the next one on the ring.
            cost: this call's work in the signal's unit; added to the replica's in-flight
                work until :meth:`on_result` reports it.
            retry_of: for a retry or hedge, the replica the first attempt went to: it is
                avoided when another can take the call, and the pick is not counted as
                a primary call (primaries alone earn retry budget).
        Raises:
            Unavailable: no replica can take the call (every breaker open, or half-open
                with its probes out); ``retry_after_s`` says when one re-probes.
        """
        eligible = self.breakers.available(now)
        if retry_of is not None:
            others = eligible.copy()
            others[self.index(retry_of)] = False
            if others.any():
                eligible = others
        if not eligible.any():
            self.stats.unavailable += 1
            raise self._unavailable(now)
        if key is not None:
            i = self.affinity.choose(key, eligible)
        else:
            i = self.policy.choose(self.work, self.weights, eligible, cost)
        probe = self.breakers.state(i, now) is not BreakerState.CLOSED
        if not self.breakers.acquire(i, now):  # available() said it could: a bug if not
            raise InternalError(f"replica {self.replicas[i]!r} was eligible but its breaker refused the call")
        if not probe:
            self._unpermitted[i] += 1
        self.inflight[i] += cost
        self.stats.picks += 1
        if retry_of is None:
            self.stats.primaries += 1
            self.budget.on_primary()
        else:
            self.stats.retries_picked += 1
        return self.replicas[i]

    def _unavailable(self, now: float) -> Unavailable:
        states = self.breakers.states(now)
        at = self.breakers.available_at(now)
        parts = []
        for i, name in enumerate(self.replicas):  # error path only: R names for the message
            if states[i] == BreakerState.OPEN:
                parts.append(f"{name} open for {(at[i] - now) * 1e3:.0f} ms")
            else:
                parts.append(f"{name} {BreakerState(int(states[i])).name.lower()} with its probes out")
        retry_after = float(max(0.0, at.min() - now))
        return Unavailable(f"no replica of {len(self.replicas)} can take the call: " + ", ".join(parts), retry_after_s=retry_after)

    # ---- results ------------------------------------------------------------------

    def on_result(self, replica: str, code: grpc.StatusCode | None, latency_s: float | None, now: float, *, cost: float = 1.0) -> None:
        """Report how a picked call ended.

        ``code``: its status (``OK`` or None for success). UNAVAILABLE and
        DEADLINE_EXCEEDED count against the replica's breaker. RESOURCE_EXHAUSTED is a
        live replica shedding work it cannot finish in time (issue 17's admission): no
        verdict on its health, or every replica of a fleet under overload would open its
        breaker at once and a short burst would become a full outage; it frees a probe
        permit and records no latency (a refusal is fast). CANCELLED (the caller's own
        cancellation) changes no state but frees a half-open probe permit; any other status is an answer
        (INVALID_ARGUMENT comes from a healthy replica) and closes it. ``latency_s`` feeds the hedge delay for
        answers and for deadline-exceeded calls (the time waited, a lower bound), not
        for fast UNAVAILABLE refusals, which would make a dead replica look quick;
        None records nothing (a stream whose first message :meth:`on_answer` timed).
        ``cost``: the cost passed to :meth:`pick` (as moved by :meth:`add_inflight`).
        """
        i = self._slot(replica)
        if i is None:
            return
        self.inflight[i] = max(0.0, self.inflight[i] - cost)
        held_permit = self._unpermitted[i] == 0
        if not held_permit:
            self._unpermitted[i] -= 1
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            if held_permit:
                self.breakers.release(i)
            return
        if code == grpc.StatusCode.CANCELLED:
            # Our own cancellation (a hedge that lost, a caller gone) says nothing about
            # the replica's health; the time waited is still a lower bound on latency.
            if held_permit:
                self.breakers.release(i)
            if latency_s is not None:
                self.latency.record(i, latency_s, now)
            return
        if code is not None and code != grpc.StatusCode.OK and is_retryable(code):
            self.stats.failures += 1
            self.breakers.on_failure(i, now)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and latency_s is not None:
                self.latency.record(i, latency_s, now)
            return
        self.breakers.on_success(i, now)
        if latency_s is not None:
            self.latency.record(i, latency_s, now)

    def can_retry(self, code: grpc.StatusCode | None) -> bool:
        """Whether a call that failed with ``code`` may be retried: only a retryable
        status, and only with a token from the retry budget (which it then spends)."""
        return self.budget.try_retry(code)

    def can_hedge(self) -> bool:
        """Whether a hedge (a second call while the first is still out) may be sent:
        spends a token from the same budget as retries."""
        return self.budget.try_spend()

    def hedge_delay(self, replica: str) -> float:
        """Seconds to wait on ``replica`` before hedging (its recent latency percentile)."""
        i = self._slot(replica)
        return self.latency.hedge_delay(i) if i is not None else self.latency.default_delay_s

    def add_inflight(self, replica: str, delta: float) -> None:
        """Move a call in progress's cost by ``delta`` (a generation stream's work
        changes as its chunks arrive: :class:`~recserve.routing.load.DecodeLoad`); the
        cost later reported to :meth:`on_result` is the moved one."""
        i = self._slot(replica)
        if i is not None:
            self.inflight[i] = max(0.0, self.inflight[i] + delta)

    def on_answer(self, replica: str, latency_s: float, now: float) -> None:
        """A streaming call's first message arrived after ``latency_s``: the replica
        serves, so its breaker closes now (a half-open probe that streams for seconds
        must not hold the replica's traffic back that long) and the time to the first
        message feeds its hedge delay. The call is still in flight: end it with
        :meth:`on_result`, passing ``latency_s=None`` (recorded once)."""
        i = self._slot(replica)
        if i is None:
            return
        self.breakers.on_success(i, now)
        self.latency.record(i, latency_s, now)

    def set_reported_load(self, replica: str, work: float) -> None:
        """The replica's own report of work this router did not send (same unit as cost)."""
        i = self._slot(replica)
        if i is not None:
            self.reported[i] = max(0.0, work)

    def state(self, replica: str, now: float) -> BreakerState:
        return self.breakers.state(self.index(replica), now)


def _carry_rows(old: object, fresh: object, old_n: int, old_pos: np.ndarray, new_pos: np.ndarray) -> None:
    """Copy the per-replica rows of ``old``'s arrays (first axis = replicas) into
    ``fresh``'s at the replicas' new positions, and its scalar counters as they are:
    breakers and latency trackers keep their state across a membership change without
    this module knowing their fields."""
    for name, value in vars(old).items():
        if isinstance(value, np.ndarray) and value.ndim >= 1 and value.shape[0] == old_n:
            target = getattr(fresh, name)
            if isinstance(target, np.ndarray) and target.shape[1:] == value.shape[1:]:
                target[new_pos] = value[old_pos]
        elif not isinstance(value, np.ndarray):
            setattr(fresh, name, value)
