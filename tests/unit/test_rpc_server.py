"""recserve.rpc.server: malformed request bytes become INVALID_ARGUMENT naming the method,
for every handler kind, through the interceptor every recserve server installs (no
sockets: handlers are called directly with a fake context)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from recserve.rpc.server import DecodeErrorInterceptor, MalformedRequest, checked_handler, decode
from recserve.v1 import embedding_pb2

METHOD = "/recserve.v1.EmbeddingShard/GetPlan"
GOOD = embedding_pb2.GetPlanRequest().SerializeToString()  # b"": the default message parses
BAD = b"\xfe"


class Aborted(Exception):
    """What grpc's context.abort raises (AbortError), with what it was told."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class FakeContext:
    def __init__(self) -> None:
        self.written: list[Any] = []

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    async def write(self, message: Any) -> None:
        self.written.append(message)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def assert_invalid_argument(err: pytest.ExceptionInfo[Aborted]) -> None:
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert METHOD in err.value.details and "recserve.v1.GetPlanRequest" in err.value.details
    assert "(1 byte)" in err.value.details


def test_decode_names_the_method_the_type_and_the_size() -> None:
    assert decode(embedding_pb2.GetPlanRequest.FromString, METHOD, GOOD) == embedding_pb2.GetPlanRequest()
    with pytest.raises(MalformedRequest) as err:
        decode(embedding_pb2.LookupRequest.FromString, "/x.Y/Z", b"\x0a\xff\xff")
    assert err.value.message.startswith("/x.Y/Z: the request body (3 bytes) is not a valid recserve.v1.LookupRequest")
    assert err.value.kind.name == "INVALID_ARGUMENT"


def test_unary_unary_parses_itself_and_aborts_invalid_argument() -> None:
    seen: list[Any] = []

    async def get_plan(request: embedding_pb2.GetPlanRequest, context: Any) -> embedding_pb2.GetPlanResponse:
        seen.append(request)
        return embedding_pb2.GetPlanResponse(plan_version=3)

    original = grpc.unary_unary_rpc_method_handler(get_plan, embedding_pb2.GetPlanRequest.FromString, embedding_pb2.GetPlanResponse.SerializeToString)
    handler: Any = checked_handler(original, METHOD)
    assert handler.request_deserializer is None  # grpc hands the raw bytes over
    assert handler.response_serializer is original.response_serializer
    assert run(handler.unary_unary(GOOD, FakeContext())).plan_version == 3
    assert seen == [embedding_pb2.GetPlanRequest()]
    with pytest.raises(Aborted) as err:
        run(handler.unary_unary(BAD, FakeContext()))
    assert_invalid_argument(err)
    assert len(seen) == 1  # the servicer never saw the bad body


def test_unary_stream_async_generator_and_writer_servicers() -> None:
    async def gen(request: Any, context: Any) -> AsyncIterator[int]:
        yield 1
        yield 2

    async def writer(request: Any, context: Any) -> None:
        await context.write(7)

    for behavior in (gen, writer):
        handler: Any = checked_handler(grpc.unary_stream_rpc_method_handler(behavior, embedding_pb2.GetPlanRequest.FromString), METHOD)
        assert handler.response_streaming and handler.request_deserializer is None
        context = FakeContext()

        async def drain(body: bytes) -> list[Any]:
            out = handler.unary_stream(body, context)
            if behavior is writer:
                await out
                return context.written
            return [r async for r in out]

        assert run(drain(GOOD)) == ([1, 2] if behavior is gen else [7])
        with pytest.raises(Aborted) as err:
            run(drain(BAD))
        assert_invalid_argument(err)


def test_stream_request_servicers_get_invalid_argument_from_a_bad_message() -> None:
    """For stream requests the deserializer raises while the servicer reads its stream
    (inside its own await), and the wrapper around the servicer answers it."""

    async def count(requests: AsyncIterator[Any], context: Any) -> int:
        return len([r async for r in requests])

    handler: Any = checked_handler(grpc.stream_unary_rpc_method_handler(count, embedding_pb2.GetPlanRequest.FromString), METHOD)
    assert handler.request_deserializer is not None

    async def stream(bodies: list[bytes]) -> AsyncIterator[Any]:
        for body in bodies:  # grpc deserializes each message as the servicer reads it
            yield handler.request_deserializer(body)

    assert run(handler.stream_unary(stream([GOOD, GOOD]), FakeContext())) == 2
    with pytest.raises(Aborted) as err:
        run(handler.stream_unary(stream([GOOD, BAD]), FakeContext()))
    assert_invalid_argument(err)


def test_raw_bytes_handlers_are_left_alone() -> None:
    async def raw(request: bytes, context: Any) -> bytes:
        return request

    original = grpc.unary_unary_rpc_method_handler(raw)
    assert checked_handler(original, "/recserve.test.ShardFault/Set") is original


def test_the_interceptor_wraps_every_method_once() -> None:
    async def get_plan(request: Any, context: Any) -> embedding_pb2.GetPlanResponse:
        return embedding_pb2.GetPlanResponse()

    original = grpc.unary_unary_rpc_method_handler(get_plan, embedding_pb2.GetPlanRequest.FromString)
    interceptor: Any = DecodeErrorInterceptor()  # called with fake call details

    class Details:
        def __init__(self, method: str) -> None:
            self.method = method
            self.invocation_metadata = ()

    async def found(details: Any) -> grpc.RpcMethodHandler:
        return original

    async def missing(details: Any) -> None:
        return None

    async def go() -> None:
        first = await interceptor.intercept_service(found, Details(METHOD))
        again = await interceptor.intercept_service(found, Details(METHOD))
        assert first is again and first is not original  # wrapped once, then cached
        with pytest.raises(Aborted) as err:
            await first.unary_unary(BAD, FakeContext())
        assert_invalid_argument(err)
        assert await interceptor.intercept_service(missing, Details("/no.Such/Method")) is None  # grpc: UNIMPLEMENTED

    run(go())
