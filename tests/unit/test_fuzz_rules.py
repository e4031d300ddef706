"""The bad-input suites' own rules, without a server: what counts as a violation
(gRPC and HTTP), how header deadlines are resolved, that the drawn requests are
hostile in the ways issue 17 lists, and the fd/thread leak arithmetic."""

from __future__ import annotations

import os

import grpc
import numpy as np
from hypothesis import given, settings

from recserve.bench.fuzz_grpc import Case, Method, Resources, ResourceProbe, cases, judge, resolve_header_deadline, tensors
from recserve.bench.fuzz_http import judge_http
from recserve.v1 import ranking_pb2

RANK = Method("/recserve.v1.Ranking/Rank", ranking_pb2.RankRequest, False, False)


def case(header: str = "normal", timeout: str = "normal") -> Case:
    return Case(ranking_pb2.RankRequest(), header, timeout, False)


def test_client_errors_pass_and_crash_or_outage_statuses_are_violations() -> None:
    for code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED):
        assert judge(RANK, case(), code, "k = 0 is invalid") is None, code
    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS):
        assert judge(RANK, case(), code, "x") is not None, code
    assert judge(RANK, case(), None, "no answer in 30 s") == "no answer in 30 s"
    # A handler that raised is a violation whatever code grpc put on it.
    assert judge(RANK, case(), grpc.StatusCode.UNIMPLEMENTED, "Unexpected <class 'NotImplementedError'>: Method not implemented!") is not None
    assert judge(RANK, case(), grpc.StatusCode.UNIMPLEMENTED, "Admin.RefreshIndex is served by the cascade") is None


def test_a_past_deadline_must_not_be_answered_ok_and_deadline_exceeded_needs_an_expiring_one() -> None:
    assert judge(RANK, case("past"), grpc.StatusCode.OK, "") is not None
    assert judge(RANK, case("long_past"), grpc.StatusCode.OK, "") is not None
    assert judge(RANK, case("past"), grpc.StatusCode.DEADLINE_EXCEEDED, "") is None
    assert judge(RANK, case("past"), grpc.StatusCode.INVALID_ARGUMENT, "") is None  # another client error found first
    assert judge(RANK, case("1ms"), grpc.StatusCode.DEADLINE_EXCEEDED, "") is None
    assert judge(RANK, case(timeout="1ms"), grpc.StatusCode.DEADLINE_EXCEEDED, "") is None
    assert judge(RANK, case("year_2500", "1h"), grpc.StatusCode.DEADLINE_EXCEEDED, "") is not None  # a stall, not a deadline
    assert judge(RANK, case("int64_max"), grpc.StatusCode.OK, "") is None


def test_header_deadlines_resolve_relative_to_the_send_time() -> None:
    msg = ranking_pb2.RankRequest(user_id=3)
    now = 1_800_000_000_000
    assert resolve_header_deadline(msg, "past", now).header.deadline_unix_ms == now - 50  # type: ignore[attr-defined]
    assert resolve_header_deadline(msg, "1ms", now).header.deadline_unix_ms == now + 1  # type: ignore[attr-defined]
    assert resolve_header_deadline(msg, "int64_max", now).header.deadline_unix_ms == 2**63 - 1  # type: ignore[attr-defined]
    assert resolve_header_deadline(msg, "negative", now).header.deadline_unix_ms == -5  # type: ignore[attr-defined]
    stamped = ranking_pb2.RankRequest(header={"deadline_unix_ms": 5})
    assert resolve_header_deadline(stamped, "unset", now).header.deadline_unix_ms == 0  # type: ignore[attr-defined]  # an example's stale stamp goes
    assert not resolve_header_deadline(msg, "unset", now).HasField("header")
    assert not msg.HasField("header")  # the drawn message itself is not mutated


def test_drawn_tensors_cover_wrong_dtypes_lying_shapes_truncations_and_hostile_ids() -> None:
    seen: dict[str, int] = {"wrong_dtype": 0, "lying_shape": 0, "truncated": 0, "negative_id": 0, "overflow_id": 0, "empty": 0}

    @settings(max_examples=300, database=None, deadline=None, derandomize=True)
    @given(t=tensors())
    def draw(t: dict[str, object]) -> None:
        if not t:
            seen["empty"] += 1
            return
        dtype, shape, data = t["dtype"], list(t["shape"]), bytes(t["data"])  # type: ignore[call-overload]
        if dtype != 4:
            seen["wrong_dtype"] += 1
            return
        size = int(np.prod(shape)) if shape and all(s >= 0 for s in shape) else -1
        if len(shape) == 1 and size * 8 > len(data):
            seen["truncated" if size < 2**20 else "lying_shape"] += 1
            return
        if size * 8 != len(data):
            seen["lying_shape"] += 1
            return
        ids = np.frombuffer(data, np.int64)
        seen["negative_id"] += bool((ids < 0).any())
        seen["overflow_id"] += bool((ids >= 2**31).any())

    draw()
    assert all(n > 0 for n in seen.values()), seen


def test_crossovers_keep_some_of_a_good_requests_fields() -> None:
    good = ranking_pb2.RankRequest(user_id=424242, model="two_tower")
    kept = {"any": 0}

    @settings(max_examples=100, database=None, deadline=None, derandomize=True)
    @given(c=cases(RANK, [good]))
    def draw(c: Case) -> None:
        kept["any"] += c.message.user_id == 424242  # type: ignore[attr-defined]

    draw()
    assert 0 < kept["any"] < 100, kept


def test_http_rule_accepts_4xx_and_a_504_only_for_a_request_with_its_own_deadline() -> None:
    for status in (200, 400, 401, 413, 422, 429):
        assert judge_http(status, b"{}") is None, status
    for status in (500, 502, 503):
        assert judge_http(status, b"{}") is not None, status
    assert judge_http(504, b'{"user_id": 1}') is not None
    assert judge_http(504, b'{"user_id": 1, "deadline_ms": 2}') is None
    assert judge_http(None, None) is not None


def test_leaks_are_growth_beyond_the_slack() -> None:
    before = {"ranker-0": Resources(fds=20, threads=10)}
    assert ResourceProbe.leaks(before, {"ranker-0": Resources(fds=26, threads=14)}, fd_slack=6, thread_slack=4) == []
    assert ResourceProbe.leaks(before, {"ranker-0": Resources(fds=27, threads=15)}, fd_slack=6, thread_slack=4) == [
        "ranker-0: open fds 20 -> 27", "ranker-0: threads 10 -> 15"]


def test_the_probe_counts_this_processes_fds_and_sees_it_alive() -> None:
    probe = ResourceProbe({"me": os.getpid()})
    assert probe.dead() == []
    assert ResourceProbe({"gone": 2**22 + 12345}).dead() == ["gone"]  # above pid_max's default
    first = probe.sample()["me"]
    r, w = os.pipe()
    try:
        assert probe.sample()["me"].fds == first.fds + 2
    finally:
        os.close(r)
        os.close(w)
