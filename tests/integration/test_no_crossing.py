"""No answer crosses callers (issue 17; reference §10.11.6's war story: a reply
delivered to the wrong caller after a cancellation).

Two tenants send concurrent traffic with random cancellations while faults make the
dangerous paths run: a delayed shard (so late primary replies arrive after a hedge has
already resolved the window), then a shard SIGKILLed mid-run. Every answer that comes
back is compared with its own caller's oracle, computed outside the code under test:

- lookups: TorchRec's ``EmbeddingBagCollection`` over the source weights, bag by bag
  (a bag the client flagged as degraded holds default rows by contract and is left
  out; the rest must match exactly, sums bit for bit);
- Rank scores: the in-process models holding the exported tables
  (``tests.integration.test_ranking_service.in_process``), for every answer not
  degraded; a degraded answer (rows a killed shard could not serve) must still score
  exactly its own caller's candidates;
- the decode path's prefix cache: two tenants, the same prompts, on the same replica
  (one session key), streams cancelled mid-way; every stream that finishes equals
  greedy full-recompute decoding (:func:`generation.oracle.generate_recompute`).

The checker (:func:`tests.unit.test_no_crossing.mismatches`) is proved able to fail in
its unit tests (a swapped pair of answers is named as a crossing).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from generation.oracle import generate_recompute
from generation.types import GenerationRequest
from recserve.client import GenerationClient
from recserve.cluster.rankers import RankerCluster
from recserve.cluster.shards import ShardCluster
from recserve.config.spec import LookupConfig
from recserve.lookup.client import LookupClient
from recserve.lookup.types import LookupResult
from recserve.routing import RoutingConfig
from recserve.rpc.deadline import make_header
from recserve.v1 import ranking_pb2
from recserve.v1.ranking_pb2_grpc import RankingStub
from tests.integration.ranker_world import RankerWorld, make_ranker_world
from tests.integration.test_ranking_service import in_process, rank_request, scores_by_item
from generation.service import load_model
from tests.integration.test_generation_prefix import SYSTEM, TINY, two_replicas
from tests.integration.lookup_world import Env, lookup_env
from tests.unit.test_lookup_fakes import FEATURES, TABLES, make_config
from tests.unit.test_lookup_oracle import ebc_pooled, make_ebc, random_kjt
from tests.unit.test_no_crossing import mismatches

pytestmark = pytest.mark.integration

TENANTS = ("alpha", "beta")
SLOW, DEAD = 0, 2  # the delayed shard, the killed one
CANCEL_P = 0.3  # the share of callers cancelled at a random moment


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """Three shards of its own: the test kills one and does not bring it back."""
    with lookup_env(tmp_path_factory.mktemp("no-crossing")) as world:
        yield world


def checked_bags(kjt: KeyedJaggedTensor, result: LookupResult | None, want: dict[str, torch.Tensor]) -> tuple[np.ndarray | None, np.ndarray, int]:
    """(got, want, bags) flattened over the bags with no missing row, in key order, for
    one caller (got None: the caller was cancelled). A degraded bag holds default rows
    by contract, so it is left out of both sides; ``bags`` counts those compared."""
    got_parts, want_parts, bags = [], [], 0
    for key in kjt.keys():
        w = want[key].numpy()
        ok = np.ones(w.shape[0], bool)
        if result is not None:
            ok = result.missing_bags.get(key, np.zeros(w.shape[0], np.int64)) == 0
            got_parts.append(result.pooled.to_dict()[key].numpy()[ok] if result.pooled is not None else np.zeros(0))
        want_parts.append(w[ok])
        bags += int(ok.sum())
    if result is None:
        return None, np.concatenate([p.ravel() for p in want_parts]), 0
    return np.concatenate([p.ravel() for p in got_parts]), np.concatenate([p.ravel() for p in want_parts]), bags


def test_two_tenants_lookups_under_cancellation_hedges_and_a_killed_shard_each_get_their_own_rows(env: Env) -> None:
    rng = np.random.default_rng(1717)
    keys = [f.name for f in FEATURES]
    ebc = make_ebc(TABLES, FEATURES, env.weights)
    # One round per phase: two healthy; two with one shard delayed 150 ms, past the hedge
    # delay (its late replies land after a replica's hedge resolved the window); one with
    # a shard killed in the middle of the round; one with it dead. 2 tenants x 8 callers
    # per round.
    phases = ["healthy", "healthy", "slow", "slow", "kill", "dead"]
    per_round = 8
    cfg = make_config(hedge_burst=50.0, lookup=LookupConfig(hedge_budget=0.5))
    inputs: list[KeyedJaggedTensor] = []
    outcomes: list[LookupResult | None] = []
    tenant_of: list[str] = []

    async def one_round(client: LookupClient, phase: str) -> None:
        calls = []
        for tenant in TENANTS:
            for _ in range(per_round):
                kjt = random_kjt(rng, env.plan, env.freq, keys)
                inputs.append(kjt)
                tenant_of.append(tenant)
                calls.append(asyncio.ensure_future(client.lookup(kjt, pooled=True, header=make_header(timeout_s=3.0, tenant=tenant))))
        cancellers = [asyncio.ensure_future(cancel_after(t, float(rng.uniform(0.0, 0.02)))) for t in calls if rng.random() < CANCEL_P]
        if phase == "kill":  # SIGKILL while the round's windows are in flight
            await asyncio.sleep(float(rng.uniform(0.0, 0.01)))
            await asyncio.to_thread(env.cluster.kill, DEAD)
        await asyncio.gather(*cancellers)
        for task in calls:
            try:
                outcomes.append(await task)
            except asyncio.CancelledError:
                outcomes.append(None)

    async def body() -> tuple[int, int]:
        async with LookupClient.connect(cfg, env.plan, env.cluster.addresses) as client:
            for phase in phases:
                if phase == "slow":
                    await asyncio.to_thread(env.cluster.set_fault, SLOW, delay_ms=150.0, methods=["Lookup"])
                elif phase == "kill":
                    await asyncio.to_thread(env.cluster.set_fault, SLOW)
                await one_round(client, phase)
            return client.stats.rpcs_hedge, client.stats.rpc_errors

    hedges, errors = asyncio.run(body())
    got, want, bags = [], [], 0
    for kjt, res in zip(inputs, outcomes):
        g, w, b = checked_bags(kjt, res, ebc_pooled(ebc, kjt))
        got.append(g)
        want.append(w)
        bags += b
    # Sums are exact in fp32 (the same order as TorchRec); the mean feature within 1e-6.
    assert mismatches(got, want, atol=1e-6) == []
    # The premise: every hazard really happened.
    cancelled = sum(r is None for r in outcomes)
    answered = len(outcomes) - cancelled
    assert 1 <= cancelled and answered >= len(outcomes) // 2, (cancelled, answered)
    assert hedges >= 1  # late primaries raced their hedges
    assert errors >= 1  # the killed shard was tried
    assert sum(r is not None and r.degraded for r in outcomes) >= 1  # rows with no live owner
    assert bags >= answered  # most bags compared, not skipped as degraded
    # Both tenants' answers were checked (not one tenant's alone).
    assert {t for t, r in zip(tenant_of, outcomes) if r is not None} == set(TENANTS)


async def cancel_after(task: asyncio.Future[LookupResult], delay_s: float) -> None:
    """Cancel ``task`` after ``delay_s`` (the delay is a random moment in its life, not a
    synchronisation: the check holds whatever it hits — queued, in a window, resolved)."""
    await asyncio.sleep(delay_s)
    task.cancel()


# ---- Rank scores ----------------------------------------------------------------------

RANK_MODELS = ("dlrm", "two_tower")


@dataclasses.dataclass
class Ranked:
    world: RankerWorld
    shards: ShardCluster
    rankers: RankerCluster


@pytest.fixture(scope="module")
def ranked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ranked]:
    """A tiny trained world on 2 shards and 1 ranker of its own (the test kills a shard)."""
    world = make_ranker_world(tmp_path_factory.mktemp("no-crossing-rank"))
    with ShardCluster(world.plan_path, world.root / "shards", load_from=world.models) as shards:
        with RankerCluster(world.spec_path, world.models, shards.addresses, num_rankers=1, data_root=world.root / "rankers") as rankers:
            yield Ranked(world, shards, rankers)


def test_two_tenants_rank_calls_under_cancellation_and_a_killed_shard_each_get_their_own_scores(ranked: Ranked) -> None:
    export = ranked.world.export
    rng = np.random.default_rng(1719)
    per_round = 6
    sent: list[tuple[str, int, np.ndarray]] = []  # (model, user, [C] candidates) per call
    answers: list[ranking_pb2.RankResponse | None] = []

    async def one_round(stub: RankingStub, kill: bool) -> None:
        calls = []
        for tenant in TENANTS:
            for _ in range(per_round):
                model = RANK_MODELS[int(rng.integers(0, len(RANK_MODELS)))]
                user = int(rng.integers(0, export.arrays.num_users))
                items = rng.choice(export.arrays.num_items, 40, replace=False)
                sent.append((model, user, items))
                req = rank_request(user, items, model, timeout_s=10.0)
                req.header.tenant = tenant
                calls.append(stub.Rank(req, timeout=20.0))
        loop = asyncio.get_running_loop()
        for call in calls:
            if rng.random() < CANCEL_P:
                loop.call_later(float(rng.uniform(0.0, 0.02)), call.cancel)
        if kill:  # SIGKILL a shard while the round's lookups are in flight
            await asyncio.to_thread(ranked.shards.kill, 1)
        for call in calls:
            try:
                answers.append(await call)
            except asyncio.CancelledError:
                answers.append(None)
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.CANCELLED, e
                answers.append(None)

    async def body() -> None:
        async with grpc.aio.insecure_channel(ranked.rankers.addresses[0]) as channel:
            stub = RankingStub(channel)
            for kill in (False, True, False):
                await one_round(stub, kill)

    asyncio.run(body())
    # Oracle scores, one in-process forward per model over every call's pairs.
    want_scores: list[np.ndarray] = [np.zeros(0, np.float32)] * len(sent)
    for model in RANK_MODELS:
        idx = [i for i, (m, _, _) in enumerate(sent) if m == model]
        users = np.concatenate([np.full(sent[i][2].shape, sent[i][1]) for i in idx])
        items = np.concatenate([sent[i][2] for i in idx])
        for i, part in zip(idx, np.split(in_process(export, model, export.arrays, users, items), len(idx))):
            want_scores[i] = part
    got_ids, want_ids, got_scores, checked_scores = [], [], [], []
    for (_, _, items), resp, want in zip(sent, answers, want_scores):
        scores = None if resp is None else scores_by_item(resp)
        got_ids.append(None if scores is None else np.sort(np.fromiter(scores, np.int64)))
        want_ids.append(np.sort(items))
        exact = scores is not None and resp is not None and not resp.degraded and scores.keys() == set(items.tolist())
        got_scores.append(np.array([scores[i] for i in items.tolist()], np.float32) if exact and scores is not None else None)
        checked_scores.append(want)
    assert mismatches(got_ids, want_ids) == []  # every answer scores its own caller's candidates
    assert mismatches(got_scores, checked_scores, atol=1e-4) == []  # and, when whole, its own scores
    answered = sum(a is not None for a in answers)
    exact_n = sum(g is not None for g in got_scores)
    assert 1 <= len(answers) - answered and answered >= len(answers) // 2, answered
    assert exact_n >= per_round  # the healthy round's answers were compared score by score
    assert any(a is not None and a.degraded and a.missing_rows > 0 for a in answers)  # the kill bit


# ---- the decode path's prefix cache --------------------------------------------------

PROMPTS = [SYSTEM + "Item 7?", SYSTEM + "And item 9?", SYSTEM + "Item 7?", "Short one."]
NEW_TOKENS = 6


def test_two_tenants_same_prompts_with_cancellations_each_stream_equals_full_recompute() -> None:
    rng = np.random.default_rng(1718)

    async def stream(client: GenerationClient, prompt: str, tenant: str, cancel_at: int) -> tuple[np.ndarray, str]:
        """The stream's tokens and replica; cancelled (its own task) right after chunk
        ``cancel_at`` (-1: never), so the cancellation lands mid-stream on any machine."""
        tokens, replica = [], ""
        async for chunk in client.generate(prompt, max_new_tokens=NEW_TOKENS, timeout_s=30.0, session_key="shared", tenant=tenant):
            tokens.append(np.asarray(chunk.tokens, np.int64))
            replica = chunk.replica
            if chunk.index == cancel_at and not chunk.finished:
                task = asyncio.current_task()
                assert task is not None
                task.cancel()  # raised inside the client's stream at its next await
        return np.concatenate(tokens), replica

    async def body() -> tuple[list[tuple[str, np.ndarray | None, str]], set[str], int]:
        async with two_replicas() as replicas:
            addresses = {r.address for r in replicas}
            out: list[tuple[str, np.ndarray | None, str]] = []
            async with GenerationClient([r.address for r in replicas], RoutingConfig(), rng=np.random.default_rng(0)) as client:
                for _ in range(3):  # rounds: later ones find earlier rounds' blocks cached
                    jobs = [(p, t) for p in PROMPTS for t in TENANTS]
                    cancel_at = [int(rng.integers(0, 2)) if rng.random() < CANCEL_P else -1 for _ in jobs]
                    tasks = [asyncio.ensure_future(stream(client, p, t, c)) for (p, t), c in zip(jobs, cancel_at)]
                    for (prompt, _), task in zip(jobs, tasks):
                        try:
                            tokens, replica = await task
                            out.append((prompt, tokens, replica))
                        except asyncio.CancelledError:
                            out.append((prompt, None, ""))
            hits = sum(r.hits for r in replicas)
        return out, addresses, hits

    out, addresses, hits = asyncio.run(body())
    assert {replica for _, tokens, replica in out if tokens is not None} <= addresses
    # Full recompute of each prompt (the byte tokenizer: its UTF-8 bytes, no BOS) on the
    # same seed's random weights the replicas load, built here apart from any server.
    model = load_model(TINY).model
    oracle: dict[str, np.ndarray] = {}
    got, want = [], []
    for prompt, tokens, replica in out:
        if prompt not in oracle:
            request = GenerationRequest(prompt=np.frombuffer(prompt.encode(), np.uint8).astype(np.int64), max_new_tokens=NEW_TOKENS)
            oracle[prompt] = generate_recompute(model, request)
        got.append(tokens)
        want.append(oracle[prompt])
    assert mismatches(got, want) == []
    cancelled = sum(tokens is None for _, tokens, _ in out)
    assert 1 <= cancelled <= len(out) // 2, cancelled
    assert hits > 0  # the prefix cache really served blocks (else nothing could cross)
    assert len({w.tobytes() for w in oracle.values()}) >= 2  # distinct prompts, distinct answers
