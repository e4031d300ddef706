"""The edge between the lookup client and the shard servers: async unary RPCs.

:class:`ShardTransport` is what the client calls; :class:`GrpcShardTransport` is the
real one (one grpc.aio channel per shard, message limits raised, gRPC's own retries
off because the client hedges and fails over itself). Every failure surfaces as the
:class:`~recserve.errors.RecserveError` of the shard's status (through the one mapping,
:func:`recserve.rpc.status.error_from_code`; codes without a kind are INTERNAL), so
the client asks ``is_retryable(grpc_code(error))`` before it hedges or retries, and a
status crosses the hop unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any, Protocol

import grpc

from recserve.config.spec import LookupConfig
from recserve.errors import RecserveError
from recserve.rpc.status import error_from_code
from recserve.v1 import embedding_pb2, embedding_pb2_grpc


def shard_call_error(shard: int, code: grpc.StatusCode, details: str) -> RecserveError:
    """The error of a failed shard RPC: the RecserveError of ``code``'s kind, its
    message naming the shard and the status ("shard 2: UNAVAILABLE: connection refused")."""
    return error_from_code(code, f"shard {shard}: {code.name}: {details}")


class ShardTransport(Protocol):
    """Async RPCs to shard ``k`` (``0 <= k < num_shards``); failures raise the
    :func:`shard_call_error` of their status."""

    @property
    def num_shards(self) -> int: ...

    async def lookup(self, shard: int, request: embedding_pb2.LookupRequest, timeout_s: float) -> embedding_pb2.LookupResponse: ...

    def start_lookup(self, shard: int, request: embedding_pb2.LookupRequest, timeout_s: float) -> Coroutine[Any, Any, embedding_pb2.LookupResponse]:
        """:meth:`lookup`, its RPC started before this returns (the request goes out at
        the event loop's next turn); await the coroutine (or make it a task) for the reply."""
        ...

    async def upsert(self, shard: int, request: embedding_pb2.UpsertRequest, timeout_s: float,
                     metadata: Sequence[tuple[str, str]] = ()) -> embedding_pb2.UpsertResponse: ...  # fmt: skip

    async def get_plan(self, shard: int, timeout_s: float) -> embedding_pb2.GetPlanResponse: ...

    async def shard_info(self, shard: int, timeout_s: float) -> embedding_pb2.ShardInfoResponse: ...

    async def close(self) -> None: ...


def channel_options(max_message_bytes: int, *, max_frame_bytes: int = 0) -> list[tuple[str, int]]:
    """Client channel options: raised message limits, no transparent retries (the
    client hedges itself), short reconnect backoff so a restarted shard is back fast;
    ``max_frame_bytes`` > 0 raises the HTTP/2 frame size (fewer frames per reply)."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_retries", 0),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    if max_frame_bytes:
        options.append(("grpc.http2.max_frame_size", max_frame_bytes))
    return options


# Every variable transport_env may set. A launcher given transport settings drops these
# from the environment its children inherit: "" / 0 (gRPC's / glibc's default) must not
# turn into whatever the launching process happens to export.
TRANSPORT_ENV_KEYS = ("GRPC_EXPERIMENTS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def transport_env(lookup: LookupConfig) -> dict[str, str]:
    """Process-start environment of the lookup path's transport settings, for the
    launcher to pass to each shard (gRPC reads ``GRPC_EXPERIMENTS`` and glibc its
    ``MALLOC_*`` thresholds only when a process starts). Empty for the defaults.

    Example: ``grpc_experiments="-event_engine_client"`` -> ``{"GRPC_EXPERIMENTS": "-event_engine_client"}``.
    """
    env: dict[str, str] = {}
    if lookup.grpc_experiments:
        env["GRPC_EXPERIMENTS"] = lookup.grpc_experiments
    if lookup.shard_malloc_mmap_threshold_bytes:
        # Replies of 150-250 kB are above glibc's default mmap threshold: each one is
        # mmapped and page-faulted afresh. A higher threshold keeps them on the heap, and
        # an equal trim threshold stops the heap from being handed back after each.
        env["MALLOC_MMAP_THRESHOLD_"] = str(lookup.shard_malloc_mmap_threshold_bytes)
        env["MALLOC_TRIM_THRESHOLD_"] = str(lookup.shard_malloc_mmap_threshold_bytes)
    return env


class GrpcShardTransport:
    """One grpc.aio channel per shard address. Channels are created on first use, inside
    the running event loop (grpc.aio binds a channel to the loop that made it)."""

    def __init__(self, addresses: Sequence[str], *, max_message_bytes: int = 256 << 20, max_frame_bytes: int = 0) -> None:
        self.addresses = list(addresses)
        self._options = channel_options(max_message_bytes, max_frame_bytes=max_frame_bytes)
        self._channels: list[grpc.aio.Channel | None] = [None] * len(self.addresses)
        self._stubs: list[embedding_pb2_grpc.EmbeddingShardStub | None] = [None] * len(self.addresses)

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    def _stub(self, shard: int) -> embedding_pb2_grpc.EmbeddingShardStub:
        stub = self._stubs[shard]
        if stub is None:
            channel = grpc.aio.insecure_channel(self.addresses[shard], options=self._options)
            self._channels[shard] = channel
            stub = embedding_pb2_grpc.EmbeddingShardStub(channel)
            self._stubs[shard] = stub
        return stub

    async def _call(self, shard: int, method: str, request: object, timeout_s: float, metadata: Sequence[tuple[str, str]] = ()) -> object:
        if not 0 <= shard < len(self.addresses):
            raise shard_call_error(shard, grpc.StatusCode.INVALID_ARGUMENT, f"no address for shard {shard} ({len(self.addresses)} known)")
        try:
            return await getattr(self._stub(shard), method)(request, timeout=max(timeout_s, 1e-3), metadata=tuple(metadata) or None)
        except grpc.aio.AioRpcError as e:
            raise shard_call_error(shard, e.code(), e.details() or "") from None
        except asyncio.TimeoutError:
            raise shard_call_error(shard, grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s * 1000:.1f} ms") from None

    async def lookup(self, shard: int, request: embedding_pb2.LookupRequest, timeout_s: float) -> embedding_pb2.LookupResponse:
        return await self.start_lookup(shard, request, timeout_s)

    def start_lookup(self, shard: int, request: embedding_pb2.LookupRequest, timeout_s: float) -> Coroutine[Any, Any, embedding_pb2.LookupResponse]:
        """Start the Lookup RPC now and return the awaitable of its reply. grpc.aio
        schedules the call's send as it is created, so a window's RPCs leave at the event
        loop's next turn; through a task of our own (``lookup``) each waited one more
        turn behind the window's remaining work, ~1 ms in the closed loop (issue 9)."""
        if not 0 <= shard < len(self.addresses):
            return self._raise(shard_call_error(shard, grpc.StatusCode.INVALID_ARGUMENT, f"no address for shard {shard} ({len(self.addresses)} known)"))
        try:
            call = self._stub(shard).Lookup(request, timeout=max(timeout_s, 1e-3))
        except Exception as e:  # e.g. a closed channel: this call fails, as it would inside a task
            return self._raise(e)
        return self._reply(shard, call, timeout_s)

    @staticmethod
    async def _raise(error: BaseException) -> Any:
        raise error

    async def _reply(self, shard: int, call: Awaitable[embedding_pb2.LookupResponse], timeout_s: float) -> embedding_pb2.LookupResponse:
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            raise shard_call_error(shard, e.code(), e.details() or "") from None
        except asyncio.TimeoutError:
            raise shard_call_error(shard, grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s * 1000:.1f} ms") from None

    async def upsert(self, shard: int, request: embedding_pb2.UpsertRequest, timeout_s: float,
                     metadata: Sequence[tuple[str, str]] = ()) -> embedding_pb2.UpsertResponse:  # fmt: skip
        """``metadata``: the admin token's ``authorization`` (:func:`recserve.rpc.auth.admin_metadata`)."""
        return await self._call(shard, "Upsert", request, timeout_s, metadata)  # type: ignore[return-value]

    async def get_plan(self, shard: int, timeout_s: float) -> embedding_pb2.GetPlanResponse:
        return await self._call(shard, "GetPlan", embedding_pb2.GetPlanRequest(), timeout_s)  # type: ignore[return-value]

    async def shard_info(self, shard: int, timeout_s: float) -> embedding_pb2.ShardInfoResponse:
        return await self._call(shard, "ShardInfo", embedding_pb2.ShardInfoRequest(), timeout_s)  # type: ignore[return-value]

    async def close(self) -> None:
        channels = [c for c in self._channels if c is not None]
        self._channels = [None] * len(self.addresses)
        self._stubs = [None] * len(self.addresses)
        for c in channels:
            await c.close(None)
