"""Config objects of the decode engine: model shape, KV pool, batching policy, device.

Each is validated when built (``__post_init__`` through :func:`recserve.errors.require`,
so a bad value raises ConfigError naming the field, the value and the fix). Derive
variants with ``dataclasses.replace``. No torch here: the CLI builds these before it
decides to import torch.
"""

from __future__ import annotations

import dataclasses

from recserve.errors import require

DEVICES = ("auto", "cpu", "cuda")  # the same switch as ``ranker.device``
DTYPES = ("float32", "float64", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: ``n_layers`` pre-LayerNorm blocks of ``n_heads``-head
    causal attention over ``dim`` (head width ``dim // n_heads``) and a 4×``dim`` MLP;
    learned absolute positions up to ``max_seq_len``; the output head is tied to the
    token embedding. ``vocab_size`` is the byte tokenizer's 259 by default."""

    vocab_size: int = 259
    n_layers: int = 2
    n_heads: int = 4
    dim: int = 64
    max_seq_len: int = 2048
    dtype: str = "float32"

    def __post_init__(self) -> None:
        require(isinstance(self.vocab_size, int) and self.vocab_size >= 2, "model.vocab_size", self.vocab_size, "use at least 2 tokens")
        require(isinstance(self.n_layers, int) and 1 <= self.n_layers <= 64, "model.n_layers", self.n_layers, "use 1..64 layers")
        require(isinstance(self.n_heads, int) and self.n_heads >= 1, "model.n_heads", self.n_heads, "use at least 1 head")
        require(isinstance(self.dim, int) and self.dim >= 1 and self.dim % max(1, self.n_heads) == 0, "model.dim", self.dim,
                f"use a positive width divisible by n_heads ({self.n_heads})")
        require(isinstance(self.max_seq_len, int) and 2 <= self.max_seq_len <= 65_536, "model.max_seq_len", self.max_seq_len, "use 2..65,536 positions")
        require(self.dtype in DTYPES, "model.dtype", self.dtype, f"use one of {DTYPES} (float64 for exactness oracles)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """Bytes one cached token costs (reference eq. 5): 2 (K and V) × layers × heads × head_dim × element size."""
        return 2 * self.n_layers * self.n_heads * self.head_dim * element_bytes


@dataclasses.dataclass(frozen=True)
class KvCacheConfig:
    """The paged KV pool: ``num_blocks`` preallocated blocks of ``block_tokens`` tokens.
    ``model_version`` is part of every prefix-cache key, so blocks computed by other
    weights are never reused; ``prefix_sharing`` turns copy-on-write prefix sharing off
    (the contiguous baseline)."""

    num_blocks: int = 256
    block_tokens: int = 16
    model_version: str = "v0"
    prefix_sharing: bool = True

    def __post_init__(self) -> None:
        require(isinstance(self.num_blocks, int) and self.num_blocks >= 1, "kv.num_blocks", self.num_blocks, "use at least 1 block")
        require(isinstance(self.block_tokens, int) and 1 <= self.block_tokens <= 1024, "kv.block_tokens", self.block_tokens, "use 1..1,024 tokens per block (16 is the usual)")
        require(isinstance(self.model_version, str) and bool(self.model_version), "kv.model_version", self.model_version, "name the weights' version (prefix-cache key)")

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_tokens

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_tokens)


@dataclasses.dataclass(frozen=True)
class ContinuousBatchConfig:
    """Iteration-level batching over a paged KV pool (``kv``).

    ``max_seqs``: live sequences (holding KV) at most — the maximum batch size.
    ``token_budget``: tokens one step computes at most (decode tokens + prefill chunks,
    reference eq. 8). ``prefill_chunk_tokens``: the largest piece of one prompt per step;
    None prefills a prompt whole in one step (unchunked; it may exceed the budget when it
    is the step's first prefill, so a long prompt is never starved)."""

    kv: KvCacheConfig = KvCacheConfig()
    max_seqs: int = 64
    token_budget: int = 512
    prefill_chunk_tokens: int | None = 128

    def __post_init__(self) -> None:
        require(isinstance(self.max_seqs, int) and self.max_seqs >= 1, "batching.max_seqs", self.max_seqs, "use at least 1 sequence")
        require(isinstance(self.token_budget, int) and self.token_budget >= 1, "batching.token_budget", self.token_budget, "use at least 1 token per step")
        chunk = self.prefill_chunk_tokens
        require(chunk is None or (isinstance(chunk, int) and 1 <= chunk <= self.token_budget), "batching.prefill_chunk_tokens", chunk,
                f"use 1..token_budget ({self.token_budget}) tokens, or None for unchunked prefill")


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """The whole engine: model, batching (with its KV pool) and device (``auto`` = CUDA
    when available, else CPU — the rankers' switch)."""

    model: ModelConfig = ModelConfig()
    batching: ContinuousBatchConfig = ContinuousBatchConfig()
    device: str = "auto"

    def __post_init__(self) -> None:
        require(self.device in DEVICES, "generation.device", self.device, f"use one of {DEVICES}")
