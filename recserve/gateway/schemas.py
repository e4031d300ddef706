"""The gateway's request and response bodies, as data.

One :class:`ObjectSchema` per body. The same objects validate request bodies
(:mod:`recserve.gateway.validate`) and are emitted as the OpenAPI document's JSON Schemas
(:mod:`recserve.gateway.openapi`), so the two cannot drift. Bounds that come from the
cluster spec (``k`` up to ``cascade.max_k``, candidates up to ``ranker.max_candidates``)
are filled in by :func:`request_schemas`.

Field kinds are few on purpose: integers, numbers, strings, booleans, integer id arrays
(validated as numpy arrays, never per id in Python) and arrays of objects (responses).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from recserve.config.spec import MODEL_NAMES, ClusterConfig

INT64_MAX = (1 << 63) - 1
INT32_MAX = (1 << 31) - 1


class Kind(enum.Enum):
    INTEGER = "integer"
    NUMBER = "number"
    STRING = "string"
    BOOLEAN = "boolean"
    ID_ARRAY = "id_array"  # int64 ids [N] -> np.ndarray
    NUMBER_ARRAY = "number_array"  # float32 scores [N] (responses only)
    OBJECT_ARRAY = "object_array"  # [ObjectSchema] (responses only)
    OBJECT = "object"  # one ObjectSchema (responses only)
    ANY = "any"  # any JSON value, null included (responses only)


@dataclasses.dataclass(frozen=True)
class Field:
    """One property. ``minimum`` / ``maximum`` bound an integer (or every id of an
    ``ID_ARRAY``); ``max_items`` bounds an array's length; ``enum`` lists a string's
    values."""

    name: str
    kind: Kind
    description: str
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    max_items: int | None = None
    enum: tuple[str, ...] | None = None
    items: ObjectSchema | None = None  # OBJECT_ARRAY's element, OBJECT's schema
    nullable: bool = False  # null allowed (responses only)

    def json_schema(self) -> dict[str, Any]:
        """This field as JSON Schema (OpenAPI 3.0 dialect)."""
        bounds = {k: v for k, v in (("minimum", self.minimum), ("maximum", self.maximum)) if v is not None}
        if self.kind is Kind.ID_ARRAY:
            out: dict[str, Any] = {"type": "array", "items": {"type": "integer", "format": "int64", **bounds}}
            if self.max_items is not None:
                out["maxItems"] = self.max_items
        elif self.kind is Kind.NUMBER_ARRAY:
            out = {"type": "array", "items": {"type": "number", "format": "float"}}
        elif self.kind is Kind.OBJECT_ARRAY:
            assert self.items is not None
            out = {"type": "array", "items": {"$ref": f"#/components/schemas/{self.items.name}"}}
        elif self.kind is Kind.OBJECT:
            assert self.items is not None
            # OpenAPI 3.0 ignores siblings of $ref: wrap it, so the description stays.
            out = {"allOf": [{"$ref": f"#/components/schemas/{self.items.name}"}]}
        elif self.kind is Kind.ANY:
            out = {}
        elif self.kind is Kind.INTEGER:
            out = {"type": "integer", "format": "int64", **bounds}
        else:
            out = {"type": self.kind.value, **bounds}
        if self.enum is not None:
            out["enum"] = list(self.enum)
        if self.nullable and self.kind is not Kind.ANY:
            out["nullable"] = True
        out["description"] = self.description
        return out


@dataclasses.dataclass(frozen=True)
class ObjectSchema:
    """A JSON object with exactly these ``fields`` (unknown keys are refused)."""

    name: str
    description: str
    fields: tuple[Field, ...]

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    def json_schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "object",
            "description": self.description,
            "additionalProperties": False,
            "properties": {f.name: f.json_schema() for f in self.fields},
        }
        required = [f.name for f in self.fields if f.required]
        if required:
            out["required"] = required
        return out


def request_schemas(cluster: ClusterConfig) -> dict[str, ObjectSchema]:
    """The request bodies, bounded by the spec: ``{"RecommendRequest", "RankRequest",
    "GenerateRequest"}``."""
    max_k = cluster.cascade.max_k
    gen = cluster.generation
    max_candidates = cluster.ranker.max_candidates
    deadline = Field("deadline_ms", Kind.NUMBER, "time budget in ms from arrival; the gateway's timeout_ms caps it (the earlier wins)",
                     minimum=1, maximum=cluster.gateway.timeout_ms)  # fmt: skip
    user = Field("user_id", Kind.INTEGER, "the user; ids beyond the trained users are new users (cold start)", required=True, minimum=0, maximum=INT64_MAX)
    return {
        "RecommendRequest": ObjectSchema("RecommendRequest", "POST /v1/recommendations: the top k items for a user through the L0-L3 cascade", (
            user,
            Field("k", Kind.INTEGER, f"items wanted (default: cascade.l3_out = {cluster.cascade.l3_out})", minimum=1, maximum=max_k),
            deadline,
            Field("exclude_ids", Kind.ID_ARRAY, "item ids never to return", minimum=0, maximum=INT64_MAX, max_items=100_000),
            Field("recent_item_ids", Kind.ID_ARRAY, "items the user just saw (appended to the history; never returned)", minimum=0, maximum=INT64_MAX, max_items=10_000),
        )),  # fmt: skip
        "RankRequest": ObjectSchema("RankRequest", "POST /v1/rank: score given candidates for a user, best first", (
            user,
            Field("candidate_ids", Kind.ID_ARRAY, f"item ids to score (1..{max_candidates:,}: ranker.max_candidates)", required=True, minimum=0,
                  maximum=INT64_MAX, max_items=max_candidates),
            Field("model", Kind.STRING, "model to score with (default: the ranker's first)", enum=MODEL_NAMES),
            Field("history_item_ids", Kind.ID_ARRAY, "recent items appended to the user's history", minimum=0, maximum=INT64_MAX, max_items=10_000),
            deadline,
        )),  # fmt: skip
        "GenerateRequest": ObjectSchema("GenerateRequest", "POST /v1/generate: stream a continuation of a prompt as server-sent events", (
            Field("prompt", Kind.STRING, "the prompt text (UTF-8 bytes are the tokens); give this or prompt_tokens, not both"),
            Field("prompt_tokens", Kind.ID_ARRAY, "the prompt as token ids (byte tokenizer: 0..258); give this or prompt, not both",
                  minimum=0, maximum=INT32_MAX, max_items=65_536),
            Field("max_new_tokens", Kind.INTEGER, f"tokens to generate at most (default {min(32, gen.max_new_tokens_cap)}; generation.max_new_tokens_cap = {gen.max_new_tokens_cap:,})",
                  minimum=1, maximum=gen.max_new_tokens_cap),
            Field("temperature", Kind.NUMBER, "0 = greedy (default); > 0 samples from softmax(logits / temperature)", minimum=0),
            Field("seed", Kind.INTEGER, "the sampling seed (same seed, same text)", minimum=-INT64_MAX - 1, maximum=INT64_MAX),
            Field("session_key", Kind.STRING, "an affinity key (a user, a conversation): its requests go to one replica, which reuses their prompt's KV blocks"),
            Field("deadline_ms", Kind.NUMBER, f"time budget in ms from arrival for the whole stream; generation.default_timeout_ms = {gen.default_timeout_ms:,g} caps it",
                  minimum=1, maximum=gen.default_timeout_ms),
        )),  # fmt: skip
    }


STAGE_REPORT = ObjectSchema("StageReport", "what one cascade stage did", (
    Field("stage", Kind.STRING, "L0, L1, L2 or L3", required=True),
    Field("budget_ms", Kind.NUMBER, "time the stage was given", required=True),
    Field("elapsed_ms", Kind.NUMBER, "time it took", required=True),
    Field("in_count", Kind.INTEGER, "candidates in", required=True),
    Field("out_count", Kind.INTEGER, "candidates out", required=True),
    Field("degraded", Kind.BOOLEAN, "whether it fell back", required=True),
    Field("degraded_reason", Kind.STRING, "why ('' when not degraded)", required=True),
    Field("coverage", Kind.NUMBER, "fraction of its input it covered", required=True),
))  # fmt: skip

ERROR_DETAIL = ObjectSchema("ErrorDetail", "what went wrong", (
    Field("status", Kind.INTEGER, "the HTTP status again", required=True),
    Field("kind", Kind.STRING, "recserve error kind, e.g. invalid_argument, unprocessable, unauthenticated, resource_exhausted", required=True),
    Field("field", Kind.STRING, "the offending field's JSON path, e.g. exclude_ids[3], or null", required=True, nullable=True),
    Field("value", Kind.ANY, "the offending value (any JSON type), or null", required=True),
    Field("message", Kind.STRING, "a message naming the field, the value and the fix", required=True),
))  # fmt: skip


DOWNSTREAM = ObjectSchema("Downstream", "one downstream process", (
    Field("address", Kind.STRING, "HOST:PORT", required=True),
    Field("serving", Kind.BOOLEAN, "gRPC health SERVING", required=True),
))  # fmt: skip


def response_schemas() -> dict[str, ObjectSchema]:
    """The response bodies (success and error) of the OpenAPI document."""
    versions = (
        Field("index_version", Kind.STRING, "the L0 index served", required=True),
        Field("model_version", Kind.STRING, "the models served", required=True),
    )
    return {
        "RecommendResponse": ObjectSchema("RecommendResponse", "the cascade's answer", (
            Field("item_ids", Kind.ID_ARRAY, "k item ids, best first", required=True),
            Field("scores", Kind.NUMBER_ARRAY, "their scores", required=True),
            Field("stages", Kind.OBJECT_ARRAY, "one report per stage, L0..L3", required=True, items=STAGE_REPORT),
            Field("coverage", Kind.NUMBER, "fraction of the planned work done", required=True),
            Field("degraded", Kind.BOOLEAN, "whether any stage fell back", required=True),
            Field("degraded_reason", Kind.STRING, "why ('' when not degraded)", required=True),
            *versions,
            Field("request_id", Kind.STRING, "this request's id (also the X-Request-Id header)", required=True),
        )),  # fmt: skip
        "RankResponse": ObjectSchema("RankResponse", "the candidates, best first", (
            Field("item_ids", Kind.ID_ARRAY, "the candidate ids, best first", required=True),
            Field("scores", Kind.NUMBER_ARRAY, "their scores (logits)", required=True),
            Field("model", Kind.STRING, "the model that scored", required=True),
            Field("model_version", Kind.STRING, "the models served", required=True),
            Field("degraded", Kind.BOOLEAN, "whether rows were missing or the user is new", required=True),
            Field("degraded_reason", Kind.STRING, "why ('' when not degraded)", required=True),
            Field("request_id", Kind.STRING, "this request's id (also the X-Request-Id header)", required=True),
        )),  # fmt: skip
        "ReadyResponse": ObjectSchema("ReadyResponse", "readiness of every downstream", (
            Field("ready", Kind.BOOLEAN, "whether every downstream is SERVING", required=True),
            Field("downstream", Kind.OBJECT_ARRAY, "one entry per downstream address", required=True, items=DOWNSTREAM),
            Field("crash_looping", Kind.ANY, "under `recserve serve`: names of the children crash-looping now (any makes it 503)"),
            Field("supervisor", Kind.ANY, "under `recserve serve`: per child its state, restarts, last exit code, recent exits"),
        )),  # fmt: skip
        "GenerateChunk": ObjectSchema("GenerateChunk", "the data of one `event: chunk` of POST /v1/generate's event stream", (
            Field("index", Kind.INTEGER, "chunk sequence number, from 0 (also the event's id)", required=True),
            Field("tokens", Kind.ID_ARRAY, "the token ids this chunk carries (one; none in a final 'deadline' chunk)", required=True),
            Field("text", Kind.STRING, "their text (a character split across tokens arrives whole with its last byte)", required=True),
            Field("finished", Kind.BOOLEAN, "the last chunk of the stream", required=True),
            Field("finish_reason", Kind.STRING, "on the last chunk: length (max_new_tokens), stop (the stop token), deadline; else ''", required=True),
            Field("emitted_unix_us", Kind.INTEGER, "wall clock (unix microseconds) when the replica sent it", required=True),
        )),  # fmt: skip
        "HealthResponse": ObjectSchema("HealthResponse", "the process is alive", (Field("status", Kind.STRING, "always 'ok'", required=True),)),
        "ErrorResponse": ObjectSchema("ErrorResponse", "every error answer", (
            Field("error", Kind.OBJECT, "what went wrong", required=True, items=ERROR_DETAIL),
            Field("request_id", Kind.STRING, "this request's id", required=True),
        )),  # fmt: skip
    }

