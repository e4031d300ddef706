"""recserve.rpc.server: malformed request bytes become INVALID_ARGUMENT naming the method,
for every handler kind, on both of grpc's registration paths (no sockets: handlers are
called directly with a fake context)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from recserve.rpc.server import CheckedServer, MalformedRequest, checked_handler, decode, make_server
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


class SyncContext:
    """What grpc hands a sync servicer (run in its thread pool): a blocking abort."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass


def kind_of(fn: Any) -> str:
    return "coroutine" if inspect.iscoroutinefunction(fn) else "asyncgen" if inspect.isasyncgenfunction(fn) else "sync"


def test_each_wrapper_is_of_its_servicers_kind_so_grpc_runs_it_the_same_way() -> None:
    """grpc aio runs a plain function in its thread pool with a sync context (blocking
    abort); wrapping one in a coroutine would run it on the event loop, where its
    ``context.abort`` returns an un-awaited coroutine and the abort is lost."""

    async def coro(request: Any, context: Any) -> Any:
        return request

    async def agen(request: Any, context: Any) -> AsyncIterator[Any]:
        yield request

    def plain(request: Any, context: Any) -> Any:
        return request

    def gen(request: Any, context: Any) -> Any:
        yield request

    makers = {
        (False, False): (grpc.unary_unary_rpc_method_handler, "unary_unary"),
        (False, True): (grpc.unary_stream_rpc_method_handler, "unary_stream"),
        (True, False): (grpc.stream_unary_rpc_method_handler, "stream_unary"),
        (True, True): (grpc.stream_stream_rpc_method_handler, "stream_stream"),
    }
    for (request_streaming, response_streaming), (make, attr) in makers.items():
        behaviors = [coro, plain] + ([agen, gen] if response_streaming else [])
        for behavior in behaviors:
            wrapped: Any = checked_handler(make(behavior, embedding_pb2.GetPlanRequest.FromString), METHOD)
            expected = "sync" if behavior is gen else kind_of(behavior)
            assert kind_of(getattr(wrapped, attr)) == expected, (attr, behavior.__name__)
            assert (wrapped.request_deserializer is None) == (not request_streaming)


def test_sync_servicers_abort_through_their_sync_context() -> None:
    def plain(request: Any, context: Any) -> embedding_pb2.GetPlanResponse:
        return embedding_pb2.GetPlanResponse(plan_version=4)

    def gen(request: Any, context: Any) -> Any:
        yield embedding_pb2.GetPlanResponse(plan_version=5)

    unary: Any = checked_handler(grpc.unary_unary_rpc_method_handler(plain, embedding_pb2.GetPlanRequest.FromString), METHOD)
    assert unary.unary_unary(GOOD, SyncContext()).plan_version == 4
    with pytest.raises(Aborted) as err:
        unary.unary_unary(BAD, SyncContext())
    assert_invalid_argument(err)
    stream: Any = checked_handler(grpc.unary_stream_rpc_method_handler(gen, embedding_pb2.GetPlanRequest.FromString), METHOD)
    assert [r.plan_version for r in stream.unary_stream(GOOD, SyncContext())] == [5]
    with pytest.raises(Aborted) as err:
        list(stream.unary_stream(BAD, SyncContext()))  # parsed on first next(): in grpc's thread pool
    assert_invalid_argument(err)


def test_a_bad_message_read_in_a_task_group_child_is_still_invalid_argument() -> None:
    async def count(requests: AsyncIterator[Any], context: Any) -> int:
        got: list[Any] = []

        async def read() -> None:
            got.extend([r async for r in requests])

        async with asyncio.TaskGroup() as group:
            group.create_task(read())
        return len(got)

    handler: Any = checked_handler(grpc.stream_unary_rpc_method_handler(count, embedding_pb2.GetPlanRequest.FromString), METHOD)

    async def stream(bodies: list[bytes]) -> AsyncIterator[Any]:
        for body in bodies:
            yield handler.request_deserializer(body)

    assert run(handler.stream_unary(stream([GOOD]), FakeContext())) == 1
    with pytest.raises(Aborted) as err:
        run(handler.stream_unary(stream([GOOD, BAD]), FakeContext()))
    assert_invalid_argument(err)


def test_raw_bytes_handlers_are_left_alone() -> None:
    async def raw(request: bytes, context: Any) -> bytes:
        return request

    original = grpc.unary_unary_rpc_method_handler(raw)
    assert checked_handler(original, "/recserve.test.ShardFault/Set") is original


class RecordingServer(grpc.aio.Server):
    """Stands in for the grpc.aio server inside CheckedServer: records registrations."""

    def __init__(self) -> None:
        self.generic: list[grpc.GenericRpcHandler] = []
        self.registered: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Any) -> None:
        self.generic.extend(generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.registered[service_name] = method_handlers

    def add_insecure_port(self, address: str) -> int:
        raise AssertionError("no sockets in unit tests")

    def add_secure_port(self, address: str, server_credentials: Any) -> int:
        raise AssertionError("no sockets in unit tests")

    async def start(self) -> None:
        pass

    async def stop(self, grace: float | None = None) -> None:
        pass

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return True


class Details:
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def test_a_checked_server_wraps_generated_services_on_both_registration_paths() -> None:
    """The generated add_*Servicer_to_server registers a generic handler and the
    registered-method table; every method on both comes out checked."""
    from recserve.v1 import embedding_pb2_grpc

    class Service(embedding_pb2_grpc.EmbeddingShardServicer):
        async def GetPlan(self, request: Any, context: Any) -> embedding_pb2.GetPlanResponse:
            return embedding_pb2.GetPlanResponse(plan_version=9)

    inner = RecordingServer()
    server = CheckedServer(inner)
    embedding_pb2_grpc.add_EmbeddingShardServicer_to_server(Service(), server)
    registered = inner.registered["recserve.v1.EmbeddingShard"]
    assert sorted(registered) == ["GetPlan", "Lookup", "ShardInfo", "Upsert"]
    assert all(h.request_deserializer is None for h in registered.values())  # each parses its own bytes
    (generic,) = inner.generic
    via_generic: Any = generic.service(Details(METHOD))  # type: ignore[arg-type]
    assert via_generic is generic.service(Details(METHOD))  # type: ignore[arg-type]  # wrapped once, then cached
    assert generic.service(Details("/no.Such/Method")) is None  # type: ignore[arg-type]  # grpc: UNIMPLEMENTED
    handler: Any
    for handler in (registered["GetPlan"], via_generic):
        assert run(handler.unary_unary(GOOD, FakeContext())).plan_version == 9
        with pytest.raises(Aborted) as err:
            run(handler.unary_unary(BAD, FakeContext()))
        assert_invalid_argument(err)


def test_make_server_returns_a_checked_aio_server() -> None:
    async def build() -> grpc.aio.Server:
        server = make_server(max_message_bytes=8 << 20)
        await server.stop(None)  # never started, no port bound
        return server

    server = run(build())
    assert isinstance(server, CheckedServer) and isinstance(server, grpc.aio.Server)  # reflection picks its aio servicer by this


# Servers built without make_server, each with why it may: nothing a user calls.
RAW_SERVERS_ALLOWED = {
    "recserve/rpc/server.py",  # make_server itself
    "recserve/bench/scheduler.py",  # the loopback ping of the scheduler benchmark (raw bytes, nothing to parse)
    "recserve/bench/bare.py",  # the bench's bare ceiling: raw bytes, no interceptors by design (checks its input itself)
}


def test_every_server_in_the_repo_is_built_by_make_server() -> None:
    """A ``grpc.aio.server(...)`` / ``grpc.server(...)`` call outside recserve.rpc.server
    would serve methods whose malformed bytes escape as UNKNOWN; packages that land
    later are covered the moment they exist."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    offenders = []
    for package in ("recserve", "embedding_server", "ranker", "cascade", "generation"):
        for path in sorted((root / package).rglob("*.py")) if (root / package).is_dir() else []:
            rel = path.relative_to(root).as_posix()
            if rel in RAW_SERVERS_ALLOWED or rel.startswith("recserve/v1/"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "server":
                    owner = node.func.value
                    name = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
                    if name in ("aio", "grpc"):
                        offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, f"build gRPC servers with recserve.rpc.server.make_server: {offenders}"


def test_health_watchers_get_not_serving_and_their_streams_end_at_shutdown() -> None:
    """So server.stop(grace) waits only for real RPCs, not the whole grace per watcher."""
    from grpc_health.v1 import health_pb2

    from recserve.rpc.server import Health

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    async def go() -> None:
        health = Health()
        await health.set("", not_serving)
        context = FakeContext()
        request = health_pb2.HealthCheckRequest(service="")
        watch = asyncio.ensure_future(health.Watch(request, context))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        await health.set("", serving)
        await asyncio.sleep(0)
        assert (await health.Check(request, context)).status == serving  # type: ignore[arg-type]
        assert not watch.done()  # a watcher stays until something ends it
        await health.enter_graceful_shutdown()
        await asyncio.wait_for(watch, 5.0)  # returns: the stream ends with OK
        await health.set("", serving)  # ignored once shutting down
        assert [r.status for r in context.written] == [not_serving, serving, not_serving]
        assert (await health.Check(request, context)).status == not_serving  # type: ignore[arg-type]
        listed = await health.List(health_pb2.HealthListRequest(), context)  # type: ignore[arg-type]
        assert {name: r.status for name, r in listed.statuses.items()} == {"": not_serving}
        with pytest.raises(Aborted) as err:
            await health.Check(health_pb2.HealthCheckRequest(service="nope"), context)  # type: ignore[arg-type]
        assert err.value.code == grpc.StatusCode.NOT_FOUND and "'nope'" in err.value.details
        late = FakeContext()  # a watcher arriving during shutdown gets the status and ends at once
        await asyncio.wait_for(health.Watch(request, late), 5.0)  # type: ignore[arg-type]
        assert [r.status for r in late.written] == [not_serving]

    run(go())


def test_a_watcher_still_writing_serving_when_shutdown_begins_gets_not_serving_too() -> None:
    """The shutdown can land while a watcher's write of SERVING is still in flight (seen
    on a loaded machine): the stream must still end with NOT_SERVING, not with SERVING."""
    from grpc_health.v1 import health_pb2

    from recserve.rpc.server import Health

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    class SlowContext(FakeContext):
        def __init__(self) -> None:
            super().__init__()
            self.in_write = asyncio.Event()
            self.release = asyncio.Event()

        async def write(self, message: Any) -> None:
            self.in_write.set()
            await self.release.wait()  # the transport has not taken the message yet
            self.written.append(message)

    async def go() -> None:
        health = Health()
        await health.set("", serving)
        context = SlowContext()
        watch = asyncio.ensure_future(health.Watch(health_pb2.HealthCheckRequest(service=""), context))  # type: ignore[arg-type]
        await asyncio.wait_for(context.in_write.wait(), 5.0)
        await health.enter_graceful_shutdown()  # while SERVING is being written
        context.release.set()
        await asyncio.wait_for(watch, 5.0)
        assert [r.status for r in context.written] == [serving, not_serving]

    run(go())
