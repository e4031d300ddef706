"""The gateway's OpenAPI document (recserve/gateway/openapi.py): a valid OpenAPI 3
document, built from the very schemas that validate request bodies."""

from __future__ import annotations

import dataclasses

from openapi_spec_validator import validate as validate_spec

from recserve.config import load
from recserve.gateway.openapi import openapi_document
from recserve.gateway.schemas import request_schemas, response_schemas

CLUSTER = load()
ENDPOINTS = {("post", "/v1/recommendations"), ("post", "/v1/rank"), ("post", "/v1/generate"), ("get", "/healthz"), ("get", "/readyz"),
             ("get", "/metrics"), ("get", "/openapi.json")}  # fmt: skip


def test_the_document_is_valid_openapi_3_and_lists_every_endpoint() -> None:
    doc = openapi_document(CLUSTER)
    validate_spec(doc)  # raises on an invalid document
    assert doc["openapi"].startswith("3.")
    assert {(m, p) for p, ops in doc["paths"].items() for m in ops} == ENDPOINTS | {("get", "/"), ("get", "/v1/status")}
    bare = openapi_document(CLUSTER, status_page=False)  # a gateway without scrape targets serves no status page
    validate_spec(bare)
    assert {(m, p) for p, ops in bare["paths"].items() for m in ops} == ENDPOINTS
    for path in ("/v1/recommendations", "/v1/rank"):
        answers = doc["paths"][path]["post"]["responses"]
        assert set(answers) == {"200", "400", "401", "422", "429", "503", "504"}
    assert doc["components"]["securitySchemes"]["apiKey"]["name"] == CLUSTER.gateway.api_key_header


def test_request_schemas_in_the_document_are_the_validating_ones() -> None:
    cluster = dataclasses.replace(CLUSTER, cascade=dataclasses.replace(CLUSTER.cascade, max_k=77))
    doc = openapi_document(cluster)
    for name, schema in request_schemas(cluster).items():
        emitted = doc["components"]["schemas"][name]
        assert emitted == schema.json_schema()
        assert emitted["additionalProperties"] is False
        assert set(emitted["properties"]) == {f.name for f in schema.fields}
    assert doc["components"]["schemas"]["RecommendRequest"]["properties"]["k"]["maximum"] == 77  # the spec's bound, in the document
    for name in response_schemas():
        assert name in doc["components"]["schemas"]
    assert {"StageReport", "ErrorDetail", "Downstream"} <= set(doc["components"]["schemas"])  # nested ones, collected
