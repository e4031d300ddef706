"""Shedding on a real grpc.aio server (loopback, in process), issue 17:

- the transport bound (``make_server``'s ``maximum_concurrent_rpcs``): a call past it is
  refused RESOURCE_EXHAUSTED by grpc before any servicer code runs, while the calls
  inside the bound still finish;
- the scheduler's slack check reaches the caller as RESOURCE_EXHAUSTED with the
  ``retry-after-ms`` trailer, through the one error mapping (recserve.rpc.status)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from recserve.errors import RecserveError
from recserve.rpc.server import make_server
from recserve.rpc.status import abort_with
from recserve.scheduling import Done, FeatureParallelConfig, FeatureParallelPolicy, Scheduler
from recserve.scheduling.loop import ServingLoop

pytestmark = pytest.mark.integration

Request, Response = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
SERVICE = "recserve.test.Shed"
PATH = f"/{SERVICE}/Call"


async def serve(handler: Any, **make: Any) -> tuple[grpc.aio.Server, str]:
    server = make_server(max_message_bytes=1 << 20, **make)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {"Call": grpc.unary_unary_rpc_method_handler(handler, Request.FromString, Response.SerializeToString)}),))  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_calls_past_maximum_concurrent_rpcs_are_refused_before_the_servicer_runs() -> None:
    async def main() -> None:
        entered = 0
        both_in = asyncio.Event()
        release = asyncio.Event()

        async def handler(request: Any, context: Any) -> Any:
            nonlocal entered
            entered += 1
            if entered == 2:
                both_in.set()
            await release.wait()
            return Response(status=Response.SERVING)

        server, address = await serve(handler, maximum_concurrent_rpcs=2)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                call = channel.unary_unary(PATH, request_serializer=Request.SerializeToString, response_deserializer=Response.FromString)
                held = [asyncio.ensure_future(call(Request(), timeout=30)) for _ in range(2)]
                await asyncio.wait_for(both_in.wait(), 30)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call(Request(), timeout=30)  # a third, while two are in: over the bound
                assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert entered == 2  # refused by grpc itself: the servicer never saw it
                release.set()
                replies = await asyncio.gather(*held)
                assert [r.status for r in replies] == [Response.SERVING] * 2
                assert (await call(Request(), timeout=30)).status == Response.SERVING  # room again
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_the_slack_check_answers_resource_exhausted_with_a_retry_after_trailer() -> None:
    async def main() -> None:
        gate = asyncio.Event()

        async def runner(batch: Any) -> list[Done]:
            await gate.wait()
            return [Done(Response(status=Response.SERVING)) for _ in batch.handles]

        policy = FeatureParallelPolicy(FeatureParallelConfig(window_ms=0.0, max_cost=1.0, dispatch_margin_ms=0.0))
        loop = ServingLoop(Scheduler(policy), runner, max_inflight=1, name="shed-test")
        loop.start()
        for _ in range(loop.scheduler.admission.config.shed_after_batches):  # as if every (warm) batch took 500 ms
            loop.scheduler.service.observe(1.0, 0.5)

        submitted = 0
        four_in = asyncio.Event()

        async def handler(request: Any, context: Any) -> Any:
            nonlocal submitted
            try:
                future = loop.submit_nowait(request, deadline=time.monotonic() + context.time_remaining())
                submitted += 1
                if submitted == 4:
                    four_in.set()
                return await future
            except RecserveError as exc:
                await abort_with(context, exc)

        server, address = await serve(handler)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                call = channel.unary_unary(PATH, request_serializer=Request.SerializeToString, response_deserializer=Response.FromString)
                queued = [asyncio.ensure_future(call(Request(), timeout=60)) for _ in range(4)]
                await asyncio.wait_for(four_in.wait(), 30)  # all four are in the scheduler: 1 running, 3 queued
                rpc = call(Request(), timeout=1.0)  # 1 s of slack < (3 queued + 1 running) x 500 ms + 500 ms
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await rpc
                assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "slack" in (caught.value.details() or "")
                trailers = dict(await rpc.trailing_metadata() or ())
                assert int(trailers["retry-after-ms"]) >= 1500  # the ~2 s the batches ahead take
                assert loop.scheduler.shed == 1
                gate.set()
                assert [r.status for r in await asyncio.gather(*queued)] == [Response.SERVING] * 4
        finally:
            gate.set()  # a running batch always finishes: let it, or aclose waits forever
            await server.stop(None)
            await loop.aclose(drain=False)

    asyncio.run(main())
