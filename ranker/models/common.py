"""Tensor helpers shared by the models: mean pooling of jagged ids, padding of
unpooled rows. Each is one batched torch op (no loop over bags or ids)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 bag lengths -> ``[B]`` int64 start offsets (what ``embedding_bag``
    takes with ``include_last_offset=False``)."""
    return torch.cumsum(lengths, 0) - lengths


def mean_pool(weight: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Mean of each bag's rows: ``weight`` [R, D], ``values`` [L] int64 ids, ``lengths``
    [B] int64 -> ``[B, D]``; an empty bag pools to zeros (as torchrec's EBC and the
    shards' mean pooling do). Gradients are sparse (the touched rows only): see
    :func:`ranker.train._optimizers`."""
    return F.embedding_bag(values, weight, offsets_of(lengths), mode="mean", sparse=True)


def gather_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``weight`` [R, D] rows of ``ids`` [L] -> ``[L, D]``, with a sparse gradient."""
    return F.embedding(ids, weight, sparse=True)


def pad_jagged(rows: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpooled rows of B examples -> (``[B, width, D]`` padded rows, ``[B, width]`` bool
    mask).

    ``rows`` [L, D] are the examples' rows concatenated in order, ``lengths`` [B] int64
    (each <= ``width``). Example: lengths [2, 0, 1] with width 2 put rows 0-1 in
    example 0 and row 2 in example 2, slot 0. One ``index_put``.
    """
    b = int(lengths.shape[0])
    d = int(rows.shape[1])
    if b and int(lengths.max()) > width:
        raise ValueError(f"pad_jagged: a bag has {int(lengths.max())} rows; width is {width}")
    example = torch.repeat_interleave(torch.arange(b, device=rows.device), lengths)
    slot = torch.arange(rows.shape[0], device=rows.device) - torch.repeat_interleave(offsets_of(lengths), lengths)
    out = rows.new_zeros((b, width, d))
    out[example, slot] = rows
    mask = torch.arange(width, device=rows.device)[None, :] < lengths[:, None]
    return out, mask


def to_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy array as a tensor on ``device`` (one host-to-device copy)."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)
