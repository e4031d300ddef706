"""GrpcShardTransport.start_lookup over a real gRPC server on loopback (issue 9): the RPC
starts when the call is made, before anything awaits it (a window's requests leave at
the event loop's next turn, not behind the window's remaining work), and its failures
surface as the shard's status, as ``lookup``'s do."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from recserve.errors import InvalidArgument, RecserveError, ResourceExhausted
from recserve.lookup.transport import GrpcShardTransport
from recserve.rpc.status import grpc_code
from recserve.v1 import embedding_pb2, embedding_pb2_grpc


class _Shard(embedding_pb2_grpc.EmbeddingShardServicer):
    """Answers Lookup with its plan version; counts arrivals; can refuse."""

    def __init__(self) -> None:
        self.arrived = asyncio.Event()
        self.requests = 0
        self.refuse = False

    async def Lookup(self, request: embedding_pb2.LookupRequest, context: grpc.aio.ServicerContext) -> embedding_pb2.LookupResponse:
        self.requests += 1
        self.arrived.set()
        if self.refuse:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many ids")
        return embedding_pb2.LookupResponse(plan_version=7 + request.plan_version)


async def _serve() -> tuple[grpc.aio.Server, _Shard, str]:
    server = grpc.aio.server()
    shard = _Shard()
    embedding_pb2_grpc.add_EmbeddingShardServicer_to_server(shard, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, shard, f"127.0.0.1:{port}"


def test_the_rpc_starts_before_anything_awaits_it_and_answers_when_awaited() -> None:
    async def body() -> None:
        server, shard, address = await _serve()
        transport = GrpcShardTransport([address])
        try:
            reply = await transport.lookup(0, embedding_pb2.LookupRequest(plan_version=1), 5.0)  # the channel is up
            assert reply.plan_version == 8
            shard.arrived.clear()
            pending = transport.start_lookup(0, embedding_pb2.LookupRequest(plan_version=2), 5.0)
            # Nothing awaits or schedules ``pending``: the request reaches the shard anyway.
            await asyncio.wait_for(shard.arrived.wait(), 5.0)
            assert shard.requests == 2
            assert (await pending).plan_version == 9
        finally:
            await transport.close()
            await server.stop(None)

    asyncio.run(body())


def test_a_started_rpc_fails_with_the_shards_status() -> None:
    async def body() -> None:
        server, shard, address = await _serve()
        transport = GrpcShardTransport([address])
        try:
            shard.refuse = True
            with pytest.raises(ResourceExhausted, match="shard 0: RESOURCE_EXHAUSTED: too many ids"):
                await transport.start_lookup(0, embedding_pb2.LookupRequest(), 5.0)
            # No address for shard 3: the error comes where it is awaited, not at the call.
            pending = transport.start_lookup(3, embedding_pb2.LookupRequest(), 5.0)
            with pytest.raises(RecserveError) as info:
                await pending
            assert isinstance(info.value, InvalidArgument) and grpc_code(info.value) is grpc.StatusCode.INVALID_ARGUMENT
            assert "no address for shard 3 (1 known)" in str(info.value)
        finally:
            await transport.close()
            await server.stop(None)

    asyncio.run(body())
