"""The ranker process (``recserve ranker serve``): Ranking and Admin over gRPC, health,
reflection, start-up and shutdown.

Start-up order, so readiness is honest:

1. bind and start the grpc.aio server (:func:`recserve.rpc.server.make_server`); health
   reports NOT_SERVING for "", ``recserve.v1.Ranking`` and ``recserve.v1.Admin``; the
   port goes to ``port_file`` (atomically) for launchers that asked for port 0;
2. wait until every shard is SERVING (up to ``SHARD_WAIT_S``), read every shard's ShardInfo (the model_version of each table) and the plan (GetPlan);
3. load the export and start the lookup client (:func:`ranker.service.open_model_set`:
   FAILED_PRECONDITION, and the process exits non-zero, when the shards do not serve
   this export's tables at its version);
4. health -> SERVING.

SIGTERM / SIGINT: health NOT_SERVING, in-flight RPCs get a grace period, then the lookup
client and executors close.

Co-location (``[generation] co_locate``; ``recserve ranker serve --with-generation``): the
composition root hands :func:`serve` the critical lane of a shared
:class:`~recserve.scheduling.device.DeviceExecutor` for the forwards and a
:class:`Colocated` service (Generation, on the best-effort lane of the same executor)
that registers on this server, loads after the ranker and reports SERVING with it. The
ranker package never imports the generation one: the caller composes them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Protocol

import grpc
import numpy as np

from ranker.batch import QueryKind
from ranker.serving import versions_from_shard_info
from ranker.service import Answer, RankingCore, open_model_set
from recserve.config.spec import ClusterConfig
from recserve.errors import InvalidArgument, RecserveError, Unavailable, Unimplemented
from recserve.metrics import catalog
from recserve.metrics.serve import start_and_record
from recserve.rpc.deadline import RequestContext, context_from_header
from recserve.rpc.health import Baseline, DeepCheck, DeepCheckConfig, shard_upserts
from recserve.rpc.server import add_health_and_reflection, make_server
from recserve.rpc.status import abort_with, error_from_code
from recserve.rpc.auth import DEFAULT_TOKEN_ENV, AdminAuth, TenantAuth
from recserve.rpc.serving import Slot, serve_loaded, wait_until_serving
from recserve.rpc.tensors import ids_from, pack
from recserve.sharding.plan import ShardingPlan
from recserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2, embedding_pb2, ranking_pb2, ranking_pb2_grpc
from recserve.v1.embedding_pb2_grpc import EmbeddingShardStub

log = logging.getLogger(__name__)

RANKING_SERVICE = ranking_pb2.DESCRIPTOR.services_by_name["Ranking"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
RANKING_SHORT = RANKING_SERVICE.rpartition(".")[2]  # the service label of recserve's metrics
ADMIN_TOKEN_ENV = DEFAULT_TOKEN_ENV  # [admin] token_env's default
MAX_MESSAGE_BYTES = 64 << 20
GRACE_S = 2.0
SHARD_INFO_TIMEOUT_S = 10.0
SHARD_WAIT_S = 120.0  # a ranker started with its shards waits this long for their tiers
# The deep check's fixed Rank must repeat its baseline scores this closely: a batch of
# another size may round differently in the last bits, a wrong answer differs in the first.
PROBE_RTOL, PROBE_ATOL = 1e-4, 1e-6


@dataclasses.dataclass(frozen=True)
class RankerProcessConfig:
    """One ranker process: the cluster spec, the export, the shards, where to listen."""

    cluster: ClusterConfig
    models_dir: str
    shard_addresses: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0
    port_file: str = ""
    admin_token: str = ""  # read from $[admin] token_env; "" = admin refused unless insecure_admin
    insecure_admin: bool = False  # --insecure-admin: no token, admin operations open to every caller
    metrics_port: int = 0  # Prometheus /metrics on host (0 = a free port, -1 = none)
    metrics_port_file: str = ""  # the bound metrics port is written here before gRPC listens


class Colocated(Protocol):
    """A second service served by the ranker process on its device (see the module doc)."""

    @property
    def services(self) -> Sequence[str]:
        """Its gRPC service names: health and reflection list them with the ranker's."""
        ...

    def register(self, server: grpc.aio.Server) -> None:
        """Add its servicers to ``server`` (before it starts)."""

    async def load(self) -> None:
        """Load and start it (after the ranker has loaded, before health says SERVING)."""

    async def aclose(self) -> None:
        """Drain and close it (after the server stopped; also when it never loaded)."""


def _context(header: common_pb2.RequestHeader, context: grpc.aio.ServicerContext, core: RankingCore) -> RequestContext:
    return context_from_header(header, context.time_remaining(), default_timeout_s=core.config.default_timeout_ms / 1e3)


def _reason(answer: Answer) -> str:
    return ",".join(answer.degraded_reasons)


class RankingServicer(ranking_pb2_grpc.RankingServicer):
    def __init__(self, slot: Slot[RankingCore], tenants: TenantAuth | None = None) -> None:
        self.slot = slot
        self.tenants = tenants or TenantAuth(None)

    async def Rank(self, request: ranking_pb2.RankRequest, context: grpc.aio.ServicerContext) -> ranking_pb2.RankResponse:
        try:
            tenant = self.tenants.resolve(context.invocation_metadata(), request.header.tenant)  # first: who asks
            core = self.slot.get()
            ctx = _context(request.header, context, core)
            query = core.query(QueryKind.RANK, request.model, request.user_id, ids_from(request.candidate_ids, "candidate_ids"), ids_from(request.history_item_ids, "history_item_ids"))
            a = await core.submit(query, deadline=ctx.deadline, tenant=tenant, priority=ctx.priority, request_id=ctx.request_id)
        except RecserveError as exc:
            await abort_with(context, exc)
            raise  # unreachable: abort raises
        for reason in a.degraded_reasons:  # recserve_degraded_responses_total: one per reason
            catalog.DEGRADED_RESPONSES.labels(RANKING_SHORT, reason).inc()
        return ranking_pb2.RankResponse(
            item_ids=pack(a.item_ids), scores=pack(a.scores), degraded=a.degraded, degraded_reason=_reason(a),
            missing_rows=a.missing_rows, model_version=a.model_version, model=a.model,
        )  # fmt: skip

    async def EmbedUser(self, request: ranking_pb2.EmbedUserRequest, context: grpc.aio.ServicerContext) -> ranking_pb2.EmbedUserResponse:
        try:
            tenant = self.tenants.resolve(context.invocation_metadata(), request.header.tenant)  # first: who asks
            core = self.slot.get()
            ctx = _context(request.header, context, core)
            query = core.query(QueryKind.EMBED, "", request.user_id, np.zeros(0, np.int64), ids_from(request.history_item_ids, "history_item_ids"))
            a = await core.submit(query, deadline=ctx.deadline, tenant=tenant, priority=ctx.priority, request_id=ctx.request_id)
        except RecserveError as exc:
            await abort_with(context, exc)
            raise
        assert a.vector is not None
        return ranking_pb2.EmbedUserResponse(vector=pack(a.vector), model_version=a.model_version, degraded=a.degraded, degraded_reason=_reason(a), missing_rows=a.missing_rows)


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, slot: Slot[RankingCore], process: RankerProcessConfig) -> None:
        self.slot = slot
        self.process = process
        self.admin = AdminAuth(process.admin_token, token_env=process.cluster.admin.token_env, insecure=process.insecure_admin)
        self._reloading = asyncio.Lock()

    async def ReloadModels(self, request: admin_pb2.ReloadModelsRequest, context: grpc.aio.ServicerContext) -> admin_pb2.ReloadModelsResponse:
        try:
            self.admin.check(context.invocation_metadata(), "Admin.ReloadModels", request.admin_token)  # before anything about the process shows
            context_from_header(request.header, context.time_remaining())  # an expired request is refused, not executed
            core = self.slot.get()
            if not request.models_dir:
                raise InvalidArgument("models_dir is empty: name the `recserve train --out` directory to load")
            if self._reloading.locked():
                raise Unavailable("another ReloadModels is in progress; retry when it has finished", retry_after_s=1.0)
            async with self._reloading:
                t0 = time.perf_counter()
                plan, reported = await shard_state(self.process.shard_addresses)
                new = await open_model_set(self.process.cluster, request.models_dir, self.process.shard_addresses, plan=plan, reported=reported, expected_version=request.model_version)
                old = await core.reload(new)
        except RecserveError as exc:
            await abort_with(context, exc)
            raise
        return admin_pb2.ReloadModelsResponse(model_version=new.version, previous_version=old.version, tables=sorted(new.served.values()), load_seconds=time.perf_counter() - t0)

    async def AddItems(self, request: admin_pb2.AddItemsRequest, context: grpc.aio.ServicerContext) -> admin_pb2.AddItemsResponse:
        try:
            self.admin.check(context.invocation_metadata(), "Admin.AddItems", request.admin_token)  # before anything about the process shows
            context_from_header(request.header, context.time_remaining())  # an expired request is refused, not executed
            core = self.slot.get()
            ids = ids_from(request.item_ids, "item_ids")
            vectors = await core.add_items(ids, ids_from(request.categories, "categories"), ids_from(request.tag_ids, "tag_ids"), ids_from(request.tag_lengths, "tag_lengths"))
        except RecserveError as exc:
            await abort_with(context, exc)
            raise
        return admin_pb2.AddItemsResponse(added=int(ids.shape[0]), vectors=pack(vectors), num_items=core.current.export.arrays.num_items)

    async def RefreshIndex(self, request: admin_pb2.RefreshIndexRequest, context: grpc.aio.ServicerContext) -> admin_pb2.RefreshIndexResponse:
        # The generated base would answer "Unexpected <class 'NotImplementedError'>".
        await abort_with(context, Unimplemented("Admin.RefreshIndex is served by the cascade (recserve cascade serve), not by a ranker: send it to the cascade"))
        raise AssertionError("unreachable: abort raises")

    async def ModelStatus(self, request: admin_pb2.ModelStatusRequest, context: grpc.aio.ServicerContext) -> admin_pb2.ModelStatusResponse:
        try:
            context_from_header(request.header, context.time_remaining())  # an expired request is refused, not executed
            core = self.slot.get()
        except RecserveError as exc:
            await abort_with(context, exc)
            raise
        ms = core.current
        st = ms.client.stats
        return admin_pb2.ModelStatusResponse(
            model_version=ms.version, models_dir=str(ms.export.path), models=sorted(ms.models), tables=sorted(ms.served.values()), reloads=core.reloads,
            forwards=core.forwards, requests=core.requests, lookup_windows=st.windows, lookup_ids=st.ids_requested, lookup_unique_ids=st.ids_unique,
        )  # fmt: skip


def differing_scores(expected: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> str:
    """How the fixed Rank's scores by candidate id (model -> float32 [C]) differ from the
    baseline's beyond rtol PROBE_RTOL ("" = they do not)."""
    for model, want in expected.items():
        have = got.get(model)
        if have is None or have.shape != want.shape:
            return f"model {model!r} answered {None if have is None else have.shape[0]} scores, the baseline {want.shape[0]}"
        bad = np.flatnonzero(~np.isclose(have, want, rtol=PROBE_RTOL, atol=PROBE_ATOL))
        if bad.size:
            i = int(bad[0])
            return (f"model {model!r} scored item {i} {float(have[i]):.6g}, the baseline {float(want[i]):.6g} "
                    f"({bad.size} of {want.shape[0]} items differ beyond rtol {PROBE_RTOL:g})")  # fmt: skip
    return ""


def rank_baseline(core: RankingCore, shard_addresses: Sequence[str]) -> Baseline[dict[str, np.ndarray]]:
    """The ranker's deep check: :meth:`RankingCore.deep_probe` (every candidate once,
    finite scores), whose scores must repeat the first undegraded answer's. A degraded
    or shed answer is no verdict; a ReloadModels re-takes the baseline, and so does a
    differing answer after an upsert on any shard (the epoch: reloads and upsert counts)."""
    reloads = core.reloads

    async def answer() -> dict[str, np.ndarray] | None:
        nonlocal reloads
        if core.reloads != reloads:  # another model set: its own answer is the baseline
            reloads = core.reloads
            baseline.reset()
        answers = await core.deep_probe()
        if len(answers) < len(core.config.models) or any(a.degraded for a in answers.values()):
            return None
        return {model: a.scores[np.argsort(a.item_ids)] for model, a in answers.items()}  # by candidate id

    async def epoch() -> tuple[object, ...] | None:
        upserts = await shard_upserts(shard_addresses)
        return None if upserts is None else (core.reloads, core.current.version, core.current.export.arrays.num_items, upserts)

    baseline: Baseline[dict[str, np.ndarray]] = Baseline(answer, differing_scores, epoch=epoch, what="ranker: the fixed Rank for user 0")
    return baseline


async def shard_state(addresses: Sequence[str]) -> tuple[ShardingPlan, dict[str, str]]:
    """(the shards' newest plan, table -> model_version over every shard)."""
    infos = []
    plan: ShardingPlan | None = None
    for k, address in enumerate(addresses):
        async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]) as channel:
            stub = EmbeddingShardStub(channel)
            try:
                infos.append(await stub.ShardInfo(embedding_pb2.ShardInfoRequest(), timeout=SHARD_INFO_TIMEOUT_S))
                reply = await stub.GetPlan(embedding_pb2.GetPlanRequest(), timeout=SHARD_INFO_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                raise error_from_code(exc.code(), f"shard {k} at {address}: {exc.details()}") from None
            got = ShardingPlan.from_json(reply.plan_json)
            if plan is None or got.version > plan.version:
                plan = got
    if plan is None:
        raise InvalidArgument("no shard addresses: pass --shards HOST:PORT[,HOST:PORT...] or set shard_addresses in the spec")
    return plan, versions_from_shard_info(infos)


async def _load(config: RankerProcessConfig, executor: Executor | None = None, colocated: Colocated | None = None) -> RankingCore:
    await wait_until_serving(config.shard_addresses, what="shard", timeout_s=SHARD_WAIT_S)
    plan, reported = await shard_state(config.shard_addresses)
    models = await open_model_set(config.cluster, config.models_dir, config.shard_addresses, plan=plan, reported=reported)
    core = RankingCore(config.cluster.ranker, models, executor=executor)
    if colocated is not None:
        try:
            await colocated.load()
        except BaseException:
            await core.aclose()  # its lookup client is running; serve_loaded never got the core
            raise
    return core


async def serve(config: RankerProcessConfig, stop: asyncio.Event | None = None, *, executor: Executor | None = None,
                colocated: Colocated | None = None) -> None:  # fmt: skip
    """Run one ranker until ``stop`` is set or SIGTERM / SIGINT arrives (listening, and
    NOT_SERVING, while it waits for its shards and loads: :func:`serve_loaded`).
    ``executor`` runs the forwards (default: the core's own thread); ``colocated`` is
    served beside Ranking (see the module doc)."""
    # /metrics first: its port file is written before the gRPC one, which launchers wait for.
    start_and_record(config.host, config.metrics_port, config.metrics_port_file)
    server = make_server(max_message_bytes=MAX_MESSAGE_BYTES)
    slot: Slot[RankingCore] = Slot("ranker (models and shard tables)")
    ranking_pb2_grpc.add_RankingServicer_to_server(RankingServicer(slot, TenantAuth.from_cluster(config.cluster, os.environ)), server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(slot, config), server)
    services = [RANKING_SERVICE, ADMIN_SERVICE]
    if colocated is not None:
        colocated.register(server)
        services += list(colocated.services)
    health = await add_health_and_reflection(server, services)

    deep: list[DeepCheck] = []
    deep_config = DeepCheckConfig.from_env(os.environ)  # before listening: a bad value fails the start

    def ready(core: RankingCore, port: int) -> None:
        core.start()
        # Readiness also needs a fixed Rank to pass and repeat its scores (recserve.rpc.health):
        # a wedged executor or a wrong answer turns it NOT_SERVING and its calls UNAVAILABLE.
        check = DeepCheck(health, services, rank_baseline(core, config.shard_addresses), config=deep_config,
                          on_change=slot.set_not_serving, what="ranker")  # fmt: skip
        check.start()
        deep.append(check)
        log.info("ranker SERVING on %s:%d: models %s, model_version %s%s", config.host, port, list(core.current.models), core.current.version,
                 f", co-located with {list(colocated.services)}" if colocated is not None else "")  # fmt: skip

    try:
        await serve_loaded(server, health, services, slot, lambda: _load(config, executor, colocated), what="ranker", host=config.host,
                           port=config.port, port_file=config.port_file, on_ready=ready, stop=stop, grace_s=GRACE_S, tls=config.cluster.tls)  # fmt: skip
    finally:
        for check in deep:
            await check.aclose()
        if colocated is not None:  # the server has stopped: no new streams; drain what runs
            await colocated.aclose()
