"""One retry budget for retries and hedges; retry only retryable statuses (pure)."""

from __future__ import annotations

import grpc
import pytest

from recserve.errors import ConfigError
from recserve.routing import HedgeBudget, RetryBudget, is_retryable
from recserve.rpc.status import RETRYABLE_CODES


def test_a_retry_storm_spends_at_most_ratio_times_primaries_plus_burst() -> None:
    # Every call fails with UNAVAILABLE and every failure asks to retry (retries fail
    # too and ask again): the budget alone bounds the extra calls.
    budget = RetryBudget(0.1, burst=5)
    primaries, extra = 2000, 0
    for _ in range(primaries):
        budget.on_primary()
        while budget.try_retry(grpc.StatusCode.UNAVAILABLE):
            extra += 1
    assert extra <= 0.1 * primaries + 5
    assert extra >= 0.1 * primaries - 1  # and the budget is actually there to spend
    assert budget.spent == extra and budget.extra_ratio == pytest.approx(extra / primaries)
    assert budget.denied == primaries  # each call's last retry request was refused


def test_retries_and_hedges_share_one_budget() -> None:
    budget = RetryBudget(0.1, burst=2)
    assert budget.try_spend() and budget.try_retry(grpc.StatusCode.DEADLINE_EXCEEDED)
    assert not budget.try_spend() and not budget.try_retry(grpc.StatusCode.RESOURCE_EXHAUSTED)
    budget.on_primary(10)  # ten primaries earn one call
    assert budget.try_spend() and not budget.try_retry(grpc.StatusCode.UNAVAILABLE)


def test_non_retryable_statuses_are_never_retried_and_cost_nothing() -> None:
    budget = RetryBudget(0.1, burst=10)
    final = [c for c in grpc.StatusCode if c not in RETRYABLE_CODES]
    assert grpc.StatusCode.INVALID_ARGUMENT in final and grpc.StatusCode.OK in final
    for code in [*final, None]:
        assert not is_retryable(code)
        assert not budget.try_retry(code), code
    assert budget.tokens == 10 and budget.spent == 0 and budget.not_retryable == len(final) + 1
    for code in RETRYABLE_CODES:
        assert is_retryable(code) and budget.try_retry(code)


def test_hedge_budget_is_the_same_bucket_for_the_lookup_client() -> None:
    assert HedgeBudget is RetryBudget
    assert RetryBudget().ratio == 0.1  # the 10 % default
    with pytest.raises(ConfigError, match=r"retry_budget.ratio = 1.5"):
        RetryBudget(1.5, burst=1)
    with pytest.raises(ConfigError, match=r"retry_budget.burst = -1"):
        RetryBudget(0.1, burst=-1)
