"""Pieces every recserve server process shares at its edge: the port file launchers
read, waiting for dependencies to report SERVING, the slot servicers find their
core in once loading is done, SIGTERM / SIGINT handling, and :func:`serve_loaded`, the
listen-first / load / serve / drain life of a process that composes them."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recserve.config.spec import TlsConfig
from recserve.errors import Unavailable
from recserve.rpc.auth import add_listening_port, open_channel
from recserve.rpc.server import Health

log = logging.getLogger(__name__)
T = TypeVar("T")
POLL_S = 0.2
CHECK_TIMEOUT_S = 10.0


def write_port_file(path: str | Path, port: int) -> None:
    """Write the bound port atomically (a launcher polls for the file and reads it)."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(str(port))
    os.replace(tmp, path)


class Slot(Generic[T]):
    """Where servicers find the process's core: empty while it is still loading (the
    server already listens, so health can say NOT_SERVING and calls get UNAVAILABLE
    with a retry hint instead of connection refused)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.value: T | None = None
        # Why the deep check fails ("" = it passes; recserve.rpc.health): calls then
        # answer UNAVAILABLE, so the callers' breakers take this replica out.
        self.not_serving = ""

    def get(self) -> T:
        if self.value is None:
            raise Unavailable(f"the {self.what} is still loading; retry shortly", retry_after_s=1.0)
        if self.not_serving:
            raise Unavailable(f"the {self.what} is NOT_SERVING: {self.not_serving}", retry_after_s=1.0)
        return self.value

    def set_not_serving(self, reason: str) -> None:
        """The deep check's verdict (:class:`recserve.rpc.health.DeepCheck`'s ``on_change``)."""
        self.not_serving = reason


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM / SIGINT set ``stop`` (ignored off the main thread, e.g. in tests)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass


async def wait_until_serving(addresses: Sequence[str], *, service: str = "", what: str = "server", timeout_s: float, tls: TlsConfig | None = None) -> None:
    """Wait until every address reports ``service`` SERVING on gRPC health (a process
    started beside its dependencies waits for them instead of failing); Unavailable
    naming each laggard and its state after ``timeout_s``. ``tls``: they listen with TLS."""
    end = time.monotonic() + timeout_s
    request = health_pb2.HealthCheckRequest(service=service)
    while True:
        waiting = []
        for k, address in enumerate(addresses):
            async with open_channel(address, tls) as channel:
                try:
                    reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=CHECK_TIMEOUT_S)
                    if reply.status != health_pb2.HealthCheckResponse.SERVING:
                        waiting.append(f"{what} {k} at {address} is {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
                except grpc.aio.AioRpcError as exc:
                    waiting.append(f"{what} {k} at {address}: {exc.code().name}")
        if not waiting:
            return
        if time.monotonic() > end:
            raise Unavailable(f"not SERVING after {timeout_s:.0f} s: {'; '.join(waiting)}")
        await asyncio.sleep(POLL_S)


class Closable(Protocol):
    async def aclose(self) -> None: ...


C = TypeVar("C", bound=Closable)


async def serve_loaded(
    server: grpc.aio.Server,
    health: Health,
    services: Sequence[str],
    slot: Slot[C],
    load: Callable[[], Awaitable[C]],
    *,
    what: str,
    host: str,
    port: int,
    port_file: str = "",
    on_ready: Callable[[C, int], None] | None = None,
    stop: asyncio.Event | None = None,
    grace_s: float = 2.0,
    tls: TlsConfig | None = None,
) -> None:
    """Run a server process whose core takes a while to load, honestly observable:

    1. bind ``host:port`` (a taken port is Unavailable naming it) and start, health still
       NOT_SERVING (``server`` has its servicers, health and reflection registered);
       write the bound port to ``port_file``;
    2. ``load()`` the core, racing ``stop`` (SIGTERM / SIGINT): a stop while loading
       leaves at once;
    3. put the core in ``slot``, call ``on_ready(core, port)``, report SERVING for "" and
       ``services``, and serve until ``stop``;
    4. health NOT_SERVING (watch streams end), ``grace_s`` for in-flight calls, then
       ``core.aclose()``.

    ``tls``: listen with TLS when it is enabled (``[tls]``; :mod:`recserve.rpc.auth`).
    """
    try:
        bound = add_listening_port(server, f"{host}:{port}", tls)
    except RuntimeError:  # grpc's "Failed to bind": a clear error, not a traceback
        raise Unavailable(f"{what}: cannot listen on {host}:{port} (port in use or address not local); pick another --port") from None
    await server.start()
    if port_file:
        write_port_file(port_file, bound)
    log.info("%s listening on %s:%d (loading)", what, host, bound)
    stop = stop or asyncio.Event()
    stop_on_signals(stop)
    core: C | None = None
    loading = asyncio.ensure_future(load())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():  # stopped while waiting for dependencies or loading
            loading.cancel()
            return
        core = loading.result()
        slot.value = core
        if on_ready is not None:
            on_ready(core, bound)
        for name in ("", *services):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await stop.wait()
    finally:
        stopping.cancel()
        await health.enter_graceful_shutdown()
        await server.stop(grace_s)
        if core is not None:
            await core.aclose()
