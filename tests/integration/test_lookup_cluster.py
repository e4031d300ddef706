"""The lookup client against real shard processes on loopback (RocksDB in a temp dir).

RPC and hedge counts come from the servers' own ShardInfo counters. One cluster of 3
shards serves the whole module; tests that change it (fault, kill, upsert) undo it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recserve.cluster.shards import ShardCluster
from recserve.config.spec import ClusterConfig, LookupConfig, ShardServerConfig
from recserve.lookup.client import LookupClient
from recserve.lookup.config import LookupClientConfig
from recserve.lookup.types import LookupResult
from recserve.sharding.plan import Tier
from recserve.v1 import embedding_pb2, embedding_pb2_grpc
from tests.unit.test_lookup_client import item_kjt, lost_count, lost_mask
from tests.integration.lookup_world import Env, lookup_env
from tests.unit.test_lookup_fakes import FEATURES, TABLES, make_config, make_plan, make_weights, tier_ids
from tests.unit.test_lookup_oracle import ebc_pooled, make_ebc, random_kjt

pytestmark = pytest.mark.integration
T = TypeVar("T")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with lookup_env(tmp_path_factory.mktemp("lookup")) as world:
        yield world


# A small per-RPC id limit, so ordinary windows exceed it (the default is 262,144).
SMALL_MAX_IDS = 32


@pytest.fixture(scope="module")
def small_limit_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """The same plan and weights on shards that accept at most SMALL_MAX_IDS ids per RPC."""
    root: Path = tmp_path_factory.mktemp("lookup-small-rpc")
    plan, freq = make_plan()
    plan.save(root / "plan.json")
    weights = make_weights()
    np.savez(root / "weights.npz", **weights)  # type: ignore[arg-type]
    server = ShardServerConfig(threads=1, row_cache_bytes=1 << 20, max_ids_per_rpc=SMALL_MAX_IDS)
    with ShardCluster(root / "plan.json", root / "data", load_from=root / "weights.npz", server=server, insecure_admin=True) as cluster:
        yield Env(cluster, plan, freq, weights)


def shard_info(env: Env) -> list[embedding_pb2.ShardInfoResponse]:
    out = []
    for address in env.cluster.addresses:
        with grpc.insecure_channel(address) as channel:
            out.append(embedding_pb2_grpc.EmbeddingShardStub(channel).ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=5))
    return out


def rpcs(env: Env) -> np.ndarray:
    return np.array([i.rpcs for i in shard_info(env)])


def with_client(env: Env, body: Callable[[LookupClient], Awaitable[T]], config: LookupClientConfig | None = None, **kw: Any) -> tuple[LookupClient, T]:
    async def go() -> tuple[LookupClient, T]:
        client = LookupClient.connect(config or make_config(), env.plan, env.cluster.addresses, **kw)
        await client.start()
        try:
            return client, await body(client)
        finally:
            await client.aclose()

    return asyncio.run(go())


def kjts(env: Env, n: int, seed: int) -> list[KeyedJaggedTensor]:
    rng = np.random.default_rng(seed)
    keys = [f.name for f in FEATURES]
    return [random_kjt(rng, env.plan, env.freq, keys) for _ in range(n)]


def test_pooled_equals_torchrec_on_real_shards(env: Env) -> None:
    inputs = kjts(env, 16, seed=11)
    before = rpcs(env)
    client, results = with_client(env, lambda c: asyncio.gather(*(c.lookup(k, pooled=True, timeout_s=5) for k in inputs)))
    ebc = make_ebc(TABLES, FEATURES, env.weights)
    for kjt, res in zip(inputs, results):
        assert res.pooled is not None and not res.degraded
        want = ebc_pooled(ebc, kjt)
        got = res.pooled.to_dict()
        for key in ("item_id", "hist_items", "wide_tag"):  # fp32 sum: exact
            assert torch.equal(got[key], want[key]), key
        torch.testing.assert_close(got["user_id"], want["user_id"], rtol=0, atol=1e-6)  # mean
    assert client.stats.dedup_ratio > 1.0
    delta = rpcs(env) - before
    assert (delta > 0).sum() >= 2
    assert delta.sum() == client.stats.rpcs_primary + client.stats.rpcs_hedge


def test_partial_pooling_fp16_and_int8_on_real_shards(env: Env) -> None:
    inputs = kjts(env, 8, seed=12)
    ebc = make_ebc(TABLES, FEATURES, env.weights)
    wants = [ebc_pooled(ebc, k) for k in inputs]
    # Stated tolerances: partial pooling changes summation order (1e-5); fp16 rounds each
    # element to 11 bits; int8 rowwise quantises to 1/255 of each row's range, summed
    # over bags of up to 6 ids of N(0, 1) values (so a few 1e-2 at most).
    # The shards import torch + fbgemm on their first int8 request (seconds here): a long deadline.
    for cfg, atol in ((make_config(partial_pooling=True), 1e-5), (make_config(row_dtype="float16"), 1e-2), (make_config(row_dtype="int8"), 0.2)):
        _, results = with_client(env, lambda c: asyncio.gather(*(c.lookup(k, pooled=True, timeout_s=60) for k in inputs)), cfg)
        for res, want in zip(results, wants):
            assert res.pooled is not None and not res.degraded
            for key, value in want.items():
                torch.testing.assert_close(res.pooled.to_dict()[key], value, rtol=1e-5, atol=atol)


def test_many_concurrent_callers_merge_into_one_rpc_per_shard_per_window(env: Env) -> None:
    inputs = kjts(env, 64, seed=13)
    before = rpcs(env)
    client, results = with_client(env, lambda c: asyncio.gather(*(c.lookup(k, pooled=True, timeout_s=5) for k in inputs)))
    assert len(results) == 64 and not any(r.degraded for r in results)
    s = client.stats
    delta = rpcs(env) - before
    assert delta.sum() == s.rpcs_primary + s.rpcs_hedge  # the servers saw exactly our RPCs
    assert s.windows <= 4  # 64 callers merged into a few windows
    assert s.rpcs_primary <= s.windows * env.plan.num_shards  # one RPC per shard per window
    assert s.ids_requested / s.rpcs_primary > 64  # each RPC carried many callers' ids


def test_one_bad_caller_fails_only_itself(env: Env) -> None:
    good = kjts(env, 6, seed=14)
    bad = KeyedJaggedTensor(keys=["user_id"], values=torch.tensor([3, 500]), lengths=torch.tensor([2]))

    async def body(c: LookupClient) -> list[Any]:
        calls = [c.lookup(k, pooled=True, timeout_s=5) for k in good[:3]] + [c.lookup(bad, pooled=True, timeout_s=5)] + [c.lookup(k, pooled=True, timeout_s=5) for k in good[3:]]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    _, out = with_client(env, body)
    from recserve.errors import InvalidArgument

    assert isinstance(out[3], InvalidArgument) and "id 500 is out of range [0, 500)" in str(out[3])
    ebc = make_ebc(TABLES, FEATURES, env.weights)
    for res, k in zip(out[:3] + out[4:], good):
        assert isinstance(res, LookupResult) and res.pooled is not None and not res.degraded
        assert torch.equal(res.pooled.to_dict()["item_id"], ebc_pooled(ebc, k)["item_id"])


def test_delayed_shard_is_hedged_to_a_replica_within_deadline_and_budget(env: Env) -> None:
    slow = 0
    hot = tier_ids(env.plan, "item", Tier.HOT)
    hot_on_slow = hot[(env.plan.router("item").hot_replicas_of(hot) == slow).any(axis=1)]
    warmup = kjts(env, 12, seed=15)
    # Timing robust on a loaded 2-core CI box: a generous deadline, and an injected delay
    # far beyond it, so only a hedge can deliver the rows in time (the primary cannot
    # answer before the caller's deadline however the machine is loaded).
    deadline_s = 2.0
    delay_ms = 30_000
    burst = 10.0
    cfg = make_config(hedge_burst=burst, lookup=LookupConfig(hedge_budget=0.05))

    async def body(c: LookupClient) -> tuple[list[LookupResult], list[float], int, int]:
        for k in warmup:  # latency samples for every shard
            await c.lookup(k, pooled=True, timeout_s=5)
        # The premise: the shard about to be delayed is healthy, so hot ids are routed to
        # it. On a loaded box one warm-up window can make it read slow by chance (hot
        # routing then avoids it and nothing is ever hedged): warm up until it reads fast.
        # Two late windows in a row eject it for the tracker's slow_ttl_s (1 s) whatever
        # the later samples say, so keep warming up, paced, for several such periods.
        give_up = time.monotonic() + 15.0
        i = 0
        while c.runtime.tracker.slow(c.runtime.clock())[slow] and time.monotonic() < give_up:
            await c.lookup(warmup[i % len(warmup)], pooled=True, timeout_s=5)
            await asyncio.sleep(0.05)
            i += 1
        assert not c.runtime.tracker.slow(c.runtime.clock())[slow]
        # Warm-up windows on a loaded box may be hedged too (first calls pay lazy set-up);
        # the hedges under test start from a full burst, and the budget is checked over them.
        c.runtime.budget.tokens = c.runtime.budget.burst
        base_primary, base_hedge = c.stats.rpcs_primary, c.stats.rpcs_hedge
        before = rpcs(env)
        env.cluster.set_fault(slow, delay_ms=delay_ms, methods=["Lookup"])
        try:
            out, took = [], []
            for i in range(20):
                ids = np.resize(hot_on_slow[i * 3 :], 6)
                t0 = time.monotonic()
                out.append(await c.lookup(item_kjt(ids), pooled=False, timeout_s=deadline_s))
                took.append(time.monotonic() - t0)
        finally:
            env.cluster.set_fault(slow)
        after = rpcs(env)
        sent = int((after - before).sum())
        primaries = c.stats.rpcs_primary - base_primary
        assert c.stats.rpcs_hedge - base_hedge == sent - primaries  # servers agree with the client
        return out, took, sent - primaries, primaries

    client, (results, took, hedges, primaries) = with_client(env, body, cfg)
    assert all(not r.degraded for r in results)  # every hot row came from a replica in time
    assert max(took) < deadline_s + 0.5  # resolved by its deadline (plus wake-up slack), long before the primary's delay
    assert hedges >= 1
    assert hedges <= 0.05 * primaries + burst  # the budget over the hedged phase: 5% of its primaries + a full burst
    assert hedges < 20  # a stuck replica is ejected from hot routing, not hedged around on every window


def test_killed_shard_serves_replicas_and_flags_the_rest(env: Env) -> None:
    dead = 2
    rng = np.random.default_rng(16)
    per_table = {"item": "item_id", "wide": "wide_tag"}
    batches = []
    for _ in range(24):
        t = ("item", "wide")[int(rng.integers(0, 2))]
        ids = np.concatenate([rng.choice(tier_ids(env.plan, t, tier), 4) for tier in (Tier.HOT, Tier.WARM, Tier.COLD)])
        batches.append((t, ids))
    env.cluster.kill(dead)
    try:

        async def body(c: LookupClient) -> list[LookupResult]:
            out: list[LookupResult] = []
            for _ in range(3):  # several windows: failover first, then an open breaker
                out += await asyncio.gather(*(c.lookup(item_kjt(ids, per_table[t]), pooled=False, timeout_s=2) for t, ids in batches))
            return out

        client, results = with_client(env, body)
    finally:
        env.cluster.restart(dead)
    assert len(results) == 3 * len(batches)  # no caller failed
    for i, res in enumerate(results):
        t, ids = batches[i % len(batches)]
        assert res.missing == lost_count(env.plan, t, ids, {dead}), i
        rows = res.rows[per_table[t]].numpy()
        r = env.plan.router(t)
        hot = r.tier_of(ids) == Tier.HOT
        np.testing.assert_array_equal(rows[hot], env.weights[t][ids[hot]])  # replicated: served
    assert sum(r.missing for r in results) > 0


def test_partial_pooling_with_a_killed_slice_shard_leaves_half_arrived_warm_rows_out(env: Env) -> None:
    # Oracle: TorchRec on the source weights with every row that cannot arrive (no live
    # owner: a warm row with a slice on the dead shard, a cold row it owns) set to the
    # default row; partial pooling's stated tolerance.
    dead = 2
    inputs = kjts(env, 12, seed=17)
    table_of = {f.name: f.table for f in FEATURES}
    wide = np.concatenate([k.to_dict()["wide_tag"].values().numpy() for k in inputs])
    half = (env.plan.router("wide").tier_of(wide) == Tier.WARM) & lost_mask(env.plan, "wide", wide, {dead})
    assert half.sum() >= 3  # warm rows with one slice on the dead shard, one on a live shard
    lost = {t.name: lost_mask(env.plan, t.name, np.arange(t.rows), {dead}) for t in TABLES}
    ebc = make_ebc(TABLES, FEATURES, {t: np.where(lost[t][:, None], np.float32(0), w) for t, w in env.weights.items()})
    env.cluster.kill(dead)
    try:
        # A new client: its breakers are closed, so the first window sends to the dead shard.
        client, results = with_client(env, lambda c: asyncio.gather(*(c.lookup(k, pooled=True, timeout_s=5) for k in inputs)), make_config(partial_pooling=True))
    finally:
        env.cluster.restart(dead)
    assert client.stats.rpc_errors >= 1  # the dead shard was tried
    for kjt, res in zip(inputs, results):
        assert res.pooled is not None
        assert res.missing == sum(lost_count(env.plan, table_of[key], jt.values().numpy(), {dead}) for key, jt in kjt.to_dict().items())
        want = ebc_pooled(ebc, kjt)
        for key in kjt.keys():
            torch.testing.assert_close(res.pooled.to_dict()[key], want[key], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("partial", [False, True], ids=["rows", "partial_pooling"])
def test_windows_over_the_shards_max_ids_per_rpc_are_chunked_on_real_shards(small_limit_env: Env, partial: bool) -> None:
    env = small_limit_env
    inputs = kjts(env, 16, seed=18)
    # The client learns the limit from the cluster spec the shards were started with.
    spec = ClusterConfig(tables=TABLES, features=FEATURES, shard_server=env.cluster.server)
    config = LookupClientConfig.from_cluster(spec, partial_pooling=partial)
    assert config.max_ids_per_rpc == SMALL_MAX_IDS
    before = shard_info(env)
    client, results = with_client(env, lambda c: asyncio.gather(*(c.lookup(k, pooled=True, timeout_s=5) for k in inputs)), config)
    after = shard_info(env)
    rpcs_delta = np.array([b.rpcs for b in after]) - np.array([b.rpcs for b in before])
    errors_delta = np.array([b.errors for b in after]) - np.array([b.errors for b in before])
    ids_delta = np.array([b.ids_requested for b in after]) - np.array([b.ids_requested for b in before])
    s = client.stats
    assert errors_delta.sum() == 0 and s.rpc_errors == 0  # no RPC over the limit (RESOURCE_EXHAUSTED)
    assert rpcs_delta.sum() == s.rpcs_primary + s.rpcs_hedge
    assert (rpcs_delta > s.windows).any()  # several RPCs to one shard per window
    assert ids_delta.sum() / rpcs_delta.sum() <= SMALL_MAX_IDS
    ebc = make_ebc(TABLES, FEATURES, env.weights)
    for kjt, res in zip(inputs, results):
        assert res.pooled is not None and not res.degraded
        want = ebc_pooled(ebc, kjt)
        for key in kjt.keys():
            got = res.pooled.to_dict()[key]
            if partial or key == "user_id":  # partial sums / mean: the stated tolerance
                torch.testing.assert_close(got, want[key], rtol=1e-5, atol=1e-5)
            else:  # fp32 sum of rows: exact
                assert torch.equal(got, want[key]), key


def test_hot_upsert_visible_through_near_cache_within_bound(env: Env) -> None:
    staleness_ms = 200.0
    cfg = make_config(lookup=LookupConfig(near_cache_rows=10_000, near_cache_staleness_ms=staleness_ms))
    hot = tier_ids(env.plan, "item", Tier.HOT)
    a_id, b_id = int(hot[0]), int(hot[1])
    old = env.weights["item"][[a_id, b_id]]
    new = np.full((2, 16), 3.5, np.float32)
    skew = [0.0]  # the reader's clock: real time plus a skew the test advances

    async def body(reader: LookupClient) -> dict[str, Any]:
        writer = LookupClient.connect(make_config(), env.plan, env.cluster.addresses)
        await writer.start()
        try:
            seen: dict[str, Any] = {}
            await reader.lookup(item_kjt(np.array([a_id, b_id])), pooled=False, timeout_s=2)  # fills the cache
            await writer.upsert("item", np.array([a_id]), new[:1])  # another writer
            seen["cached"] = (await reader.lookup(item_kjt(np.array([a_id])), pooled=False, timeout_s=2)).rows["item_id"]
            skew[0] += staleness_ms / 1000.0 + 0.001  # the staleness bound has passed
            seen["after_bound"] = (await reader.lookup(item_kjt(np.array([a_id])), pooled=False, timeout_s=2)).rows["item_id"]
            await reader.upsert("item", np.array([b_id]), new[1:])  # through the reader's own path
            seen["own"] = (await reader.lookup(item_kjt(np.array([b_id])), pooled=False, timeout_s=2)).rows["item_id"]
            seen["hit_rate"] = reader.near_cache_hit_rate
        finally:
            await writer.upsert("item", np.array([a_id, b_id]), old)  # restore for other tests
            await writer.aclose()
        return seen

    _, seen = with_client(env, body, cfg, clock=lambda: time.monotonic() + skew[0])
    assert torch.equal(seen["cached"][0], torch.from_numpy(old[0]))  # served from the near cache
    assert torch.equal(seen["after_bound"][0], torch.from_numpy(new[0]))  # visible once the bound passed
    assert torch.equal(seen["own"][0], torch.from_numpy(new[1]))  # own upserts: immediately
    assert seen["hit_rate"] > 0


def test_bench_lookup_runs_end_to_end_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``recserve bench lookup`` at toy scale: real shard processes, every non-Redis mode,
    the open-loop run and the TorchRec check on batches the client actually served."""
    import argparse
    import json

    from recserve.bench import lookup as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        ["--items", "4000", "--dim", "16", "--shards", "2", "--concurrency", "8", "--ids-per-request", "16", "--bags", "4",
         "--seconds", "0.3", "--open-loop-seconds", "0.3", "--rate", "100", "--stream-requests", "3000", "--prebuilt-kjts", "200",
         "--check-requests", "50", "--no-redis", "--workdir", str(tmp_path), "--json",
         "--concurrency-high", "16", "--knee-seconds", "0.2", "--knee-settle-after-fail-s", "0.3", "--unloaded-seconds", "0.3", "--capacity-plot", str(tmp_path / "cap.png")]
    )  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert bench.run(args) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(capsys.readouterr().out)
    rows = report["rows_per_s"]
    assert rows["feature_parallel"] > 0 and rows["naive"] > 0 and rows["torchrec_local"] > 0
    assert rows["redis_mget"] is None and "no-redis" in report["redis_reason"]
    assert report["speedup_vs_naive"] == pytest.approx(rows["feature_parallel"] / rows["naive"])
    assert report["pooled_matches_torchrec"] is True and report["max_abs_err"] == 0.0 and report["checked_requests"] > 0
    assert report["dedup_ratio"] > 1.0
    assert report["open_loop_rate_per_s"] == 100 and report["p50_ms"] is not None and report["open_loop_failures"] == 0
    assert set(report["profile_ms_per_window"]) == {"dedup_route", "serialisation", "rpc", "gather", "pooling"}
    # Equal memory: without Redis the budget is 1.35x the raw rows, and everything recserve
    # caches (DRAM tiers, row and block caches, near cache) fits under it.
    budget = report["memory_budget"]
    assert report["memory_budget_source"].startswith("1.35x") and budget["total_bytes"] == int(1.35 * 4000 * 16 * 4)
    assert 0 < report["recserve_data_bytes"] <= budget["total_bytes"] and report["shard_rss_bytes"] > 0
    assert report["redis_used_memory"] is None and report["speedup_vs_redis_per_request_c64"] is None
    # C=64 in interleaved rounds (default 3): the client's figure is the rounds' median.
    rounds = report["c64_rounds"]
    assert len(rounds) == 3 and all(r["feature_parallel"] > 0 and r["redis_mget"] is None for r in rounds)
    assert rows["feature_parallel"] == sorted(r["feature_parallel"] for r in rounds)[1]
    assert report["speedup_vs_redis_per_request_c64_spread"] is None and report["redis_window_requests"] is None
    assert report["rows_per_s_c_high"]["feature_parallel"] > 0
    # The bare ceiling runs in the same rounds, and really pools the rows it is timed for.
    assert all(r["bare_ceiling"] > 0 for r in rounds) and report["bare_matches_oracle"] is True
    assert rows["bare_ceiling"] == sorted(r["bare_ceiling"] for r in rounds)[1]
    assert report["client_vs_bare_c64"] == pytest.approx(sorted(r["feature_parallel"] / r["bare_ceiling"] for r in rounds)[1])
    assert report["bare_vs_redis_per_request_c64"] is None  # no Redis in this run
    assert report["bare_unloaded_p50_ms"] > 0 and report["bare_knee_ratio_vs_redis"] is None
    # Capacity: both knees found by the shared knee finder, their ratio reported.
    knees = report["knees"]
    assert set(knees) == {"feature_parallel", "naive", "bare_ceiling"} and all(k["probes"] and k["curve"] for k in knees.values())
    if knees["bare_ceiling"]["knee_per_s"] and knees["feature_parallel"]["knee_per_s"]:
        assert report["knee_ratio_vs_bare"] == pytest.approx(knees["feature_parallel"]["knee_per_s"] / knees["bare_ceiling"]["knee_per_s"])
    assert report["config"]["knee_settle_after_fail_s"] == 0.3
    if knees["naive"]["knee_per_s"] and knees["feature_parallel"]["knee_per_s"]:
        assert report["knee_ratio_vs_naive"] == pytest.approx(knees["feature_parallel"]["knee_per_s"] / knees["naive"]["knee_per_s"])
    assert report["knee_ratio_vs_redis"] is None
    assert report["unloaded_rate_per_s"] == 25.0 and report["unloaded_p50_ms"] is not None
    assert report["tiered_rows_per_s"] > 0 and report["equal_memory_vs_tiered"] == pytest.approx(rows["feature_parallel"] / report["tiered_rows_per_s"])
    assert report["tiered"]["tiers"][0]["cold_ids"] > 0  # the tiered run really reads RocksDB
    assert (tmp_path / "cap.png").stat().st_size > 1000
