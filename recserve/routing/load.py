"""The work signal of a generation stream: active tokens plus KV occupancy (pure).

Two choices compares replicas on a work signal (:mod:`recserve.routing.choice`); for a
ranker it is in-flight candidates, for a decoder it is what predicts queueing there
(reference §10.11.3 and §10.6): the **active tokens** a replica still has to compute
for the streams it holds (prompt tokens not yet prefilled, tokens not yet generated:
each costs a slot in a future step's token budget) plus its **KV occupancy** (tokens
whose K/V it holds: each costs pool memory, so admission waits or preempts when the
pool fills, and attention reads it on every step).

**Who measures it: both.** The client tracks its own streams exactly, per chunk: a
stream starts with ``prompt + max_new_tokens`` active tokens and nothing held; its first
chunk means the prompt was prefilled (prompt tokens move from active to held); each
chunk's tokens move the same way (:meth:`DecodeLoad.cost`). The difference goes into
the router's in-flight work (:meth:`recserve.routing.Router.add_inflight`) as chunks
arrive, so that part is never stale. The work *other* clients sent is what the replica
reports in-band, in the initial metadata of every stream it starts
(``recserve-active-tokens``: tokens its live streams may still compute;
``recserve-kv-occupancy``: the used fraction of its KV pool):
:meth:`DecodeLoad.reported` turns that into the router's reported load
(:meth:`~recserve.routing.Router.set_reported_load`), minus this client's own share, so
nothing is counted twice. It is as fresh as the last stream started on that replica.

Held tokens weigh ``kv_weight`` (0.5 by default) against 1 for an active token: a held
token occupies memory and attention bandwidth, a token still to compute also occupies
a step. With ``kv_weight = 1`` a stream's cost would stay ``prompt + max_new_tokens``
for its whole life (the KV reservation), and routing could not tell a stream about to
finish from one just started.

Example::

    load = DecodeLoad()
    load.cost(prompt_tokens=40, max_new_tokens=32)                 # 72.0 before prefill
    load.cost(prompt_tokens=40, max_new_tokens=32, generated=8,
              prefilled=True)                                      # 24 + 0.5 * 48 = 48.0
"""

from __future__ import annotations

import dataclasses
import math

from recserve.errors import require

__all__ = ["DecodeLoad"]


@dataclasses.dataclass(frozen=True)
class DecodeLoad:
    """Cost of one generation stream in token units (see the module docstring).

    ``kv_weight``: what one token held in the KV cache costs against one token still to
    compute (in ``[0, 1]``)."""

    kv_weight: float = 0.5
    kv_capacity_tokens: float = 4096.0  # a replica's KV pool in tokens ([generation] num_blocks x block_tokens)

    def __post_init__(self) -> None:
        require(
            isinstance(self.kv_weight, (int, float)) and math.isfinite(self.kv_weight) and 0.0 <= self.kv_weight <= 1.0,
            "decode_load.kv_weight", self.kv_weight, "use a weight in [0, 1] (a held token costs at most an active one)",
        )  # fmt: skip
        require(
            isinstance(self.kv_capacity_tokens, (int, float)) and math.isfinite(self.kv_capacity_tokens) and self.kv_capacity_tokens > 0,
            "decode_load.kv_capacity_tokens", self.kv_capacity_tokens, "use the replicas' KV pool size in tokens (num_blocks x block_tokens)",
        )  # fmt: skip

    def reported(self, active_tokens: float, kv_occupancy: float, own_active_tokens: float) -> float:
        """The work a replica reports beyond this client's: its ``active_tokens`` less
        the ``own_active_tokens`` this client's other streams there still have to compute,
        plus ``kv_weight`` x its held tokens (``kv_occupancy`` in [0, 1] of
        ``kv_capacity_tokens``; the whole pool: it is the pool's fullness that makes
        admission wait, whoever's tokens fill it). Bad or missing numbers count as 0."""
        others = active_tokens - own_active_tokens if math.isfinite(active_tokens) and math.isfinite(own_active_tokens) else 0.0
        occupancy = min(1.0, max(0.0, kv_occupancy)) if math.isfinite(kv_occupancy) else 0.0
        return float(max(0.0, others) + self.kv_weight * occupancy * self.kv_capacity_tokens)

    def active(self, prompt_tokens: int, max_new_tokens: int, generated: int = 0) -> int:
        """Tokens a stream may still compute, as the replica counts them
        (``prompt + max_new_tokens - generated``; ``recserve-active-tokens``)."""
        return max(0, prompt_tokens + max_new_tokens - min(max(0, generated), max_new_tokens))

    def cost(self, prompt_tokens: int, max_new_tokens: int, generated: int = 0, *, prefilled: bool = False) -> float:
        """Active tokens + ``kv_weight`` x held tokens of one stream.

        ``prompt_tokens``: its prompt length; ``max_new_tokens``: its budget;
        ``generated``: tokens received so far; ``prefilled``: whether the first chunk
        arrived (the server has the prompt's K/V)."""
        generated = min(max(0, generated), max_new_tokens)
        active = max_new_tokens - generated + (0 if prefilled else prompt_tokens)
        held = generated + (prompt_tokens if prefilled else 0)
        return float(active + self.kv_weight * held)
