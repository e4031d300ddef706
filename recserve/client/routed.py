"""The routed unary call every recserve client makes: one replica set, one router, one
retry loop (docs/architecture.md §9). :class:`~recserve.client.RankingClient` and
:class:`~recserve.client.RecClient` are thin typed layers over :class:`RoutedCalls`.

One call (:meth:`RoutedCalls.call`):

1. ``router.pick(now, cost=C)`` chooses a replica by power of two choices on in-flight
   cost, skipping replicas whose breaker is open;
2. the RPC carries the remaining deadline twice: as the gRPC timeout and as
   ``header.deadline_unix_ms`` (:func:`recserve.rpc.deadline.make_header`), so the
   server sees it whichever way it reads it; every attempt carries the same
   ``header.request_id``, so the servers' log lines of one call join up;
3. ``router.on_result`` reports the status (feeding the breaker and the work signal);
4. a retryable status (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) is retried on
   another replica while the deadline has time left and ``router.can_retry`` grants a
   token from the shared retry budget (retries stay within ``retry_budget`` x primary
   calls + ``retry_burst``, whatever fails). Any other status is final and raised at once.
   Only idempotent methods (reads: Rank, EmbedUser, Recommend) go through here.

One server-streaming call (:meth:`RoutedCalls.stream`: ``Generate``) takes the same
steps with two differences: a call is retried only **before its first message
arrived** (after that the caller has consumed part of an answer, and a second replica
would start over), and its cost follows the stream (a ``progress`` callback gives the
new cost per message: a generation stream's active tokens and KV occupancy,
:class:`~recserve.routing.DecodeLoad`). The first message closes the replica's breaker
(:meth:`~recserve.routing.Router.on_answer`); a replica that dies mid-stream still
counts against it. Closing the stream (``aclose()``, or dropping it after ``break``)
cancels the RPC. A ``key`` (``session_key``) routes by consistent-hash affinity instead
of two choices, falling back clockwise when the owner's breaker is open.

Failures surface as the :class:`~recserve.errors.RecserveError` of the server's status
(:func:`recserve.rpc.status.error_from_code`: the status crosses the hop unchanged), the
message naming the replica and the method, with ``retry_after_s`` from the server's
``retry-after-ms`` trailer. When no replica can take the call the router's
:class:`~recserve.errors.Unavailable` (with ``retry_after_s``) propagates. Cancelling the
caller cancels the RPC and reports CANCELLED to the router (no verdict on the replica's
health).

Stubs are injected (``stub_factory``) so unit tests drive the loop with fake stubs and a
fake clock, no sockets; by default one grpc.aio channel is opened per replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recserve.config.spec import TlsConfig
from recserve.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from recserve.logs import inherited_request_id
from recserve.lookup.transport import channel_options
from recserve.routing import Router, RoutingConfig, is_retryable
from recserve.routing.resolve import Membership, ReplicaResolver
from recserve.rpc.auth import DEFAULT_API_KEY_METADATA, forwarded_metadata, open_channel
from recserve.rpc.deadline import make_header
from recserve.rpc.status import error_from_code
from recserve.v1 import common_pb2

__all__ = ["CallStats", "RoutedCalls", "StubFactory", "ids_arg", "retry_after_s", "stream_verdict", "verdict"]

# address -> stub (an object whose method attributes are grpc.aio unary-unary callables).
StubFactory = Callable[[str], Any]
DRAIN_GRACE_S = 30.0  # a replica the resolver dropped: its calls still out get this long to finish
log = logging.getLogger(__name__)


@dataclasses.dataclass
class CallStats:
    """Counters since the client was built (all calls, every method)."""

    attempts: int = 0  # RPCs sent, retries included
    retries: int = 0  # attempts after the first, granted by the retry budget
    retries_refused_by_budget: int = 0  # retryable failures raised because no token was left


def ids_arg(array: np.ndarray | Sequence[int], field: str) -> np.ndarray:
    """int64 [N] from an integer array argument; a float or 2-D array is a caller bug,
    named here rather than truncated or flattened silently."""
    a = np.asarray(array)
    if a.ndim != 1:
        raise InvalidArgument(f"{field} has shape {list(a.shape)}; pass a 1-D int64 array [N]")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise InvalidArgument(f"{field} has dtype {a.dtype.name}; pass integer item ids (int64)")
    return np.ascontiguousarray(a, dtype=np.int64)


def retry_after_s(error: grpc.aio.AioRpcError) -> float | None:
    """The server's ``retry-after-ms`` trailer (set by :func:`recserve.rpc.status.abort_with`)."""
    trailers = error.trailing_metadata()
    value = trailers.get("retry-after-ms") if isinstance(trailers, grpc.aio.Metadata) else None
    try:
        return float(value) / 1e3 if value is not None else None
    except (TypeError, ValueError):
        return None  # a malformed hint is no hint


def verdict(code: grpc.StatusCode, timeout_s: float | None, usual_s: float) -> grpc.StatusCode:
    """The status the router should judge the replica by. A DEADLINE_EXCEEDED on a call
    whose whole timeout was shorter than the replica's usual latency (its hedge-delay
    percentile) says the caller's budget was tight, not that the replica is sick: the
    cascade's stages set such deadlines on purpose, and three of them must not open a
    healthy ranker's breaker. It is reported as CANCELLED (no verdict; the time waited
    still feeds the latency estimate)."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout_s is not None and timeout_s < usual_s:
        return grpc.StatusCode.CANCELLED
    return code


def stream_verdict(code: grpc.StatusCode, answered: bool, timeout_s: float | None, usual_s: float) -> grpc.StatusCode:
    """The status the router should judge a streaming call by. Before its first message,
    as :func:`verdict`. After it, the replica has shown it serves: a DEADLINE_EXCEEDED
    then is the caller's budget running out mid-stream, reported as CANCELLED (no
    verdict); any other status (UNAVAILABLE: the replica died mid-stream) counts."""
    if answered and code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return grpc.StatusCode.CANCELLED
    return verdict(code, timeout_s, usual_s)


def _forwarded(own: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """The ``metadata=`` keyword of an outgoing call: the key of the request it is made
    for, else the client's own ``api_key``, else nothing (no keyword at all, so test
    fakes without a metadata parameter keep working)."""
    metadata = forwarded_metadata() or own
    return {"metadata": metadata} if metadata else {}


class RoutedCalls:
    """Channels, router and retry loop for one replica set of one gRPC service.

    Args:
        addresses: ``host:port`` of each replica (distinct).
        stub_class: the generated stub (``ranking_pb2_grpc.RankingStub``), built on each channel.
        service: the full service name (``"recserve.v1.Ranking"``): the health check's
            service, and the name clients use in ``FailedPrecondition`` messages.
        what: the replica's kind in messages (``"ranker"``, ``"recommender"``).
        config: the routing section of the spec (two choices, breakers, retry budget).
        weights: capacity weight per replica (default all 1; see :class:`~recserve.routing.Router`).
        rng: random generator for two choices (inject a seeded one in tests).
        clock: monotonic seconds; the router's clock and the timeline of deadlines. gRPC
            timeouts are the differences ``deadline - clock()``, so a fake clock must
            tick in seconds.
        max_message_bytes: send / receive limit per channel.
        stub_factory: address -> stub, replacing the channels (tests: fake stubs; no
            channel is opened, so :meth:`check_ready` reports every replica not ready).
        tls: the spec's ``[tls]``: channels verify the replicas' certificates when it is
            enabled (:mod:`recserve.rpc.auth`).
        api_key: this client's tenant API key, sent as ``x-api-key`` call metadata
            (``""`` = none: the key-less tenant).
        resolver: how replica names are resolved (default: :func:`recserve.routing.resolve.default_resolver`,
            the host's DNS under ``RECSERVE_RESOLVE`` overrides). With fake stubs and no
            resolver, nothing is looked up.
        resolve: False keeps the addresses as given (gRPC resolves a name itself, to one
            channel): for a client that indexes per-replica state of its own. Names are
            also kept under ``tls`` (the servers' certificates name them, not pod IPs).

    An address that is a name (a Kubernetes headless Service) stands for every address it
    resolves to: :meth:`start` resolves it and the calls re-resolve it every ``[routing]
    dns_refresh_ms`` in the background (:meth:`refresh`), so pods an autoscaler adds get
    traffic and removed ones stop getting it (:mod:`recserve.routing.resolve`).

    Every call carries the API key of the request it is made for, if any
    (:func:`recserve.rpc.auth.forwarded_metadata`): a cascade's Rank calls prove the
    tenant to the rankers with the key its own caller sent.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        stub_class: Callable[[grpc.aio.Channel], Any],
        *,
        service: str,
        what: str,
        config: RoutingConfig = RoutingConfig(),
        weights: Sequence[float] | None = None,
        rng: np.random.Generator | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_message_bytes: int = 64 << 20,
        stub_factory: StubFactory | None = None,
        tls: TlsConfig | None = None,
        api_key: str = "",
        resolver: ReplicaResolver | None = None,
        resolve: bool = True,
    ) -> None:
        self.router = Router(addresses, config, weights=weights, rng=rng)
        # Names among the addresses (a headless Service) are re-resolved, one replica per
        # answer (recserve.routing.resolve). Fake stubs without a fake resolver: no lookups.
        # Under TLS the name stays: a certificate names the host, not the pods' IPs.
        dynamic = resolve and (resolver is not None or stub_factory is None) and not (tls is not None and tls.enabled)
        membership = Membership(self.router.replicas, resolver, refresh_s=config.dns_refresh_ms / 1e3, now=clock()) if dynamic else None
        self.membership = membership if membership is not None and membership.dynamic else None
        self._refreshing: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()  # channels of removed replicas, draining
        self._tls = tls
        self._own_metadata: tuple[tuple[str, str], ...] = ((DEFAULT_API_KEY_METADATA, api_key),) if api_key else ()
        self.addresses = self.router.replicas
        self.service = service
        self.what = what
        self.stats = CallStats()
        self.clock = clock
        self._stub_class = stub_class
        self._stub_factory = stub_factory
        self._options = channel_options(max_message_bytes)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, Any] = {}

    # ---- lifecycle ----------------------------------------------------------------

    @property
    def started(self) -> bool:
        return bool(self._stubs)

    async def start(self) -> None:
        """Open one channel per replica (inside the running loop: grpc.aio binds a
        channel to the loop that made it). Connecting is lazy, so a replica that is down
        now costs nothing until it is picked."""
        if self._stubs:
            return
        self._open(self.addresses)
        if self.membership is not None:
            await self.refresh()  # route over the pods behind a name from the first call

    def _open(self, addresses: Sequence[str]) -> None:
        for address in addresses:
            if address in self._stubs:
                continue
            if self._stub_factory is not None:
                self._stubs[address] = self._stub_factory(address)
                continue
            channel = open_channel(address, self._tls, self._options)
            self._channels[address] = channel
            self._stubs[address] = self._stub_class(channel)

    async def refresh(self) -> bool:
        """Re-resolve the replica names now (off the event loop: the lookup blocks) and
        route over the answer: new replicas get channels, removed ones get no more calls
        and their channels close once their calls are done (a grace). Whether the set
        changed. Called at start and, every ``[routing] dns_refresh_ms``, by the calls."""
        if self.membership is None:
            return False
        await asyncio.to_thread(self.membership.refresh, self.clock())
        # Apply the membership's current answer (not just this refresh's change: one that
        # completed while the client was closed must still reach the router).
        want = self.membership.replicas
        if not self._stubs or want == self.router.replicas:
            return False
        keep = set(want)
        removed = [a for a in self.router.replicas if a not in keep]
        self._open(want)
        self.router.set_replicas(want)
        self.addresses = self.router.replicas
        closing = [self._channels.pop(a) for a in removed if a in self._channels]
        for address in removed:
            self._stubs.pop(address, None)
        for channel in closing:  # in-flight calls on them finish within the grace, then are cancelled
            task = asyncio.get_running_loop().create_task(channel.close(DRAIN_GRACE_S))
            self._closing.add(task)  # held: the loop keeps only a weak reference to a task
            task.add_done_callback(self._closing.discard)
        return True

    def _maybe_refresh(self) -> None:
        """Start a background re-resolution when one is due (never on the call's path)."""
        m = self.membership
        if m is None or (self._refreshing is not None and not self._refreshing.done()) or not m.due(self.clock()):
            return

        async def run() -> None:
            try:
                await self.refresh()
            except Exception:  # a resolver bug must not fail calls: the current set stays
                log.exception("re-resolving %s replicas failed", self.what)

        self._refreshing = asyncio.get_running_loop().create_task(run())

    async def aclose(self) -> None:
        """Close every channel; RPCs still out end CANCELLED."""
        if self._refreshing is not None:
            self._refreshing.cancel()
            self._refreshing = None
        channels = list(self._channels.values())
        self._channels.clear()
        self._stubs.clear()
        await asyncio.gather(*(c.close(None) for c in channels))

    async def check_ready(self, timeout_s: float = 1.0) -> dict[str, bool]:
        """address -> whether the replica reports :attr:`service` SERVING on gRPC health
        within ``timeout_s`` (checked concurrently; a refusal or a timeout is False)."""
        request = health_pb2.HealthCheckRequest(service=self.service)

        async def one(address: str) -> bool:
            channel = self._channels.get(address)
            if channel is None:
                return False
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout_s)
            except grpc.aio.AioRpcError:
                return False
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

        answers = await asyncio.gather(*(one(a) for a in self.addresses))
        return dict(zip(self.addresses, answers, strict=True))

    # ---- the routed call ----------------------------------------------------------

    def deadline(self, timeout_s: float | None, deadline: float | None) -> float:
        """The call's deadline on :attr:`clock` (``math.inf``: none): the earlier of
        ``deadline`` and now + ``timeout_s``."""
        if timeout_s is not None and not timeout_s > 0:
            raise InvalidArgument(f"timeout_s is {timeout_s}; use a positive number of seconds (or None for no deadline)")
        out = math.inf if deadline is None else deadline
        if timeout_s is not None:
            out = min(out, self.clock() + timeout_s)
        return out

    def _next_attempt(
        self, method: str, deadline: float, cost: float, key: str | None, retry_of: str | None, attempts: int, failure: str
    ) -> tuple[float, str, float | None]:
        """The next attempt of a routed call (unary or stream): DEADLINE_EXCEEDED once the
        deadline has passed, else the replica the router picks (by ``key`` affinity when
        given; Unavailable naming the last failure when every breaker is open), counted in
        the stats. Returns (now, replica, the attempt's timeout in s; None: no deadline)."""
        now = self.clock()
        remaining = deadline - now
        if remaining <= 0:
            raise DeadlineExceeded(
                f"{self.what} {method}: the deadline passed {-remaining * 1e3:.1f} ms ago"
                + (f", after {attempts} attempts (last on {retry_of})" if attempts else ", before the first attempt")
            )
        try:
            replica = self.router.pick(now, key=key, cost=cost, retry_of=retry_of)
        except Unavailable as exc:  # every breaker open: fail fast, naming the first failure
            if retry_of is None:
                raise
            raise Unavailable(f"{exc.message}; after {failure}", retry_after_s=exc.retry_after_s) from None
        self.stats.attempts += 1
        self.stats.retries += retry_of is not None
        return now, replica, None if math.isinf(remaining) else remaining

    async def call(
        self,
        method: str,
        build: Callable[[common_pb2.RequestHeader], Any],
        *,
        cost: float,
        deadline: float,
        tenant: str,
        priority: str,
        request_id: str = "",
        client: str = "client",
    ) -> tuple[Any, str, int]:
        """Send ``method`` (built per attempt by ``build(header)``) through the router
        until it answers, fails for good, the deadline passes or the retry budget
        refuses. ``request_id`` ``""``: the bound one (:mod:`recserve.logs`), else a
        fresh one. ``client`` names the caller in the not-started message. Returns
        (reply, replica, attempts)."""
        if not self._stubs:
            raise FailedPrecondition(f"{client}.{method}: the client is not started; call await start() (or use async with)")
        self._maybe_refresh()
        router = self.router
        # One id across attempts, so the servers' logs join them: the caller's, else the
        # request this call is made for (a cascade calling rankers), else a fresh one.
        request_id = request_id or inherited_request_id() or uuid.uuid4().hex
        retry_of: str | None = None
        failure = ""  # the last failed attempt, for the message
        attempts = 0
        while True:
            now, replica, timeout = self._next_attempt(method, deadline, cost, None, retry_of, attempts, failure)
            attempts += 1
            request = build(make_header(timeout_s=timeout, tenant=tenant, priority=priority, request_id=request_id))
            rpc = getattr(self._stubs[replica], method)(request, timeout=timeout, **_forwarded(self._own_metadata))
            # Anything escaping the await other than a status (the caller's cancellation,
            # the channel closed under us) is no verdict on the replica: CANCELLED.
            code = grpc.StatusCode.CANCELLED
            try:
                reply = await rpc
                code = grpc.StatusCode.OK
                return reply, replica, attempts
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                failure = f"{self.what} {replica}: {method}: {code.name}: {exc.details() or ''}"
                retry_after = retry_after_s(exc)
            except asyncio.CancelledError:
                rpc.cancel()
                raise
            finally:
                end = self.clock()
                router.on_result(replica, verdict(code, timeout, router.hedge_delay(replica)), end - now, end, cost=cost)
            refusal = self._why_not_retry(code, deadline)
            if refusal is not None:
                error = error_from_code(code, failure + refusal)
                error.retry_after_s = retry_after
                raise error
            retry_of = replica

    async def stream(
        self,
        method: str,
        build: Callable[[common_pb2.RequestHeader], Any],
        *,
        cost: float,
        deadline: float,
        tenant: str,
        priority: str,
        session_key: str = "",
        progress: Callable[[Any], float] | None = None,
        on_start: Callable[[str, grpc.aio.Metadata | None], None] | None = None,
        request_id: str = "",
        client: str = "client",
    ) -> AsyncGenerator[tuple[Any, str, int], None]:
        """Send the server-streaming ``method`` through the router; yield (message,
        replica, attempts) per message received.

        Retried on another replica like :meth:`call`, but only while no message has
        arrived; after the first one, a failure is raised as is. ``session_key``: routes
        by affinity (and travels in ``header.session_key``) when not ``""``.
        ``progress(message)``: the call's cost once ``message`` arrived (default: the
        cost stays ``cost``). ``on_start(replica, initial_metadata)``: called once, when
        the first message arrived (the replica's in-band load report). Closing the
        generator cancels the RPC (reported CANCELLED: no verdict on the replica)."""
        if not self._stubs:
            raise FailedPrecondition(f"{client}.{method}: the client is not started; call await start() (or use async with)")
        self._maybe_refresh()
        router = self.router
        request_id = request_id or inherited_request_id() or uuid.uuid4().hex
        key = session_key or None
        retry_of: str | None = None
        failure = ""
        attempts = 0
        while True:
            now, replica, timeout = self._next_attempt(method, deadline, cost, key, retry_of, attempts, failure)
            attempts += 1
            header = make_header(timeout_s=timeout, tenant=tenant, priority=priority, request_id=request_id)
            header.session_key = session_key
            rpc = getattr(self._stubs[replica], method)(build(header), timeout=timeout, **_forwarded(self._own_metadata))
            code = grpc.StatusCode.CANCELLED  # anything but a status or the end: no verdict
            current = cost  # the cost the router holds for this call now
            answered = False
            retry_after: float | None = None
            try:
                async for message in rpc:
                    if not answered:
                        answered = True
                        at = self.clock()
                        router.on_answer(replica, at - now, at)
                        if on_start is not None:
                            on_start(replica, await rpc.initial_metadata())  # resolved: a message came after it
                    if progress is not None:
                        new = progress(message)
                        router.add_inflight(replica, new - current)
                        current = new
                    yield message, replica, attempts
                code = grpc.StatusCode.OK
                return
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                failure = f"{self.what} {replica}: {method}: {code.name}: {exc.details() or ''}"
                retry_after = retry_after_s(exc)
            except (asyncio.CancelledError, GeneratorExit):
                rpc.cancel()
                raise
            finally:
                end = self.clock()
                judged = stream_verdict(code, answered, timeout, router.hedge_delay(replica))
                # After on_answer timed the first message, the stream's length is no latency.
                router.on_result(replica, judged, None if answered else end - now, end, cost=current)
            refusal = " (not retried: the stream had started)" if answered and is_retryable(code) else self._why_not_retry(code, deadline)
            if refusal is not None:
                error = error_from_code(code, failure + refusal)
                error.retry_after_s = retry_after
                raise error
            retry_of = replica

    def _why_not_retry(self, code: grpc.StatusCode, deadline: float) -> str | None:
        """None when a failed attempt may be retried (a budget token is then spent),
        else what to add to its error message ("" when the status says it all)."""
        if not is_retryable(code):
            return ""  # the answer of a healthy replica: retrying cannot change it
        if deadline - self.clock() <= 0:
            return " (not retried: the deadline has passed)"
        if not self.router.can_retry(code):
            self.stats.retries_refused_by_budget += 1
            return " (not retried: the retry budget is spent)"
        return None
