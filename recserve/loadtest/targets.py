"""What ``recserve loadtest`` sends requests to: one small ABC, one factory keyed by an Enum.

A :class:`Target` serves request ``i`` (pool entry ``i % size`` of a
:class:`~recserve.loadtest.requests.RequestPool`) by a deadline on the driver's monotonic
clock and says whether the answer was degraded; any failure raises, and
:func:`status_name` names it by its gRPC status. Targets:

* ``recommend`` over gRPC: one ``Recommender.Recommend`` per request on the cascade
  (round-robin over the addresses given), a plain stub so one request is one RPC; the
  user's latest history items go as ``recent_item_ids``;
* ``rank`` over gRPC: :class:`recserve.client.RankingClient` over the rankers (routed by
  two choices; its retries are counted in ``attempts``): the user's real candidates, its
  latest history items as ``history_item_ids``;
* ``lookup`` over gRPC: a :class:`~recserve.lookup.client.LookupClient` of the load
  test's own, on the plan the shards serve (``GetPlan``), sending each request's DLRM
  features (user, candidates, history, categories, tags) as one caller would;
* ``recommend`` / ``rank`` over HTTP: ``POST /v1/recommendations`` and ``POST /v1/rank``
  of the gateway (aiohttp) with the same fields, the JSON error body's ``kind`` naming
  the status.

``server_requests()`` reads the servers' own request counter (cascade and rankers:
``Admin.ModelStatus.requests``; shards: ``ShardInfo.rpcs``), so a run can be checked
against what the servers saw.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from recserve.errors import ConfigError, ErrorKind, InvalidArgument, RecserveError
from recserve.loadtest.requests import RequestPool
from recserve.rpc.status import GRPC_CODE, HTTP_STATUS
from recserve.rpc.tensors import pack

if TYPE_CHECKING:
    from recserve.config.spec import ClusterConfig
    from recserve.lookup.config import LookupClientConfig


class TargetKind(enum.Enum):
    RECOMMEND = "recommend"
    RANK = "rank"
    LOOKUP = "lookup"


_KIND_OF_HTTP: dict[int, ErrorKind] = {status: kind for kind, status in HTTP_STATUS.items()}  # the one mapping, read backwards


def status_name(error: BaseException) -> str:
    """The gRPC status name a failed request is counted under."""
    if isinstance(error, RecserveError):
        return GRPC_CODE[error.kind].name
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code().name
    if isinstance(error, HttpError):
        return error.status
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return "DEADLINE_EXCEEDED"
    if isinstance(error, (ConnectionError, OSError)):
        return "UNAVAILABLE"
    return "INTERNAL"


class HttpError(Exception):
    """A non-200 answer of the gateway, named by its status (``"RESOURCE_EXHAUSTED"``)."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


class Target(abc.ABC):
    """One endpoint under load (see the module docstring)."""

    kind: TargetKind
    label: str = ""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def call(self, i: int, deadline_s: float) -> bool:
        """Serve request ``i`` by ``deadline_s`` (monotonic); True when degraded."""

    @abc.abstractmethod
    async def aclose(self) -> None: ...

    async def server_requests(self) -> int | None:
        """The servers' own count of requests (None where there is none to read)."""
        return None


def _remaining(deadline_s: float) -> float:
    # A request the generator reaches after its deadline still goes out with a sliver of
    # time: it fails DEADLINE_EXCEEDED on the server's clock, counted like any other.
    return max(deadline_s - time.monotonic(), 1e-3)


class _Channels:
    """One grpc.aio channel per address, handed out round-robin."""

    def __init__(self, addresses: Sequence[str], stub: Callable[[grpc.aio.Channel], Any]) -> None:
        if not addresses:
            raise ConfigError("loadtest: no server address; pass --grpc HOST:PORT[,HOST:PORT...] or --data DIR of a running `recserve serve`")
        self.addresses = list(addresses)
        self._make = stub
        self.channels: list[grpc.aio.Channel] = []
        self.stubs: list[Any] = []
        self._next = itertools.cycle(range(len(self.addresses)))

    def open(self) -> None:
        from recserve.lookup.transport import channel_options

        self.channels = [grpc.aio.insecure_channel(a, options=channel_options(64 << 20)) for a in self.addresses]
        self.stubs = [self._make(c) for c in self.channels]

    def pick(self) -> Any:
        return self.stubs[next(self._next)]

    async def close(self) -> None:
        await asyncio.gather(*(c.close(None) for c in self.channels))


async def _model_status_requests(channels: _Channels) -> int:
    from recserve.rpc.deadline import make_header
    from recserve.v1 import admin_pb2, admin_pb2_grpc

    replies = await asyncio.gather(*(admin_pb2_grpc.AdminStub(c).ModelStatus(admin_pb2.ModelStatusRequest(header=make_header(timeout_s=10.0)), timeout=10.0)
                                     for c in channels.channels))  # fmt: skip
    return int(sum(r.requests for r in replies))


class GrpcRecommendTarget(Target):
    kind = TargetKind.RECOMMEND

    def __init__(self, addresses: Sequence[str], pool: RequestPool, *, k: int = 0) -> None:
        from recserve.v1.recommender_pb2_grpc import RecommenderStub

        self.pool, self.k = pool, k
        self._channels = _Channels(addresses, RecommenderStub)
        self.label = f"Recommend over gRPC at {','.join(addresses)}"

    async def start(self) -> None:
        self._channels.open()

    async def call(self, i: int, deadline_s: float) -> bool:
        from recserve.rpc.deadline import make_header
        from recserve.v1 import recommender_pb2

        timeout = _remaining(deadline_s)
        e = self.pool.entry(i)
        request = recommender_pb2.RecommendRequest(header=make_header(timeout_s=timeout), user_id=int(self.pool.user_ids[e]), k=self.k)
        recent = self.pool.history(e)
        if recent.size:  # the user's latest real items, as a feed service passes what it just showed
            request.recent_item_ids.CopyFrom(pack(recent))
        reply = await self._channels.pick().Recommend(request, timeout=timeout)
        return bool(reply.degraded)

    async def aclose(self) -> None:
        await self._channels.close()

    async def server_requests(self) -> int | None:
        return await _model_status_requests(self._channels)


class GrpcRankTarget(Target):
    kind = TargetKind.RANK

    def __init__(self, addresses: Sequence[str], pool: RequestPool, *, model: str = "", routing: Any = None) -> None:
        from recserve.client import RankingClient
        from recserve.routing import RoutingConfig
        from recserve.v1.admin_pb2_grpc import AdminStub

        self.pool, self.model = pool, model
        self.client = RankingClient(addresses, routing if routing is not None else RoutingConfig())  # the spec's [routing], as the cascade's
        self._admin = _Channels(addresses, AdminStub)
        self.label = f"Rank over gRPC at {','.join(addresses)}"

    async def start(self) -> None:
        await self.client.start()
        self._admin.open()

    async def call(self, i: int, deadline_s: float) -> bool:
        e = self.pool.entry(i)
        # The client's clock is the driver's (time.monotonic): the deadline passes as is.
        history = self.pool.history(e)
        result = await self.client.rank(int(self.pool.user_ids[e]), self.pool.candidates[e], model=self.model, deadline=deadline_s,
                                        history_item_ids=history if history.size else None)  # fmt: skip
        return bool(result.degraded)

    async def aclose(self) -> None:
        await self.client.aclose()
        await self._admin.close()

    async def server_requests(self) -> int | None:
        return await _model_status_requests(self._admin)

    @property
    def attempts(self) -> int:
        return self.client.stats.attempts


WARM_UP_LOOKUPS = 32  # sequential, before the run (GrpcLookupTarget.start)


class GrpcLookupTarget(Target):
    """DLRM lookups of each request through a LookupClient of the load test's own."""

    kind = TargetKind.LOOKUP

    def __init__(self, addresses: Sequence[str], pool: RequestPool, config: LookupClientConfig, view: Any, *, kjt_cache: dict[int, Any] | None = None) -> None:
        self.pool, self.config, self.addresses = pool, config, list(addresses)
        self._view = view
        self._arrays: Any = None
        # pool entry -> its KJT; share one dict between targets of the same pool (the
        # window sweep's arms) to build them once.
        self._kjts: dict[int, Any] = {} if kjt_cache is None else kjt_cache
        self.client: Any = None
        self.label = f"feature-parallel lookups of {len(addresses)} shards"

    async def start(self) -> None:
        import torch

        from ranker.features import serving_arrays
        from recserve.lookup.client import LookupClient

        # One torch thread, as the ranker and the demo run: the client pools on the event
        # loop, and two intra-op threads spinning against each other (and the shards) on a
        # shared 2-core box stretched a 500-id window's pooling to ~20 ms here, stalling
        # the generator with it.
        torch.set_num_threads(1)
        from recserve.lookup.transport import GrpcShardTransport
        from recserve.sharding.plan import ShardingPlan

        transport = GrpcShardTransport(self.addresses, max_frame_bytes=self.config.lookup.http2_max_frame_bytes)
        plan = ShardingPlan.from_json((await transport.get_plan(0, 10.0)).plan_json)
        self.client = LookupClient(self.config, plan, transport)
        # Every request's KJT before the run: building one (and torch's first import)
        # on the send path would read as the generator's own lag.
        if len(self._kjts) < self.pool.size:
            self._arrays = serving_arrays(self._view)
            for e in range(self.pool.size):
                self.kjt(e)
        await self.client.start()
        # A few lookups with a generous deadline before any load: the first windows pay
        # one-off costs (torch's first embedding_bag, channel set-up), and the client's
        # admission estimates its service time from the windows it runs; learnt from a
        # cold window alone, it would shed every caller with a tight deadline, so no
        # window would ever run to correct it.
        for e in range(min(WARM_UP_LOOKUPS, self.pool.size)):
            await self.client.lookup(self.kjt(e), pooled=True, timeout_s=2.0)

    def kjt(self, e: int) -> Any:
        """The KJT of pool entry ``e`` (built once): DLRM's features of (user, candidate) pairs, [C] each."""
        kjt = self._kjts.get(e)
        if kjt is None:
            from ranker.features import sparse_features
            from ranker.models.dlrm import DLRM_FEATURES

            cand = self.pool.candidates[e]
            users = np.full(cand.shape[0], self.pool.user_ids[e], dtype=np.int64)
            kjt = self._kjts[e] = sparse_features(self._arrays, DLRM_FEATURES, users, cand).kjt()
        return kjt

    async def call(self, i: int, deadline_s: float) -> bool:
        result = await self.client.lookup(self.kjt(self.pool.entry(i)), pooled=True, deadline=deadline_s)
        return bool(result.degraded)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def shard_infos(self) -> list[Any]:
        t = self.client.transport
        return list(await asyncio.gather(*(t.shard_info(s, 10.0) for s in range(self.client.runtime.plan.num_shards))))

    async def server_requests(self) -> int | None:
        return int(sum(i.rpcs for i in await self.shard_infos()))


class HttpTarget(Target):
    """``POST /v1/recommendations`` or ``POST /v1/rank`` of the gateway at ``url``."""

    def __init__(self, kind: TargetKind, url: str, pool: RequestPool, *, k: int = 0, model: str = "", headers: dict[str, str] | None = None) -> None:
        if kind is TargetKind.LOOKUP:
            raise InvalidArgument("--target lookup drives the shards over gRPC; the gateway serves recommend and rank (drop --http)")
        self.kind, self.pool, self.k, self.model = kind, pool, k, model
        self.url = url.rstrip("/") + ("/v1/recommendations" if kind is TargetKind.RECOMMEND else "/v1/rank")
        self.headers = dict(headers or {})
        self.session: Any = None
        self.label = f"POST {self.url}"

    async def start(self) -> None:
        import aiohttp

        # No connection cap: an open loop must not queue in its own client.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=self.headers)

    async def call(self, i: int, deadline_s: float) -> bool:
        import aiohttp

        timeout = _remaining(deadline_s)
        e = self.pool.entry(i)
        body: dict[str, Any] = {"user_id": int(self.pool.user_ids[e]), "deadline_ms": max(int(math.floor(timeout * 1e3)), 1)}
        history = self.pool.history(e).tolist()
        if self.kind is TargetKind.RECOMMEND:
            if self.k:
                body["k"] = self.k
            if history:
                body["recent_item_ids"] = history
        else:
            body["candidate_ids"] = self.pool.candidates[e].tolist()
            if history:
                body["history_item_ids"] = history
            if self.model:
                body["model"] = self.model
        async with self.session.post(self.url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            data = await response.json(content_type=None)
            if response.status != 200:
                kind = str((data.get("error") or {}).get("kind", "")).upper() if isinstance(data, dict) else ""
                if kind not in grpc.StatusCode.__members__:
                    kind = GRPC_CODE[_KIND_OF_HTTP.get(response.status, ErrorKind.INTERNAL)].name
                raise HttpError(kind, f"{self.url}: HTTP {response.status}: {data}")
            return bool(data.get("degraded", False))

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()


def make_target(
    kind: TargetKind,
    pool: RequestPool,
    *,
    grpc_addresses: Sequence[str] = (),
    http_url: str | None = None,
    cluster: ClusterConfig | None = None,
    lookup_config: LookupClientConfig | None = None,
    view: Any = None,
    k: int = 0,
    model: str = "",
    kjt_cache: dict[int, Any] | None = None,
) -> Target:
    """The target of ``kind``: over HTTP when ``http_url`` is given, else over gRPC at
    ``grpc_addresses`` (recommend: the cascade; rank: the rankers; lookup: the shards,
    in shard order, with ``lookup_config`` or the client config of ``cluster``)."""
    if http_url is not None:
        return HttpTarget(kind, http_url, pool, k=k, model=model)
    if kind is TargetKind.RECOMMEND:
        return GrpcRecommendTarget(grpc_addresses, pool, k=k)
    if kind is TargetKind.RANK:
        return GrpcRankTarget(grpc_addresses, pool, model=model, routing=cluster.routing if cluster is not None else None)
    if lookup_config is None:
        if cluster is None:
            raise InvalidArgument("--target lookup needs the cluster spec (--config) for its tables and features")
        from recserve.lookup.config import LookupClientConfig

        lookup_config = LookupClientConfig.from_cluster(cluster)
    if view is None:
        raise InvalidArgument("--target lookup needs the catalog (--catalog DIR) to build each request's features")
    return GrpcLookupTarget(grpc_addresses, pool, lookup_config, view, kjt_cache=kjt_cache)
