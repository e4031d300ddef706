"""The three models on random weights: split forwards, padding, CUDA vs CPU.

No catalog needed: features come from a tiny hand-made :class:`ServingArrays`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ranker.config import DlrmConfig, L3Config, TwoTowerConfig
from ranker.features import DENSE_FEATURES, LOG_SCALE, LogCounts, ServingArrays, Source, SparseFeature, dense_features, sparse_features
from ranker.models.common import pad_jagged
from ranker.models.dlrm import DLRM_FEATURES, DlrmRanker
from ranker.models.l3 import L3Reranker
from ranker.models.two_tower import TwoTower
from ranker.scoring import jagged_tensors
from recserve.catalog.storage import Csr

ITEMS, USERS, CATS, TAGS = 50, 12, 5, 9
ROWS = {"dlrm_user": USERS, "dlrm_item": ITEMS, "dlrm_category": CATS, "dlrm_tag": TAGS, "dlrm_category_cross": CATS * CATS}
ROWS.update({f"{p}_{t}": n for p in ("tt", "l3") for t, n in (("item", ITEMS), ("category", CATS), ("tag", TAGS))})


def make_arrays(seed: int = 0) -> ServingArrays:
    rng = np.random.default_rng(seed)
    hist_len = rng.integers(0, 9, USERS)  # includes empty histories
    tag_len = rng.integers(1, 4, ITEMS)
    hist = Csr(rng.integers(0, ITEMS, int(hist_len.sum())), np.concatenate([[0], np.cumsum(hist_len)]))
    tags = Csr(rng.integers(0, TAGS, int(tag_len.sum())), np.concatenate([[0], np.cumsum(tag_len)]))
    counts = LogCounts(
        item=np.stack([rng.integers(0, 30, ITEMS), rng.integers(0, 3, ITEMS)], 1),
        user=np.stack([rng.integers(0, 30, USERS), rng.integers(0, 3, USERS)], 1),
        category=np.stack([rng.integers(10, 90, CATS), rng.integers(0, 9, CATS)], 1),
        total=np.array([1000, 80]),
    )
    return ServingArrays(item_category=rng.integers(0, CATS, ITEMS), item_tags=tags, user_history=hist, counts=counts)


def _pairs(n: int = 40) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.integers(0, USERS, n), rng.integers(0, ITEMS, n)


def test_pad_jagged_places_rows_and_masks_the_rest() -> None:
    rows = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    padded, mask = pad_jagged(rows, torch.tensor([2, 0, 1]), 2)
    assert padded.tolist() == [[[0, 1], [2, 3]], [[0, 0], [0, 0]], [[4, 5], [0, 0]]]
    assert mask.tolist() == [[True, True], [False, False], [True, False]]
    with pytest.raises(ValueError, match="width is 1"):
        pad_jagged(rows, torch.tensor([2, 1]), 1)


def test_dlrm_score_pooled_equals_forward() -> None:
    arrays = make_arrays()
    users, items = _pairs()
    model = DlrmRanker(DlrmConfig(embedding_dim=4, dense_arch=(8, 4), over_arch=(8, 1)), ROWS, generator=torch.Generator().manual_seed(0))
    kjt = sparse_features(arrays, DLRM_FEATURES, users, items).kjt()
    dense = torch.from_numpy(dense_features(arrays, users, items))
    with torch.no_grad():
        pooled = model.dlrm.sparse_arch.embedding_bag_collection(kjt).to_dict()
        torch.testing.assert_close(model.score_pooled(dense, pooled), model(dense, kjt))


def test_l3_handles_empty_histories_and_ignores_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    arrays = make_arrays()
    users, items = _pairs()
    model = L3Reranker(L3Config(embedding_dim=4, history=3, hidden=8), ROWS, generator=torch.Generator().manual_seed(0))
    feats = model.pooled_features + model.unpooled_features
    jag = jagged_tensors(sparse_features(arrays, feats, users, items), torch.device("cpu"))
    dense = torch.from_numpy(dense_features(arrays, users, items))
    with torch.no_grad():
        out = model(jag, dense)
        assert out.shape == (40,) and torch.isfinite(out).all()
        assert int(jag["l3_history_items"][1].min()) == 0 and int(jag["l3_history_items"][1].max()) == 3
    # Padding slots carry zeros; garbage there must not change a score (the mask works).
    import ranker.models.l3 as l3_module

    def noisy_pad(rows: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        padded, mask = pad_jagged(rows, lengths, width)
        return torch.where(mask[:, :, None], padded, torch.full_like(padded, 1e3)), mask

    monkeypatch.setattr(l3_module, "pad_jagged", noisy_pad)
    with torch.no_grad():
        torch.testing.assert_close(model(jag, dense), out)


def test_two_tower_vectors_are_unit_length() -> None:
    arrays = make_arrays()
    users, items = _pairs()
    from ranker.scoring import item_vectors, user_vectors

    model = TwoTower(TwoTowerConfig(embedding_dim=4, hidden=8, out_dim=6), ROWS, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        u, v = user_vectors(model, arrays, users), item_vectors(model, arrays, items)
    assert u.shape == (40, 6) and v.shape == (40, 6)
    torch.testing.assert_close(u.norm(dim=1), torch.ones(40))
    torch.testing.assert_close(v.norm(dim=1), torch.ones(40))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dlrm_and_l3_batch_on_cuda_matches_cpu() -> None:
    arrays = make_arrays()
    users, items = _pairs(4096)
    dense = torch.from_numpy(dense_features(arrays, users, items))
    dlrm = DlrmRanker(DlrmConfig(), ROWS, generator=torch.Generator().manual_seed(0)).eval()
    l3 = L3Reranker(L3Config(), ROWS, generator=torch.Generator().manual_seed(0)).eval()
    kjt = sparse_features(arrays, DLRM_FEATURES, users, items).kjt()
    l3_jag = sparse_features(arrays, l3.pooled_features + l3.unpooled_features, users, items)
    cuda = torch.device("cuda")
    with torch.no_grad():
        cpu_d, cpu_l = dlrm(dense, kjt), l3(jagged_tensors(l3_jag, torch.device("cpu")), dense)
        gpu_d = dlrm.to(cuda)(dense.to(cuda), kjt.to(cuda)).cpu()
        gpu_l = l3.to(cuda)(jagged_tensors(l3_jag, cuda), dense.to(cuda)).cpu()
    torch.testing.assert_close(gpu_d, cpu_d, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gpu_l, cpu_l, rtol=1e-4, atol=1e-4)
    # The device check to report (printed, not asserted: speed belongs in benchmarks):
    # host-to-device copies of one scoring batch from numpy features, and the dense
    # forward time on pooled blocks at B = 4,096.
    from torch.profiler import ProfilerActivity, profile

    from ranker.scoring import dlrm_logits

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dlrm_logits(dlrm, arrays, users, items)
        torch.cuda.synchronize()
    copies = sum(e.count for e in prof.key_averages() if "HtoD" in e.key)
    pooled = {k: v.to(cuda) for k, v in dlrm.dlrm.sparse_arch.embedding_bag_collection(kjt.to(cuda)).to_dict().items()}
    dense_cuda = dense.to(cuda)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.no_grad():
        for _ in range(3):  # warm-up: kernels load and cache on first use
            dlrm.score_pooled(dense_cuda, pooled)
        start.record()
        for _ in range(20):
            dlrm.score_pooled(dense_cuda, pooled)
        end.record()
        torch.cuda.synchronize()
    print(f"GPU check: {copies} host-to-device copies per scoring batch; DLRM dense forward at B=4096: {start.elapsed_time(end) / 20:.3f} ms")
    assert copies >= 1  # the batch did reach the device


def test_row_sparse_adam_matches_torch_sparse_adam() -> None:
    from ranker.optim import RowSparseAdam

    torch.manual_seed(0)
    init = torch.randn(20, 3)
    ours, ref = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    opt_ours, opt_ref = RowSparseAdam([ours], lr=0.1), torch.optim.SparseAdam([ref], lr=0.1)
    for step in range(4):
        ids = torch.tensor([1, 5, 5, 7 + step, 19])  # a duplicate id, and rows that come and go
        offsets = torch.tensor([0, 2])
        for p, opt in ((ours, opt_ours), (ref, opt_ref)):
            opt.zero_grad()
            (torch.nn.functional.embedding_bag(ids, p, offsets, mode="mean", sparse=True) ** 2).sum().backward()
            opt.step()
    torch.testing.assert_close(ours, ref)
    assert torch.equal(ours[0], init[0]) and not torch.equal(ours[5], init[5])  # untouched rows stay, touched rows move


def _history(arrays: ServingArrays, user: int) -> np.ndarray:
    offsets = np.asarray(arrays.user_history.offsets)
    return np.asarray(arrays.user_history.values)[offsets[user] : offsets[user + 1]]


def test_category_cross_pairs_every_history_category_with_the_candidates() -> None:
    arrays = make_arrays()
    users, items = _pairs()
    cross = SparseFeature("x", "dlrm_category_cross", Source.CATEGORY_CROSS)
    values, lengths = sparse_features(arrays, (cross,), users, items).feature("x")
    cat = arrays.item_category
    # Oracle: a plain loop over pairs and their history items.
    expected = [int(cat[h]) * CATS + int(cat[i]) for u, i in zip(users, items) for h in _history(arrays, int(u))]
    assert values.tolist() == expected
    assert lengths.tolist() == [len(_history(arrays, int(u))) for u in users]
    assert 0 <= values.min() and values.max() < ROWS["dlrm_category_cross"]
    assert "dlrm_category_cross" in {f.name for f in DLRM_FEATURES}


def test_history_category_log_share_counts_the_candidates_category() -> None:
    arrays = make_arrays()
    users, items = _pairs()
    got = dense_features(arrays, users, items)[:, DENSE_FEATURES.index("history_category_log_share")]
    cat = arrays.item_category
    same = np.array([int((cat[_history(arrays, int(u))] == cat[i]).sum()) for u, i in zip(users, items)])
    lengths = np.array([len(_history(arrays, int(u))) for u in users])
    assert same.max() > 0 and (same == 0).any()  # both cases occur in the sample
    np.testing.assert_allclose(got, np.log((same + 0.1) / (lengths + 1.0)) / LOG_SCALE, rtol=1e-6)


def test_two_tower_category_rows_have_their_own_width() -> None:
    from ranker.scoring import item_vectors, user_vectors

    arrays = make_arrays()
    users, items = _pairs()
    wide = TwoTower(TwoTowerConfig(embedding_dim=4, hidden=8, out_dim=6, category_dim=7), ROWS, generator=torch.Generator().manual_seed(0))
    assert tuple(wide.tables["tt_category"].shape) == (CATS, 7) and tuple(wide.tables["tt_item"].shape) == (ITEMS, 4)
    with torch.no_grad():
        assert user_vectors(wide, arrays, users).shape == (40, 6) and item_vectors(wide, arrays, items).shape == (40, 6)
    same = TwoTower(TwoTowerConfig(embedding_dim=4, hidden=8, out_dim=6, category_dim=0), ROWS)
    assert tuple(same.tables["tt_category"].shape) == (CATS, 4)  # 0 = embedding_dim


def test_linear_decay_reaches_the_final_fraction_and_stays() -> None:
    from ranker.optim import RowSparseAdam, linear_decay

    w = torch.nn.Parameter(torch.zeros(3, 2))
    opts: list[torch.optim.Optimizer] = [RowSparseAdam([w], lr=0.1), torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=0.2)]
    schedules = linear_decay(opts, steps=4, final=0.25)
    seen = []
    for _ in range(6):
        for opt in opts:
            opt.step()  # no gradients: a no-op step, as the scheduler expects one first
        for s in schedules:
            s.step()
        seen.append([opt.param_groups[0]["lr"] for opt in opts])
    np.testing.assert_allclose([r[0] for r in seen], [0.08125, 0.0625, 0.04375, 0.025, 0.025, 0.025])
    np.testing.assert_allclose([r[1] for r in seen], [0.1625, 0.125, 0.0875, 0.05, 0.05, 0.05])
