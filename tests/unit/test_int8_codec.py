"""The one int8-rowwise decoder (``recserve.rpc.tensors.dequantize_int8``) against
fbgemm's own ``Fused8BitRowwiseQuantizedToFloat``, and both of its users share it."""

from __future__ import annotations

import numpy as np
import torch

from embedding_server import quant
from recserve.lookup import wire
from recserve.rpc import tensors


def test_dequantize_int8_matches_fbgemm_and_is_the_one_both_sides_use() -> None:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    rows = np.random.default_rng(0).normal(size=(64, 24)).astype(np.float32) * 3.0
    fused = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(torch.from_numpy(rows)).numpy()
    oracle = torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(torch.from_numpy(fused)).numpy()
    got = tensors.dequantize_int8(fused)
    assert got.shape == (64, 24) and got.dtype == np.float32
    np.testing.assert_allclose(got, oracle, rtol=1e-6, atol=1e-6)
    # One codec: the shard's quant module and the client's wire module use this function.
    assert quant.dequantize_int8 is tensors.dequantize_int8
    assert wire.dequantize_int8 is tensors.dequantize_int8
