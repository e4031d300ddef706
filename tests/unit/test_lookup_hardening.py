"""Issue 8 hardening of the lookup client, over the in-process fake fleet: deadline
arguments, chunking to the shards' ``max_ids_per_rpc``, shard errors in the one error
hierarchy, and callers resolved through the scheduler (one result channel)."""

from __future__ import annotations

import asyncio
import collections
import math

import grpc
import numpy as np
import pytest
import torch

from recserve.config.spec import ClusterConfig, LookupConfig, ShardServerConfig
from recserve.errors import DeadlineExceeded, InternalError, InvalidArgument, RecserveError, ResourceExhausted, Unavailable
from recserve.lookup.client import LookupClient
from recserve.lookup.config import LookupClientConfig
from recserve.lookup.transport import GrpcShardTransport, shard_call_error
from recserve.lookup.types import LookupResult
from recserve.rpc.status import grpc_code
from recserve.sharding.plan import Tier
from recserve.v1 import embedding_pb2
from tests.unit.test_lookup_client import item_kjt, run
from tests.unit.test_lookup_fakes import FEATURES, TABLES, FakeShards, make_config, make_plan, make_weights, tier_ids
from tests.unit.test_lookup_oracle import ebc_pooled, make_ebc, random_kjt

# ---- deadline arguments ------------------------------------------------------------------


def test_a_nan_timeout_or_deadline_is_rejected_and_edge_timeouts_behave_as_stated() -> None:
    plan, _ = make_plan()
    weights = make_weights()
    fake = FakeShards(plan, weights)
    client = LookupClient(make_config(), plan, fake)
    kjt = item_kjt(np.array([1, 2, 2]))
    cases = {
        "nan timeout": {"timeout_s": math.nan},
        "nan deadline": {"deadline": math.nan},
        "negative timeout": {"timeout_s": -0.5},
        "-inf timeout": {"timeout_s": -math.inf},
    }

    async def body() -> tuple[dict[str, BaseException | LookupResult], int, LookupResult]:
        out: dict[str, BaseException | LookupResult] = {}
        for label, kw in cases.items():
            try:
                out[label] = await client.lookup(kjt, pooled=True, **kw)  # type: ignore[arg-type]
            except RecserveError as e:
                out[label] = e
        rpcs_before = fake.rpcs()
        no_deadline = await client.lookup(kjt, pooled=True, timeout_s=math.inf)
        return out, rpcs_before, no_deadline

    out, rpcs_before, no_deadline = run(client, body)
    assert isinstance(out["nan timeout"], InvalidArgument) and "timeout_s = nan" in str(out["nan timeout"])
    assert isinstance(out["nan deadline"], InvalidArgument) and "deadline = nan" in str(out["nan deadline"])
    # A timeout already spent is a deadline in the past, as for a header's deadline.
    assert isinstance(out["negative timeout"], DeadlineExceeded)
    assert isinstance(out["-inf timeout"], DeadlineExceeded)
    assert rpcs_before == 0  # none of them reached a shard
    # +inf is no deadline (like None): served in full.
    assert not no_deadline.degraded and no_deadline.pooled is not None
    assert torch.equal(no_deadline.pooled["item_id"], torch.from_numpy(weights["item"][[1, 2, 2]].sum(axis=0, keepdims=True)))


# ---- chunking ------------------------------------------------------------------------------


def test_the_client_takes_max_ids_per_rpc_from_the_cluster_spec() -> None:
    cluster = ClusterConfig(tables=TABLES, features=FEATURES, shard_server=ShardServerConfig(max_ids_per_rpc=777))
    assert LookupClientConfig.from_cluster(cluster).max_ids_per_rpc == 777
    assert LookupClientConfig.from_cluster(cluster, max_ids_per_rpc=5).max_ids_per_rpc == 5
    with pytest.raises(InvalidArgument, match="lookup_client.max_ids_per_rpc = 0"):
        make_config(max_ids_per_rpc=0)


@pytest.mark.parametrize("partial", [False, True], ids=["rows", "partial_pooling"])
def test_a_window_over_max_ids_per_rpc_succeeds_in_several_rpcs(partial: bool) -> None:
    plan, freq = make_plan()
    weights = make_weights()
    fake = FakeShards(plan, weights)
    limit = 40
    fake.set_max_ids(limit)  # the shards answer RESOURCE_EXHAUSTED above it, as real ones do
    client = LookupClient(make_config(max_ids_per_rpc=limit, partial_pooling=partial), plan, fake)
    rng = np.random.default_rng(21)
    keys = [f.name for f in FEATURES]
    kjts = [random_kjt(rng, plan, freq, keys, max_len=12) for _ in range(8)]
    # Partial pooling needs every caller pooled; otherwise mix in unpooled callers.
    pooled = [partial or i % 2 == 0 for i in range(len(kjts))]

    async def body() -> list[LookupResult]:
        return list(await asyncio.gather(*(client.lookup(k, pooled=p, timeout_s=5.0) for k, p in zip(kjts, pooled))))

    results = run(client, body)
    assert client.stats.windows == 1
    per_shard = collections.Counter(c.shard for c in fake.calls)
    assert max(per_shard.values()) >= 3  # one window, several RPCs to one shard
    assert max(c.n_ids for c in fake.calls) <= limit
    assert client.stats.rpc_errors == 0 and client.stats.rpcs_hedge == 0
    assert all(c.request.pooled == partial for c in fake.calls)
    ebc = make_ebc(TABLES, FEATURES, weights)
    table_of = {f.name: f.table for f in FEATURES}
    for kjt, res, p in zip(kjts, results, pooled):
        assert not res.degraded
        if not p:
            for key, jt in kjt.to_dict().items():
                assert torch.equal(res.rows[key], torch.from_numpy(weights[table_of[key]][jt.values().numpy()]))
            continue
        assert res.pooled is not None
        want = ebc_pooled(ebc, kjt)
        for key in kjt.keys():
            got = res.pooled.to_dict()[key]
            if partial or key == "user_id":  # summation order changes / mean: the stated tolerance
                torch.testing.assert_close(got, want[key], rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(got, want[key]), key


@pytest.mark.parametrize("partial", [False, True], ids=["rows", "partial_pooling"])
def test_hedges_of_a_late_shard_are_chunked_to_max_ids_per_rpc(partial: bool) -> None:
    plan, _ = make_plan()
    weights = make_weights()
    fake = FakeShards(plan, weights)
    limit = 8
    fake.set_max_ids(limit)
    client = LookupClient(make_config(max_ids_per_rpc=limit, partial_pooling=partial, hedge_burst=100.0), plan, fake)
    late = 0
    hot = tier_ids(plan, "item", Tier.HOT)
    hot_on_late = hot[(plan.router("item").hot_replicas_of(hot) == late).any(axis=1)][:40]
    assert hot_on_late.size == 40

    async def body() -> LookupResult:
        fake.set_blocked(late)  # only hedges to the other replicas can deliver its rows
        try:
            return await client.lookup(item_kjt(hot_on_late), pooled=partial, timeout_s=5.0)
        finally:
            fake.release(late)

    result = run(client, body)
    assert not result.degraded
    if partial:
        assert result.pooled is not None
        want = torch.from_numpy(weights["item"][hot_on_late].sum(axis=0, keepdims=True))
        torch.testing.assert_close(result.pooled["item_id"], want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(result.rows["item_id"], torch.from_numpy(weights["item"][hot_on_late]))
    hedges = [c for c in fake.calls if c.shard != late][-client.stats.rpcs_hedge :]
    assert client.stats.rpcs_hedge >= 2  # the late shard's rows took more than one hedge RPC
    assert max(c.n_ids for c in fake.calls) <= limit
    assert not any(c.request.pooled for c in hedges)  # hedges ask for rows, also in partial mode
    assert client.stats.rpc_errors == 0


# ---- shard errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.UNKNOWN, InternalError),  # no kind of its own: INTERNAL, not retried
    ],
)
def test_shard_call_failures_are_recserve_errors_of_their_status(code: grpc.StatusCode, kind: type[RecserveError]) -> None:
    err = shard_call_error(3, code, "details here")
    assert type(err) is kind
    assert str(err) == f"shard 3: {code.name}: details here"
    if kind is not InternalError:
        assert grpc_code(err) == code  # crosses the hop unchanged


def test_the_grpc_transport_raises_recserve_errors() -> None:
    transport = GrpcShardTransport(["127.0.0.1:1"])  # never dialled: the shard index is checked first
    with pytest.raises(InvalidArgument, match="shard 5: INVALID_ARGUMENT: no address for shard 5"):
        asyncio.run(transport.lookup(5, embedding_pb2.LookupRequest(), 1.0))


# ---- one result channel -------------------------------------------------------------------


def test_callers_resolve_through_the_scheduler_while_their_window_still_runs() -> None:
    plan, _ = make_plan()
    weights = make_weights()
    fake = FakeShards(plan, weights)
    client = LookupClient(make_config(), plan, fake)
    cold = tier_ids(plan, "item", Tier.COLD)
    owner = plan.router("item").cold_owners_of(cold)[:, 0]
    fast_ids, slow_ids = cold[owner == 0][:4], cold[owner == 2][:4]

    async def body() -> tuple[int, int, LookupResult, LookupResult]:
        fake.set_blocked(2)
        fast = asyncio.ensure_future(client.lookup(item_kjt(fast_ids), pooled=False, timeout_s=5.0))
        slow = asyncio.ensure_future(client.lookup(item_kjt(slow_ids), pooled=False, timeout_s=5.0))
        fast_result = await fast
        # The window still waits on shard 2, but the scheduler has already finished the
        # fast caller: resolved early through it, not at the window's end.
        completed_early = client.scheduler.stats().completed
        running = client.scheduler.stats().inflight_batches
        fake.release(2)
        return completed_early, running, fast_result, await slow

    completed_early, running, fast, slow = run(client, body)
    assert client.stats.windows == 1
    assert running == 1 and completed_early == 1
    stats = client.scheduler.stats()
    assert stats.completed == 2 and stats.failed == 0  # each counted once, none failed by the window's end
    assert stats.latency_s.count == 2
    assert torch.equal(fast.rows["item_id"], torch.from_numpy(weights["item"][fast_ids]))
    assert torch.equal(slow.rows["item_id"], torch.from_numpy(weights["item"][slow_ids]))
