"""Property-based bad input for every gRPC method of a running server (issue 17).

The random-bytes helper of the hardening issue (``tests/grpc_fuzz.py``) sends bodies that
mostly fail to parse. This module sends requests that *parse*, drawn by ``hypothesis``
from each method's reflected request type, so they reach the servicer's validation:

* random field values, every field independently missing or set (scalars at their
  boundaries: ``-1``, ``2**31``, ``2**63 - 1``, ``-2**63``; open enums' unknown values;
  ``NaN`` / ``inf`` floats; odd strings, path traversals);
* ``recserve.v1.Tensor`` fields (:func:`tensors`): well-formed INT64 ids that are
  negative, past every table or overflowing; the right bytes under a wrong dtype; shapes
  that disagree with the data, negative or huge (``2**62``); truncated and random
  ``data``; a real large array (up to 600,000 ids, over gRPC's 4 MiB message cap);
* crossovers with real requests (``examples``): a good request with some top-level
  fields replaced by random ones or removed, which gets past the first checks;
* ``header.deadline_unix_ms`` in the past, a millisecond ahead, far in the future
  (year 2500, ``2**63 - 1``) or negative, and gRPC deadlines of 1 ms or 1 hour.

:func:`judge` is the outcome rule: OK or a client-error status (:data:`CLIENT_CODES`);
``DEADLINE_EXCEEDED`` only where a deadline could expire (a past header deadline must
get exactly that, or another client error — never OK, since expired work is never
executed); ``UNKNOWN`` / ``INTERNAL`` / ``UNAVAILABLE`` or no answer within the watchdog
are violations. :func:`fuzz_methods` runs the cases (hypothesis, seeded from ``seed``
and the method, so a run repeats exactly; no shrinking, no example database) and returns a :class:`PropertyReport`;
:class:`ResourceProbe` counts a process's open fds and threads from ``/proc``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np
from google.protobuf import descriptor_pool, message, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings
from hypothesis import strategies as st

TENSOR_TYPE = "recserve.v1.Tensor"
HEADER_TYPE = "recserve.v1.RequestHeader"
# Statuses that tell the caller its request was wrong (or refused): the only non-OK
# answers bad input may get.
CLIENT_CODES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,  # a method another kind of process serves (the message says which)
})  # fmt: skip
# What grpc says when a handler raised instead of answering (the generated base's
# NotImplementedError included): never a clear status, whatever its code.
CRASH_DETAILS = ("Unexpected <class", "Exception calling application", "internal error:")
# Deadline choices for header.deadline_unix_ms, resolved when the request is sent.
HEADER_DEADLINES = ("unset", "past", "long_past", "1ms", "normal", "year_2500", "int64_max", "negative")
EXPIRING = frozenset({"past", "long_past", "1ms"})  # DEADLINE_EXCEEDED is a fine answer to these
GRPC_TIMEOUTS_S = {"normal": 10.0, "1ms": 0.001, "1h": 3600.0}
WATCHDOG_S = 30.0  # an answer slower than this is "stopped answering", whatever the deadline
INT64 = (-(2**63), -(2**31) - 1, -1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1)
INT32 = (-(2**31), -1, 0, 1, 7, 1000, 2**31 - 1)
STRINGS = ("", "dlrm", "two_tower", "l3", "default", "../../../etc", "/nonexistent", "\x00", "é" * 3, "a" * 300)
DTYPES = (0, 1, 2, 3, 4, 5, 6, 99, -1)  # recserve.v1.DType, unknown values included (proto3 enums are open)


# -- reflection and raw calls (shared with tests/grpc_fuzz.py) --------------------------------


@dataclasses.dataclass(frozen=True)
class Method:
    """One fuzzable method: ``path`` is ``/package.Service/Method``."""

    path: str
    request_type: type[message.Message]
    client_streaming: bool
    server_streaming: bool


def list_methods(channel: grpc.Channel, *, skip_services: Sequence[str] = ()) -> list[Method]:
    """Every method of every service the server's reflection lists, sorted by service."""
    database = ProtoReflectionDescriptorDatabase(channel)
    pool = descriptor_pool.DescriptorPool(database)
    methods: list[Method] = []
    for service_name in sorted(database.get_services()):
        if service_name in skip_services:
            continue
        service = pool.FindServiceByName(service_name)
        for m in service.methods:
            request_type = message_factory.GetMessageClass(m.input_type)
            methods.append(Method(f"/{service.full_name}/{m.name}", request_type, bool(m.client_streaming), bool(m.server_streaming)))
    return methods


def call_raw(channel: grpc.Channel, method: Method, body: bytes, timeout_s: float | None, *, drain: bool,
             metadata: Sequence[tuple[str, str]] = (), watchdog_s: float = WATCHDOG_S) -> tuple[grpc.StatusCode | None, str]:  # fmt: skip
    """Send ``body`` raw (a one-message stream to a stream-request method). A streamed reply
    is read to its end when ``drain``, else cancelled after its first response (health
    ``Watch`` never ends). Returns the status code and details; ``(None, ...)`` when no
    answer came within ``watchdog_s`` (the call is cancelled)."""
    request: Any = iter([body]) if method.client_streaming else body
    kind = (method.client_streaming, method.server_streaming)
    make: Any = {(False, False): channel.unary_unary, (False, True): channel.unary_stream, (True, False): channel.stream_unary, (True, True): channel.stream_stream}[kind]
    stub: Any = make(method.path, request_serializer=None, response_deserializer=None)
    timeout = min(timeout_s, watchdog_s) if timeout_s is not None and not method.server_streaming else timeout_s
    cancelled_by_us = False
    try:
        if method.server_streaming:
            reply = stub(request, timeout=timeout if timeout is not None else watchdog_s, metadata=tuple(metadata))
            for _ in reply:
                if not drain:
                    cancelled_by_us = True
                    reply.cancel()
                    break
            return grpc.StatusCode.OK, ""
        future = stub.future(request, timeout=timeout_s, metadata=tuple(metadata))
        try:
            future.result(timeout=watchdog_s)
        except grpc.FutureTimeoutError:
            future.cancel()
            return None, f"no answer in {watchdog_s:g} s"
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        code = exc.code()  # type: ignore[attr-defined]
        if cancelled_by_us and code == grpc.StatusCode.CANCELLED:
            return grpc.StatusCode.OK, ""  # our own cancel after the first response
        return code, str(exc.details())  # type: ignore[attr-defined]


# -- strategies ----------------------------------------------------------------------------


def _int_array(values: st.SearchStrategy[int], max_size: int = 8) -> st.SearchStrategy[np.ndarray]:
    return st.lists(values, max_size=max_size).map(lambda xs: np.asarray(xs, dtype=np.int64))


def _ids() -> st.SearchStrategy[np.ndarray]:
    """INT64 id arrays: small valid-looking ids, boundary values, or one big array."""
    small = st.integers(0, 60)
    hostile = st.sampled_from(INT64)
    # 600,000 ids (4.8 MB) is over gRPC's default 4 MiB receive limit: the transport's own refusal.
    big = st.sampled_from((1_000, 50_000, 200_000, 600_000)).map(lambda n: np.arange(n, dtype=np.int64) % 4_000)
    return st.one_of(_int_array(small), _int_array(st.one_of(small, hostile)), big)


def _tensor_dict(dtype: int, shape: Sequence[int], data: bytes) -> dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape), "data": data}


@st.composite
def tensors(draw: st.DrawFn) -> dict[str, Any]:
    """A ``recserve.v1.Tensor`` as a dict: well-formed ids (hostile values), the right
    bytes under a wrong dtype, a shape that lies (negative, huge, off by one, 2-D),
    truncated or random data, FLOAT32 rows with NaN/inf, or empty."""
    kind = draw(st.sampled_from(("ids", "ids", "wrong_dtype", "bad_shape", "truncated", "random", "float", "empty")))
    if kind == "empty":
        return {}
    if kind == "random":
        return _tensor_dict(draw(st.sampled_from(DTYPES)), draw(st.lists(st.integers(-2, 64), max_size=3)), draw(st.binary(max_size=96)))
    if kind == "float":
        rows = draw(st.integers(0, 4))
        dim = draw(st.integers(1, 8))
        values = draw(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=rows * dim, max_size=rows * dim))
        return _tensor_dict(1, [rows, dim], np.asarray(values, dtype=np.float32).tobytes())
    ids = draw(_ids())
    data = ids.tobytes()
    if kind == "ids":
        return _tensor_dict(4, [len(ids)], data)
    if kind == "wrong_dtype":
        return _tensor_dict(draw(st.sampled_from((0, 1, 2, 3, 5, 6, 99))), [len(ids)], data)
    if kind == "truncated":
        return _tensor_dict(4, [len(ids)], data[: draw(st.integers(0, max(0, len(data) - 1)))])
    shape = draw(st.sampled_from(([-1], [len(ids) + 1], [2**62], [2**31, 2**31], [len(ids), 1, 2], [], [0, -5])))
    return _tensor_dict(4, shape, data)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.one_of(st.sampled_from((0.0, -1.0, 1e-9, float("nan"), float("inf"), -float("inf"))), st.floats(-1e4, 1e4, width=32))
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(STRINGS), st.text(max_size=12))
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values] if field.enum_type is not None else []
        return st.sampled_from([*known, 99, -1])
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return st.sampled_from((0, 1, 2**32 - 1))
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return st.sampled_from((0, 1, 2**64 - 1))
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return st.one_of(st.integers(-3, 64), st.sampled_from(INT32))
    return st.one_of(st.integers(-3, 64), st.sampled_from(INT64))


def _field_value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        child = field.message_type
        assert child is not None
        if child.GetOptions().map_entry:
            key, value = child.fields_by_name["key"], child.fields_by_name["value"]
            return st.dictionaries(_scalar(key), _scalar(value), max_size=2)
        one = message_dicts(child, depth - 1)
        return st.lists(one, max_size=3) if field.is_repeated else one
    if field.is_repeated:
        return st.lists(_scalar(field), max_size=4)
    return _scalar(field)


def message_dicts(desc: Descriptor, depth: int = 3) -> st.SearchStrategy[dict[str, Any]]:
    """A request of type ``desc`` as a field dict (the header's deadline is set later):
    every field missing or set to a random value; Tensor fields from :func:`tensors`."""
    if desc.full_name == TENSOR_TYPE:
        return tensors()
    if depth <= 0:
        return st.just({})
    if desc.full_name == HEADER_TYPE:
        fields = {f.name: _field_value(f, depth) for f in desc.fields if f.name != "deadline_unix_ms"}
    else:
        fields = {f.name: _field_value(f, depth) for f in desc.fields}
    return st.fixed_dictionaries({}, optional=fields)  # type: ignore[arg-type]


def build_message(desc: Descriptor, fields: Mapping[str, Any]) -> message.Message:
    """The message of type ``desc`` with ``fields`` (nested dicts for messages)."""
    msg = message_factory.GetMessageClass(desc)()
    for name, value in fields.items():
        field = desc.fields_by_name[name]
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            child = field.message_type
            assert child is not None
            if child.GetOptions().map_entry:
                getattr(msg, name).update(value)
            elif field.is_repeated:
                for item in value:
                    getattr(msg, name).add().CopyFrom(build_message(child, item))
            else:
                getattr(msg, name).CopyFrom(build_message(child, value))
        elif field.is_repeated:
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    return msg


@dataclasses.dataclass(frozen=True)
class Case:
    """One request to send: the message (header deadline still unset), how to set the
    header deadline and the gRPC deadline, whether to carry the admin token."""

    message: message.Message
    header_deadline: str  # one of HEADER_DEADLINES
    grpc_timeout: str  # a key of GRPC_TIMEOUTS_S
    with_token: bool


def cases(method: Method, examples: Sequence[message.Message] = ()) -> st.SearchStrategy[Case]:
    """Random requests of ``method``'s type, and crossovers with ``examples``: a copy of a
    real request with some top-level fields replaced by a random request's (or cleared)."""
    desc: Descriptor = method.request_type.DESCRIPTOR  # type: ignore[assignment]
    randoms = message_dicts(desc).map(lambda d: build_message(desc, d))
    # Examples may be of the compiled classes; the reflected type is another class.
    reflected = [method.request_type.FromString(e.SerializeToString()) for e in examples]
    if reflected:

        def cross(pair: tuple[message.Message, message.Message, list[bool]]) -> message.Message:
            good, other, take = pair
            out = type(good)()
            out.CopyFrom(good)
            part = type(other)()
            part.CopyFrom(other)
            for field, replace in zip(desc.fields, take, strict=False):
                (out if replace else part).ClearField(field.name)
            out.MergeFrom(part)  # the taken fields from `other` (absent there: left cleared)
            return out

        crossed = st.tuples(st.sampled_from(reflected), randoms, st.lists(st.booleans(), min_size=len(desc.fields), max_size=len(desc.fields))).map(cross)
        messages = st.one_of(randoms, crossed, crossed)
    else:
        messages = randoms
    has_header = "header" in desc.fields_by_name
    deadlines = st.sampled_from(HEADER_DEADLINES) if has_header else st.just("unset")
    return st.builds(Case, messages, deadlines, st.sampled_from(("normal", "normal", "normal", "1ms", "1h")), st.booleans())


def resolve_header_deadline(msg: message.Message, choice: str, now_ms: int) -> message.Message:
    """``msg`` with ``header.deadline_unix_ms`` set as ``choice`` says, relative to ``now_ms``
    ("unset": 0, none; an example's own stamp has long expired)."""
    value = {"unset": 0, "past": now_ms - 50, "long_past": 1, "1ms": now_ms + 1, "normal": now_ms + 10_000, "year_2500": 16_725_225_600_000, "int64_max": 2**63 - 1, "negative": -5}.get(choice)
    out = type(msg)()
    out.CopyFrom(msg)  # always a copy: the caller may set more fields on it
    if value is None or "header" not in msg.DESCRIPTOR.fields_by_name or (choice == "unset" and not msg.HasField("header")):
        return out
    out.header.deadline_unix_ms = value  # type: ignore[attr-defined]
    return out


# -- the outcome rule ----------------------------------------------------------------------------


def judge(method: Method, case: Case, code: grpc.StatusCode | None, details: str) -> str | None:
    """None when ``code`` is an acceptable answer to ``case``, else why not."""
    if code is None:
        return details or "no answer"
    if any(marker in details for marker in CRASH_DETAILS):
        return f"{code.name} from a handler that raised: {details[:120]!r}"
    expiring = case.header_deadline in EXPIRING or case.grpc_timeout == "1ms"
    if code == grpc.StatusCode.OK:
        if case.header_deadline in ("past", "long_past"):
            return "answered OK although the header deadline had passed (expired work executed)"
        return None
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return None if expiring else "DEADLINE_EXCEEDED without an expiring deadline (the server stalled)"
    if code == grpc.StatusCode.CANCELLED and case.grpc_timeout == "1ms":
        return None  # the client gave up before the server answered
    if code in CLIENT_CODES:
        return None
    return f"{code.name}: not a client-error status"


# -- resources -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Resources:
    fds: int
    threads: int


class ResourceProbe:
    """Open file descriptors and threads of processes, from ``/proc/PID/{fd,task}``."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)

    def dead(self) -> list[str]:
        """Processes that have exited (gone, or a zombie their launcher has not reaped)."""
        out = []
        for name, pid in self.pids.items():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]  # the name in () may hold spaces
            except FileNotFoundError:
                state = "gone"
            if state in ("Z", "X", "gone"):
                out.append(name)
        return out

    def sample(self) -> dict[str, Resources]:
        return {name: Resources(len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))) for name, pid in self.pids.items()}

    @staticmethod
    def leaks(before: Mapping[str, Resources], after: Mapping[str, Resources], *, fd_slack: int, thread_slack: int) -> list[str]:
        """Processes whose fds or threads grew by more than the slack (a per-request leak
        grows by at least the number of cases)."""
        out = []
        for name, b in before.items():
            a = after[name]
            if a.fds > b.fds + fd_slack:
                out.append(f"{name}: open fds {b.fds} -> {a.fds}")
            if a.threads > b.threads + thread_slack:
                out.append(f"{name}: threads {b.threads} -> {a.threads}")
        return out


# -- the runner ----------------------------------------------------------------------------------


@dataclasses.dataclass
class MethodStats:
    cases: int = 0
    codes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    violations: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PropertyReport:
    """Per method path: cases sent, status codes seen, violations (at most 20 kept each)."""

    methods: dict[str, MethodStats]

    @property
    def cases(self) -> int:
        return sum(m.cases for m in self.methods.values())

    @property
    def violations(self) -> list[str]:
        return [v for m in self.methods.values() for v in m.violations]


def _method_runner(channel: grpc.Channel, method: Method, stats: MethodStats, examples: Sequence[message.Message], admin_token: str,
                   clock_ms: Callable[[], int]) -> Callable[[], None]:  # fmt: skip
    """The hypothesis test for ``method``: send one drawn case, record its answer."""

    @given(case=cases(method, examples))
    def one(case: Case) -> None:
        msg = resolve_header_deadline(case.message, case.header_deadline, clock_ms())
        metadata: list[tuple[str, str]] = []
        if case.with_token and admin_token:
            metadata.append(("authorization", f"Bearer {admin_token}"))
            if "admin_token" in msg.DESCRIPTOR.fields_by_name:
                msg.ClearField("admin_token")  # the retired field is refused before anything else
        code, details = call_raw(channel, method, msg.SerializeToString(), GRPC_TIMEOUTS_S[case.grpc_timeout], drain=False, metadata=metadata)
        stats.cases += 1
        stats.codes[code.name if code is not None else "NO_ANSWER"] += 1
        why = judge(method, case, code, details)
        if why is not None and len(stats.violations) < 20:
            stats.violations.append(f"{method.path} {why}; details {details[:160]!r}; header deadline {case.header_deadline}, "
                                    f"grpc timeout {case.grpc_timeout}, request {str(msg)[:300]!r}")  # fmt: skip

    return one  # type: ignore[no-any-return]


def fuzz_methods(
    channel: grpc.Channel,
    methods: Sequence[Method],
    *,
    cases_per_method: int,
    seed: int = 0,
    examples: Mapping[str, Sequence[message.Message]] | None = None,
    admin_token: str = "",
    clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
) -> PropertyReport:
    """Send ``cases_per_method`` hypothesis-drawn :class:`Case` s to each method over
    ``channel`` and judge every answer (:func:`judge`). Draws are seeded from ``seed``
    and the method's path (adding a method changes no other's cases); nothing
    is shrunk or stored. ``admin_token``: sent, for cases with ``with_token``, as
    ``authorization: Bearer`` metadata, with the request's retired ``admin_token``
    field cleared (it is refused first, so these cases reach the method itself)."""
    report = PropertyReport(methods={})
    for method in methods:
        stats = report.methods.setdefault(method.path, MethodStats())
        run = _method_runner(channel, method, stats, (examples or {}).get(method.path, ()), admin_token, clock_ms)
        # One seed per method, from ours and its path: adding a method changes no other's cases.
        hypothesis_seed(seed * 1_000_003 + zlib.crc32(method.path.encode()))(
            settings(max_examples=cases_per_method, deadline=None, database=None, phases=(Phase.generate,),
                     suppress_health_check=list(HealthCheck), report_multiple_bugs=False)(run)  # fmt: skip
        )()
    return report
