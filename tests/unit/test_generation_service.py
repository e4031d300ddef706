"""The Generation service's core (generation/service.py) on a real asyncio loop, no
sockets: streams against naive full-recompute decoding (float64), the stop token,
seeded sampling, request validation naming field and value, cancellation stopping the
sequence at the next step and freeing its KV blocks, the deadline ending the stream with
``finish_reason = "deadline"`` (a fake clock), and the load a router reads."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any, Awaitable, Callable

import numpy as np
import pytest

from generation.oracle import generate_recompute
from generation.service import FINISH_DEADLINE, FINISH_LENGTH, FINISH_STOP, GenerationChunk, GenerationCore, LoadedModel, load_model
from generation.types import GenerationRequest
from recserve.config.spec import GenerationServiceConfig
from recserve.errors import InvalidArgument
from recserve.scheduling import DropReason
from tests.generation_utils import one_torch_thread, tiny_config, tiny_model

GUARD_S = 30.0
CFG = tiny_config(num_blocks=64, block_tokens=4, max_seqs=8, token_budget=32, chunk=8, max_seq_len=128)  # float64 weights
SERVICE = GenerationServiceConfig(device="cpu", max_seq_len=128, num_blocks=64, block_tokens=4, max_seqs=8, token_budget=32,
                                  prefill_chunk_tokens=8, max_new_tokens_cap=64, stop_token=-1)  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(test: Callable[[], Awaitable[None]]) -> None:
    """Run ``test`` on a fresh loop; fail, not hang, past GUARD_S."""

    async def guarded() -> None:
        task = asyncio.ensure_future(test())
        done, _ = await asyncio.wait({task}, timeout=GUARD_S)
        if not done:
            raise AssertionError(f"the test did not finish within {GUARD_S:g} s")
        task.result()

    asyncio.run(guarded())


def make_core(config: GenerationServiceConfig = SERVICE, **kwargs: Any) -> GenerationCore:
    return GenerationCore(config, LoadedModel(tiny_model(CFG), "v-test", "test weights"), **kwargs)


async def collect(stream: Any) -> list[GenerationChunk]:
    return [chunk async for chunk in stream]


def tokens_of(chunks: list[GenerationChunk]) -> list[int]:
    return [int(t) for c in chunks for t in c.tokens]


def test_a_stream_equals_full_recompute_one_token_per_chunk() -> None:
    prompt = np.array([5, 200, 17, 99, 3, 140, 66, 12, 250, 8, 31], dtype=np.int64)  # longer than one prefill chunk (8)

    async def body() -> None:
        core = make_core()
        core.start()
        try:
            chunks = await collect(core.submit(core.request(prompt_tokens=prompt, max_new_tokens=20), deadline=math.inf))
        finally:
            await core.aclose()
        want = generate_recompute(tiny_model(CFG), GenerationRequest(prompt, 20)).tolist()
        assert tokens_of(chunks) == want
        assert [c.index for c in chunks] == list(range(20)) and all(c.tokens.shape == (1,) for c in chunks)
        assert [c.finished for c in chunks] == [False] * 19 + [True]
        assert [c.finish_reason for c in chunks] == [""] * 19 + [FINISH_LENGTH]
        # The text is the tokens' UTF-8 bytes, decoded incrementally (specials carry none).
        text_bytes = bytes(t for t in want if t < 256)
        assert "".join(c.text for c in chunks) == text_bytes.decode("utf-8", errors="replace")
        assert core.tokens_generated == 20 and core.load() == (0, 0.0)

    run(body)


def test_a_text_prompt_is_its_utf8_bytes_and_the_stop_token_ends_the_stream() -> None:
    model = tiny_model(CFG)
    prompt = "café: "
    ids = np.frombuffer(prompt.encode(), dtype=np.uint8).astype(np.int64)
    free = generate_recompute(model, GenerationRequest(ids, 12)).tolist()
    stop = free[3]  # the 4th token the model writes: a stop token there ends the stream at it
    first = free.index(stop)

    async def body() -> None:
        core = make_core(GenerationServiceConfig(**{**SERVICE.__dict__, "stop_token": stop}))
        core.start()
        try:
            chunks = await collect(core.submit(core.request(prompt=prompt, max_new_tokens=12)))
        finally:
            await core.aclose()
        assert tokens_of(chunks) == free[: first + 1]
        assert chunks[-1].finished and chunks[-1].finish_reason == FINISH_STOP

    run(body)


def test_sampling_is_repeatable_by_seed_and_differs_across_seeds() -> None:
    prompt = np.arange(40, 52, dtype=np.int64)

    async def body() -> None:
        core = make_core()
        core.start()
        try:
            runs = []
            for seed in (7, 7, 8):
                runs.append(tokens_of(await collect(core.submit(core.request(prompt_tokens=prompt, max_new_tokens=24, temperature=1.5, seed=seed)))))
            greedy = tokens_of(await collect(core.submit(core.request(prompt_tokens=prompt, max_new_tokens=24))))
        finally:
            await core.aclose()
        assert runs[0] == runs[1]
        assert runs[0] != runs[2]
        assert runs[0] != greedy  # temperature is not ignored

    run(body)


LIMIT = CFG.model.max_seq_len  # 128 positions
BAD = [
    ({"prompt": "", "max_new_tokens": 4}, "prompt = ''"),
    ({"prompt": "hi", "prompt_tokens": np.array([1, 2]), "max_new_tokens": 4}, "prompt = 'hi' is invalid together with prompt_tokens (2 tokens)"),
    ({"prompt_tokens": np.array([3, 259, 4]), "max_new_tokens": 4}, "prompt_tokens[1] = 259 is out of range"),
    ({"prompt_tokens": np.array([3, -1]), "max_new_tokens": 4}, "prompt_tokens[1] = -1 is out of range"),
    ({"prompt": "x" * LIMIT, "max_new_tokens": 4}, f"prompt has {LIMIT} tokens, over the context limit"),
    ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens = 0 is invalid"),
    ({"prompt": "x", "max_new_tokens": -3}, "max_new_tokens = -3 is invalid"),
    ({"prompt": "x", "max_new_tokens": 65}, "max_new_tokens = 65 is invalid: use 1..64"),
    ({"prompt": "x" * 100, "max_new_tokens": 40}, "max_new_tokens = 40 is over the context limit"),
    ({"prompt": "x", "max_new_tokens": 4, "temperature": -0.5}, "temperature = -0.5 is invalid"),
    ({"prompt": "x", "max_new_tokens": 4, "temperature": math.nan}, "temperature = nan is invalid"),
    ({"prompt": "x", "max_new_tokens": 4, "temperature": math.inf}, "temperature = inf is invalid"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD, ids=[m.split(" is")[0] for _, m in BAD])
def test_bad_input_names_the_field_and_the_value(kwargs: dict[str, Any], message: str) -> None:
    core = make_core()
    with pytest.raises(InvalidArgument) as err:
        core.request(**kwargs)
    assert message in err.value.message


def test_the_longest_prompt_and_budget_that_fit_are_accepted() -> None:
    core = make_core()
    request = core.request(prompt="x" * (LIMIT - 64), max_new_tokens=64)  # exactly the context, exactly the cap
    assert (request.prompt_len, request.max_new_tokens) == (LIMIT - 64, 64)


def test_closing_the_stream_stops_the_sequence_at_the_next_step_and_frees_its_blocks() -> None:
    async def body() -> None:
        core = make_core()
        core.start()
        try:
            stream = core.submit(core.request(prompt_tokens=np.arange(10, 16, dtype=np.int64), max_new_tokens=60))
            got = [await anext(stream), await anext(stream)]
            await stream.aclose()
            assert core.load()[0] == 0  # its remaining budget left the load at once
        finally:
            await core.aclose()  # waits for the step in flight
        sched, policy = core.loop.scheduler, core.policy
        # Two tokens reached us; the step running when we left may finish, no step after it.
        assert len(got) == 2 and core.engine.steps <= 3
        assert sched.metrics.drops[DropReason.CANCELLED] == 1 and sched.idle
        assert policy.live == 0 and policy.pool.used_count == 0  # every KV block given back

    run(body)


def test_a_deadline_ends_the_stream_with_finish_reason_deadline() -> None:
    clock = FakeClock()

    async def body() -> None:
        core = make_core(clock=clock)
        core.start()
        try:
            stream = core.submit(core.request(prompt_tokens=np.arange(10, 16, dtype=np.int64), max_new_tokens=60), deadline=clock.now + 5.0)
            first = await anext(stream)
            clock.now += 10.0  # past the deadline: the loop drops it before its next step
            rest = await collect(stream)
        finally:
            await core.aclose()
        assert not first.finished
        assert rest and rest[-1].finished and rest[-1].finish_reason == FINISH_DEADLINE and rest[-1].tokens.size == 0
        assert 1 + len(rest) - 1 < 60  # cut short, not run to max_new_tokens
        assert [c.index for c in [first, *rest]] == list(range(1 + len(rest)))
        assert core.loop.scheduler.metrics.drops[DropReason.DEADLINE] == 1 and core.policy.pool.used_count == 0

    run(body)


def test_load_counts_the_tokens_a_live_stream_may_still_compute() -> None:
    async def body() -> None:
        core = make_core()
        core.start()
        try:
            stream = core.submit(core.request(prompt_tokens=np.arange(10, 18, dtype=np.int64), max_new_tokens=30))
            assert core.load()[0] == 8 + 30
            await anext(stream)
            active, occupancy = core.load()
            assert active == 8 + 30 - 1 and occupancy > 0  # its prompt's blocks are held
            rest = await collect(stream)
        finally:
            await core.aclose()
        assert len(rest) == 29 and core.load() == (0, 0.0)

    run(body)


def test_a_stream_closed_before_its_first_chunk_leaves_no_load_and_no_sequence() -> None:
    async def body() -> None:
        core = make_core()
        core.start()
        try:
            stream = core.submit(core.request(prompt_tokens=np.arange(10, 18, dtype=np.int64), max_new_tokens=30))
            assert core.load()[0] == 38
            await stream.aclose()  # never iterated (a servicer that failed before its first read)
            assert core.load()[0] == 0
        finally:
            await core.aclose()
        assert core.loop.scheduler.metrics.drops[DropReason.CANCELLED] == 1 and core.policy.pool.used_count == 0

    run(body)


def test_random_weights_are_seeded_and_named_after_seed_and_shape() -> None:
    a, b = load_model(SERVICE), load_model(SERVICE)
    c = load_model(GenerationServiceConfig(**{**SERVICE.__dict__, "seed": 1}))
    assert a.model_version == b.model_version != c.model_version
    assert all((x == y).all() for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    assert a.model.config.max_seq_len == SERVICE.max_seq_len and a.source == "random seed 0"
