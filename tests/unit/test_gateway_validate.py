"""Request bodies at the gateway (recserve/gateway/validate.py) and the one error mapping
(recserve/rpc/status.py): 400 for a body that cannot be read, 422 for one that breaks
the schema, each naming the field and the value."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from recserve.config import load
from recserve.config.spec import CascadeConfig
from recserve.errors import (
    DeadlineExceeded,
    InvalidArgument,
    InvalidField,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    UnprocessableField,
)
from recserve.gateway.schemas import request_schemas
from recserve.gateway.validate import parse_json_object, validate
from recserve.rpc import status

CLUSTER = load()
SCHEMAS = request_schemas(CLUSTER)
RECOMMEND, RANK = SCHEMAS["RecommendRequest"], SCHEMAS["RankRequest"]


@pytest.mark.parametrize("raw, needle", [
    (b'{"user_id": 1', "not valid JSON"),
    (b"", "not valid JSON"),
    (b"[1, 2]", "JSON array"),
    (b'"user"', "JSON string"),
    (b"\xff\xfe{}", "not UTF-8"),
])  # fmt: skip
def test_an_unreadable_body_is_a_400_naming_the_body(raw: bytes, needle: str) -> None:
    with pytest.raises(InvalidField) as err:
        parse_json_object(raw)
    assert not isinstance(err.value, UnprocessableField)
    assert err.value.field == "body" and needle in err.value.message
    assert status.http_status(err.value) == 400


@pytest.mark.parametrize("body, field, value, needle", [
    ({"user_id": "7"}, "user_id", "7", "use an integer"),
    ({"user_id": 7.0}, "user_id", 7.0, "use an integer"),
    ({"user_id": True}, "user_id", True, "use an integer"),
    ({"user_id": -1}, "user_id", -1, "out of range"),
    ({"k": 5}, "user_id", None, "missing"),
    ({"user_id": 1, "k": 0}, "k", 0, "1..1,000"),
    ({"user_id": 1, "k": 1001}, "k", 1001, "1..1,000"),
    ({"user_id": 1, "kk": 3}, "kk", 3, "not a field of RecommendRequest"),
    ({"user_id": 1, "deadline_ms": 0}, "deadline_ms", 0, "out of range"),
    ({"user_id": 1, "deadline_ms": "soon"}, "deadline_ms", "soon", "use a number"),
    ({"user_id": 1, "exclude_ids": 5}, "exclude_ids", 5, "array of integer ids"),
    ({"user_id": 1, "exclude_ids": [1, 2, True]}, "exclude_ids[2]", True, "integers"),
    ({"user_id": 1, "exclude_ids": [1, 2.5]}, "exclude_ids[1]", 2.5, "integers"),
    ({"user_id": 1, "exclude_ids": [1, None]}, "exclude_ids[1]", None, "integers"),
    ({"user_id": 1, "recent_item_ids": [4, -3, 2]}, "recent_item_ids[1]", -3, "out of range"),
    ({"user_id": 1, "exclude_ids": [1, 1 << 70]}, "exclude_ids[1]", 1 << 70, "out of range"),
])  # fmt: skip
def test_a_schema_violation_is_a_422_naming_the_field_and_value(body: dict[str, object], field: str, value: object, needle: str) -> None:
    with pytest.raises(UnprocessableField) as err:
        validate(RECOMMEND, body)
    assert (err.value.field, err.value.value) == (field, value)
    assert needle in err.value.message
    code, payload = status.http_error_body(err.value, "rid")
    assert code == 422 and payload["error"]["field"] == field and payload["error"]["kind"] == "unprocessable"
    json.dumps(payload)  # the body is JSON


def test_a_valid_body_gives_int64_arrays_and_leaves_absent_fields_out() -> None:
    got = validate(RECOMMEND, {"user_id": 12, "k": 5, "exclude_ids": [3, 1, 4], "recent_item_ids": []})
    assert got["user_id"] == 12 and got["k"] == 5 and "deadline_ms" not in got
    assert got["exclude_ids"].dtype == np.int64 and got["exclude_ids"].tolist() == [3, 1, 4]
    assert got["recent_item_ids"].shape == (0,)


def test_rank_bounds_come_from_the_spec() -> None:
    cluster = dataclasses.replace(CLUSTER, ranker=dataclasses.replace(CLUSTER.ranker, max_candidates=3000),
                                  cascade=dataclasses.replace(CLUSTER.cascade, max_k=50))  # fmt: skip
    schemas = request_schemas(cluster)
    with pytest.raises(UnprocessableField, match="at most 3,000"):
        validate(schemas["RankRequest"], {"user_id": 1, "candidate_ids": list(range(3001))})
    assert validate(schemas["RankRequest"], {"user_id": 1, "candidate_ids": list(range(3000))})["candidate_ids"].shape == (3000,)
    with pytest.raises(UnprocessableField, match="1..50"):
        validate(schemas["RecommendRequest"], {"user_id": 1, "k": 51})
    with pytest.raises(UnprocessableField) as err:
        validate(schemas["RankRequest"], {"user_id": 1, "candidate_ids": [1], "model": "gpt"})
    assert err.value.field == "model" and "dlrm" in err.value.message
    assert CascadeConfig().max_k == 1000  # the default the RecommendRequest cases above assume


@pytest.mark.parametrize("error, code, kind", [
    (Unauthenticated("no key"), 401, "unauthenticated"),
    (ResourceExhausted("slow down", retry_after_s=0.2), 429, "resource_exhausted"),
    (Unavailable("not ready"), 503, "unavailable"),
    (DeadlineExceeded("late"), 504, "deadline_exceeded"),
    (InvalidArgument("exclude_ids[0] = 5,004 is out of range: item ids are 0..4,999"), 400, "invalid_argument"),
    (InvalidArgument("recommender 127.0.0.1:7300: Recommend: INVALID_ARGUMENT: exclude_ids[0] = 5,004 is out of range: ..."), 400, "invalid_argument"),
    (RuntimeError("secret stuff"), 500, "internal"),
])  # fmt: skip
def test_every_error_maps_to_one_status_and_body(error: BaseException, code: int, kind: str) -> None:
    got, body = status.http_error_body(error, "rid-1")
    assert got == code and body["error"]["status"] == code and body["error"]["kind"] == kind and body["request_id"] == "rid-1"
    if isinstance(error, InvalidArgument):  # a downstream message that names its field: parsed out
        assert body["error"]["field"] == "exclude_ids[0]" and body["error"]["value"] == 5004
    if isinstance(error, RuntimeError):
        assert "secret" not in body["error"]["message"]  # an unknown exception's text is not sent


def test_retry_after_is_whole_seconds_and_always_set_on_429_and_503() -> None:
    assert status.retry_after_header(ResourceExhausted("x", retry_after_s=0.2)) == "1"
    assert status.retry_after_header(ResourceExhausted("x", retry_after_s=2.5)) == "3"
    assert status.retry_after_header(Unavailable("x")) == "1"
    assert status.retry_after_header(DeadlineExceeded("x")) is None
    assert status.retry_after_header(InvalidArgument("x")) is None


def test_an_unauthenticated_peer_status_crosses_the_hop_and_invalid_argument_stays_itself() -> None:
    import grpc

    assert isinstance(status.error_from_code(grpc.StatusCode.UNAUTHENTICATED, "x"), Unauthenticated)
    peer = status.error_from_code(grpc.StatusCode.INVALID_ARGUMENT, "x")
    assert type(peer) is InvalidArgument and status.http_status(peer) == 400
    assert status.grpc_code(UnprocessableField("k", 0, "k = 0")) == grpc.StatusCode.INVALID_ARGUMENT
