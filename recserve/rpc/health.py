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
- **Expected values** (:class:`Baseline`): the ranker (a fixed Rank's scores), the
  cascade (a fixed Recommend's item ids) and a generation replica (a fixed greedy
  decode's tokens) compare each answer with the first one they gave. Some answers
  rightly change: a reload, an index refresh, an upsert of the rows they read. Such a
  change moves the probe's *epoch* (a reload count, an index version, the shards'
  upsert counts), and a differing answer under a moved epoch re-takes the baseline
  instead of failing. A degraded or shed answer is no verdict.

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
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from typing import Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2

from recserve.errors import InternalError, require
from recserve.rpc.server import LIVENESS_SERVICE, Health
from recserve.v1 import embedding_pb2, embedding_pb2_grpc

log = logging.getLogger(__name__)

__all__ = ["DEEP_CHECK_INTERVAL_ENV", "LIVENESS_SERVICE", "Baseline", "DeepCheck", "DeepCheckConfig", "Probe", "shard_upserts"]

Probe = Callable[[], Awaitable[None]]  # raises (any exception) when the answer is wrong
T = TypeVar("T")
SHARD_INFO_TIMEOUT_S = 2.0  # one ShardInfo of an epoch (the probe's whole run has DeepCheck's timeout)
# Read by the ranker, cascade and generation servers at start: seconds between deep
# checks. A test whose counters must not move between two reads sets it long.
DEEP_CHECK_INTERVAL_ENV = "RECSERVE_DEEP_CHECK_INTERVAL_S"


@dataclasses.dataclass(frozen=True)
class DeepCheckConfig:
    """How often the deep check runs and how long one may take before it counts as a
    failure (a wedged executor never answers)."""

    # 5 s, not 2: the probe shares the replica's batches and executor with real traffic,
    # and every 2 s it cost the tail near the knee (bench rank at 20/s: 97.9 % of
    # requests within the 50 ms SLO with it, 99.0 % without). Detection within ~10 s
    # (interval + timeout) is what a readiness probe gives on Kubernetes too.
    interval_s: float = 5.0
    # Generous: the probe queues behind real work on a busy executor, and an overloaded
    # replica is not a broken one (shedding handles overload); a wedged one never answers.
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        require(self.interval_s > 0, "deep_check.interval_s", self.interval_s, "use a positive interval in seconds")
        require(self.timeout_s > 0, "deep_check.timeout_s", self.timeout_s, "use a positive timeout in seconds")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> DeepCheckConfig:
        """The defaults, with ``interval_s`` from ``$RECSERVE_DEEP_CHECK_INTERVAL_S`` when set."""
        raw = environ.get(DEEP_CHECK_INTERVAL_ENV, "").strip()
        if not raw:
            return cls()
        try:
            interval_s = float(raw)
        except ValueError:
            interval_s = float("nan")
        require(interval_s > 0, DEEP_CHECK_INTERVAL_ENV, raw, "use a positive number of seconds between deep checks")
        return cls(interval_s=interval_s)


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


class Baseline(Generic[T]):
    """A probe (:data:`Probe`) that runs a fixed request and compares its answer with the
    first one it gave.

    ``answer()`` runs the request through the real serving path; it raises when the
    answer is malformed and returns None when it is no verdict (degraded, shed).
    ``differs(expected, got)`` says how they differ ("" = the same). ``epoch()`` reads
    what may rightly change the answer (None: it cannot be read now, no verdict); without
    one, the first answer is the baseline for the process's life.

    With an epoch, a baseline is taken only when the epoch read after the answer equals
    the one read after the previous answer: nothing that may change it moved during the
    answer or for one interval before it (a client's near cache may serve a row up to
    its staleness after an upsert). A differing answer then fails only if the epoch is
    still the baseline's; otherwise the baseline is re-taken. The epoch is read only
    while there is no baseline and after a differing answer, so a healthy replica pays
    for the answer alone."""

    def __init__(
        self,
        answer: Callable[[], Awaitable[T | None]],
        differs: Callable[[T, T], str],
        *,
        epoch: Callable[[], Awaitable[Hashable | None]] | None = None,
        what: str = "the fixed request",
    ) -> None:
        self._answer = answer
        self._differs = differs
        self._epoch = epoch
        self.what = what
        self.expected: T | None = None
        self.expected_epoch: Hashable | None = None
        self.retaken = 0  # baselines dropped because the epoch moved
        self._seen: Hashable | None = None  # the epoch read after the last answer (no baseline yet)
        self._unreadable = False  # the last epoch read failed (logged once per run of failures)

    def reset(self) -> None:
        """Forget the baseline (the next stable answer becomes it)."""
        self.expected, self.expected_epoch, self._seen = None, None, None

    async def __call__(self) -> None:
        got = await self._answer()
        if got is None:
            return
        if self.expected is None:
            await self._take(got)
            return
        why = self._differs(self.expected, got)
        if not why:
            return
        now = None if self._epoch is None else await self._read_epoch()
        if self._epoch is not None and now != self.expected_epoch:
            if now is not None:  # a reload, a refresh, an upsert: the old answer is stale, not wrong
                log.info("%s: the answer changed with its epoch (%r -> %r): re-taking the baseline", self.what, self.expected_epoch, now)
                self.reset()
                self.retaken += 1
                self._seen = now
            return
        raise InternalError(f"{self.what} answered differently from its baseline, with nothing changed that may change it: {why}")

    async def _take(self, got: T) -> None:
        if self._epoch is None:
            self.expected = got
        else:
            now = await self._read_epoch()
            if now is not None and now == self._seen:
                self.expected, self.expected_epoch = got, now
            self._seen = now
        if self.expected is not None:
            log.info("%s: baseline taken", self.what)

    async def _read_epoch(self) -> Hashable | None:
        assert self._epoch is not None
        now = await self._epoch()
        if (now is None) != self._unreadable:  # say so once, not every check: the answers go unjudged meanwhile
            self._unreadable = now is None
            if now is None:
                log.warning("%s: what may change its answer cannot be read now (a peer down, or a rollout): no verdict until it can", self.what)
        return now


async def shard_upserts(addresses: Sequence[str], timeout_s: float = SHARD_INFO_TIMEOUT_S) -> tuple[tuple[str, int], ...] | None:
    """Each shard's ``(instance_id, acknowledged upsert rows)`` (``ShardInfo``), or None
    when one does not answer: the epoch part of a deep check whose answer reads shard
    rows. The count restarts at 0 with the process while the rows it counted survive
    (RocksDB), so the instance id, drawn at each start, is part of it: a restart after
    upserts must not read as "nothing changed". Shards are plaintext."""

    async def one(address: str) -> tuple[str, int]:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await embedding_pb2_grpc.EmbeddingShardStub(channel).ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=timeout_s)
            return reply.instance_id, int(reply.upserts)

    try:
        return tuple(await asyncio.gather(*(one(a) for a in addresses)))
    except grpc.aio.AioRpcError:
        return None
