from __future__ import annotations

import math
import time

import grpc
import numpy as np
import pytest

from recserve.errors import DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted
from recserve.rpc import deadline, status, tensors
from recserve.v1 import common_pb2


def test_pack_unpack_roundtrip() -> None:
    rng = np.random.default_rng(0)
    for arr in (rng.integers(0, 1 << 40, size=17), rng.standard_normal((5, 7)).astype(np.float32), np.zeros((0, 4), np.float16)):
        t = tensors.pack(arr)
        back = tensors.unpack(t, "x")
        assert back.dtype == arr.dtype.newbyteorder("<") and back.shape == arr.shape
        assert np.array_equal(back, arr)


def test_unpack_rejects_bad_length_and_dtype() -> None:
    bad = common_pb2.Tensor(dtype=common_pb2.INT64, shape=[2], data=b"\x00" * 12)
    with pytest.raises(InvalidArgument, match=r"tables\[0\]\.ids: 12 bytes .* multiple of 8"):
        tensors.unpack(bad, "tables[0].ids")
    ok = tensors.pack(np.arange(3, dtype=np.int64))
    with pytest.raises(InvalidArgument, match="dtype is INT64, expected FLOAT32"):
        tensors.unpack(ok, "rows", expect_dtype=common_pb2.FLOAT32)
    with pytest.raises(InvalidArgument, match="rank 1, expected rank 2"):
        tensors.unpack(ok, "rows", expect_ndim=2)
    with pytest.raises(InvalidArgument, match="unknown dtype enum 99"):
        tensors.unpack(common_pb2.Tensor(dtype=99, shape=[1], data=b"x"), "ids")  # type: ignore[arg-type]
    # A shape whose element count overflows int64 must not pass as "0 bytes expected".
    huge = common_pb2.Tensor(dtype=common_pb2.INT64, shape=[2**62, 4], data=b"")
    with pytest.raises(InvalidArgument, match=r"ids: 0 bytes do not match shape \[4611686018427387904, 4\]"):
        tensors.unpack(huge, "ids")
    with pytest.raises(InvalidArgument, match="negative dimension"):
        tensors.unpack(common_pb2.Tensor(dtype=common_pb2.INT64, shape=[-1], data=b""), "ids")
    # A 0-d tensor is one element.
    assert tensors.unpack(tensors.pack(np.array(7, dtype=np.int64)), "x").item() == 7


def test_deadline_takes_the_earlier_of_header_and_grpc() -> None:
    now_unix, now_mono = 1_000_000.0, 50.0
    hdr_ms = int((now_unix + 2.0) * 1000)
    d = deadline.monotonic_deadline(hdr_ms, 0.5, now_unix_s=now_unix, now_monotonic_s=now_mono)
    assert d == pytest.approx(50.5)
    d = deadline.monotonic_deadline(hdr_ms, 5.0, now_unix_s=now_unix, now_monotonic_s=now_mono)
    assert d == pytest.approx(52.0)
    assert deadline.monotonic_deadline(0, None, now_unix_s=now_unix, now_monotonic_s=now_mono) == math.inf
    assert deadline.monotonic_deadline(0, None, default_timeout_s=0.1, now_unix_s=now_unix, now_monotonic_s=now_mono) == pytest.approx(50.1)
    with pytest.raises(InvalidArgument, match="deadline_unix_ms is -5"):
        deadline.monotonic_deadline(-5, None)


def test_context_from_header() -> None:
    hdr = deadline.make_header(timeout_s=1.0, tenant="t1", priority="critical", request_id="r1")
    ctx = deadline.context_from_header(hdr)
    assert (ctx.request_id, ctx.tenant, ctx.priority) == ("r1", "t1", "critical")
    assert 0.5 < ctx.deadline - time.monotonic() <= 1.0
    late = common_pb2.RequestHeader(request_id="r2", deadline_unix_ms=int((time.time() - 1) * 1000))
    with pytest.raises(DeadlineExceeded, match="r2"):
        deadline.context_from_header(late)
    with pytest.raises(InvalidArgument, match="priority"):
        deadline.make_header(priority="urgent")
    with pytest.raises(InvalidArgument, match=r"header\.priority is 7; use CRITICAL"):
        deadline.context_from_header(common_pb2.RequestHeader(request_id="r3", priority=7))  # type: ignore[arg-type]
    unspecified = deadline.context_from_header(common_pb2.RequestHeader())
    assert (unspecified.priority, unspecified.tenant, unspecified.deadline) == ("standard", "default", math.inf)
    assert unspecified.request_id  # a fresh id when the caller sent none


def test_context_takes_grpc_deadline_when_it_is_earlier() -> None:
    hdr = deadline.make_header(timeout_s=60.0)
    before = time.monotonic()
    ctx = deadline.context_from_header(hdr, grpc_time_remaining_s=0.5)
    assert before + 0.5 <= ctx.deadline <= time.monotonic() + 0.5
    with pytest.raises(DeadlineExceeded):
        deadline.context_from_header(hdr, grpc_time_remaining_s=-0.01)


def test_status_mapping_is_total_and_specific() -> None:
    assert status.grpc_code(InvalidArgument("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status.grpc_code(NotFound("x")) == grpc.StatusCode.NOT_FOUND
    assert status.grpc_code(ValueError("x")) == grpc.StatusCode.INTERNAL
    assert status.http_status(ResourceExhausted("x")) == 429
    assert "retry after 250 ms" in status.grpc_details(ResourceExhausted("queue full", retry_after_s=0.25))
    assert status.is_retryable(grpc.StatusCode.UNAVAILABLE)
    assert not status.is_retryable(grpc.StatusCode.INVALID_ARGUMENT)


def test_error_from_code_round_trips_every_kind() -> None:
    for kind, code in status.GRPC_CODE.items():
        err = status.error_from_code(code, "peer said no")
        if kind in status.GATEWAY_ONLY_KINDS:  # shares its code: a peer's status is the other kind
            assert err.kind != kind and status.grpc_code(err) == code
            continue
        assert err.kind == kind and status.grpc_code(err) == code and err.message == "peer said no"
    assert isinstance(status.error_from_code(grpc.StatusCode.UNAVAILABLE, "x"), status.RecserveError)
    assert status.error_from_code(grpc.StatusCode.UNKNOWN, "x").kind.name == "INTERNAL"
    assert status.error_from_code(None, "x").kind.name == "INTERNAL"
