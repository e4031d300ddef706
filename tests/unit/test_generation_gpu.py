"""The decode engine on CUDA (run on the lent device machine; skipped without one): the
paged, continuously batched path equals full recompute there too (float64), with
preemption and shared prefixes, and the pool lives on the GPU."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from generation.types import GenerationRequest
from tests.generation_utils import DecodeHarness, random_prompt, tiny_config, tiny_model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_decoding_on_cuda_matches_full_recompute() -> None:
    cpu_cfg = tiny_config(num_blocks=16, block_tokens=4)
    cfg = dataclasses.replace(cpu_cfg, device="cuda")
    h = DecodeHarness(cfg, model=copy.deepcopy(tiny_model(cpu_cfg)).to("cuda"))  # the cached CPU model stays on the CPU
    assert h.engine.cache.kv.is_cuda
    rng = np.random.default_rng(0)
    system = random_prompt(rng, 8)
    for i in range(8):
        h.add(f"r{i}", GenerationRequest(np.concatenate([system, random_prompt(rng, int(rng.integers(1, 10)))]), max_new_tokens=int(rng.integers(4, 20))))
    h.run()
    assert h.policy.preemptions > 0 and h.policy.prefix_hit_blocks > 0
    h.assert_matches_oracle()
