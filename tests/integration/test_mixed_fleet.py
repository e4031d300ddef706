"""A mixed fleet behind the router: two generation replicas and one ranker, real
processes on loopback, under concurrent load.

``recserve generate serve`` x 2 (:class:`~recserve.cluster.generation.GenerationCluster`,
a tiny random-weight decoder) and ``recserve ranker serve`` x 1 on a tiny trained
export over 2 shards. Generation streams go through :class:`~recserve.client.GenerationClient`
and Rank calls through :class:`~recserve.client.RankingClient`: one
:class:`~recserve.routing.Router` class for both, with affinity on ``session_key`` for
the streams and two choices for Rank. Checked (issue 16, "Done when"):

* every request is answered (streams finish with all their tokens, Rank returns every
  candidate);
* a session sticks to its ring owner while that replica is healthy;
* a killed generation replica's breaker opens, its sessions move to the other replica,
  and after a restart its breaker closes and its sessions come back.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from ranker.export import export_models
from ranker.scrubbed import open_scrubbed
from ranker.spec import tables_and_features
from ranker.train import train_all
from recserve.client import GenerationClient, RankingClient
from recserve.cluster import ShardCluster
from recserve.cluster.generation import GenerationCluster
from recserve.cluster.rankers import RankerCluster
from recserve.config.spec import ShardingConfig
from recserve.errors import Unavailable
from recserve.routing import BreakerState, RoutingConfig
from recserve.sharding import plan_tables
from tests.integration.ranker_world import TINY, spec_text
from tests.utils_catalog import make_catalog

ITEMS = 2_000
NEW_TOKENS = 8
GENERATION_SECTION = f"""[generation]
device = "cpu"
n_layers = 1
n_heads = 2
dim = 32
max_seq_len = 256
num_blocks = 64
block_tokens = 16
max_seqs = 8
token_budget = 128
prefill_chunk_tokens = 64
max_new_tokens_cap = {NEW_TOKENS * 8}
stop_token = -1
threads = 1
"""
WAIT_S = 60.0  # guard on event waits only: a hang fails the test instead of stalling it


@dataclasses.dataclass(frozen=True)
class Fleet:
    generators: GenerationCluster
    rankers: RankerCluster


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root: Path = tmp_path_factory.mktemp("mixed-fleet")
    make_catalog(root / "catalog", items=ITEMS, users=200, impressions=4_000, categories=16, tags=64, history_len=12, candidates=128)
    view = open_scrubbed(root / "catalog")
    manifest = export_models(train_all(view, TINY), view, root / "models")
    tables, _ = tables_and_features(manifest)
    plan = plan_tables(list(tables), None, ShardingConfig(num_shards=2, hot_fraction=0.01, warm_fraction=0.1, hot_replicas=2, column_splits=2)).plan
    plan.save(root / "plan.json")
    spec = root / "cluster.toml"
    spec.write_text(spec_text(manifest, root / "models", GENERATION_SECTION))
    with ShardCluster(root / "plan.json", root / "shards", load_from=root / "models") as shards:
        with RankerCluster(spec, root / "models", shards.addresses, num_rankers=1, data_root=root / "rankers") as rankers:
            with GenerationCluster(spec, num_replicas=2, data_root=root / "generation") as generators:
                yield Fleet(generators, rankers)


def sessions_by_owner(client: GenerationClient, per_replica: int) -> dict[str, list[str]]:
    """``per_replica`` session keys owned by each replica on the client's affinity ring."""
    out: dict[str, list[str]] = {a: [] for a in client.addresses}
    k = 0
    while min(len(v) for v in out.values()) < per_replica:
        key = f"user-{k}"
        owner = client.addresses[int(client.router.affinity.owners(key)[0])]
        if len(out[owner]) < per_replica:
            out[owner].append(key)
        k += 1
    return out


async def one_stream(client: GenerationClient, key: str, turn: int) -> tuple[str, int]:
    """One explanation stream; returns (the replica that streamed it, attempts), after
    checking it was answered in full."""
    chunks = [c async for c in client.generate(f"Why item {turn} for {key}? ", max_new_tokens=NEW_TOKENS, session_key=key, timeout_s=30.0)]
    assert [c.index for c in chunks] == list(range(NEW_TOKENS))
    assert sum(c.tokens.shape[0] for c in chunks) == NEW_TOKENS
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert len({c.replica for c in chunks}) == 1
    return chunks[0].replica, chunks[0].attempts


async def one_rank(client: RankingClient, rng: np.random.Generator) -> None:
    candidates = rng.choice(ITEMS, 64, replace=False)
    res = await client.rank(int(rng.integers(0, 200)), candidates, timeout_s=30.0)
    assert sorted(res.item_ids.tolist()) == sorted(candidates.tolist())  # every candidate scored


def test_every_request_is_answered_and_each_session_sticks_to_its_replica(fleet: Fleet) -> None:
    async def go() -> None:
        async with GenerationClient(fleet.generators.addresses, rng=np.random.default_rng(0)) as gen, \
                RankingClient(fleet.rankers.addresses, rng=np.random.default_rng(1)) as rank:  # fmt: skip
            owners = sessions_by_owner(gen, 2)
            homes: dict[str, list[str]] = {key: [] for keys in owners.values() for key in keys}

            async def session(key: str) -> None:
                for turn in range(5):
                    homes[key].append((await one_stream(gen, key, turn))[0])

            async def ranking(seed: int) -> int:
                rng = np.random.default_rng(seed)
                for _ in range(12):
                    await one_rank(rank, rng)
                return 12

            ranked = await asyncio.gather(*(session(k) for k in homes), *(ranking(s) for s in range(2)))
            assert sum(r for r in ranked if r is not None) == 24
            assert {k: len(v) for k, v in homes.items()} == {k: 5 for k in homes}  # every stream answered
            for owner, keys in owners.items():
                for key in keys:
                    assert set(homes[key]) == {owner}, f"session {key} left its healthy owner {owner}: {homes[key]}"
            assert gen.stats.retries == 0 and rank.stats.retries == 0
            assert gen.router.inflight.tolist() == [0.0, 0.0]  # every stream's work was handed back

    asyncio.run(go())


def test_a_killed_generation_replica_opens_its_breaker_its_sessions_move_and_come_back(fleet: Fleet) -> None:
    generators = fleet.generators
    victim, survivor = generators.addresses[1], generators.addresses[0]
    # One failure opens the breaker; a short open period so the restarted replica is
    # probed soon; a deep retry burst so the probes of the dead replica (each retried
    # on the survivor) never run the budget dry during the outage.
    cfg = RoutingConfig(breaker_failures=1, breaker_open_ms=300.0, retry_burst=100.0)

    async def go() -> None:
        async with GenerationClient(generators.addresses, cfg, rng=np.random.default_rng(0)) as gen, \
                RankingClient(fleet.rankers.addresses, rng=np.random.default_rng(1)) as rank:  # fmt: skip
            owners = sessions_by_owner(gen, 2)
            # before -> killing (the kill is under way: streams may meet either state) ->
            # killed (the victim is dead) -> restarting (it may come back at any moment)
            # -> restarted (it is SERVING again).
            phase = {"value": "before"}
            served: list[tuple[str, str, str, int]] = []  # (phase the stream started in, session, replica, attempts)
            broken: list[tuple[str, str, str]] = []  # (phase, session, message) of streams that failed
            stop = asyncio.Event()
            progress = asyncio.Event()  # set after every answered stream: the main task re-checks

            async def session(key: str) -> None:
                turn = 0
                while not stop.is_set():
                    started_in = phase["value"]
                    try:
                        served.append((started_in, key, *await one_stream(gen, key, turn)))
                    except Unavailable as exc:
                        broken.append((started_in, key, exc.message))
                    turn += 1
                    progress.set()

            async def ranking() -> int:
                rng, n = np.random.default_rng(5), 0
                while not stop.is_set():
                    await one_rank(rank, rng)
                    n += 1
                return n

            async def until(condition: Callable[[], bool]) -> None:
                while not condition():
                    for task in (*tasks, rank_task):
                        if task.done():
                            task.result()  # a caller that died: its error, not a 60 s wait
                            raise AssertionError(f"a caller stopped early: {task}")
                    progress.clear()
                    await asyncio.wait_for(progress.wait(), WAIT_S)

            def answered(phase_name: str, keys: list[str], replica: str, n: int) -> bool:
                return all(sum(1 for p, k, r, _ in served if p == phase_name and k == key and r == replica) >= n for key in keys)

            tasks = [asyncio.ensure_future(session(k)) for keys in owners.values() for k in keys]
            rank_task = asyncio.ensure_future(ranking())
            await until(lambda: answered("before", owners[victim], victim, 2) and answered("before", owners[survivor], survivor, 2))

            phase["value"] = "killing"
            await asyncio.to_thread(generators.kill, 1)
            phase["value"] = "killed"
            # The victim's sessions move to the survivor; the survivor's stay put.
            await until(lambda: answered("killed", owners[victim], survivor, 3) and answered("killed", owners[survivor], survivor, 3))
            assert gen.router.state(victim, gen.clock()) is not BreakerState.CLOSED
            assert gen.router.breakers.opened >= 1

            phase["value"] = "restarting"
            await asyncio.to_thread(generators.restart, 1)
            phase["value"] = "restarted"
            # The first victim-session pick after the open period is the probe; once it
            # streams, the breaker is closed and the sessions are home again.
            await until(lambda: answered("restarted", owners[victim], victim, 2))
            assert gen.router.state(victim, gen.clock()) is BreakerState.CLOSED
            stop.set()
            await asyncio.gather(*tasks)
            assert await rank_task > 0  # the ranker served throughout

            # Healthy owners kept their sessions in every phase.
            assert {r for p, k, r, _ in served if k in owners[survivor]} == {survivor}
            # Before the kill the victim's sessions were home; a stream that was still
            # waiting for its first chunk when the victim died was retried on the survivor.
            assert {r for p, k, r, n in served if k in owners[victim] and p == "before" and n == 1} == {victim}
            assert {r for p, k, r, n in served if k in owners[victim] and p == "before" and n > 1} <= {survivor}
            assert {r for p, k, r, _ in served if k in owners[victim] and p == "killed"} == {survivor}
            # Only streams already running on the victim when it died fail (a started
            # stream is not retried: at most one per victim session); every stream
            # started later was answered, on the survivor or, after the restart, at home.
            for p, key, message in broken:
                assert p in ("before", "killing") and key in owners[victim], (p, key, message)
                assert "not retried: the stream had started" in message, message
            assert len(broken) <= len(owners[victim])
            assert gen.router.inflight.tolist() == [0.0, 0.0]

    asyncio.run(go())
