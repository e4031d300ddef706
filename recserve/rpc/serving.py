"""Pieces every recserve server process shares at its edge: the port file launchers
read, waiting for dependencies to report SERVING, the slot servicers find their
core in once loading is done, and SIGTERM / SIGINT handling."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recserve.errors import Unavailable

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

    def get(self) -> T:
        if self.value is None:
            raise Unavailable(f"the {self.what} is still loading; retry shortly", retry_after_s=1.0)
        return self.value


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM / SIGINT set ``stop`` (ignored off the main thread, e.g. in tests)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass


async def wait_until_serving(addresses: Sequence[str], *, service: str = "", what: str = "server", timeout_s: float) -> None:
    """Wait until every address reports ``service`` SERVING on gRPC health (a process
    started beside its dependencies waits for them instead of failing); Unavailable
    naming each laggard and its state after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    request = health_pb2.HealthCheckRequest(service=service)
    while True:
        waiting = []
        for k, address in enumerate(addresses):
            async with grpc.aio.insecure_channel(address) as channel:
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
