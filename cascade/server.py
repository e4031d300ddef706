"""The cascade process (``recserve cascade serve``): Recommender and Admin over gRPC,
health, reflection, start-up and shutdown.

Start-up: listen first (health NOT_SERVING, calls UNAVAILABLE with a retry hint), open
the export, load or build the L0 index (progress bar), connect the ranking client and
wait until every ranker answers health SERVING, then SERVING for "",
``recserve.v1.Recommender`` and ``recserve.v1.Admin``. SIGTERM: health NOT_SERVING, a
grace period for in-flight calls, then the ranking client closes.

Readiness also needs the deep check (:func:`recommend_baseline`, recserve/rpc/health.py)
to pass: a fixed Recommend through the real core must answer its baseline item ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time

import grpc
import numpy as np

from cascade.report import to_proto
from cascade.service import PROBE_REQUEST_ID, CascadeCore, RecommendQuery, Recommendation, open_cascade
from recserve.config.spec import ClusterConfig, TlsConfig
from recserve.errors import PermissionDenied, RecserveError, ResourceExhausted, Unauthenticated, Unimplemented
from recserve.metrics import catalog
from recserve.metrics.serve import start_and_record
from recserve.rpc.deadline import context_from_header
from recserve.rpc.health import Baseline, DeepCheck, DeepCheckConfig, shard_upserts
from recserve.rpc.server import add_health_and_reflection, make_server
from recserve.rpc.status import abort_with
from recserve.rpc.auth import AdminAuth, TenantAuth, open_channel
from recserve.rpc.serving import Slot, serve_loaded, wait_until_serving
from recserve.rpc.tensors import ids_from, pack
from recserve.v1 import admin_pb2, admin_pb2_grpc, recommender_pb2, recommender_pb2_grpc

log = logging.getLogger(__name__)

RECOMMENDER_SERVICE = recommender_pb2.DESCRIPTOR.services_by_name["Recommender"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
MAX_MESSAGE_BYTES = 64 << 20
GRACE_S = 2.0
RANKER_WAIT_S = 180.0
FAISS_THREADS = 1
PROBE_USER = 0  # the deep check's fixed Recommend: a known user, the default k
PROBE_DEADLINE_S = 1.0  # generous, so a healthy cascade answers it undegraded
PROBE_RTOL, PROBE_ATOL = 1e-4, 1e-6  # near-tied items may swap places (see differing_items)
MODEL_STATUS_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True)
class CascadeProcessConfig:
    cluster: ClusterConfig
    models_dir: str
    ranker_addresses: tuple[str, ...]
    shard_addresses: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0
    port_file: str = ""
    admin_token: str = ""  # read from $[admin] token_env; also sent on the AddItems calls to rankers and shards
    insecure_admin: bool = False  # --insecure-admin: no token, admin operations open to every caller
    index_dir: str = ""  # a saved index to load ('' = build from the export's vectors)
    metrics_port: int = 0  # Prometheus /metrics on host (0 = a free port, -1 = none)
    metrics_port_file: str = ""  # the bound metrics port is written here before gRPC listens


def record_metrics(rec: Recommendation) -> None:
    """One answered Recommend into ``/metrics``: each stage's time (skipped stages too)
    and degraded reason, and the response's degraded reason (a few samples per request)."""
    for report in rec.reports:
        catalog.CASCADE_STAGE_LATENCY.labels(report.stage).observe(report.elapsed_ms / 1e3)
        if report.degraded:
            catalog.CASCADE_STAGE_DEGRADED.labels(report.stage, report.degraded_reason.value).inc()
    if rec.degraded:
        catalog.DEGRADED_RESPONSES.labels(RECOMMENDER_SERVICE.rpartition(".")[2], rec.degraded_reason).inc()


class RecommenderServicer(recommender_pb2_grpc.RecommenderServicer):
    def __init__(self, slot: Slot[CascadeCore], tenants: TenantAuth | None = None) -> None:
        self.slot = slot
        self.tenants = tenants or TenantAuth(None)

    async def Recommend(self, request: recommender_pb2.RecommendRequest, context: grpc.aio.ServicerContext) -> recommender_pb2.RecommendResponse:
        try:
            # First, the tenant its key proves (also bound for the Rank calls made for it).
            tenant = self.tenants.resolve(context.invocation_metadata(), request.header.tenant)
            core = self.slot.get()
            ctx = context_from_header(request.header, context.time_remaining(), default_timeout_s=core.config.default_deadline_ms / 1e3)
            query = core.query(request.user_id, request.k, ids_from(request.exclude_ids, "exclude_ids"), ids_from(request.recent_item_ids, "recent_item_ids"),
                               deadline=ctx.deadline, tenant=tenant, priority=ctx.priority, request_id=ctx.request_id)
            rec = await core.recommend(query)
        except RecserveError as exc:
            await abort_with(context, exc)
            raise
        record_metrics(rec)
        return recommender_pb2.RecommendResponse(
            item_ids=pack(rec.item_ids), scores=pack(rec.scores), stages=[to_proto(r) for r in rec.reports], coverage=rec.coverage,
            degraded=rec.degraded, degraded_reason=rec.degraded_reason, index_version=rec.index_version, model_version=rec.model_version,
        )  # fmt: skip


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, slot: Slot[CascadeCore], process: CascadeProcessConfig) -> None:
        self.slot = slot
        self.process = process
        self.admin = AdminAuth(process.admin_token, token_env=process.cluster.admin.token_env, insecure=process.insecure_admin)

    async def RefreshIndex(self, request: admin_pb2.RefreshIndexRequest, context: grpc.aio.ServicerContext) -> admin_pb2.RefreshIndexResponse:
        try:
            self.admin.check(context.invocation_metadata(), "Admin.RefreshIndex", request.admin_token)  # before anything about the process shows
            context_from_header(request.header, context.time_remaining())  # an expired request is refused, not executed
            core = self.slot.get()
            t0 = time.perf_counter()
            new, old = await core.refresh_index(request.index_path)
        except RecserveError as exc:
            await abort_with(context, exc)
            raise
        return admin_pb2.RefreshIndexResponse(index_version=new, previous_version=old, items=core.index_items(), seconds=time.perf_counter() - t0)

    async def AddItems(self, request: admin_pb2.AddItemsRequest, context: grpc.aio.ServicerContext) -> admin_pb2.AddItemsResponse:
        try:
            self.admin.check(context.invocation_metadata(), "Admin.AddItems", request.admin_token)
            context_from_header(request.header, context.time_remaining())  # an expired request is refused, not executed
            core = self.slot.get()
            ids = ids_from(request.item_ids, "item_ids")
            version, added, upserted = await core.add_items(
                ids, ids_from(request.categories, "categories"), ids_from(request.tag_ids, "tag_ids"), ids_from(request.tag_lengths, "tag_lengths"),
            )  # fmt: skip
        except RecserveError as exc:
            await abort_with(context, exc)
            raise
        return admin_pb2.AddItemsResponse(index_version=version, added=added, upserted_rows=upserted, num_items=core.view.num_items)

    async def ReloadModels(self, request: admin_pb2.ReloadModelsRequest, context: grpc.aio.ServicerContext) -> admin_pb2.ReloadModelsResponse:
        # The generated base would answer "Unexpected <class 'NotImplementedError'>".
        await abort_with(context, Unimplemented("Admin.ReloadModels is served by the rankers (recserve ranker serve), not by the cascade: send it to each ranker"))
        raise AssertionError("unreachable: abort raises")

    async def ModelStatus(self, request: admin_pb2.ModelStatusRequest, context: grpc.aio.ServicerContext) -> admin_pb2.ModelStatusResponse:
        try:
            context_from_header(request.header, context.time_remaining())  # an expired request is refused, not executed
            core = self.slot.get()
        except RecserveError as exc:
            await abort_with(context, exc)
            raise
        return admin_pb2.ModelStatusResponse(model_version=core.view.model_version, models_dir=str(core.view.path), requests=core.requests)


def differing_items(expected: tuple[np.ndarray, np.ndarray], got: tuple[np.ndarray, np.ndarray]) -> str:
    """How a Recommend's (item ids int64 [k], scores float32 [k]) differs from the
    baseline's ("" = it does not). Items whose scores are within rtol PROBE_RTOL may swap
    places: a Rank batch of another size rounds the last bits differently."""
    (want_ids, want_scores), (ids, scores) = expected, got
    if ids.shape != want_ids.shape:
        return f"{ids.shape[0]} items, the baseline {want_ids.shape[0]}"
    moved = np.flatnonzero(ids != want_ids)
    if moved.size == 0:
        return ""
    if np.array_equal(np.sort(ids[moved]), np.sort(want_ids[moved])) and np.allclose(scores[moved], want_scores[moved], rtol=PROBE_RTOL, atol=PROBE_ATOL):
        return ""  # near-ties swapped
    return f"item ids {ids[:10].tolist()}..., the baseline {want_ids[:10].tolist()}... (first difference at rank {int(moved[0])})"


async def ranker_versions(addresses: tuple[str, ...], tls: TlsConfig | None) -> tuple[str, ...] | None:
    """Each ranker's model_version (Admin.ModelStatus), or None when one does not answer."""

    async def one(address: str) -> str:
        async with open_channel(address, tls) as channel:
            reply = await admin_pb2_grpc.AdminStub(channel).ModelStatus(admin_pb2.ModelStatusRequest(), timeout=MODEL_STATUS_TIMEOUT_S)
            return str(reply.model_version)

    try:
        return tuple(await asyncio.gather(*(one(a) for a in addresses)))
    except grpc.aio.AioRpcError:
        return None


def recommend_baseline(core: CascadeCore, config: CascadeProcessConfig) -> Baseline[tuple[np.ndarray, np.ndarray]]:
    """The cascade's deep check: a fixed Recommend (user PROBE_USER, the default k)
    through the real core (its door, L0..L3, the rankers), whose item ids must repeat the
    first undegraded answer's. A degraded or shed answer is no verdict. The epoch (what
    may rightly change the answer): the index version and size, the rankers' model
    versions (None while they differ: a rollout), the shards' upsert counts.

    It calls the rankers as the key-less tenant (no caller key to forward). Where every
    tenant has a key, the rankers refuse it (UNAUTHENTICATED): no verdict, said once."""
    none = np.zeros(0, np.int64)
    refused = False

    async def answer() -> tuple[np.ndarray, np.ndarray] | None:
        nonlocal refused
        query = core.query(PROBE_USER, 0, none, none, deadline=time.monotonic() + PROBE_DEADLINE_S, tenant="",
                           priority="critical", request_id=PROBE_REQUEST_ID)  # fmt: skip
        try:
            rec = await core.recommend(query)
        except ResourceExhausted:  # shed: the cascade is busy, not broken
            return None
        except (Unauthenticated, PermissionDenied) as exc:
            if not refused:
                log.warning("cascade deep check: the rankers refuse its key-less Rank calls (%s): its Recommend gives no verdict", exc)
                refused = True
            return None
        refused = False
        return None if rec.degraded else (np.asarray(rec.item_ids), np.asarray(rec.scores))

    async def epoch() -> tuple[object, ...] | None:
        versions, upserts = await asyncio.gather(ranker_versions(config.ranker_addresses, config.cluster.tls), shard_upserts(config.shard_addresses))
        if versions is None or upserts is None or len(set(versions)) > 1:
            return None
        return (core.index_version, core.view.num_items, versions, upserts)

    return Baseline(answer, differing_items, epoch=epoch, what=f"cascade: the fixed Recommend for user {PROBE_USER}")


async def _load(config: CascadeProcessConfig) -> CascadeCore:
    await wait_until_serving(config.ranker_addresses, service="recserve.v1.Ranking", what="ranker", timeout_s=RANKER_WAIT_S, tls=config.cluster.tls)
    return await open_cascade(config.cluster, config.models_dir, config.ranker_addresses, shard_addresses=config.shard_addresses,
                              admin_token=config.admin_token, index_dir=config.index_dir)


async def serve(config: CascadeProcessConfig, stop: asyncio.Event | None = None) -> None:
    """Run the cascade until ``stop`` is set or SIGTERM / SIGINT arrives (listening, and
    NOT_SERVING, while it waits for its rankers and builds its index: :func:`serve_loaded`)."""
    import faiss

    # One OpenMP thread: FAISS's pool is process-global, and on a shared 2-core box its
    # threads spin against the shards and rankers (small builds measured ~5x slower).
    faiss.omp_set_num_threads(FAISS_THREADS)
    # /metrics first: its port file is written before the gRPC one, which launchers wait for.
    start_and_record(config.host, config.metrics_port, config.metrics_port_file)
    server = make_server(max_message_bytes=MAX_MESSAGE_BYTES)
    slot: Slot[CascadeCore] = Slot("cascade (index and rankers)")
    recommender_pb2_grpc.add_RecommenderServicer_to_server(RecommenderServicer(slot, TenantAuth.from_cluster(config.cluster, os.environ)), server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(slot, config), server)
    health = await add_health_and_reflection(server, [RECOMMENDER_SERVICE, ADMIN_SERVICE])
    deep: list[DeepCheck] = []
    deep_config = DeepCheckConfig.from_env(os.environ)  # before listening: a bad value fails the start

    def ready(core: CascadeCore, port: int) -> None:
        check = DeepCheck(health, [RECOMMENDER_SERVICE, ADMIN_SERVICE], recommend_baseline(core, config), config=deep_config,
                          on_change=slot.set_not_serving, what="cascade")  # fmt: skip
        check.start()
        deep.append(check)
        log.info("cascade SERVING on %s:%d: index %s, model_version %s", config.host, port, core.index_version, core.view.model_version)

    try:
        await serve_loaded(server, health, [RECOMMENDER_SERVICE, ADMIN_SERVICE], slot, lambda: _load(config), what="cascade", host=config.host,
                           port=config.port, port_file=config.port_file, on_ready=ready, stop=stop, grace_s=GRACE_S, tls=config.cluster.tls)  # fmt: skip
    finally:
        for check in deep:
            await check.aclose()


__all__ = ["CascadeProcessConfig", "RecommendQuery", "serve"]
