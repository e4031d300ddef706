"""Liveness, readiness and a deep check, kept separate (issue 17; reference §10.11.9).

- **Liveness** (gRPC health service :data:`LIVENESS_SERVICE`): SERVING from the moment
  the server listens until it shuts down. It only says the process and its event loop
  answer; a supervisor (or Kubernetes' liveness probe) restarts a process that stops
  answering it.
- **Readiness** (health service ``""`` and each service name): SERVING once the core is
  loaded, and only while the deep check passes. Routers send only to ready replicas.
- **Deep check** (:class:`DeepCheck`): every ``interval_s`` it runs a fixed request
  through the process's real serving path (a shard: a lookup of fixed ids on its
  executor, compared with the rows it answered when it turned ready; a ranker: a fixed
  Rank through its scheduler and executor) with a ``timeout_s``. A wrong answer, an
  error (a table that is not loaded) or no answer in time (a wedged executor) turns
  readiness NOT_SERVING and calls ``on_change(reason)``; the servers then answer their
  calls UNAVAILABLE (their ``not_serving`` gate), so every router's breaker for that
  replica opens and traffic moves to the others. The next passing check turns it
  back SERVING.

The check runs on the event loop as one more task; the probe's own work goes where
the servers' work goes (their executors), which is the point::

    deep = DeepCheck(health, [SERVICE_NAME], probe, on_change=service.set_not_serving, what="shard 0")
    deep.start()      # after health says SERVING
    ...
    await deep.aclose()
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from grpc_health.v1 import health_pb2

from recserve.errors import require
from recserve.rpc.server import LIVENESS_SERVICE, Health

log = logging.getLogger(__name__)

__all__ = ["LIVENESS_SERVICE", "DeepCheck", "DeepCheckConfig", "Probe"]

Probe = Callable[[], Awaitable[None]]  # raises (any exception) when the answer is wrong


@dataclasses.dataclass(frozen=True)
class DeepCheckConfig:
    """How often the deep check runs and how long one may take before it counts as a
    failure (a wedged executor never answers)."""

    interval_s: float = 2.0
    # Generous: the probe queues behind real work on a busy executor, and an overloaded
    # replica is not a broken one (shedding handles overload); a wedged one never answers.
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        require(self.interval_s > 0, "deep_check.interval_s", self.interval_s, "use a positive interval in seconds")
        require(self.timeout_s > 0, "deep_check.timeout_s", self.timeout_s, "use a positive timeout in seconds")


class DeepCheck:
    """Runs ``probe`` every ``config.interval_s``; a failure or a timeout sets readiness
    (``""`` and ``services`` on ``health``) NOT_SERVING and calls ``on_change(reason)``;
    a pass after a failure sets SERVING and calls ``on_change("")``."""

    def __init__(
        self,
        health: Health,
        services: Sequence[str],
        probe: Probe,
        *,
        config: DeepCheckConfig = DeepCheckConfig(),
        on_change: Callable[[str], None] | None = None,
        what: str = "server",
    ) -> None:
        self.health = health
        self.services = ("", *services)
        self.config = config
        self.what = what
        self.reason = ""  # why the last check failed; "" = it passed (or none ran yet)
        self.checks = 0
        self.failures = 0
        self._probe = probe
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None

    async def check_once(self) -> str:
        """Run the probe once and apply the verdict; returns the failure reason ("" = passed)."""
        self.checks += 1
        started = time.monotonic()
        try:
            await asyncio.wait_for(self._probe(), self.config.timeout_s)
            reason = ""
        except asyncio.TimeoutError:
            reason = f"the deep check got no answer within {self.config.timeout_s:g} s (a wedged executor?)"
        except Exception as exc:  # noqa: BLE001  (any failure of the probe is the verdict)
            reason = f"the deep check failed: {exc}"
        if reason:
            self.failures += 1
        if reason != self.reason:
            status = health_pb2.HealthCheckResponse.NOT_SERVING if reason else health_pb2.HealthCheckResponse.SERVING
            for name in self.services:
                await self.health.set(name, status)
            if reason:
                log.error("%s: NOT_SERVING: %s", self.what, reason)
            else:
                log.warning("%s: the deep check passes again after %.3f s: SERVING", self.what, time.monotonic() - started)
            self.reason = reason
            if self._on_change is not None:
                self._on_change(reason)
        return reason

    def start(self) -> None:
        """Start checking (call inside the running loop, once readiness is SERVING)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"recserve-deep-check-{self.what}")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.check_once()
            except Exception:  # health.set cannot fail today; a bug must not end the checks silently
                log.exception("%s: deep check crashed", self.what)
