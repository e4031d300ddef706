"""Send random and truncated request bytes to every method of a running gRPC server.

Every server this project runs is fuzzed with this from its integration tests::

    from tests.grpc_fuzz import fuzz_server

    report = fuzz_server(address, seed=0, check=lambda ch: my_stub(ch).Rank(good_request))

:func:`fuzz_server` lists the server's services and methods through gRPC server
reflection (so a server must register it: :func:`recserve.rpc.server.add_health_and_reflection`),
and sends every method, of all four kinds, a fixed-seed set of bodies (a stream-request
method gets each body as a one-message stream):

* fixed hostile ones: the single byte ``0xfe``, ``0xff`` runs, a length prefix far
  beyond the body, the empty body;
* random bytes of random length;
* random *valid* messages of the method's request type (random scalars, nested messages,
  repeated fields), whole and cut at a random byte — and, when the caller passes
  ``examples``, truncations of those real requests, which reach deeper into the servicer.

Each body is first parsed locally with the reflected request type. A body that does not
parse must be answered ``INVALID_ARGUMENT`` with the method's full name in the details
(its responses are read to the end: a stream may answer before it reads the bad
message); one that parses must never be answered ``UNKNOWN`` or ``INTERNAL`` (any
other status is the servicer's business; a streamed reply is cancelled after its first
response, since some streams, like health ``Watch``, never end). Afterwards health must
say SERVING for ``""`` and ``check`` (a real request the caller knows must succeed)
must pass. Every violation is collected
and reported in one ``AssertionError``; the returned :class:`FuzzReport` lets a test
also assert on coverage (which methods were reached, how many bodies were malformed).

:func:`fuzz_properties` is the property-based pass over the same reflected methods
(issue 17): requests that *parse* but carry hostile values, drawn by hypothesis
(:mod:`recserve.bench.fuzz_grpc`, which ``recserve bench fuzz`` runs at full size), each
answer judged by :func:`recserve.bench.fuzz_grpc.judge` (a client-error status, or
DEADLINE_EXCEEDED for an expired deadline). It returns the report and raises nothing,
so a test can check the processes' fds and threads before it asserts.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import grpc
from google.protobuf import message, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recserve.bench.fuzz_grpc import Method, PropertyReport, call_raw, fuzz_methods, list_methods

# Codes a request that parses must never get: they mean the servicer crashed.
CRASH_CODES = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})
FIXED_BODIES = (
    b"\xfe",  # a field number 31 with wire type 6: not a wire type at all
    b"\xff" * 12,  # an unterminated varint tag
    b"\x0a\xff\xff\xff\xff\x07",  # field 1, length-delimited, length ≈ 2 GiB
    b"\x12\x05ab",  # field 2, length 5, only 2 bytes follow
    b"",  # the default message (parses)
)


@dataclasses.dataclass
class MethodReport:
    cases: int = 0
    malformed: int = 0  # bodies that did not parse locally
    codes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)


@dataclasses.dataclass
class FuzzReport:
    """Per method path: cases sent, how many were malformed, the status codes seen."""

    methods: dict[str, MethodReport]


def random_message(desc: Descriptor, rng: random.Random, depth: int = 2) -> message.Message:
    """A random valid message of type ``desc``: each field set with probability 0.6,
    repeated fields get 0-2 values, nesting stops at ``depth``."""
    msg = message_factory.GetMessageClass(desc)()
    for field in desc.fields:
        if rng.random() > 0.6:
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            child_type = field.message_type
            if depth <= 0 or child_type is None or child_type.GetOptions().map_entry:
                continue
            target = getattr(msg, field.name)
            for _ in range(rng.randint(0, 2) if field.is_repeated else 1):
                child = random_message(child_type, rng, depth - 1)
                (target.add() if field.is_repeated else target).CopyFrom(child)
            continue
        values = [_scalar(field, rng) for _ in range(rng.randint(0, 2) if field.is_repeated else 1)]
        if field.is_repeated:
            getattr(msg, field.name).extend(values)
        else:
            setattr(msg, field.name, values[0])
    return msg


def _scalar(field: FieldDescriptor, rng: random.Random) -> Any:
    t = field.type
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return rng.choice([0.0, -1.0, 1e30, float("nan"), float("inf"), rng.uniform(-1e3, 1e3)])
    if t == FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if t == FieldDescriptor.TYPE_STRING:
        return "".join(rng.choice("abcxyz_é0") for _ in range(rng.randint(0, 8)))
    if t == FieldDescriptor.TYPE_BYTES:
        return rng.randbytes(rng.randint(0, 32))
    if t == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values] if field.enum_type is not None else []
        return rng.choice(known + [99])  # proto3 enums are open: unknown values parse
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return rng.choice([0, 1, 2**32 - 1, rng.randint(0, 1000)])
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return rng.choice([0, 1, 2**64 - 1, rng.randint(0, 1000)])
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return rng.choice([0, -1, 2**31 - 1, -(2**31), rng.randint(-1000, 1000)])
    return rng.choice([0, -1, 2**63 - 1, -(2**63), rng.randint(-1000, 1000)])  # 64-bit signed


def bodies(method: Method, rng: random.Random, cases: int, examples: Sequence[message.Message] = ()) -> list[bytes]:
    """``cases`` request bodies for ``method``: the fixed ones first, then in turn random
    bytes, a truncated random message, a whole random message, a truncated example (a
    truncated random message when there are no ``examples``)."""
    out = list(FIXED_BODIES[:cases])
    while len(out) < cases:
        kind = len(out) % 4
        if kind == 0:
            out.append(rng.randbytes(rng.randint(1, 64)))
            continue
        if kind == 3 and examples:
            full = rng.choice(list(examples)).SerializeToString()
        else:
            full = random_message(cast(Descriptor, method.request_type.DESCRIPTOR), rng).SerializeToString()
        if kind == 2:  # whole: a valid message with random contents reaches the servicer
            out.append(full)
        else:  # cut at a random byte (cut mid-field it no longer parses)
            out.append(full[: rng.randint(0, len(full) - 1)] if full else rng.randbytes(3))
    return out


def _parses(request_type: type[message.Message], body: bytes) -> bool:
    try:
        request_type.FromString(body)
    except message.DecodeError:
        return False
    return True


def fuzz_server(
    address: str,
    *,
    seed: int = 0,
    cases_per_method: int = 32,
    timeout_s: float = 10.0,
    examples: Mapping[str, Sequence[message.Message]] | None = None,
    check: Callable[[grpc.Channel], Any] | None = None,
    skip_services: Sequence[str] = (),
    options: Sequence[tuple[str, Any]] = (),
) -> FuzzReport:
    """Fuzz every method of the server at ``address`` (see the module docstring). ``examples``: real requests per method path, whose truncations are sent
    too. ``check``: called with a channel after the fuzzing; raise if the server no
    longer serves. Raises AssertionError listing every violation."""
    failures: list[str] = []
    report = FuzzReport(methods={})
    with grpc.insecure_channel(address, options=list(options)) as channel:
        for method in list_methods(channel, skip_services=skip_services):
            # One stream per method, seeded by its name: adding a method changes no other's cases.
            rng = random.Random(seed * 1_000_003 + zlib.crc32(method.path.encode()))
            stats = report.methods.setdefault(method.path, MethodReport())
            for body in bodies(method, rng, cases_per_method, (examples or {}).get(method.path, ())):
                parses = _parses(method.request_type, body)
                code, details = call_raw(channel, method, body, timeout_s, drain=not parses)
                assert code is not None, f"{method.path}: {details}"
                stats.cases += 1
                stats.malformed += not parses
                stats.codes[code.name] += 1
                if not parses and (code != grpc.StatusCode.INVALID_ARGUMENT or method.path not in details):
                    failures.append(f"{method.path} body {body[:24].hex()} ({len(body)} B, malformed): {code.name} {details[:200]!r}")
                elif parses and code in CRASH_CODES:
                    failures.append(f"{method.path} body {body[:24].hex()} ({len(body)} B, parses): {code.name} {details[:200]!r}")
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            failures.append(f"after fuzzing, health is {health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)}, not SERVING")
        if check is not None:
            try:
                check(channel)
            except Exception as exc:  # noqa: BLE001  (reported with the rest)
                failures.append(f"after fuzzing, the check request failed: {exc!r}")
    if failures:
        raise AssertionError(f"{len(failures)} fuzz violation(s) on {address}:\n" + "\n".join(failures))
    return report


def fuzz_properties(
    address: str,
    *,
    seed: int = 0,
    cases_per_method: int = 12,
    examples: Mapping[str, Sequence[message.Message]] | None = None,
    admin_token: str = "",
    skip_services: Sequence[str] = (),
) -> PropertyReport:
    """Hypothesis-drawn requests to every method the server at ``address`` reflects
    (those of ``skip_services`` aside); see :func:`recserve.bench.fuzz_grpc.fuzz_methods`."""
    with grpc.insecure_channel(address) as channel:
        methods = list_methods(channel, skip_services=skip_services)
        return fuzz_methods(channel, methods, cases_per_method=cases_per_method, seed=seed, examples=examples, admin_token=admin_token)
