"""A small decoder-only transformer in plain torch, with two forward paths:

- :meth:`TinyDecoder.forward` — full causal attention over ``[B, T]`` tokens (training,
  and the naive full-recompute oracle);
- :meth:`TinyDecoder.forward_paged` — one continuous-batching step: the tokens of many
  sequences packed flat (decode tokens and prefill chunks together), whose K/V are
  written to and read from the paged pool through each sequence's block table.

Both paths use the same weights and the same math; only the order of floating-point sums
differs (decodes attend over ragged contexts with a segmented softmax,
:func:`attend_ragged`; prefill chunks and the full path use padded :func:`attend`), so
greedy decoding through the paged path equals full recompute token for token in float64
(``tests/unit/test_generation_oracle.py``), where no near-tie is that close.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from generation.config import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """``auto`` = CUDA when available, else CPU (the rankers' switch)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked softmax attention. ``q`` [G, Q, H, Dh], ``k``/``v`` [G, C, H, Dh], ``mask``
    [G, Q, C] bool (True = attend; every query row must allow at least one key) ->
    [G, Q, H, Dh]."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("gqhd,gchd->ghqc", q, k) * scale
    scores = scores.masked_fill(~mask[:, None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("ghqc,gchd->gqhd", probs, v)


def attend_ragged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_seq: torch.Tensor) -> torch.Tensor:
    """One query per sequence over ragged contexts (decode). ``q`` [G, H, Dh]; ``k``/``v``
    [K, H, Dh]: every sequence's keys back to back, K = sum of context lengths;
    ``key_seq`` [K] int64: the sequence (0..G-1) of each key -> [G, H, Dh].

    A segmented softmax (scatter max, exp, index_add): the cost follows the keys that
    exist, so one 1,024-token context does not pad every other decode to its length."""
    g = q.shape[0]
    scores = (k * q.index_select(0, key_seq)).sum(-1) * (1.0 / math.sqrt(q.shape[-1]))  # [K, H]
    index = key_seq[:, None].expand_as(scores)
    peak = torch.full((g, scores.shape[1]), float("-inf"), dtype=scores.dtype, device=scores.device)
    peak = peak.scatter_reduce(0, index, scores, reduce="amax", include_self=True)
    weights = torch.exp(scores - peak.index_select(0, key_seq))  # [K, H]
    denom = torch.zeros_like(peak).index_add_(0, key_seq, weights)  # [G, H]
    out = torch.zeros_like(q).index_add_(0, key_seq, weights[..., None] * v)  # [G, H, Dh]
    return out / denom[..., None]


@dataclasses.dataclass(frozen=True, eq=False)
class DecodeGroup:
    """The step's one-token sequences. ``q_rows`` [G] int64: their flat token rows;
    ``key_slots`` [K] int64: pool slots of all their keys, sequence after sequence;
    ``key_seq`` [K] int64: which of the G sequences each key belongs to."""

    q_rows: torch.Tensor
    key_slots: torch.Tensor
    key_seq: torch.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class AttnGroup:
    """The step's prefill chunks (a few sequences), padded to ``Q`` queries and ``C`` keys.

    ``q_index`` [G, Q] int64: rows of the step's flat tokens (padding points at row 0);
    ``q_valid`` [G, Q] bool; ``out_rows`` [V] int64 = ``q_index[q_valid]`` and
    ``valid_flat`` [V] int64 = the flat positions of ``q_valid`` (precomputed on the
    host: boolean indexing on the device would sync every layer); ``ctx_slots`` [G, C]
    int64: pool slots of each sequence's keys 0..C-1, flattened to [G × C] (padding
    points at the pool's null slot, which is never written, so no other sequence's
    values — not even a NaN — can leak in); ``mask`` [G, Q, C] bool: key position <=
    query position and inside the sequence."""

    q_index: torch.Tensor
    q_valid: torch.Tensor
    out_rows: torch.Tensor
    valid_flat: torch.Tensor
    ctx_slots: torch.Tensor
    mask: torch.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class PagedStep:
    """One step's inputs (built by :class:`generation.engine.DecodeEngine`). N tokens flat:
    ``tokens`` [N], ``positions`` [N], ``write_slots`` [N] (pool slot each token's K/V is
    written to); ``decode``: the one-token sequences (ragged attention); ``prefill``:
    the multi-token chunks (padded attention);
    ``sample_index`` [S] int64: the flat rows whose logits are wanted (the last token
    of every sequence that reached the end of its known tokens)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    decode: DecodeGroup | None
    prefill: AttnGroup | None
    sample_index: torch.Tensor


class KvPool(Protocol):
    """The physical pool the paged path reads and writes: ``kv`` [L, slots, 2, H, Dh]
    with slots = blocks × block_tokens (see :class:`generation.kv_cache.PagedKvCache`)."""

    kv: torch.Tensor


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc1 = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.fc2 = nn.Linear(4 * cfg.dim, cfg.dim)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., D] -> q, k, v each [..., H, Dh]."""
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=-1)
        shape = (*x.shape[:-1], self.n_heads, self.head_dim)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x`` [B, T, D], ``mask`` [B, T, T] -> [B, T, D]."""
        q, k, v = self._qkv(x)
        out = attend(q, k, v, mask)
        x = x + self.proj(out.reshape(x.shape))
        return self._mlp(x)

    def forward_paged(self, x: torch.Tensor, step: PagedStep, pool: torch.Tensor) -> torch.Tensor:
        """``x`` [N, D]; ``pool`` [slots, 2, H, Dh]: this layer's K/V -> [N, D]."""
        q, k, v = self._qkv(x)
        # Write the step's K/V first: a prefill chunk's tokens attend to each other.
        pool.index_copy_(0, step.write_slots, torch.stack((k, v), dim=1))
        out = torch.zeros_like(q)
        d = step.decode
        if d is not None:
            kv = pool.index_select(0, d.key_slots)  # [K, 2, H, Dh]: one gather for K and V
            out.index_copy_(0, d.q_rows, attend_ragged(q.index_select(0, d.q_rows), kv[:, 0], kv[:, 1], d.key_seq))
        g = step.prefill
        if g is not None:
            n_seq, n_q = g.q_index.shape
            kv = pool.index_select(0, g.ctx_slots).view(n_seq, -1, *pool.shape[1:])  # [G, C, 2, H, Dh]
            qg = q.index_select(0, g.q_index.reshape(-1)).view(n_seq, n_q, *q.shape[1:])  # [G, Q, H, Dh]
            og = attend(qg, kv[:, :, 0], kv[:, :, 1], g.mask).reshape(n_seq * n_q, *q.shape[1:])
            out.index_copy_(0, g.out_rows, og.index_select(0, g.valid_flat))
        x = x + self.proj(out.reshape(x.shape))
        return self._mlp(x)


class TinyDecoder(nn.Module):
    """Token + learned position embeddings, ``n_layers`` :class:`DecoderLayer`, final
    LayerNorm, output head tied to the token embedding.

    Example::

        model = TinyDecoder(ModelConfig(n_layers=2, dim=64)).eval()
        logits = model(torch.tensor([[256, 104, 105]]))  # [1, 3, 259]
    """

    def __init__(self, cfg: ModelConfig, *, init_std: float = 0.02) -> None:
        super().__init__()
        self.config = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=init_std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        self.to(TORCH_DTYPES[cfg.dtype])

    @property
    def dtype(self) -> torch.dtype:
        return self.tok.weight.dtype

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.ln_f(h) @ self.tok.weight.T

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` [B, T] int64 -> logits [B, T, V]; full causal attention, no cache."""
        _, t = tokens.shape
        pos = torch.arange(t, device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)[None]
        mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()[None].expand(tokens.shape[0], t, t)
        for layer in self.layers:
            x = layer(x, mask)
        return self._logits(x)

    def forward_paged(self, step: PagedStep, pool: KvPool) -> torch.Tensor:
        """One continuous-batching step -> logits [S, V] for ``step.sample_index``."""
        x = self.tok(step.tokens) + self.pos(step.positions)
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        for i, layer in enumerate(layers):
            x = layer.forward_paged(x, step, pool.kv[i])
        return self._logits(x.index_select(0, step.sample_index))
