"""Naive greedy decoding by full recompute: no KV cache, one sequence at a time, every
step re-runs the whole sequence through :meth:`TinyDecoder.forward`. The oracle the
paged, continuously batched path must match token for token."""

from __future__ import annotations

import numpy as np
import torch

from generation.model import TinyDecoder
from generation.types import GenerationRequest


def generate_recompute(model: TinyDecoder, request: GenerationRequest) -> np.ndarray:
    """[G] int64 greedy tokens for ``request`` (same stop rules as the engine)."""
    device = model.tok.weight.device
    tokens = torch.from_numpy(request.prompt.copy()).to(device)[None]
    out: list[int] = []
    limit = request.max_new_tokens if request.stop_after is None else request.stop_after
    with torch.inference_mode():
        while len(out) < limit:
            token = int(model(tokens)[0, -1].argmax())
            out.append(token)
            if token == request.stop_token:
                break
            tokens = torch.cat([tokens, torch.tensor([[token]], device=device)], dim=1)
    return np.array(out, dtype=np.int64)
