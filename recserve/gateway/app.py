"""The gateway's aiohttp application: routes, the edge middleware and the handlers.

``make_app`` wires a :class:`Downstream` (a :class:`recserve.client.RecClient` in the
process; a fake in tests), the tenants and the spec into a ``web.Application``:

* ``POST /v1/recommendations``, ``POST /v1/rank``: authenticate (401), parse and
  validate the body (400 / 422, :mod:`recserve.gateway.validate`), take the tenant's
  quota (429 + ``Retry-After``), then call downstream with one absolute deadline: the
  earlier of ``gateway.timeout_ms`` and the body's ``deadline_ms``, counted from the
  request's arrival. Downstream statuses map to HTTP through
  :func:`recserve.rpc.status.http_error_body` only (DEADLINE_EXCEEDED -> 504, ...).
* ``POST /v1/generate``: the same gates, then a :class:`Generator` stream (the
  :class:`recserve.client.generation.GenerationClient` over ``--generators``) answered
  as server-sent events (``text/event-stream``): one ``event: chunk`` per generated
  chunk, whose ``data`` is a ``GenerateChunk`` JSON object, the last with ``finished``.
  The response starts only once the first chunk has arrived, so an error before it (a
  bad prompt: 400 naming the field; no replica: 503; the deadline: 504) is an ordinary
  JSON error answer; an error after it is one ``event: error`` whose ``data`` is the
  error body, and the stream ends. The stream's budget is the earlier of
  ``generation.default_timeout_ms`` and the body's ``deadline_ms``; a client that
  disconnects cancels the RPC, and the replica stops the sequence at its next step.
  Without generators: 503.
* ``GET /healthz`` (the process lives), ``GET /readyz`` (every downstream SERVING, the
  answer cached :data:`READY_CACHE_S`), ``GET /metrics`` (this process, Prometheus text),
  ``GET /openapi.json``; ``GET /`` and ``GET /v1/status`` from
  :mod:`recserve.gateway.status` when scrape targets are given.

The edge middleware gives every response an ``X-Request-Id`` (the caller's, when it sent
a sane one), turns every error into the one JSON error body, records
``recserve_http_requests_total`` / ``recserve_http_latency_seconds`` by route, and caps
requests in flight at ``gateway.max_concurrency`` (429 + ``Retry-After``). A client that
disconnects cancels its handler (the runner is built with ``handler_cancellation``), and
so the downstream RPC: its server sees CANCELLED.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from aiohttp import web

from recserve.cluster.supervise import SUPERVISOR_STATE_ENV, read_report
from recserve.config.spec import ClusterConfig
from recserve.errors import InternalError, InvalidField, RecserveError, ResourceExhausted, Unavailable
from recserve.gateway.openapi import openapi_document
from recserve.gateway.schemas import ObjectSchema, request_schemas
from recserve.gateway.tenants import Quotas, TenantTable
from recserve.rpc.auth import bind_caller_key
from recserve.gateway.validate import parse_json_object, validate
from recserve.logs import set_request_id
from recserve.metrics import catalog
from recserve.rpc.status import http_error_body, retry_after_header

log = logging.getLogger(__name__)

READY_CACHE_S = 0.5  # /readyz answers from a check at most this old
DEFAULT_MAX_NEW_TOKENS = 32  # a /v1/generate body without max_new_tokens (at most generation.max_new_tokens_cap)
READY_CHECK_TIMEOUT_S = 1.0
REQUEST_ID_HEADER = "X-Request-Id"
ERROR_MESSAGE = web.ResponseKey("error_message", str)
_SANE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")  # a caller's id is echoed only if it is this


class Downstream(Protocol):
    """What the gateway needs of :class:`recserve.client.RecClient`."""

    @property
    def clock(self) -> Callable[[], float]:
        """Monotonic seconds: the timeline of ``deadline`` arguments."""

    async def recommend(self, user_id: int, k: int = 0, *, deadline: float | None = None, exclude_ids: np.ndarray | None = None,
                        recent_item_ids: np.ndarray | None = None, tenant: str = "default", priority: str = "standard",
                        request_id: str = "") -> Any: ...  # fmt: skip

    async def rank(self, user_id: int, candidate_ids: np.ndarray, *, model: str = "", history_item_ids: np.ndarray | None = None,
                   deadline: float | None = None, tenant: str = "default", priority: str = "standard", request_id: str = "") -> Any: ...  # fmt: skip

    async def check_ready(self, timeout_s: float = 1.0) -> dict[str, bool]: ...


class Generator(Protocol):
    """What the gateway needs of :class:`recserve.client.generation.GenerationClient`:
    ``generate`` is an async generator of chunks (``index``, ``tokens`` int32 [n],
    ``text``, ``finished``, ``finish_reason``, ``emitted_unix_us``); closing it cancels
    the stream. ``deadline`` is on the downstream's clock."""

    def generate(self, prompt: str = "", *, prompt_tokens: np.ndarray | Sequence[int] | None = None, max_new_tokens: int = 32,
                 temperature: float = 0.0, seed: int = 0, session_key: str = "", timeout_s: float | None = None,
                 deadline: float | None = None, tenant: str = "default", priority: str = "best_effort",
                 request_id: str = "") -> AsyncIterator[Any]: ...  # fmt: skip

    async def check_ready(self, timeout_s: float = 1.0) -> dict[str, bool]: ...


@dataclasses.dataclass
class Gateway:
    """The live state behind the handlers (one per app)."""

    cluster: ClusterConfig
    downstream: Downstream
    tenants: TenantTable
    quotas: Quotas
    schemas: dict[str, ObjectSchema]
    openapi: bytes  # the document, serialised once
    generator: Generator | None = None  # None: /v1/generate answers 503
    inflight: int = 0
    ready_at: float = -1e18  # clock of the cached readiness
    ready: dict[str, bool] = dataclasses.field(default_factory=dict)
    ready_check: asyncio.Task[dict[str, bool]] | None = None


GATEWAY_KEY = web.AppKey("gateway", Gateway)
# Per-request values the edge middleware sets for the handlers (typed keys: aiohttp warns on str keys).
REQUEST_ID = web.RequestKey("request_id", str)
ARRIVAL_S = web.RequestKey("arrival_s", float)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_app(
    cluster: ClusterConfig,
    downstream: Downstream,
    tenants: TenantTable,
    *,
    scrape_targets: Mapping[str, str] | None = None,
    generator: Generator | None = None,
) -> web.Application:
    """The application (unstarted). ``cluster.gateway`` sets the body cap, the timeout
    and the concurrency cap; ``scrape_targets`` (name -> ``/metrics`` URL) adds the
    status page when given; ``generator`` serves ``POST /v1/generate`` (None: 503)."""
    schemas = request_schemas(cluster)
    gateway = Gateway(
        cluster=cluster, downstream=downstream, tenants=tenants, quotas=Quotas(tenants.tenants), schemas=schemas,
        openapi=json.dumps(openapi_document(cluster, status_page=scrape_targets is not None), indent=1).encode(), generator=generator,
    )  # fmt: skip
    # client_max_size: aiohttp refuses a longer body while reading it, before it is whole.
    app = web.Application(middlewares=[edge_middleware], client_max_size=cluster.gateway.max_body_bytes)
    app[GATEWAY_KEY] = gateway
    app.router.add_post("/v1/recommendations", recommendations)
    app.router.add_post("/v1/rank", rank)
    app.router.add_post("/v1/generate", generate)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    if scrape_targets is not None:
        from recserve.gateway import status

        status.add_routes(app, scrape_targets)
    return app


# ---- the edge ------------------------------------------------------------------------

def _route(request: web.Request) -> str:
    """The route template (a bounded label set): unmatched paths are one label."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def edge_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request id, the JSON error body for every failure, the HTTP metrics."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    request_id = given if _SANE_REQUEST_ID.match(given) else uuid.uuid4().hex
    request[REQUEST_ID] = request_id
    set_request_id(request_id)  # this request's log lines, here and downstream of the handler, carry it
    request[ARRIVAL_S] = request.app[GATEWAY_KEY].downstream.clock()
    route = _route(request)
    started = time.perf_counter()
    status = 499  # nginx's "client closed request": what a cancelled handler is counted as
    try:
        try:
            response = await handler(request)
        except web.HTTPException as exc:  # the router's 404 / 405
            response = _http_exception(exc, request_id)
        except RecserveError as exc:
            response = error_response(exc, request_id)
        except asyncio.CancelledError:
            log.info("%s %s: cancelled (the client went away)", request.method, route)
            raise
        except Exception as exc:  # a bug: 500, logged with its traceback (never the headers)
            log.exception("%s %s failed", request.method, route)
            response = error_response(exc, request_id)
        response.headers[REQUEST_ID_HEADER] = request_id
        status = response.status
        if status >= 400:
            log.log(logging.WARNING if status >= 500 else logging.INFO, "%s %s -> %d: %s", request.method, route, status, response.get(ERROR_MESSAGE, ""))
        return response
    finally:
        observe_http(route, status, time.perf_counter() - started)


def error_response(error: BaseException, request_id: str) -> web.Response:
    status, body = http_error_body(error, request_id)
    response = web.json_response(body, status=status)
    response[ERROR_MESSAGE] = body["error"]["message"]  # for the edge's log line (never a key: messages do not quote them)
    retry = retry_after_header(error)
    if retry is not None:
        response.headers["Retry-After"] = retry
    return response


def _http_exception(exc: web.HTTPException, request_id: str) -> web.Response:
    body = {"error": {"status": exc.status, "kind": exc.reason.lower().replace(" ", "_"), "field": None, "value": None,
                      "message": f"{exc.reason}: no such route or method; see GET /openapi.json"}, "request_id": request_id}  # fmt: skip
    return web.json_response(body, status=exc.status, headers={k: v for k, v in exc.headers.items() if k == "Allow"})


def observe_http(route: str, status: int, seconds: float) -> None:
    """One finished request in ``recserve_http_requests_total{route,status}`` and
    ``recserve_http_latency_seconds{route}`` (:mod:`recserve.metrics.catalog`)."""
    catalog.HTTP_REQUESTS.labels(route=route, status=str(status)).inc()
    catalog.HTTP_LATENCY.labels(route=route).observe(seconds)


# ---- request endpoints ---------------------------------------------------------------

class _Admitted:
    """One request through the gates, in order: a process slot (``max_concurrency``:
    429, shed like a scheduler's admission), its tenant (401), its body (400 / 422), the tenant's quota (429; a body that
    fails costs no token). Whatever it took is given back on exit, or at once when a
    gate refuses."""

    def __init__(self, request: web.Request, schema: str) -> None:
        self.request = request
        self.gateway = request.app[GATEWAY_KEY]
        self.schema = self.gateway.schemas[schema]
        self.slot = False
        self.tenant_name: str | None = None  # set once its quota is taken

    async def __aenter__(self) -> tuple[str, str, dict[str, Any]]:
        g, request, limit = self.gateway, self.request, self.gateway.cluster.gateway
        if g.inflight >= limit.max_concurrency:
            # Overload, not a dead process: RESOURCE_EXHAUSTED (429) is what every shedding
            # door answers (issue 17), and a client may retry it after Retry-After.
            raise ResourceExhausted(f"the gateway has {g.inflight} requests in flight (gateway.max_concurrency = {limit.max_concurrency})", retry_after_s=1.0)
        # Taken before the first await (reading the body), so concurrent readers count.
        g.inflight += 1
        self.slot = True
        try:
            presented = request.headers.get(g.tenants.header)
            tenant = g.tenants.authenticate(presented)
            # The downstream gRPC servers authenticate the tenant again: forward the key.
            bind_caller_key(presented or "", g.tenants.header.lower())
            body = validate(self.schema, parse_json_object(await _read_body(request, limit.max_body_bytes)))
            g.quotas.admit(tenant.name, g.downstream.clock())
        except BaseException:
            await self.__aexit__()
            raise
        self.tenant_name = tenant.name
        return tenant.name, tenant.priority, body

    async def __aexit__(self, *exc: object) -> None:
        if self.slot:
            self.slot = False
            self.gateway.inflight -= 1
        if self.tenant_name is not None:
            self.gateway.quotas.release(self.tenant_name)
            self.tenant_name = None


async def _read_body(request: web.Request, cap: int) -> bytes:
    """The whole body, or InvalidField (400) if it is longer than ``cap`` bytes (by its
    Content-Length before reading, or while reading a chunked one)."""
    length = request.content_length
    if length is not None and length > cap:
        raise InvalidField("body", length, f"the body is {length:,} bytes; gateway.max_body_bytes is {cap:,}: send a smaller request")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise InvalidField("body", None, f"the body is over gateway.max_body_bytes = {cap:,} bytes: send a smaller request") from None


def _deadline(request: web.Request, body: dict[str, Any]) -> float:
    """The absolute deadline (downstream clock): arrival + the earlier of the gateway's
    timeout and the body's ``deadline_ms``."""
    g = request.app[GATEWAY_KEY]
    budget_ms = min(g.cluster.gateway.timeout_ms, body.get("deadline_ms", g.cluster.gateway.timeout_ms))
    return request[ARRIVAL_S] + budget_ms / 1e3


async def recommendations(request: web.Request) -> web.Response:
    async with _Admitted(request, "RecommendRequest") as (tenant, priority, body):
        rec = await request.app[GATEWAY_KEY].downstream.recommend(
            body["user_id"], body.get("k", 0), deadline=_deadline(request, body), exclude_ids=body.get("exclude_ids"),
            recent_item_ids=body.get("recent_item_ids"), tenant=tenant, priority=priority, request_id=request[REQUEST_ID],
        )  # fmt: skip
    return web.json_response({
        "item_ids": rec.item_ids.tolist(), "scores": rec.scores.tolist(), "stages": [dataclasses.asdict(s) for s in rec.stages],
        "coverage": rec.coverage, "degraded": rec.degraded, "degraded_reason": rec.degraded_reason,
        "index_version": rec.index_version, "model_version": rec.model_version, "request_id": request[REQUEST_ID],
    })  # fmt: skip


async def rank(request: web.Request) -> web.Response:
    async with _Admitted(request, "RankRequest") as (tenant, priority, body):
        res = await request.app[GATEWAY_KEY].downstream.rank(
            body["user_id"], body["candidate_ids"], model=body.get("model", ""), history_item_ids=body.get("history_item_ids"),
            deadline=_deadline(request, body), tenant=tenant, priority=priority, request_id=request[REQUEST_ID],
        )  # fmt: skip
    return web.json_response({
        "item_ids": res.item_ids.tolist(), "scores": res.scores.tolist(), "model": res.model, "model_version": res.model_version,
        "degraded": res.degraded, "degraded_reason": res.degraded_reason, "request_id": request[REQUEST_ID],
    })  # fmt: skip


SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(event: str, data: dict[str, Any], event_id: int | None = None) -> bytes:
    """One server-sent event: ``event: NAME``, an optional ``id:``, one ``data:`` line of
    compact JSON (JSON escapes newlines, so one line always suffices), a blank line."""
    head = f"event: {event}\n" + (f"id: {event_id}\n" if event_id is not None else "")
    return (head + "data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n\n").encode()


def chunk_json(chunk: Any) -> dict[str, Any]:
    """A generated chunk as the ``GenerateChunk`` JSON object of one ``chunk`` event."""
    return {"index": int(chunk.index), "tokens": np.asarray(chunk.tokens).tolist(), "text": chunk.text, "finished": bool(chunk.finished),
            "finish_reason": chunk.finish_reason, "emitted_unix_us": int(chunk.emitted_unix_us)}  # fmt: skip


async def generate(request: web.Request) -> web.StreamResponse:
    async with _Admitted(request, "GenerateRequest") as (tenant, priority, body):
        g = request.app[GATEWAY_KEY]
        if g.generator is None:
            raise Unavailable("POST /v1/generate: this gateway has no generation replicas; start it with --generators HOST:PORT,... "
                              "(recserve serve: [topology] generators >= 1)", retry_after_s=1.0)  # fmt: skip
        budget_ms = min(g.cluster.generation.default_timeout_ms, body.get("deadline_ms", math.inf))
        chunks = g.generator.generate(
            body.get("prompt", ""), prompt_tokens=body.get("prompt_tokens"),
            max_new_tokens=body.get("max_new_tokens", min(DEFAULT_MAX_NEW_TOKENS, g.cluster.generation.max_new_tokens_cap)),
            temperature=body.get("temperature", 0.0), seed=body.get("seed", 0), session_key=body.get("session_key", ""),
            deadline=request[ARRIVAL_S] + budget_ms / 1e3, tenant=tenant, priority=priority, request_id=request[REQUEST_ID],
        )  # fmt: skip
        try:
            # The first chunk before any byte is sent: an error until then is a JSON answer with its own status.
            chunk = await anext(chunks, None)
            if chunk is None:
                raise InternalError("the generation replica ended the stream without a chunk")
            response = web.StreamResponse(headers={**SSE_HEADERS, REQUEST_ID_HEADER: request[REQUEST_ID]})
            await response.prepare(request)
            try:
                while chunk is not None:
                    await response.write(sse_event("chunk", chunk_json(chunk), int(chunk.index)))
                    chunk = None if chunk.finished else await anext(chunks, None)
            except ConnectionResetError:  # the client left mid-write (before its cancellation reached us): nobody to tell
                log.info("POST /v1/generate: the client went away mid-stream")
                return response
            except Exception as exc:  # after the first chunk the status is sent: the error is the last event
                if isinstance(exc, RecserveError):
                    log.info("POST /v1/generate: the stream failed after it started: %s", exc.message)
                else:  # a bug: logged with its traceback; the event names only its type (http_error_body)
                    log.exception("POST /v1/generate: the stream failed after it started")
                await response.write(sse_event("error", http_error_body(exc, request[REQUEST_ID])[1]))
            await response.write_eof()
        finally:
            # Leaving early (a disconnect cancels this handler) closes the stream: that cancels the RPC.
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()
    return response


# ---- probes and documents --------------------------------------------------------------

async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _check_ready(g: Gateway) -> dict[str, bool]:
    """Every downstream's readiness (the generation replicas' too, when there are any)."""
    checks = [g.downstream.check_ready(READY_CHECK_TIMEOUT_S)]
    if g.generator is not None:
        checks.append(g.generator.check_ready(READY_CHECK_TIMEOUT_S))
    ready: dict[str, bool] = {}
    for part in await asyncio.gather(*checks):
        ready |= part
    return ready


async def readyz(request: web.Request) -> web.Response:
    """200 when every downstream reports SERVING and (under ``recserve serve``) no child
    crash-loops, else 503 + ``Retry-After``; from a check at most READY_CACHE_S old (one
    check in flight, shared by every caller). The body names the crash-looping children
    (``crash_looping``) and the supervisor's per-child restarts (``supervisor``)."""
    g = request.app[GATEWAY_KEY]
    now = g.downstream.clock()
    if now - g.ready_at > READY_CACHE_S:
        if g.ready_check is None:
            g.ready_check = asyncio.ensure_future(_check_ready(g))
        check = g.ready_check
        try:
            g.ready = await asyncio.shield(check)  # a caller that leaves must not cancel the others' check
            g.ready_at = now
        finally:
            if check.done() and g.ready_check is check:
                g.ready_check = None
    ready = bool(g.ready) and all(g.ready.values())
    body: dict[str, Any] = {"ready": ready, "downstream": [{"address": a, "serving": s} for a, s in g.ready.items()]}
    # Under `recserve serve` the supervisor restarts crashed children; one that crash-loops
    # is not ready even in the moments it answers SERVING between crashes: say so.
    report = read_report(os.environ.get(SUPERVISOR_STATE_ENV))
    if report is not None:
        looping = list(report.get("crash_looping") or [])
        body["crash_looping"] = looping
        body["supervisor"] = report.get("children", {})
        if looping:
            ready = body["ready"] = False
    return web.json_response(body, status=200 if ready else 503, headers=None if ready else {"Retry-After": "1"})


async def metrics(request: web.Request) -> web.Response:
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

    return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[GATEWAY_KEY].openapi, content_type="application/json")


__all__ = ["GATEWAY_KEY", "Downstream", "Gateway", "Generator", "make_app", "READY_CACHE_S"]
