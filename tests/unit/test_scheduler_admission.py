"""Admission at add: queue bounds, tenant concurrent-cost quotas, tenant rate (token
bucket on the caller's clock), retry-after hints. Fake clock, no sleeps."""

from __future__ import annotations

import grpc
import pytest

from recserve.config.spec import TenantConfig
from recserve.errors import ConfigError, InvalidArgument, ResourceExhausted
from recserve.rpc.status import grpc_code, is_retryable
from recserve.scheduling import AdmissionConfig, Done, FeatureParallelConfig, FeatureParallelPolicy, Priority, Scheduler, WorkItem


def item(rid: str, *, tenant: str = "t", cost: float = 1.0) -> WorkItem:
    return WorkItem(rid, tenant, Priority.STANDARD, 100.0, cost, None)


def scheduler(adm: AdmissionConfig) -> Scheduler:
    return Scheduler(FeatureParallelPolicy(FeatureParallelConfig(window_ms=0.0, max_cost=1e9)), adm)


def drain(sched: Scheduler, now: float, service_s: float = 0.0) -> int:
    batch = sched.schedule(now)
    if batch is None:
        return 0
    sched.complete(batch, [Done(None)] * len(batch), now + service_s)
    return len(batch)


def test_queue_item_bound_rejects_with_retry_after_and_recovers() -> None:
    sched = scheduler(AdmissionConfig(max_queued_items=3))
    for i in range(3):
        sched.add(item(f"r{i}"), 0.0)
    with pytest.raises(ResourceExhausted) as info:
        sched.add(item("r3"), 0.0)
    err = info.value
    assert grpc_code(err) == grpc.StatusCode.RESOURCE_EXHAUSTED and is_retryable(grpc_code(err))
    assert err.retry_after_s is not None and err.retry_after_s > 0
    assert "3 items queued" in err.message
    assert sched.stats().drops["rejected"] == 1 and sched.queued_count == 3
    assert drain(sched, 0.0) == 3
    sched.add(item("r3"), 0.0)  # room again once the queue drained


def test_queue_full_retry_hint_grows_with_measured_service_time() -> None:
    sched = scheduler(AdmissionConfig(max_queued_items=4))
    sched.add(item("warm"), 0.0)
    drain(sched, 0.0, service_s=0.050)  # one measured batch of 1 item: 50 ms
    for i in range(4):
        sched.add(item(f"r{i}"), 1.0)
    with pytest.raises(ResourceExhausted) as info:
        sched.add(item("x"), 1.0)
    # 4 items ahead at the measured 1 item / batch and 50 ms / batch.
    assert info.value.retry_after_s == pytest.approx(4 * 0.050)


def test_queue_cost_bound() -> None:
    sched = scheduler(AdmissionConfig(max_queued_cost=10.0))
    sched.add(item("a", cost=6.0), 0.0)
    with pytest.raises(ResourceExhausted):
        sched.add(item("b", cost=5.0), 0.0)
    sched.add(item("c", cost=4.0), 0.0)  # exactly at the bound is fine
    assert sched.stats().queued_cost == 10.0
    with pytest.raises(InvalidArgument):  # can never fit: not retryable
        sched.add(item("huge", cost=11.0), 0.0)


def test_tenant_concurrent_cost_quota_is_per_tenant_and_released_on_finish() -> None:
    adm = AdmissionConfig(tenants=(TenantConfig("small", max_concurrent_cost=5.0),))
    sched = scheduler(adm)
    sched.add(item("a", tenant="small", cost=3.0), 0.0)
    sched.add(item("b", tenant="small", cost=2.0), 0.0)
    with pytest.raises(ResourceExhausted) as info:
        sched.add(item("c", tenant="small", cost=1.0), 0.0)
    assert "max_concurrent_cost 5" in info.value.message and info.value.retry_after_s is not None
    for i in range(20):  # an unlisted tenant is unlimited by default
        sched.add(item(f"o{i}", tenant="other", cost=3.0), 0.0)
    batch = sched.schedule(0.0)
    assert batch is not None
    with pytest.raises(ResourceExhausted):  # still running: still counted
        sched.add(item("c", tenant="small", cost=1.0), 0.0)
    sched.complete(batch, [Done(None)] * len(batch), 0.01)
    sched.add(item("c", tenant="small", cost=1.0), 0.01)
    assert sched.admission.tenant_inflight_cost("small") == 1.0


def test_tenant_rate_token_bucket_on_the_passed_in_clock() -> None:
    # 10 requests/s with a 0.2 s burst: the bucket holds 2 requests.
    adm = AdmissionConfig(tenants=(TenantConfig("t", rate_per_s=10.0),), rate_burst_s=0.2)
    sched = scheduler(adm)
    sched.add(item("a"), 0.0)
    sched.add(item("b"), 0.0)
    with pytest.raises(ResourceExhausted) as info:
        sched.add(item("c"), 0.0)
    assert info.value.retry_after_s == pytest.approx(0.1)  # one token refills in 1/10 s
    with pytest.raises(ResourceExhausted) as info:
        sched.add(item("c"), 0.04)
    assert info.value.retry_after_s == pytest.approx(0.06)
    sched.add(item("c"), 0.1)
    # Long idle refills only up to the burst, not beyond.
    for i in range(2):
        sched.add(item(f"d{i}"), 10.0)
    with pytest.raises(ResourceExhausted):
        sched.add(item("d2"), 10.0)
    assert sched.stats().drops["rejected"] == 3


def test_default_tenant_quota_applies_to_each_unlisted_tenant_separately() -> None:
    adm = AdmissionConfig(default_tenant=TenantConfig("unlisted", max_concurrent_cost=2.0))
    sched = scheduler(adm)
    for tenant in ("x", "y"):
        sched.add(item(f"{tenant}1", tenant=tenant), 0.0)
        sched.add(item(f"{tenant}2", tenant=tenant), 0.0)
        with pytest.raises(ResourceExhausted):
            sched.add(item(f"{tenant}3", tenant=tenant), 0.0)


def test_a_rejection_for_another_reason_does_not_spend_a_rate_token() -> None:
    adm = AdmissionConfig(max_queued_items=1, tenants=(TenantConfig("t", rate_per_s=1.0),), rate_burst_s=1.0)
    sched = scheduler(adm)
    sched.add(item("other", tenant="u"), 0.0)  # fills the queue
    with pytest.raises(ResourceExhausted) as info:
        sched.add(item("a"), 0.0)
    assert "queue is full" in info.value.message
    drain(sched, 0.0)
    sched.add(item("a"), 0.0)  # the bucket's single token is still there


def test_admission_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_queued_items"):
        AdmissionConfig(max_queued_items=0)
    with pytest.raises(ConfigError, match="tenants"):
        AdmissionConfig(tenants=(TenantConfig("a"), TenantConfig("a")))
