"""The decode engine's messages: what a caller asks for, what a sequence carries between
steps, and what it gets back. ``GenerationRequest`` is the scheduler ``WorkItem.payload``;
``SequenceState`` is ``Handle.state`` (owned by the engine, kept across preemptions)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from recserve.errors import InvalidArgument
from recserve.scheduling import Handle


@dataclasses.dataclass(frozen=True, eq=False)
class GenerationRequest:
    """``prompt``: [P] int64 token ids (P >= 1). ``max_new_tokens``: the per-request
    compute budget (reference §10.6.9): generation stops there whatever the model says,
    and KV admission plans for it. ``stop_token``: greedy decoding ends after emitting it
    (None: never). ``stop_after``: benchmarks only — end after this many tokens, standing
    in for an EOS the random-weight model would not produce; the scheduler never reads it.
    ``temperature``: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature)
    with Gumbel noise drawn from (``seed``, position), so a sequence's tokens do not depend
    on its batch neighbours and a preempted sequence recomputes the same tokens."""

    prompt: np.ndarray
    max_new_tokens: int
    stop_token: int | None = None
    stop_after: int | None = None
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        p = self.prompt
        if not isinstance(p, np.ndarray) or p.ndim != 1 or p.shape[0] < 1 or p.dtype != np.int64:
            raise InvalidArgument(
                f"prompt must be a non-empty [P] int64 array of token ids; got {type(p).__name__} "
                f"{getattr(p, 'dtype', '')} of shape {getattr(p, 'shape', '?')}"
            )
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens = {self.max_new_tokens!r} must be an integer >= 1")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgument(f"temperature = {self.temperature!r} is invalid: use a finite value >= 0 (0 = greedy)")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.max_new_tokens:
            raise InvalidArgument(f"stop_after = {self.stop_after!r} must be in 1..max_new_tokens ({self.max_new_tokens})")

    @property
    def prompt_len(self) -> int:
        return int(self.prompt.shape[0])


@dataclasses.dataclass(slots=True, eq=False)
class SequenceState:
    """Tokens known so far: ``tokens[:length]`` = prompt + generated ([P + max_new_tokens]
    int64 buffer). Survives preemption: a recomputed sequence prefills all known tokens."""

    tokens: np.ndarray
    length: int
    prompt_len: int

    @classmethod
    def start(cls, request: GenerationRequest) -> SequenceState:
        buf = np.empty(request.prompt_len + request.max_new_tokens, dtype=np.int64)
        buf[: request.prompt_len] = request.prompt
        return cls(buf, request.prompt_len, request.prompt_len)

    @property
    def generated(self) -> np.ndarray:
        """[G] int64: the tokens generated so far (a view)."""
        return self.tokens[self.prompt_len : self.length]


def known_tokens(handle: Handle) -> np.ndarray:
    """[T] int64: prompt + generated tokens of a decode handle (a view)."""
    state: Any = handle.state
    if state is None:
        return handle.item.payload.prompt  # type: ignore[no-any-return]
    return state.tokens[: state.length]  # type: ignore[no-any-return]


def generated_count(handle: Handle) -> int:
    state: Any = handle.state
    return 0 if state is None else int(state.length - state.prompt_len)


def request_of(handle: Handle) -> GenerationRequest:
    payload = handle.item.payload
    if not isinstance(payload, GenerationRequest):
        raise InvalidArgument(f"request {handle.request_id}: the decode policy needs a GenerationRequest payload, got {type(payload).__name__}")
    return payload
