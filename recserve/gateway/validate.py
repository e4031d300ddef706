"""Request bodies in, typed values out: JSON parsing and schema checks at the gateway.

The rule (docs/architecture.md §3, "The HTTP gateway"):

* **400** (:class:`~recserve.errors.InvalidField`, kind ``invalid_argument``): the body
  cannot be read as a JSON object: malformed JSON, not UTF-8, not an object, or over
  ``gateway.max_body_bytes``;
* **422** (:class:`~recserve.errors.UnprocessableField`, kind ``unprocessable``):
  well-formed JSON that breaks the schema: an unknown or missing field, a wrong type, a
  value out of range (``user_id`` < 0, ``k`` beyond ``cascade.max_k``, a negative id).

Values the gateway cannot judge (an item id beyond the catalog, ``k`` beyond the
catalog's size) go downstream and come back INVALID_ARGUMENT: 400, naming the field.

Id arrays are checked as arrays: one C-level pass for the element types, then numpy for
the range (no Python loop per id; only an error's message looks for the first bad one).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from recserve.errors import InvalidField, UnprocessableField
from recserve.gateway.schemas import Field, Kind, ObjectSchema

_JSON_TYPE = {Kind.INTEGER: "an integer", Kind.NUMBER: "a number", Kind.STRING: "a string", Kind.BOOLEAN: "true or false", Kind.ID_ARRAY: "an array of integer ids"}


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; InvalidField("body", ...) otherwise (400)."""
    try:
        text = raw.decode("utf-8")  # explicitly: json.loads would guess UTF-16/32 from the first bytes
    except UnicodeDecodeError as exc:
        raise InvalidField("body", None, f"the body is not UTF-8 text (byte {exc.start}): send a JSON object") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidField("body", text[max(0, exc.pos - 20) : exc.pos + 20],
                           f"the body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None  # fmt: skip
    if not isinstance(value, dict):
        raise InvalidField("body", type(value).__name__, f"the body is a JSON {_json_name(value)}; send a JSON object")
    return value


def validate(schema: ObjectSchema, body: dict[str, Any]) -> dict[str, Any]:
    """Check ``body`` against ``schema``; the values, id arrays as int64 ``np.ndarray``
    [N]. Absent optional fields are absent from the result. UnprocessableField (422)
    naming the first bad field and its value."""
    known = {f.name: f for f in schema.fields}
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise UnprocessableField(unknown[0], _echo(body[unknown[0]]), f"{unknown[0]} is not a field of {schema.name}; its fields are {sorted(known)}")
    out: dict[str, Any] = {}
    for f in schema.fields:
        if f.name not in body or body[f.name] is None:
            if f.required:
                raise UnprocessableField(f.name, None, f"{f.name} is missing: {schema.name} needs it ({f.description})")
            continue
        out[f.name] = _check(f, body[f.name])
    return out


def _check(f: Field, value: Any) -> Any:
    if f.kind is Kind.ID_ARRAY:
        return _ids(f, value)
    if f.kind is Kind.INTEGER:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif f.kind is Kind.NUMBER:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif f.kind is Kind.STRING:
        ok = isinstance(value, str)
    elif f.kind is Kind.BOOLEAN:
        ok = isinstance(value, bool)
    else:  # response-only kinds never appear in a request schema
        raise AssertionError(f"{f.name}: {f.kind} is not a request field kind")
    if not ok:
        raise UnprocessableField(f.name, _echo(value), f"{f.name} = {json.dumps(value)[:80]} is invalid: use {_JSON_TYPE[f.kind]}")
    if f.minimum is not None and value < f.minimum or f.maximum is not None and value > f.maximum:
        raise UnprocessableField(f.name, value, f"{f.name} = {value:,} is out of range: use {_range(f)}")
    if f.enum is not None and value not in f.enum:
        raise UnprocessableField(f.name, _echo(value), f"{f.name} = {value!r:.80} is invalid: use one of {list(f.enum)}")
    return value


def _ids(f: Field, value: Any) -> np.ndarray:
    """int64 [N] from a JSON array of integers within the field's bounds."""
    if not isinstance(value, list):
        raise UnprocessableField(f.name, _echo(value), f"{f.name} = {json.dumps(value)[:80]} is invalid: use {_JSON_TYPE[f.kind]}")
    if f.max_items is not None and len(value) > f.max_items:
        raise UnprocessableField(f.name, len(value), f"{f.name} has {len(value):,} ids; at most {f.max_items:,} are allowed")
    types = set(map(type, value))  # one C-level pass; bool is not int here (type, not isinstance)
    if types - {int}:
        i = next(i for i, v in enumerate(value) if type(v) is not int)  # the error's message only
        raise UnprocessableField(f"{f.name}[{i}]", value[i], f"{f.name}[{i}] = {json.dumps(value[i])} is invalid: item ids are integers")
    try:
        ids = np.array(value, dtype=np.int64)
    except OverflowError:
        i = next(i for i, v in enumerate(value) if not -(1 << 63) <= v < 1 << 63)
        raise UnprocessableField(f"{f.name}[{i}]", value[i], f"{f.name}[{i}] = {value[i]} is out of range: use {_range(f)}") from None
    bad = np.flatnonzero(ids < f.minimum) if f.minimum is not None else np.empty(0, np.int64)
    if bad.size:
        i = int(bad[0])
        raise UnprocessableField(f"{f.name}[{i}]", int(ids[i]), f"{f.name}[{i}] = {int(ids[i]):,} is out of range: use {_range(f)}")
    return ids


def _range(f: Field) -> str:
    lo = "" if f.minimum is None else f"{f.minimum:,g}" if isinstance(f.minimum, float) and not f.minimum.is_integer() else f"{int(f.minimum):,}"
    hi = "" if f.maximum is None else f"{f.maximum:,g}" if isinstance(f.maximum, float) and not f.maximum.is_integer() else f"{int(f.maximum):,}"
    return f"{lo}..{hi}"


def _json_name(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def _echo(value: Any) -> Any:
    """A value to quote back in an error body: scalars as they are (long strings cut),
    an array or object only by its size (the body is the caller's own, no need to
    send it back whole)."""
    if isinstance(value, str):
        return value[:80]
    if isinstance(value, list):
        return f"array of {len(value):,}"
    if isinstance(value, dict):
        return f"object of {len(value):,} keys"
    return value
