"""The Generation service's core: validated requests in, streamed token chunks out, on
the decode engine and a :class:`~recserve.scheduling.ServingLoop` (docs/architecture.md
§6, "The generation service"). No gRPC here: :mod:`generation.server` is the edge.

- :func:`load_model` — a ``recserve train --lm`` checkpoint (its weights' hash is the
  prefix-cache ``model_version``), or seeded random weights of the ``[generation]``
  shape (``model_version`` ``random-…``, named after seed and shape);
- :meth:`GenerationCore.request` — checks one request, raising InvalidArgument whose
  message names the field and the value: neither or both of ``prompt`` /
  ``prompt_tokens``, a token outside the vocabulary, a prompt over the context limit,
  ``max_new_tokens`` <= 0, over ``max_new_tokens_cap`` or past the context, a negative
  or NaN ``temperature``;
- :meth:`GenerationCore.submit` — admits it now (admission errors raise here, before
  any chunk) and returns a :class:`GenerationStream`: one :class:`GenerationChunk` per
  generated token, the last one ``finished`` with its ``finish_reason``:
  ``"length"`` (``max_new_tokens``), ``"stop"`` (the stop token), ``"deadline"`` (the
  deadline passed: the sequence was dropped before its next step; the final chunk has
  no tokens). Closing or cancelling the stream cancels the sequence: it is in no step
  after the one running, and its KV blocks return when that step completes.

Text: byte tokens decode through one incremental UTF-8 decoder per stream, so a
character split across tokens arrives whole in the chunk of its last byte.

Example::

    core = GenerationCore(GenerationServiceConfig(), load_model(GenerationServiceConfig()))
    core.start()
    stream = core.submit(core.request(prompt="because you liked", max_new_tokens=8), deadline=time.monotonic() + 5)
    async for chunk in stream:
        print(chunk.text, end="")  # chunk.tokens: [1] int64
    await core.aclose()
"""

from __future__ import annotations

import codecs
import concurrent.futures
import dataclasses
import logging
import math
import time
from collections.abc import AsyncGenerator
from typing import Callable

import numpy as np
import torch

from recserve.config.spec import GenerationServiceConfig
from recserve.errors import DeadlineExceeded, InvalidArgument
from recserve.scheduling import ItemStream, ServingLoop

from generation.config import ContinuousBatchConfig, GenerationConfig, KvCacheConfig, ModelConfig
from generation.engine import build
from generation.model import TinyDecoder
from generation.policy import PagedPolicy
from generation.tokenizer import ByteTokenizer
from generation.types import GenerationRequest

log = logging.getLogger(__name__)

FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_DEADLINE = "deadline"
FINISH_CANCELLED = "cancelled"  # in the wire enum; never sent here: a cancelled stream has no one left to send to
LOOP_NAME = "generation"  # the ServingLoop's metrics label (recserve_scheduler_*{loop="generation"})
_EMPTY = np.zeros(0, dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """The weights a core serves, with the ``model_version`` its prefix-cache keys use
    and where they came from (``source``: the checkpoint path, or ``random seed N``)."""

    model: TinyDecoder
    model_version: str
    source: str


def load_model(config: GenerationServiceConfig, checkpoint: str = "") -> LoadedModel:
    """``checkpoint`` (else ``config.checkpoint``): a ``recserve train --lm`` directory;
    none: random weights of the configured shape from ``config.seed`` (std 0.3, so the
    greedy text depends on the prompt, as a test needs)."""
    path = checkpoint or config.checkpoint
    if path:
        from generation.train import load_checkpoint

        model, doc = load_checkpoint(path)
        return LoadedModel(model, str(doc["model_version"]), f"checkpoint {path}")
    shape = ModelConfig(n_layers=config.n_layers, n_heads=config.n_heads, dim=config.dim, max_seq_len=config.max_seq_len)
    torch.manual_seed(config.seed)
    model = TinyDecoder(shape, init_std=0.3).eval()
    version = f"random-s{config.seed}-l{shape.n_layers}h{shape.n_heads}d{shape.dim}t{shape.max_seq_len}"
    return LoadedModel(model, version, f"random seed {config.seed}")


def engine_config(config: GenerationServiceConfig, model: ModelConfig, model_version: str) -> GenerationConfig:
    """The decode engine's config: the model's own shape, the ``[generation]`` pool and batching."""
    kv = KvCacheConfig(num_blocks=config.num_blocks, block_tokens=config.block_tokens, model_version=model_version)
    batching = ContinuousBatchConfig(kv=kv, max_seqs=config.max_seqs, token_budget=config.token_budget,
                                     prefill_chunk_tokens=config.prefill_chunk_tokens)  # fmt: skip
    return GenerationConfig(model=model, batching=batching, device=config.device)


@dataclasses.dataclass(frozen=True, eq=False)
class GenerationChunk:
    """One streamed piece. ``tokens``: [n] int64 generated in this step (n = 1; 0 in a
    final ``"deadline"`` chunk); ``text``: their UTF-8 text (may be "" while a character
    is incomplete); ``finish_reason``: "" until ``finished``."""

    index: int
    tokens: np.ndarray
    text: str
    finished: bool = False
    finish_reason: str = ""


def _short(text: str, limit: int = 40) -> str:
    """``text`` quoted for an error message, cut to ``limit`` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "…")


class GenerationCore:
    """Validates requests and streams them through the decode engine (module doc).

    ``executor``: where decode steps run (default: the loop's own one-thread pool; a
    co-located ranker passes its shared device executor); ``clock``: monotonic seconds."""

    def __init__(
        self,
        config: GenerationServiceConfig,
        loaded: LoadedModel,
        *,
        executor: concurrent.futures.Executor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.model_version = loaded.model_version
        self.source = loaded.source
        if config.threads:
            torch.set_num_threads(config.threads)
        self.engine_config = engine_config(config, loaded.model.config, loaded.model_version)
        scheduler, self.engine = build(self.engine_config, loaded.model)
        self.policy: PagedPolicy = scheduler.policy  # type: ignore[assignment]
        self.loop = ServingLoop(scheduler, self.engine.run_batch, 1, executor, clock=clock, name=LOOP_NAME)
        self.tokenizer = ByteTokenizer()
        self.vocab_size = loaded.model.config.vocab_size
        self.context_limit = loaded.model.config.max_seq_len
        self.stop_token = None if config.stop_token < 0 else config.stop_token
        self.requests = 0
        self.tokens_generated = 0
        self.active_tokens = 0  # the live streams' budgets not yet generated: prompt + max_new_tokens - generated, summed

    def start(self) -> None:
        """Start the serving loop (from inside the running event loop)."""
        self.loop.start()

    async def aclose(self) -> None:
        """Finish the streams in flight, then stop."""
        await self.loop.aclose()

    # ---- requests ----------------------------------------------------------------------

    def request(
        self, *, prompt: str = "", prompt_tokens: np.ndarray | None = None, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
    ) -> GenerationRequest:
        """A checked :class:`GenerationRequest`. ``prompt`` is text (byte-tokenized, no
        BOS: the LM is trained on bare text); ``prompt_tokens`` [T] integer ids, the
        alternative. InvalidArgument naming the field and its value otherwise."""
        tokens = _EMPTY if prompt_tokens is None else np.asarray(prompt_tokens).reshape(-1)
        if prompt and tokens.size:
            raise InvalidArgument(f"prompt = {_short(prompt)} is invalid together with prompt_tokens ({tokens.size:,} tokens): send one of them")
        if not prompt and not tokens.size:
            raise InvalidArgument("prompt = '' is invalid: the request has neither prompt text nor prompt_tokens; send one of them")
        field = "prompt" if prompt else "prompt_tokens"
        if prompt:
            tokens = self.tokenizer.encode(prompt, bos=False)
        else:
            bad = np.flatnonzero((tokens < 0) | (tokens >= self.vocab_size))
            if bad.size:
                i = int(bad[0])
                raise InvalidArgument(f"prompt_tokens[{i}] = {int(tokens[i])} is out of range: token ids are 0..{self.vocab_size - 1} "
                                      f"(the byte vocabulary; {bad.size:,} of {tokens.size:,} ids are outside it)")  # fmt: skip
            tokens = tokens.astype(np.int64)
        n, limit, cap = int(tokens.size), self.context_limit, self.config.max_new_tokens_cap
        if n >= limit:
            raise InvalidArgument(f"{field} has {n:,} tokens, over the context limit: the model holds {limit:,} positions "
                                  f"(prompt + max_new_tokens); send at most {limit - 1:,} prompt tokens")  # fmt: skip
        if not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= cap:
            raise InvalidArgument(f"max_new_tokens = {max_new_tokens!r} is invalid: use 1..{cap:,} (generation.max_new_tokens_cap)")
        if n + max_new_tokens > limit:
            raise InvalidArgument(f"max_new_tokens = {max_new_tokens:,} is over the context limit: the prompt's {n:,} tokens + {max_new_tokens:,} "
                                  f"exceed the model's {limit:,} positions; ask for at most {limit - n:,}")  # fmt: skip
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
            raise InvalidArgument(f"temperature = {temperature!r} is invalid: use a finite value >= 0 (0 = greedy)")
        return GenerationRequest(tokens, max_new_tokens, stop_token=self.stop_token, temperature=float(temperature), seed=int(seed))

    def submit(
        self, request: GenerationRequest, *, deadline: float = math.inf, tenant: str = "default", priority: str = "standard",
        request_id: str | None = None,
    ) -> GenerationStream:
        """Admit ``request`` now (ResourceExhausted, DeadlineExceeded, InvalidArgument for
        a request the KV pool could never hold, Unavailable while closing: raised here)
        and return its stream. ``deadline``: monotonic seconds."""
        items = self.loop.submit_stream(request, cost=float(request.prompt_len), deadline=deadline, tenant=tenant, priority=priority,
                                        request_id=request_id)  # fmt: skip
        self.requests += 1
        return GenerationStream(self, request, items)

    def load(self) -> tuple[int, float]:
        """(active tokens, KV occupancy in [0, 1]): the live streams' budgets not yet
        generated (prompt + max_new_tokens - generated, summed) and how full the KV pool
        is — the load a router compares replicas on."""
        pool = self.policy.pool
        return self.active_tokens, pool.used_count / pool.num_blocks

    def prefix_hit_blocks(self) -> int:
        """Prompt blocks taken from the prefix cache instead of being recomputed, so far."""
        return int(self.policy.prefix_hit_blocks)


class GenerationStream:
    """The chunks of one admitted request (an async iterator). ``aclose()`` (or
    ``cancel()``) cancels the sequence if it is still running."""

    def __init__(self, core: GenerationCore, request: GenerationRequest, items: ItemStream) -> None:
        self._core = core
        self._request = request
        self._items = items
        self._budget = request.prompt_len + request.max_new_tokens
        core.active_tokens += self._budget
        self._chunks = self._run()

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        return await self._chunks.__anext__()

    def cancel(self) -> None:
        self._items.cancel()

    async def aclose(self) -> None:
        self._items.cancel()
        await self._chunks.aclose()
        self._release()  # a stream closed before its first chunk never ran _run's finally

    def _release(self) -> None:
        """Take what is left of this stream's budget out of the core's load (once)."""
        self._core.active_tokens -= self._budget
        self._budget = 0

    async def _run(self) -> AsyncGenerator[GenerationChunk, None]:
        core = self._core
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        index = 0
        try:
            try:
                async for token in self._items:
                    core.tokens_generated += 1
                    core.active_tokens -= 1
                    self._budget -= 1
                    yield GenerationChunk(index, np.array([token], dtype=np.int64), decoder.decode(_text_bytes(token)))
                    index += 1
                generated: np.ndarray = await self._items.result()
            except DeadlineExceeded:
                # Dropped before its next step (or before its first): end the stream
                # cleanly, saying why, with whatever text the decoder still held.
                yield GenerationChunk(index, _EMPTY, decoder.decode(b"", final=True), True, FINISH_DEADLINE)
                return
            last = int(generated[-1])
            core.tokens_generated += 1
            reason = FINISH_STOP if last == self._request.stop_token else FINISH_LENGTH
            yield GenerationChunk(index, generated[-1:].copy(), decoder.decode(_text_bytes(last), final=True), True, reason)
        finally:
            self._items.cancel()  # a consumer that left early (closed, cancelled): the sequence stops; no-op when finished
            self._release()


def _text_bytes(token: int) -> bytes:
    """The UTF-8 byte of a byte token; specials (BOS, EOS, PAD) carry no text."""
    return bytes((token,)) if token < 256 else b""


__all__ = ["FINISH_CANCELLED", "FINISH_DEADLINE", "FINISH_LENGTH", "FINISH_STOP", "GenerationChunk", "GenerationCore", "GenerationStream",
           "LoadedModel", "engine_config", "load_model"]
