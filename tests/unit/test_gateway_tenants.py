"""The gateway's tenants (recserve/gateway/tenants.py): API-key authentication compared
against every keyed tenant, and per-tenant token buckets and concurrency caps on a fake
clock."""

from __future__ import annotations

import hmac

import pytest

from recserve.config.spec import TenantConfig
from recserve.errors import ConfigError, ResourceExhausted, Unauthenticated
from recserve.gateway import tenants as tenants_mod
from recserve.gateway.tenants import Quotas, TenantTable

FEED = TenantConfig("feed", api_key_env="FEED_API_KEY", rate_per_s=2.0, burst=3)
ADS = TenantConfig("ads", api_key_env="ADS_API_KEY", max_concurrent_requests=2)
OPEN = TenantConfig("open")
KEYS = {"FEED_API_KEY": "feed-secret-0123456789", "ADS_API_KEY": "ads-secret-9876543210"}


def test_a_key_selects_its_tenant_and_no_key_selects_the_keyless_one() -> None:
    table = TenantTable.from_env([FEED, ADS, OPEN], KEYS)
    assert table.authenticate("feed-secret-0123456789").name == "feed"
    assert table.authenticate("ads-secret-9876543210").name == "ads"
    assert table.authenticate(None).name == "open"
    assert table.authenticate("").name == "open"  # an empty header is no key


def test_a_wrong_key_is_refused_even_when_a_keyless_tenant_exists_and_never_quoted() -> None:
    table = TenantTable.from_env([FEED, OPEN], KEYS)
    for wrong in ("feed-secret-012345678", "feed-secret-01234567890", "nope"):
        with pytest.raises(Unauthenticated) as err:
            table.authenticate(wrong)
        assert wrong not in err.value.message and "X-API-Key" in err.value.message


def test_no_key_without_a_keyless_tenant_is_refused() -> None:
    table = TenantTable.from_env([FEED, ADS], KEYS, header="X-Key")
    with pytest.raises(Unauthenticated, match="X-Key"):
        table.authenticate(None)


def test_every_keyed_tenant_is_compared_even_after_a_match(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(tenants_mod.hmac, "compare_digest", counting)
    table = TenantTable.from_env([FEED, ADS, OPEN], KEYS)
    assert table.authenticate("feed-secret-0123456789").name == "feed"  # feed is the first keyed tenant
    assert len(calls) == 2  # ...and ads was compared all the same
    assert {len(a) for a, _ in calls} == {32} and {len(b) for _, b in calls} == {32}  # digests: equal lengths, whatever was sent


def test_a_keyed_tenant_without_its_variable_is_a_startup_error_naming_both() -> None:
    with pytest.raises(ConfigError) as err:
        TenantTable.from_env([FEED, ADS], {"FEED_API_KEY": "feed-secret-0123456789"})
    assert "'ads'" in err.value.message and "ADS_API_KEY" in err.value.message
    with pytest.raises(ConfigError, match="ADS_API_KEY"):
        TenantTable.from_env([FEED, ADS], {**KEYS, "ADS_API_KEY": ""})  # set but empty is missing


def test_two_keyless_tenants_are_refused_and_no_tenants_means_an_open_default() -> None:
    with pytest.raises(ConfigError, match="at most one"):
        TenantTable([OPEN, TenantConfig("other")], {})
    table = TenantTable([], {})
    assert table.authenticate(None).name == "default"


def test_the_token_bucket_allows_its_burst_then_refills_at_its_rate() -> None:
    quotas = Quotas([FEED])
    for _ in range(3):  # burst = 3
        quotas.admit("feed", 100.0)
        quotas.release("feed")
    with pytest.raises(ResourceExhausted) as err:
        quotas.admit("feed", 100.0)
    assert err.value.retry_after_s == pytest.approx(0.5)  # one token at 2/s
    assert "'feed'" in err.value.message and "2 requests/s" in err.value.message
    quotas.admit("feed", 100.5)  # half a second later: one token back
    quotas.release("feed")
    with pytest.raises(ResourceExhausted):
        quotas.admit("feed", 100.5)
    quotas.admit("feed", 200.0)  # long idle: refilled, but only up to the burst
    quotas.admit("feed", 200.0)
    quotas.admit("feed", 200.0)
    with pytest.raises(ResourceExhausted):
        quotas.admit("feed", 200.0)


def test_the_default_bucket_holds_one_second_of_rate() -> None:
    assert TenantConfig("t", rate_per_s=5.0).bucket_size == 5.0
    assert TenantConfig("t", rate_per_s=0.1).bucket_size == 1.0
    assert TenantConfig("t", rate_per_s=5.0, burst=2).bucket_size == 2.0


def test_the_concurrency_cap_refuses_without_spending_rate_and_frees_on_release() -> None:
    capped = TenantConfig("c", api_key_env="C_KEY", max_concurrent_requests=2, rate_per_s=1.0, burst=3)
    quotas = Quotas([capped])
    quotas.admit("c", 0.0)
    quotas.admit("c", 0.0)
    assert quotas.inflight("c") == 2
    with pytest.raises(ResourceExhausted, match="2 requests in flight") as err:
        quotas.admit("c", 0.0)
    assert err.value.retry_after_s is not None and err.value.retry_after_s > 0
    quotas.release("c")
    quotas.admit("c", 0.0)  # the refused one took no token: the third of the burst is still there
    quotas.release("c")
    quotas.release("c")
    quotas.release("c")
    quotas.release("c")  # releasing more than admitted never goes negative
    assert quotas.inflight("c") == 0


def test_unlimited_tenants_are_never_refused() -> None:
    quotas = Quotas([OPEN])
    for _ in range(1000):
        quotas.admit("open", 0.0)
    assert quotas.inflight("open") == 1000
