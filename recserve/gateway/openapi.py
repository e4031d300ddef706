"""The OpenAPI 3 document of the gateway, built from :mod:`recserve.gateway.schemas`
(the very objects that validate request bodies) and the spec's bounds.

Every endpoint is listed with its request schema, its success schema and the error
answers it can give, each with the one error body (``ErrorResponse``).
"""

from __future__ import annotations

from typing import Any

from recserve.config.spec import ClusterConfig
from recserve.gateway.schemas import Kind, ObjectSchema, request_schemas, response_schemas

OPENAPI_VERSION = "3.0.3"

_ERRORS = {
    400: "the body cannot be read: malformed JSON, not an object, over gateway.max_body_bytes; or a value downstream rejected (the message names it)",
    401: "no API key, or one that matches no tenant",
    422: "well-formed JSON that breaks the schema: an unknown or missing field, a wrong type, a value out of range",
    429: "over the tenant's rate or concurrency quota, the gateway at gateway.max_concurrency, or shed downstream (Retry-After says when to retry)",
    503: "not ready, or a downstream unavailable (Retry-After)",
    504: "the deadline (the earlier of gateway.timeout_ms and deadline_ms) passed",
}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(schema)}}}


def _components(schemas: list[ObjectSchema]) -> dict[str, Any]:
    """Every schema and, transitively, the object schemas its fields refer to."""
    out: dict[str, Any] = {}
    todo = list(schemas)
    while todo:
        s = todo.pop()
        if s.name in out:
            continue
        out[s.name] = s.json_schema()
        todo += [f.items for f in s.fields if f.kind in (Kind.OBJECT, Kind.OBJECT_ARRAY) and f.items is not None]
    return dict(sorted(out.items()))


def openapi_document(cluster: ClusterConfig, *, status_page: bool = True) -> dict[str, Any]:
    """The document as a dict (``GET /openapi.json`` serves it as JSON); ``status_page``:
    the gateway serves ``GET /`` and ``GET /v1/status`` (it scrapes targets)."""
    requests, responses = request_schemas(cluster), response_schemas()
    header = cluster.gateway.api_key_header

    def post(summary: str, request: str, response: str, errors: tuple[int, ...]) -> dict[str, Any]:
        answers = {"200": _json(response, "the answer")} | {str(c): _json("ErrorResponse", _ERRORS[c]) for c in errors}
        return {"post": {
            "summary": summary, "description": requests[request].description, "security": [{"apiKey": []}, {}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}}, "responses": answers,
        }}  # fmt: skip

    errors = (400, 401, 422, 429, 503, 504)
    paths: dict[str, Any] = {
        "/v1/recommendations": post("Recommend items to a user", "RecommendRequest", "RecommendResponse", errors),
        "/v1/rank": post("Rank candidates for a user", "RankRequest", "RankResponse", errors),
        "/v1/generate": {"post": {
            "summary": "Generate text, streamed token by token as server-sent events", "description": requests["GenerateRequest"].description
            + ". The 200 answer is text/event-stream: one `event: chunk` per chunk, its `data` a GenerateChunk object (the last has finished = true);"
            " an error after the stream started is one `event: error` whose `data` is an ErrorResponse, and the stream ends. An error before the"
            " first chunk (a bad prompt, no replica, the deadline) is an ordinary JSON error answer.",
            "security": [{"apiKey": []}, {}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("GenerateRequest")}}},
            "responses": {"200": {"description": "the event stream (`event: chunk` with GenerateChunk data; `event: error` with ErrorResponse data)",
                                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}
            | {str(c): _json("ErrorResponse", _ERRORS[c]) for c in errors},
        }},  # fmt: skip
        "/healthz": {"get": {"summary": "Liveness: 200 while the process runs", "responses": {"200": _json("HealthResponse", "alive")}}},
        "/readyz": {"get": {"summary": "Readiness: 200 when every downstream reports SERVING", "responses": {
            "200": _json("ReadyResponse", "every downstream SERVING"), "503": _json("ReadyResponse", "some downstream is not SERVING (Retry-After)")}}},
        "/metrics": {"get": {"summary": "This process's Prometheus metrics", "responses": {
            "200": {"description": "Prometheus text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {
            "200": {"description": "OpenAPI 3", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
    }  # fmt: skip
    if status_page:
        paths["/"] = {"get": {"summary": "The status page (HTML for people; refreshes itself from /v1/status)", "responses": {
            "200": {"description": "one HTML page", "content": {"text/html": {"schema": {"type": "string"}}}}}}}  # fmt: skip
        paths["/v1/status"] = {"get": {"summary": "The status page's JSON: health, rates, latencies and ratios aggregated from every process's /metrics",
                                       "responses": {"200": {"description": "the aggregate (recserve/gateway/status.py)",
                                                             "content": {"application/json": {"schema": {"type": "object"}}}}}}}  # fmt: skip
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "recserve HTTP gateway", "version": "1",
                 "description": "Recommendations, ranking and streamed generation over HTTP. Errors: 400 = the body cannot be read; 422 = the body breaks the schema."},
        "paths": paths,
        "components": {
            "schemas": _components([*requests.values(), *responses.values()]),
            "securitySchemes": {"apiKey": {"type": "apiKey", "in": "header", "name": header}},
        },
    }  # fmt: skip
