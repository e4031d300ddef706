"""Who is calling and may they: API-key authentication and per-tenant quotas.

Both are synchronous state machines with no I/O (the clock is passed in), used by the
gateway's request path and unit-tested with a fake clock.

* :class:`TenantTable` maps an API key to its tenant. Keys come from the environment
  (``[[tenants]] api_key_env``) when the gateway starts and live only here, as SHA-256
  digests: a presented key is hashed and compared with ``hmac.compare_digest`` against
  **every** keyed tenant (no early exit, equal lengths), so the time taken says nothing
  about which key, or how much of one, matched. A request without a key is the key-less
  tenant's (at most one; none = 401). A spec with no ``[[tenants]]`` has an implicit
  key-less, unlimited ``default``.
* :class:`Quotas` holds one token bucket (``rate_per_s``, ``bucket_size``) and one
  in-flight counter (``max_concurrent_requests``) per tenant. ``admit`` checks the
  concurrency cap first, so a request refused for it spends no rate token; a refusal is
  ResourceExhausted with a ``retry_after_s`` hint (HTTP 429 + ``Retry-After``).

Example::

    table = TenantTable.from_env(cluster.tenants, os.environ)
    tenant = table.authenticate(request.headers.get("X-API-Key"))   # Unauthenticated -> 401
    quotas = Quotas(table.tenants)
    quotas.admit(tenant.name, time.monotonic())                     # ResourceExhausted -> 429
    try: ...
    finally: quotas.release(tenant.name)
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Mapping, Sequence

from recserve.config.spec import TenantConfig
from recserve.errors import ConfigError, ResourceExhausted, Unauthenticated

DEFAULT_TENANT = TenantConfig(name="default")
MIN_RETRY_AFTER_S = 0.001


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class TenantTable:
    """The tenants of one gateway and their key digests (never the keys themselves).

    ``keys`` maps a keyed tenant's name to its key; every tenant with an
    ``api_key_env`` must have a non-empty one.
    """

    def __init__(self, tenants: Sequence[TenantConfig], keys: Mapping[str, str], *, header: str = "X-API-Key") -> None:
        self.tenants: tuple[TenantConfig, ...] = tuple(tenants) or (DEFAULT_TENANT,)
        self.header = header
        keyless = [t for t in self.tenants if not t.api_key_env]
        if len(keyless) > 1:
            raise ConfigError(f"tenants {[t.name for t in keyless]} have no api_key_env: at most one tenant may serve requests without a key")
        self.keyless: TenantConfig | None = keyless[0] if keyless else None
        keyed = [t for t in self.tenants if t.api_key_env]
        for t in keyed:
            if not keys.get(t.name):
                raise ConfigError(f"tenant {t.name!r} has no API key: set the environment variable {t.api_key_env} (tenants.{t.name}.api_key_env)")
        self._keyed: tuple[tuple[bytes, TenantConfig], ...] = tuple((_digest(keys[t.name]), t) for t in keyed)

    @classmethod
    def from_env(cls, tenants: Sequence[TenantConfig], environ: Mapping[str, str], *, header: str = "X-API-Key") -> TenantTable:
        """Read each keyed tenant's key from ``environ[api_key_env]``; a missing or empty
        variable is a ConfigError naming the tenant and the variable (never a value)."""
        keys = {t.name: environ.get(t.api_key_env, "") for t in tenants if t.api_key_env}
        return cls(tenants, keys, header=header)

    def authenticate(self, presented: str | None) -> TenantConfig:
        """The tenant of a request whose key header is ``presented`` (None or "" =
        absent). Unauthenticated when a key matches no tenant, or no key came and no
        tenant is key-less. The message never quotes the key."""
        if not presented:
            if self.keyless is None:
                raise Unauthenticated(f"this gateway needs an API key: send it in the {self.header} header")
            return self.keyless
        digest = _digest(presented)
        found: TenantConfig | None = None
        for want, tenant in self._keyed:  # every tenant, always: no early exit
            if hmac.compare_digest(digest, want):
                found = tenant
        if found is None:
            raise Unauthenticated(f"the API key in the {self.header} header matches no tenant")
        return found


class TenantQuota:
    """One tenant's live quota state: a token bucket and an in-flight count."""

    __slots__ = ("name", "rate", "capacity", "tokens", "last", "max_inflight", "inflight")

    def __init__(self, config: TenantConfig) -> None:
        self.name = config.name
        self.rate = config.rate_per_s
        self.capacity = config.bucket_size
        self.tokens = self.capacity
        self.last: float | None = None  # clock of the last refill
        self.max_inflight = config.max_concurrent_requests  # 0 = no cap
        self.inflight = 0


class Quotas:
    """Per-tenant admission at the gateway (see the module docstring). Tenants unknown
    to it are unlimited (authentication only ever yields known ones)."""

    def __init__(self, tenants: Sequence[TenantConfig]) -> None:
        self._quotas = {t.name: TenantQuota(t) for t in tenants}

    def admit(self, tenant: str, now: float) -> None:
        """Take one request of ``tenant`` at clock ``now``, or raise ResourceExhausted
        with the time after which a retry can succeed."""
        q = self._quotas.get(tenant)
        if q is None:
            return
        if q.max_inflight and q.inflight >= q.max_inflight:
            # A slot frees when a request ends: no better hint than "soon".
            raise ResourceExhausted(f"tenant {tenant!r} has {q.inflight} requests in flight, its max_concurrent_requests", retry_after_s=1.0)
        if not math.isinf(q.rate):
            if q.last is not None and now > q.last:
                q.tokens = min(q.capacity, q.tokens + (now - q.last) * q.rate)
            if q.last is None or now > q.last:
                q.last = now
            if q.tokens < 1.0:
                wait_s = max(MIN_RETRY_AFTER_S, (1.0 - q.tokens) / q.rate)
                raise ResourceExhausted(f"tenant {tenant!r} exceeds its rate of {q.rate:g} requests/s (burst {q.capacity:g})", retry_after_s=wait_s)
            q.tokens -= 1.0
        q.inflight += 1

    def release(self, tenant: str) -> None:
        """One admitted request of ``tenant`` has ended (answered, failed or cancelled)."""
        q = self._quotas.get(tenant)
        if q is not None and q.inflight > 0:
            q.inflight -= 1

    def inflight(self, tenant: str) -> int:
        q = self._quotas.get(tenant)
        return q.inflight if q is not None else 0
