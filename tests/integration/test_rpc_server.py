"""recserve.rpc.server on a real grpc.aio server (loopback, in process): every handler
kind, async and sync servicers alike, keeps grpc's semantics (a servicer's own abort
code and details, invocation and trailing metadata, the deadline) and answers malformed
bytes INVALID_ARGUMENT naming the method; interceptors see parsed requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from recserve.rpc.server import make_server

pytestmark = pytest.mark.integration

Request, Response = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
SERVICE = "recserve.test.Kinds"
OK, DENY = Request(service="ok").SerializeToString(), Request(service="deny").SerializeToString()
BAD = b"\xfe"


def _answer(request: Any, context: Any) -> Any:
    """Echo the invocation metadata and whether a deadline arrived into the trailers;
    None for "deny" (the caller aborts PERMISSION_DENIED)."""
    metadata = dict(context.invocation_metadata())
    context.set_trailing_metadata((("x-echo", str(metadata.get("x-in", ""))), ("x-deadline", "yes" if context.time_remaining() is not None else "no")))
    return None if request.service == "deny" else Response(status=Response.SERVING)


DENIED = (grpc.StatusCode.PERMISSION_DENIED, "denied by the servicer")


async def _aanswer(request: Any, context: Any) -> Any:
    response = _answer(request, context)
    if response is None:
        await context.abort(*DENIED)
    return response


def _sanswer(request: Any, context: Any) -> Any:
    response = _answer(request, context)
    if response is None:
        context.abort(*DENIED)
    return response


async def unary_unary_async(request: Any, context: Any) -> Any:
    return await _aanswer(request, context)


def unary_unary_sync(request: Any, context: Any) -> Any:
    return _sanswer(request, context)


async def unary_stream_async(request: Any, context: Any) -> AsyncIterator[Any]:
    for _ in range(2):
        yield await _aanswer(request, context)


async def unary_stream_writer(request: Any, context: Any) -> None:
    await context.write(await _aanswer(request, context))


def unary_stream_sync(request: Any, context: Any) -> Iterator[Any]:
    for _ in range(2):
        yield _sanswer(request, context)


async def stream_unary_async(requests: Any, context: Any) -> Any:
    last = None
    async for request in requests:
        last = await _aanswer(request, context)
    return last


def stream_unary_sync(requests: Any, context: Any) -> Any:
    last = None
    for request in requests:
        last = _sanswer(request, context)
    return last


async def stream_unary_task_group(requests: Any, context: Any) -> Any:
    """Reads its stream in a TaskGroup child: a parse error arrives in an ExceptionGroup."""
    got: list[Any] = []

    async def read() -> None:
        async for request in requests:
            got.append(request)

    async with asyncio.TaskGroup() as group:
        group.create_task(read())
    return await _aanswer(got[-1], context)


async def stream_stream_async(requests: Any, context: Any) -> AsyncIterator[Any]:
    async for request in requests:
        yield await _aanswer(request, context)


def stream_stream_sync(requests: Any, context: Any) -> Iterator[Any]:
    for request in requests:
        yield _sanswer(request, context)


KINDS: dict[str, tuple[Callable[..., Any], Callable[..., grpc.RpcMethodHandler]]] = {
    "UnaryUnaryAsync": (unary_unary_async, grpc.unary_unary_rpc_method_handler),
    "UnaryUnarySync": (unary_unary_sync, grpc.unary_unary_rpc_method_handler),
    "UnaryStreamAsync": (unary_stream_async, grpc.unary_stream_rpc_method_handler),
    "UnaryStreamWriter": (unary_stream_writer, grpc.unary_stream_rpc_method_handler),
    "UnaryStreamSync": (unary_stream_sync, grpc.unary_stream_rpc_method_handler),
    "StreamUnaryAsync": (stream_unary_async, grpc.stream_unary_rpc_method_handler),
    "StreamUnarySync": (stream_unary_sync, grpc.stream_unary_rpc_method_handler),
    "StreamUnaryTaskGroup": (stream_unary_task_group, grpc.stream_unary_rpc_method_handler),
    "StreamStreamAsync": (stream_stream_async, grpc.stream_stream_rpc_method_handler),
    "StreamStreamSync": (stream_stream_sync, grpc.stream_stream_rpc_method_handler),
}


def generic_handler() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {name: make(fn, Request.FromString, Response.SerializeToString) for name, (fn, make) in KINDS.items()})


async def call(channel: grpc.aio.Channel, name: str, body: bytes) -> tuple[grpc.StatusCode, str, dict[str, Any], list[Any]]:
    """Send ``body`` (a stream-request method: an ``OK`` message, then ``body``) raw;
    return (code, details, trailing metadata, responses)."""
    path = f"/{SERVICE}/{name}"
    make = KINDS[name][1]
    request_streaming = make in (grpc.stream_unary_rpc_method_handler, grpc.stream_stream_rpc_method_handler)
    response_streaming = make in (grpc.unary_stream_rpc_method_handler, grpc.stream_stream_rpc_method_handler)
    kwargs: dict[str, Any] = {"timeout": 20, "metadata": (("x-in", name),)}
    bodies = [OK, body]
    if request_streaming and response_streaming:
        rpc: Any = channel.stream_stream(path, request_serializer=None, response_deserializer=Response.FromString)(iter(bodies), **kwargs)
    elif request_streaming:
        rpc = channel.stream_unary(path, request_serializer=None, response_deserializer=Response.FromString)(iter(bodies), **kwargs)
    elif response_streaming:
        rpc = channel.unary_stream(path, request_serializer=None, response_deserializer=Response.FromString)(body, **kwargs)
    else:
        rpc = channel.unary_unary(path, request_serializer=None, response_deserializer=Response.FromString)(body, **kwargs)
    responses: list[Any] = []
    try:
        if response_streaming:
            responses = [r async for r in rpc]
        else:
            responses = [await rpc]
    except grpc.aio.AioRpcError:
        pass
    return await rpc.code(), await rpc.details(), dict(await rpc.trailing_metadata() or ()), responses


async def serving(body: Callable[[grpc.aio.Channel], Awaitable[None]], interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()) -> None:
    server = make_server(max_message_bytes=4 << 20, interceptors=interceptors)
    server.add_generic_rpc_handlers((generic_handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await body(channel)
    finally:
        await server.stop(None)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_kind_keeps_grpc_semantics_and_rejects_malformed_bytes(name: str) -> None:
    async def body(channel: grpc.aio.Channel) -> None:
        code, details, trailers, responses = await call(channel, name, OK)
        assert code == grpc.StatusCode.OK, (name, code, details)
        assert responses and all(r.status == Response.SERVING for r in responses)
        assert trailers == {"x-echo": name, "x-deadline": "yes"}  # metadata in and out, the deadline

        code, details, trailers, _ = await call(channel, name, DENY)
        assert (code, details) == DENIED, name  # a sync servicer's own abort too (was UNKNOWN)
        assert trailers["x-echo"] == name

        code, details, _, _ = await call(channel, name, BAD)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
        assert details.startswith(f"/{SERVICE}/{name}: the request body (1 byte) is not a valid grpc.health.v1.HealthCheckRequest")

    asyncio.run(serving(body))


class RecordingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps each unary-unary behaviour and records the type of request it is handed."""

    def __init__(self) -> None:
        self.request_types: list[str] = []

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.response_streaming:
            return handler
        inner = handler.unary_unary

        async def recorded(request: Any, context: Any) -> Any:
            self.request_types.append(type(request).__name__)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(recorded, handler.request_deserializer, handler.response_serializer)


def test_interceptors_see_parsed_requests_and_bad_bytes_stay_invalid_argument() -> None:
    interceptor = RecordingInterceptor()

    async def body(channel: grpc.aio.Channel) -> None:
        code, _, _, responses = await call(channel, "UnaryUnaryAsync", OK)
        assert code == grpc.StatusCode.OK and responses[0].status == Response.SERVING
        code, details, _, _ = await call(channel, "UnaryUnarySync", BAD)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"/{SERVICE}/UnaryUnarySync: ")
        code, _, _, _ = await call(channel, "StreamUnaryAsync", BAD)
        assert code == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(serving(body, (interceptor,)))
    assert interceptor.request_types == ["HealthCheckRequest"]  # parsed, not raw bytes; the bad body never reached it


def test_reflection_lists_every_registered_service_even_when_not_named() -> None:
    """So tests/grpc_fuzz.py reaches a service whose author forgot to pass its name."""
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    from recserve.rpc.server import add_health_and_reflection
    from recserve.v1 import embedding_pb2_grpc

    async def go() -> list[str]:
        server = make_server(max_message_bytes=4 << 20)
        embedding_pb2_grpc.add_EmbeddingShardServicer_to_server(embedding_pb2_grpc.EmbeddingShardServicer(), server)
        await add_health_and_reflection(server, [])  # the shard's name not passed
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:

            def services() -> list[str]:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    return sorted(ProtoReflectionDescriptorDatabase(channel).get_services())

            return await asyncio.to_thread(services)
        finally:
            await server.stop(None)

    assert asyncio.run(go()) == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "recserve.v1.EmbeddingShard"]
