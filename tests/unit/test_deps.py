"""The pinned stack works together: torchrec's DLRM runs a forward pass and an fbgemm
op runs on this machine's build (CPU here, CUDA where there is one)."""

from __future__ import annotations

import torch


def test_dlrm_forward_and_fbgemm_op() -> None:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=100, feature_names=["f0"]),
        EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=50, feature_names=["f1"]),
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables),
        dense_in_features=4,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[8, 1],
    )
    batch = 3
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"],
        values=torch.tensor([1, 2, 3, 4, 5, 6, 7], dtype=torch.int64),
        lengths=torch.tensor([2, 0, 1, 1, 2, 1], dtype=torch.int64),
    )
    out = model(torch.randn(batch, 4), kjt)
    assert out.shape == (batch, 1)
    assert torch.isfinite(out).all()

    rows = torch.randn(5, 16)
    fused = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(rows)
    assert fused.shape == (5, 16 + 8)  # D int8 + fp32 scale + fp32 bias per row
    back = torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(fused)
    # int8 rowwise: error at most half a quantisation step of each row's range.
    step = (rows.max(dim=1).values - rows.min(dim=1).values) / 255.0
    assert ((back - rows).abs() <= step[:, None] * 0.5 + 1e-6).all()
