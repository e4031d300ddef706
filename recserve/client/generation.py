"""The Python client of recserve's generation replicas: ``Generate`` as an async stream.

:class:`GenerationClient` routes each ``Generate`` stream over the replica set with the
same :class:`~recserve.routing.Router` the ranker clients use
(:meth:`recserve.client.routed.RoutedCalls.stream`):

* **load**: power of two choices on each replica's active tokens plus KV occupancy,
  divided by its capacity ``weights`` (:class:`~recserve.routing.DecodeLoad`): this
  client's own streams tracked per chunk (a stream starts at ``prompt + max_new_tokens``
  active tokens and moves them to "held" as its chunks arrive), plus what the replica
  reports of everyone else's in each stream's initial metadata
  (``recserve-active-tokens``, ``recserve-kv-occupancy``);
* **affinity**: a ``session_key`` (a user, a conversation) goes to its owner on a
  consistent-hash ring instead, so the session's prefix blocks are found in that
  replica's KV cache again; when the owner's breaker is open the key falls back to the
  next replica clockwise (and returns once it closes);
* **retries**: a retryable status (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) is
  retried on another replica only *before the first chunk arrived*, within the shared
  retry budget; after that the error is raised (a second replica would restart the
  text the caller has partly shown).

Closing the stream (``aclose()``, ``async with contextlib.aclosing(...)``, or leaving an
``async for`` with ``break``, after which the event loop closes the dropped generator)
cancels the RPC, and the server stops the sequence at its next step.

Example::

    async with GenerationClient(["127.0.0.1:7400", "127.0.0.1:7401"]) as client:
        async for chunk in client.generate("Why item 42? ", max_new_tokens=32, session_key="user-7", timeout_s=5.0):
            print(chunk.text, end="")   # chunk.tokens: int32 [n]; chunk.finished on the last one
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from recserve.client.routed import CallStats, RoutedCalls, StubFactory
from recserve.config.spec import TlsConfig
from recserve.errors import InternalError, InvalidArgument
from recserve.routing import DecodeLoad, RoutingConfig
from recserve.rpc.tensors import pack, unpack
from recserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

__all__ = ["GENERATION_SERVICE", "GeneratedChunk", "GenerationClient"]

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# The replica's in-band load report, in every stream's initial metadata (generation/server.py).
ACTIVE_TOKENS_KEY = "recserve-active-tokens"
KV_OCCUPANCY_KEY = "recserve-kv-occupancy"
_INT32 = np.iinfo(np.int32)
_EMPTY = np.zeros(0, dtype=np.int32)
_EMPTY.flags.writeable = False  # shared: read-only like the unpacked views


@dataclasses.dataclass(frozen=True)
class GeneratedChunk:
    """One ``GenerateChunk`` of a stream. ``tokens`` is a read-only view over the
    message's bytes."""

    index: int  # chunk sequence number, from 0
    tokens: np.ndarray  # int32 [n]: the tokens this chunk carries
    text: str  # their text
    finished: bool  # the last chunk of the stream
    finish_reason: str  # on the last chunk: "length", "stop", "cancelled", "deadline"; else ""
    emitted_unix_us: int  # wall clock (unix microseconds) when the server sent it
    replica: str  # the replica streaming it
    attempts: int = 1  # RPCs sent for this stream (1 + retries before the first chunk)


def prompt_tokens_arg(tokens: np.ndarray | Sequence[int]) -> np.ndarray:
    """int32 [T] token ids from the ``prompt_tokens`` argument (the wire's dtype); a
    2-D, float or out-of-int32 array is a caller bug, named here rather than cast. Range
    against the model's vocabulary is the server's check (it knows the vocabulary)."""
    a = np.asarray(tokens)
    if a.ndim != 1:
        raise InvalidArgument(f"prompt_tokens has shape {list(a.shape)}; pass a 1-D array of token ids [T]")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise InvalidArgument(f"prompt_tokens has dtype {a.dtype.name}; pass integer token ids")
    if a.size and (int(a.min()) < _INT32.min or int(a.max()) > _INT32.max):
        bad = int(a[(a < _INT32.min) | (a > _INT32.max)][0])
        raise InvalidArgument(f"prompt_tokens holds {bad}, outside int32; token ids are int32 on the wire")
    return np.ascontiguousarray(a, dtype=np.int32)


class GenerationClient:
    """Async client of the ``recserve.v1.Generation`` replicas (see the module docstring).

    Args:
        addresses: ``host:port`` of each generation replica (distinct).
        config: the routing section of the spec (two choices, breakers, retry budget,
            affinity ring).
        weights: capacity weight per replica (default all 1): a replica of weight 2 is
            drawn twice as often and counts its tokens half.
        clock: monotonic seconds; the timeline of ``deadline`` arguments and of the
            router (a fake clock must tick in seconds).
        rng: random generator for two choices (seed it in tests).
        load: the work signal (:class:`~recserve.routing.DecodeLoad`; give it the
            replicas' ``kv_capacity_tokens`` = num_blocks x block_tokens when not the default).
        stub_factory: address -> stub, replacing the channels (unit tests' fakes).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        config: RoutingConfig = RoutingConfig(),
        *,
        weights: Sequence[float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: np.random.Generator | None = None,
        max_message_bytes: int = 64 << 20,
        load: DecodeLoad = DecodeLoad(),
        stub_factory: StubFactory | None = None,
        tls: TlsConfig | None = None,  # the spec's [tls]: channels over TLS when enabled
        api_key: str = "",  # this client's tenant API key (x-api-key metadata); "" = none
    ) -> None:
        self._calls = RoutedCalls(
            addresses, generation_pb2_grpc.GenerationStub, service=GENERATION_SERVICE, what="generator", config=config,
            weights=weights, rng=rng, clock=clock, max_message_bytes=max_message_bytes, stub_factory=stub_factory, tls=tls, api_key=api_key,
            resolve=False,  # _own_active is indexed by replica: membership stays fixed (gRPC resolves a name itself)
        )  # fmt: skip
        self.router = self._calls.router
        self.addresses = self._calls.addresses
        self.stats: CallStats = self._calls.stats
        self.clock = clock
        self.load = load
        # float [R]: tokens this client's live streams may still compute per replica, as
        # the replicas count them (subtracted from their reports: no double counting).
        self._own_active = np.zeros(len(self.addresses))

    # ---- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Open one channel per replica (inside the running loop; connecting is lazy)."""
        await self._calls.start()

    async def aclose(self) -> None:
        """Close every channel; streams still out end CANCELLED."""
        await self._calls.aclose()

    async def __aenter__(self) -> GenerationClient:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def check_ready(self, timeout_s: float = 1.0) -> dict[str, bool]:
        """address -> whether the replica reports ``recserve.v1.Generation`` SERVING."""
        return await self._calls.check_ready(timeout_s)

    # ---- the stream ---------------------------------------------------------------

    async def generate(
        self,
        prompt: str = "",
        *,
        prompt_tokens: np.ndarray | Sequence[int] | None = None,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        seed: int = 0,
        session_key: str = "",
        timeout_s: float | None = None,
        deadline: float | None = None,
        tenant: str = "default",
        priority: str = "best_effort",
        request_id: str = "",
    ) -> AsyncGenerator[GeneratedChunk, None]:
        """Stream the continuation of ``prompt`` (text) or ``prompt_tokens`` (int32 [T]),
        one :class:`GeneratedChunk` per server chunk, the last with ``finished``.

        The request's fields are checked by the server, which names the bad field and
        value (an empty prompt, both prompts, out-of-vocabulary tokens, a prompt over the
        context, ``max_new_tokens`` <= 0 or over the cap, a negative or NaN
        ``temperature``): this client only refuses what cannot be put on the wire.
        ``session_key``: the affinity key (``""``: none, two choices on load).
        ``timeout_s`` / ``deadline`` (on the client's clock): the earlier bounds the
        whole stream; neither means none. Raises the
        :class:`~recserve.errors.RecserveError` of the server's status.

        Example: ``[c.text async for c in client.generate("hi", max_new_tokens=4)]``.
        """
        tokens = None if prompt_tokens is None else prompt_tokens_arg(prompt_tokens)
        packed = None if tokens is None else pack(tokens)
        deadline_at = self._calls.deadline(timeout_s, deadline)
        # The byte tokenizer's length of a text prompt (its UTF-8 bytes; the server adds
        # no BOS): the client need not import the model's tokenizer to estimate its work.
        prompt_len = int(tokens.shape[0]) if tokens is not None else len(prompt.encode("utf-8"))
        budget = max(0, int(max_new_tokens))
        load = self.load
        generated = 0
        home: str | None = None  # the replica streaming, once its first chunk arrived
        counted = 0  # this stream's share of self._own_active[home]

        def build(header: common_pb2.RequestHeader) -> generation_pb2.GenerateRequest:
            request = generation_pb2.GenerateRequest(
                header=header, prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed
            )
            if packed is not None:
                request.prompt_tokens.CopyFrom(packed)
            return request

        def on_start(replica: str, metadata: Any) -> None:
            nonlocal home, counted
            i = self.router.index(replica)
            # The replica measured its load before admitting this stream, so "ours" is
            # this client's other streams there.
            active, occupancy = _reported(metadata)
            if active is not None:
                self.router.set_reported_load(replica, load.reported(active, occupancy, float(self._own_active[i])))
            home, counted = replica, load.active(prompt_len, budget)
            self._own_active[i] += counted

        def progress(message: Any) -> float:
            nonlocal generated, counted
            chunk: generation_pb2.GenerateChunk = message
            generated += _tokens_in(chunk)
            now_active = 0 if chunk.finished else load.active(prompt_len, budget, generated)
            if home is not None:
                self._own_active[self.router.index(home)] -= counted - now_active
                counted = now_active
            if chunk.finished:
                return 0.0  # nothing left on the replica for this stream
            return load.cost(prompt_len, budget, generated, prefilled=True)

        stream = self._calls.stream(
            "Generate", build, cost=load.cost(prompt_len, budget), deadline=deadline_at, tenant=tenant, priority=priority,
            session_key=session_key, progress=progress, on_start=on_start, request_id=request_id, client="GenerationClient",
        )  # fmt: skip
        try:
            async for message, replica, attempts in stream:
                chunk: generation_pb2.GenerateChunk = message
                try:
                    out = _EMPTY
                    if chunk.HasField("tokens"):
                        out = unpack(chunk.tokens, "GenerateChunk.tokens", expect_dtype=common_pb2.INT32, expect_ndim=1)
                except InvalidArgument as exc:
                    raise InternalError(f"generator {replica}: Generate: malformed chunk {chunk.index}: {exc.message}") from None
                yield GeneratedChunk(
                    index=int(chunk.index), tokens=out, text=chunk.text, finished=bool(chunk.finished),
                    finish_reason=chunk.finish_reason, emitted_unix_us=int(chunk.emitted_unix_us), replica=replica, attempts=attempts,
                )  # fmt: skip
        finally:
            # Closing this generator closes the routed stream now (not at garbage
            # collection), which cancels the RPC.
            await stream.aclose()
            if home is not None:
                self._own_active[self.router.index(home)] -= counted


def _reported(metadata: Any) -> tuple[float | None, float]:
    """(active tokens, KV occupancy) from a stream's initial metadata; (None, 0) when the
    replica reported none (an older server) or a malformed value (no report is better
    than a wrong one)."""
    try:
        get = metadata.get if metadata is not None else None
        active = get(ACTIVE_TOKENS_KEY) if get is not None else None
        occupancy = get(KV_OCCUPANCY_KEY) if get is not None else None
        return (None if active is None else float(active)), (0.0 if occupancy is None else float(occupancy))
    except (TypeError, ValueError):
        return None, 0.0


def _tokens_in(chunk: generation_pb2.GenerateChunk) -> int:
    """Tokens a chunk carries, from its shape (no unpack)."""
    if not chunk.HasField("tokens") or not chunk.tokens.shape:
        return 0
    return int(chunk.tokens.shape[0])
