"""Bad input for the HTTP gateway, from its own OpenAPI document (issue 17).

:func:`fuzz_gateway` reads ``GET /openapi.json`` and, for every operation in it,
sends schemathesis cases (hypothesis-drawn; valid bodies and, for request bodies,
bodies that break the schema), then, for every ``POST`` operation, hand-made hostile
bodies drawn by hypothesis (:func:`hostile_bodies`): random JSON of any shape, a good
body with one field of the wrong type, a body one byte over ``gateway.max_body_bytes``,
bytes that are not UTF-8, JSON cut short, the wrong content type.

:func:`judge_http` is the outcome rule: any 2xx, or a 4xx the gateway means (400, 401,
403, 404, 405, 411, 413, 415, 422, 429); 504 only for a request that set its own
``deadline_ms`` (the budget may really pass). Any other 5xx, or no answer within
:data:`TIMEOUT_S`, is a violation. Tenants: pass ``api_key`` when the gateway's
tenants need one (sent in ``api_key_header``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

TIMEOUT_S = 30.0
CLIENT_STATUSES = frozenset({400, 401, 403, 404, 405, 411, 413, 415, 422, 429})
# A body each POST operation answers 200 to; the wrong-type cases replace one field of it.
GOOD_BODIES: dict[str, dict[str, Any]] = {
    "/v1/recommendations": {"user_id": 3, "k": 5},
    "/v1/rank": {"user_id": 3, "candidate_ids": [10, 11, 12, 13]},
    "/v1/generate": {"prompt": "hello", "max_new_tokens": 4},
}
JSON_VALUES: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@dataclasses.dataclass
class OperationStats:
    cases: int = 0
    statuses: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)


@dataclasses.dataclass
class HttpReport:
    """Per operation (``"POST /v1/rank"``): cases and statuses; violations (at most 50)."""

    operations: dict[str, OperationStats]
    violations: list[str]
    hostile_cases: int = 0

    @property
    def cases(self) -> int:
        return sum(op.cases for op in self.operations.values())


def judge_http(status: int | None, body: bytes | None) -> str | None:
    """None when ``status`` is an acceptable answer to a request with ``body``."""
    if status is None:
        return f"no answer in {TIMEOUT_S:g} s"
    if 200 <= status < 300 or status in CLIENT_STATUSES:
        return None
    if status == 504 and body is not None and b"deadline_ms" in body:
        return None
    return f"HTTP {status}: not a client-error status"


@st.composite
def hostile_bodies(draw: st.DrawFn, path: str, max_body_bytes: int) -> tuple[str, bytes, str]:
    """(kind, body bytes, content type) for ``POST path``."""
    kind = draw(st.sampled_from(("random_json", "wrong_type", "wrong_type", "oversize", "bad_utf8", "truncated", "content_type", "huge_numbers")))
    good = GOOD_BODIES.get(path, {})
    if kind == "random_json":
        return kind, json.dumps(draw(JSON_VALUES)).encode(), "application/json"
    if kind in ("wrong_type", "huge_numbers") and good:
        body = dict(good)
        key = draw(st.sampled_from(sorted(good) + ["deadline_ms", "exclude_ids", "unknown_field"]))
        body[key] = draw(JSON_VALUES) if kind == "wrong_type" else draw(st.sampled_from((2**63, -(2**63) - 1, 10**30, 1e308, -1, [2**64])))
        return kind, json.dumps(body).encode(), "application/json"
    if kind == "oversize":
        return kind, b'{"user_id": 3, "pad": "' + b"x" * max_body_bytes + b'"}', "application/json"
    if kind == "bad_utf8":
        junk = draw(st.sampled_from((b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\x80")))
        return kind, b'{"user_id": 3, "prompt": "' + junk + b'"}', "application/json"
    text = json.dumps(good or {"user_id": 3}).encode()
    if kind == "truncated":
        return kind, text[: draw(st.integers(0, len(text) - 1))], "application/json"
    return kind, text, draw(st.sampled_from(("text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1", "")))


def fuzz_gateway(url: str, *, cases_per_operation: int = 20, seed: int = 0, api_key: str = "", api_key_header: str = "x-api-key",
                 hostile_cases: int | None = None) -> HttpReport:  # fmt: skip
    """Fuzz the gateway at ``url`` (``http://HOST:PORT``; see the module docstring):
    ``cases_per_operation`` schemathesis cases per operation and mode, ``hostile_cases``
    (default the same) hand-made ones per POST operation."""
    import schemathesis
    from schemathesis import GenerationMode

    headers = {api_key_header: api_key} if api_key else {}
    report = HttpReport(operations={}, violations=[])
    with requests.Session() as session:
        document = session.get(url + "/openapi.json", timeout=TIMEOUT_S).json()
        max_body = _max_body_bytes(document)
        schema = schemathesis.openapi.from_dict(document)
        operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]  # an invalid one raises here

        def record(label: str, status: int | None, body: bytes | None, what: str) -> None:
            stats = report.operations.setdefault(label, OperationStats())
            stats.cases += 1
            stats.statuses[status if status is not None else -1] += 1
            why = judge_http(status, body)
            if why is not None and len(report.violations) < 50:
                report.violations.append(f"{label} {why}: {what[:300]}")

        for operation in operations:
            label = f"{operation.method.upper()} {operation.path}"
            modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if operation.method.lower() == "post" else [GenerationMode.POSITIVE]
            for mode in modes:
                strategy = operation.as_strategy(generation_mode=mode)

                def one(case: Any, label: str = label) -> None:
                    kwargs = case.as_transport_kwargs(base_url=url)
                    kwargs["headers"] = {**(kwargs.get("headers") or {}), **headers}
                    body = kwargs.get("data") if isinstance(kwargs.get("data"), bytes) else json.dumps(kwargs["json"]).encode() if "json" in kwargs else None
                    record(label, _send(session, kwargs), body, f"{kwargs.get('method')} {kwargs.get('url')} body {body[:200] if body else None!r}")

                _run(functools.partial(one, label=label), strategy, cases_per_operation, seed * 1_000_003 + zlib.crc32(f"{label} {mode.value}".encode()))
            if operation.method.lower() == "post":
                hostile = hostile_bodies(operation.path, max_body)

                def bad(case: tuple[str, bytes, str], label: str = label, path: str = operation.path) -> None:
                    kind, body, content_type = case
                    sent = {"method": "POST", "url": url + path, "data": body, "headers": {**headers, "Content-Type": content_type}}
                    report.hostile_cases += 1
                    record(label, _send(session, sent), body, f"{kind} body {body[:200]!r} ({len(body):,} B, {content_type!r})")

                _run(functools.partial(bad, label=label, path=operation.path), hostile, hostile_cases or cases_per_operation,
                     seed * 1_000_003 + zlib.crc32(f"{label} hostile".encode()))  # fmt: skip
    return report


def _run(test: Callable[[Any], None], strategy: st.SearchStrategy[Any], cases: int, seed: int) -> None:
    """Run ``test`` on ``cases`` draws of ``strategy`` (seeded; no shrinking, no database)."""

    @hypothesis_seed(seed)
    @settings(max_examples=cases, deadline=None, database=None, phases=(Phase.generate,), suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case: Any) -> None:
        test(case)

    run()


def _send(session: requests.Session, kwargs: Mapping[str, Any]) -> int | None:
    try:
        with session.request(**{**kwargs, "timeout": TIMEOUT_S, "stream": True}) as reply:
            for _ in reply.iter_content(65536):  # an event stream ends when its generation does
                pass
            return reply.status_code
    except requests.Timeout:
        return None
    except requests.ConnectionError:
        # The gateway may close a connection on an oversize body before reading it; a
        # refusal is fine, a dead gateway is not (its /healthz is asked next).
        alive = session.get(str(kwargs["url"]).split("/v1/")[0] + "/healthz", timeout=TIMEOUT_S)
        return 413 if alive.status_code == 200 else None


def _max_body_bytes(document: Mapping[str, Any]) -> int:
    """gateway.max_body_bytes, when the document says it; else the default (1 MiB)."""
    text = json.dumps(document)
    marker = "max_body_bytes = "
    if marker in text:
        digits = text.split(marker, 1)[1].split()[0].strip(",.\"'").replace(",", "")
        if digits.isdigit():
            return int(digits)
    return 1 << 20
