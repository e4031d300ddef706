"""The physical paged KV pool: one preallocated tensor pair for every layer.

``kv`` is [L, (num_blocks + 1) × block_tokens, 2, H, Dh] (K then V of each slot side by
side, so one gather reads both) in the model's dtype on its device; token ``p`` of a sequence lives at slot ``blocks[p // B] * B + p % B`` of its
:class:`~generation.blocks.BlockTable`. Which block belongs to whom is decided by
:class:`~generation.blocks.BlockPool` (no torch); this class only holds bytes and copies
blocks for copy-on-write.
"""

from __future__ import annotations

import torch

from generation.config import KvCacheConfig, ModelConfig


class PagedKvCache:
    """Preallocated K/V for ``kv.num_blocks`` blocks of ``kv.block_tokens`` tokens."""

    def __init__(self, model: ModelConfig, kv: KvCacheConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        self.block_tokens = kv.block_tokens
        self.num_blocks = kv.num_blocks
        # One extra block at the end, the null block: never allocated, never written;
        # padded attention reads point there.
        shape = (model.n_layers, (kv.num_blocks + 1) * kv.block_tokens, 2, model.n_heads, model.head_dim)
        self.null_slot = kv.num_blocks * kv.block_tokens
        self.kv = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes of the usable pool (without the null block)."""
        per_slot = self.kv[0, 0].numel() * self.kv.element_size()
        return self.null_slot * self.kv.shape[0] * per_slot

    def block_slots(self, blocks: torch.Tensor) -> torch.Tensor:
        """[n] block ids -> [n × B] slot ids, block by block."""
        offsets = torch.arange(self.block_tokens, device=blocks.device)
        return (blocks[:, None] * self.block_tokens + offsets[None, :]).reshape(-1)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: K/V of block ``src`` into ``dst`` for every (src, dst), before
        the step that writes into ``dst``."""
        if not pairs:
            return
        ids = torch.tensor(pairs, dtype=torch.int64, device=self.kv.device)
        src, dst = self.block_slots(ids[:, 0]), self.block_slots(ids[:, 1])
        self.kv[:, dst] = self.kv[:, src]
