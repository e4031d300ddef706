"""Prefix blocks at the service level: a returning session reuses its blocks on its
replica, and no tenant ever reuses another's.

Two real Generation servers (``generation.server.GenerationServicer`` on grpc.aio,
loopback, free ports) run in this process, each on its own :class:`GenerationCore`
with a tiny random-weight decoder, so the test reads each replica's prefix-cache
counters directly; the :class:`~recserve.client.GenerationClient` in front of them
routes by ``session_key`` over real channels. The tenant travels as the clients send it
(``RequestHeader.tenant``), through the server's header parsing into the prefix-cache
keys (:func:`generation.blocks.prefix_keys`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import numpy as np
import pytest

from generation.server import GENERATION_SERVICE, GenerationServicer
from generation.service import GenerationCore, load_model
from recserve.client import GenerationClient
from recserve.config.spec import GenerationServiceConfig
from recserve.routing import RoutingConfig
from recserve.rpc.serving import Slot
from recserve.rpc.server import make_server
from recserve.v1 import generation_pb2_grpc

BLOCK = 16
TINY = GenerationServiceConfig(
    n_layers=1, n_heads=2, dim=32, max_seq_len=256, device="cpu", num_blocks=64, block_tokens=BLOCK, max_seqs=8,
    token_budget=128, prefill_chunk_tokens=64, max_new_tokens_cap=64, stop_token=-1, threads=1,
)  # fmt: skip
# 57 bytes = 3 full blocks of 16 tokens (the byte tokenizer, no BOS), then a partial one.
SYSTEM = "You are a helpful shopping assistant; explain the picks. "
FULL_BLOCKS = len(SYSTEM.encode()) // BLOCK


def shared_blocks(a: str, b: str) -> int:
    """Full blocks two prompts have in common from their start (the oracle: what a
    prefix cache of the first may give the second, counted without the code under test)."""
    x, y = a.encode(), b.encode()
    n = next((i for i in range(min(len(x), len(y))) if x[i] != y[i]), min(len(x), len(y)))
    return n // BLOCK


class Replica:
    """One in-process Generation server on a free loopback port."""

    def __init__(self) -> None:
        self.core = GenerationCore(TINY, load_model(TINY))
        self.server = make_server(max_message_bytes=64 << 20)
        slot: Slot[GenerationCore] = Slot("generation model")
        slot.value = self.core
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(slot), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def start(self) -> None:
        self.core.start()
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(None)
        await self.core.aclose()

    @property
    def hits(self) -> int:
        return self.core.prefix_hit_blocks()


@contextlib.asynccontextmanager
async def two_replicas() -> AsyncIterator[list[Replica]]:
    """Built inside the running loop (grpc.aio binds a server to the loop that made it)."""
    replicas = [Replica(), Replica()]
    try:
        for r in replicas:
            await r.start()
        yield replicas
    finally:
        for r in replicas:
            await r.stop()


async def text_of(client: GenerationClient, prompt: str, **kw: object) -> tuple[str, str]:
    chunks = [c async for c in client.generate(prompt, max_new_tokens=6, timeout_s=30.0, **kw)]  # type: ignore[arg-type]
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert len({c.replica for c in chunks}) == 1
    return "".join(c.text for c in chunks), chunks[0].replica


def test_a_returning_session_reuses_its_prefix_blocks_and_no_tenant_reuses_anothers() -> None:
    async def body() -> None:
        async with two_replicas() as replicas:
            by_address = {r.address: r for r in replicas}
            async with GenerationClient([r.address for r in replicas], RoutingConfig(), rng=np.random.default_rng(0)) as client:
                assert GENERATION_SERVICE == "recserve.v1.Generation"
                # Turn 1 of a conversation: nothing cached anywhere yet.
                first, home = await text_of(client, SYSTEM + "Item 7?", session_key="conv-1", tenant="acme")
                assert [r.hits for r in replicas] == [0, 0]
                # Turn 2 returns to the same replica (affinity) and finds its prompt's
                # leading blocks there: exactly the system prompt's full blocks.
                assert shared_blocks(SYSTEM + "Item 7?", SYSTEM + "And item 9?") == FULL_BLOCKS == 3
                _, again = await text_of(client, SYSTEM + "And item 9?", session_key="conv-1", tenant="acme")
                assert again == home
                assert by_address[home].hits == FULL_BLOCKS
                other = next(r for r in replicas if r.address != home)
                assert other.hits == 0
                # Another tenant, same session key (so the same replica) and the very same
                # prompt: no block of acme's is reused, and the recomputed K/V gives the
                # same greedy text as acme's first turn (the cache changes cost, not output).
                theirs, where = await text_of(client, SYSTEM + "Item 7?", session_key="conv-1", tenant="globex")
                assert where == home
                assert by_address[home].hits == FULL_BLOCKS
                assert theirs == first
                # globex's own blocks are reused on its return (the whole repeated prompt:
                # 64 bytes, 4 blocks); acme's still are too (its "Item 8?" shares 3).
                repeat = shared_blocks(SYSTEM + "Item 7?", SYSTEM + "Item 7?")
                assert repeat == 4
                await text_of(client, SYSTEM + "Item 7?", session_key="conv-1", tenant="globex")
                assert by_address[home].hits == FULL_BLOCKS + repeat
                await text_of(client, SYSTEM + "Item 8?", session_key="conv-1", tenant="acme")
                assert by_address[home].hits == FULL_BLOCKS + repeat + shared_blocks(SYSTEM + "Item 7?", SYSTEM + "Item 8?")
                assert other.hits == 0

    asyncio.run(body())


def test_without_a_session_key_the_returning_prompt_can_miss_its_replica() -> None:
    """The control for the affinity claim: with no key, two choices spreads the turns, so
    some return to the replica without their blocks (here: the turn counts show it)."""

    async def body() -> None:
        async with two_replicas() as replicas:
            async with GenerationClient([r.address for r in replicas], RoutingConfig(), rng=np.random.default_rng(3)) as client:
                homes = [(await text_of(client, SYSTEM + f"Item {k}?", tenant="acme"))[1] for k in range(12)]
            assert len(set(homes)) == 2  # both replicas served turns of the "same" session
            # Each replica recomputed the system prompt once: 12 turns, only 12 - 2 reused it.
            assert sum(r.hits for r in replicas) == (len(homes) - 2) * FULL_BLOCKS

    asyncio.run(body())
