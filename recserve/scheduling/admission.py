"""Admission control at ``Scheduler.add`` (reference §10.12.2): a bounded queue and
per-tenant quotas, checked and reserved in one synchronous step.

- queue bound: queued item count and total queued cost;
- per-tenant concurrent cost: cost admitted and not yet finished (queued + running +
  resident); reserved at add, released when the item reaches a terminal state;
- per-tenant request rate: a token bucket refilled from the caller's clock;
- deadline slack (``shed_by_slack``): the core sheds a request whose slack
  (deadline − now) is below its estimated queue wait plus service time, from the
  service-time fit (:class:`~recserve.scheduling.estimators.ServiceTimeEstimator`), the
  mean batch size and the number of batches that run at once (:meth:`Admission.shed`).

A rejection raises :class:`~recserve.errors.ResourceExhausted` with a ``retry_after_s``
hint and costs a few microseconds: no allocation beyond the exception itself, no scan.
Checks run before the rate token is taken, so a request rejected for another reason does
not spend its tenant's rate.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from recserve.config.spec import TenantConfig
from recserve.errors import InvalidArgument, ResourceExhausted, require


@dataclasses.dataclass(frozen=True)
class AdmissionConfig:
    """Queue bounds and tenant quotas of one scheduler.

    ``tenants`` lists quotas by tenant name (``TenantConfig.max_concurrent_cost`` in the
    scheduler's cost unit, ``rate_per_s`` in requests/s); ``default_tenant`` applies to
    tenants not listed (its ``name`` is ignored); None means unlisted tenants are
    unlimited. The rate bucket holds ``max(1, rate_per_s * rate_burst_s)`` requests.
    """

    max_queued_items: int = 100_000
    max_queued_cost: float = math.inf
    tenants: tuple[TenantConfig, ...] = ()
    default_tenant: TenantConfig | None = None
    rate_burst_s: float = 0.1
    min_retry_after_s: float = 0.001
    max_retry_after_s: float = 10.0
    # Shed at add a request whose deadline slack is below its estimated queue wait plus
    # service time (reference §10.11.10): without it an overloaded EDF queue runs every
    # item right at its deadline and most of them miss it. False: queue bounds only.
    shed_by_slack: bool = True
    # Batches measured before the slack check may shed: the first batches of a fresh
    # process pay lazy initialisation (torch kernels, caches, connections), and an
    # estimate from them alone shed a cold ranker's healthy traffic (bench recall).
    shed_after_batches: int = 8

    def __post_init__(self) -> None:
        require(self.max_queued_items >= 1, "admission.max_queued_items", self.max_queued_items, "use at least 1 item")
        require(self.max_queued_cost > 0, "admission.max_queued_cost", self.max_queued_cost, "use a positive cost (math.inf for no bound)")
        names = [t.name for t in self.tenants]
        require(len(set(names)) == len(names), "admission.tenants", names, "list each tenant once")
        require(self.shed_after_batches >= 1, "admission.shed_after_batches", self.shed_after_batches, "use at least 1 measured batch")
        require(self.rate_burst_s > 0, "admission.rate_burst_s", self.rate_burst_s, "use a positive burst length in seconds")
        require(0 < self.min_retry_after_s <= self.max_retry_after_s, "admission.min_retry_after_s", self.min_retry_after_s,
                f"use 0 < min_retry_after_s <= max_retry_after_s ({self.max_retry_after_s})")


class TenantQuota:
    """Live quota state of one tenant."""

    __slots__ = ("name", "max_cost", "rate", "capacity", "tokens", "last", "inflight_cost")

    def __init__(self, config: TenantConfig, burst_s: float, name: str) -> None:
        self.name = name
        self.max_cost = config.max_concurrent_cost
        self.rate = config.rate_per_s
        self.capacity = max(1.0, self.rate * burst_s)
        self.tokens = self.capacity
        self.last: float | None = None
        self.inflight_cost = 0.0


class Admission:
    """Checks and reserves at add; releases at the terminal transition.

    ``queue_drain_s`` and ``batch_service_s`` are supplied by the core and only called on
    a rejection, to compute the retry-after hint.
    """

    def __init__(
        self,
        config: AdmissionConfig,
        *,
        queue_drain_s: Callable[[], float] = lambda: 0.0,
        batch_service_s: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.config = config
        self._queue_drain_s = queue_drain_s
        self._batch_service_s = batch_service_s
        self._quotas: dict[str, TenantQuota | None] = {
            t.name: self._make_quota(t, t.name) for t in config.tenants
        }

    def _make_quota(self, tenant: TenantConfig | None, name: str) -> TenantQuota | None:
        if tenant is None or (math.isinf(tenant.max_concurrent_cost) and math.isinf(tenant.rate_per_s)):
            return None  # unlimited: nothing to track
        return TenantQuota(tenant, self.config.rate_burst_s, name)

    def admit(self, tenant: str, cost: float, queued_items: int, queued_cost: float, now: float) -> TenantQuota | None:
        """Admit one request of ``cost`` or raise ResourceExhausted. Returns the tenant's
        quota record to release later (None when the tenant is unlimited)."""
        cfg = self.config
        if queued_items >= cfg.max_queued_items:
            raise ResourceExhausted(
                f"scheduler queue is full: {queued_items:,} items queued (max_queued_items={cfg.max_queued_items:,})",
                retry_after_s=self._hint(self._queue_drain_s()),
            )
        if queued_cost + cost > cfg.max_queued_cost:
            if cost > cfg.max_queued_cost:
                raise InvalidArgument(
                    f"request cost {cost:g} exceeds the scheduler's max_queued_cost {cfg.max_queued_cost:g}; "
                    "it can never be admitted: split it into smaller requests"
                )
            raise ResourceExhausted(
                f"scheduler queue is full: queued cost {queued_cost:g} + {cost:g} > max_queued_cost {cfg.max_queued_cost:g}",
                retry_after_s=self._hint(self._queue_drain_s()),
            )
        try:
            quota = self._quotas[tenant]
        except KeyError:
            quota = self._quotas[tenant] = self._make_quota(cfg.default_tenant, tenant)
        if quota is None:
            return None
        if quota.inflight_cost + cost > quota.max_cost:
            if cost > quota.max_cost:
                raise InvalidArgument(
                    f"request cost {cost:g} exceeds tenant {tenant!r}'s max_concurrent_cost {quota.max_cost:g}; "
                    "it can never be admitted: split it into smaller requests"
                )
            raise ResourceExhausted(
                f"tenant {tenant!r} has cost {quota.inflight_cost:g} in flight; + {cost:g} exceeds its "
                f"max_concurrent_cost {quota.max_cost:g}",
                retry_after_s=self._hint(self._batch_service_s()),
            )
        if quota.rate != math.inf:
            if quota.last is not None and now > quota.last:
                quota.tokens = min(quota.capacity, quota.tokens + (now - quota.last) * quota.rate)
            if quota.last is None or now > quota.last:
                quota.last = now
            if quota.tokens < 1.0:
                raise ResourceExhausted(
                    f"tenant {tenant!r} exceeds its rate of {quota.rate:g} requests/s",
                    retry_after_s=self._hint((1.0 - quota.tokens) / quota.rate),
                )
            quota.tokens -= 1.0
        quota.inflight_cost += cost
        return quota

    def shed(self, request_id: str, slack_s: float, wait_s: float, service_s: float, queued_items: int) -> None:
        """Raise ResourceExhausted if ``slack_s`` (deadline − now) is below ``wait_s``
        (estimated queue wait) + ``service_s`` (estimated service time of its batch): the
        request cannot finish in time, so refusing it now (a few µs, with a hint of when
        the queue will have drained) beats running it into its deadline. Callers skip it
        for requests without a deadline."""
        if self.config.shed_by_slack and slack_s < wait_s + service_s:
            raise ResourceExhausted(
                f"request {request_id} has {slack_s * 1e3:.3f} ms of slack; the estimated queue wait "
                f"{wait_s * 1e3:.3f} ms ({queued_items:,} items queued) + service {service_s * 1e3:.3f} ms exceed it: shed",
                retry_after_s=self._hint(wait_s),
            )

    @staticmethod
    def release(quota: TenantQuota | None, cost: float) -> None:
        """Return ``cost`` of a finished item to its tenant."""
        if quota is not None:
            quota.inflight_cost -= cost
            if quota.inflight_cost < 1e-9:
                quota.inflight_cost = 0.0  # absorb float drift

    @staticmethod
    def refund(quota: TenantQuota | None, cost: float) -> None:
        """Undo an ``admit`` whose item was then refused (by the policy): its cost and its
        rate token go back to the tenant."""
        if quota is not None:
            Admission.release(quota, cost)
            if quota.rate != math.inf:
                quota.tokens = min(quota.capacity, quota.tokens + 1.0)

    @staticmethod
    def adjust(quota: TenantQuota | None, delta: float) -> None:
        """An admitted item's cost changed by ``delta`` (never rejected: it is already in)."""
        if quota is not None:
            quota.inflight_cost += delta

    def tenant_inflight_cost(self, tenant: str) -> float:
        """Cost the tenant has admitted and not finished (0.0 for untracked tenants)."""
        quota = self._quotas.get(tenant)
        return quota.inflight_cost if quota is not None else 0.0

    def _hint(self, seconds: float) -> float:
        cfg = self.config
        return min(cfg.max_retry_after_s, max(cfg.min_retry_after_s, seconds))
