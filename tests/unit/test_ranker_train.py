"""Ranker training on a tiny catalog: no leakage, determinism, features, export round trip.

One 5k-item catalog and one short training run per module (seconds); every test reads
them. Training sees only the scrubbed view: a copy of the catalog with the ground truth
deleted trains to bit-identical weights.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ranker.config import DlrmConfig, L3Config, TrainConfig, TwoTowerConfig
from ranker.export import compute_model_version, export_models
from ranker.features import dense_features, gather_jagged, serving_arrays
from ranker.scoring import score_pairs
from ranker.scrubbed import GROUND_TRUTH_FILES, GROUND_TRUTH_MANIFEST_FIELDS, open_scrubbed
from ranker.serving import check_table_versions, load_model, open_export
from ranker.train import TrainedModels, train_all
from recserve.errors import FailedPrecondition
from tests.utils_catalog import make_catalog

TINY = TrainConfig(
    dlrm=DlrmConfig(embedding_dim=8, dense_arch=(16, 8), over_arch=(16, 1)),
    two_tower=TwoTowerConfig(embedding_dim=8, hidden=16, out_dim=8),
    l3=L3Config(embedding_dim=8, history=8, hidden=16),
    device="cpu",
    batch_size=512,
    tt_batch_size=256,
    epochs=1,
    tt_epochs=1,
    max_rows=4096,
    progress=False,
)


@pytest.fixture(scope="module")
def catalog_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ranker-catalog") / "catalog"
    make_catalog(out, items=5_000, users=500, impressions=20_000, categories=16, tags=64, history_len=12, candidates=128)
    return out


@pytest.fixture(scope="module")
def trained(catalog_dir: Path) -> TrainedModels:
    torch.set_num_threads(1)  # one thread: reductions in a fixed order, so reruns match bit for bit
    return train_all(open_scrubbed(catalog_dir), TINY)


def _scrubbed_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for name in GROUND_TRUTH_FILES:
        (dst / name).unlink()
    manifest = json.loads((dst / "manifest.json").read_text())
    for key in GROUND_TRUTH_MANIFEST_FIELDS:
        manifest.pop(key, None)
    manifest["config"] = {k: v for k, v in manifest["config"].items() if not (k == "seed" or k.startswith("click_"))}
    for name in GROUND_TRUTH_FILES:
        manifest["arrays"].pop(name.removesuffix(".npy"), None)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def _weights(m: TrainedModels) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": v for n, mod in (("dlrm", m.dlrm), ("tt", m.two_tower), ("l3", m.l3)) for k, v in mod.state_dict().items()}


def test_training_on_a_copy_without_ground_truth_gives_identical_weights(catalog_dir: Path, trained: TrainedModels, tmp_path: Path) -> None:
    scrubbed = _scrubbed_copy(catalog_dir, tmp_path / "scrubbed")
    assert not (scrubbed / "item_vectors.npy").exists()
    again = train_all(open_scrubbed(scrubbed), TINY)
    a, b = _weights(trained), _weights(again)
    assert sorted(a) == sorted(b)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert different == []
    # Training moved the weights: the equality above is not two untouched inits.
    init = train_all(open_scrubbed(scrubbed), dataclasses.replace(TINY, epochs=0, tt_epochs=0))
    assert not torch.equal(_weights(init)["dlrm.dlrm.over_arch.model.1.weight"], a["dlrm.dlrm.over_arch.model.1.weight"])


def test_scrubbed_view_has_no_ground_truth_attribute(catalog_dir: Path) -> None:
    view = open_scrubbed(catalog_dir)
    names = {f.name for f in dataclasses.fields(view)}
    assert not names & {"item_vectors", "user_vectors", "item_popularity", "items_by_popularity", "category_centroids", "truth", "manifest"}
    assert view.num_items == 5_000 and len(view.train) == 18_000


def test_counts_and_dense_features_leave_the_row_out(catalog_dir: Path) -> None:
    view = open_scrubbed(catalog_dir)
    arrays = serving_arrays(view)
    items = np.asarray(view.train.item)
    assert arrays.counts.item[:, 0].sum() == len(items) and np.array_equal(arrays.counts.item[:, 0], np.bincount(items, minlength=5_000))
    # An item shown once in train: with its own row left out it looks unseen, clicked or not.
    once = np.flatnonzero(arrays.counts.item[items, 0] == 1)[:2]
    users, its, labels = np.asarray(view.train.user)[once], items[once], np.asarray(view.train.label)[once]
    loo = dense_features(arrays, users, its, labels)
    unseen = dense_features(arrays, users, np.full(len(once), int(np.flatnonzero(arrays.counts.item[:, 0] == 0)[0])))
    assert np.allclose(loo[:, :2], unseen[:, :2])
    assert not np.allclose(dense_features(arrays, users, its)[:, 0], loo[:, 0])


def test_gather_jagged_keeps_last_and_excludes() -> None:
    from recserve.catalog.storage import Csr

    csr = Csr(np.array([10, 11, 12, 20, 30, 31], dtype=np.int64), np.array([0, 3, 4, 6], dtype=np.int64))
    v, n = gather_jagged(csr, np.array([2, 0, 1]), last=2)
    assert v.tolist() == [30, 31, 11, 12, 20] and n.tolist() == [2, 2, 1]
    v, n = gather_jagged(csr, np.array([0, 2]), exclude=np.array([1, -1]))
    assert v.tolist() == [10, 12, 30, 31] and n.tolist() == [2, 2]


def test_export_round_trip_scores_match_and_version_is_checked(catalog_dir: Path, trained: TrainedModels, tmp_path: Path) -> None:
    manifest = export_models(trained, open_scrubbed(catalog_dir), tmp_path / "models")
    assert manifest["model_version"] == compute_model_version(trained)
    assert {"dlrm_item", "dlrm_user", "tt_item", "l3_item"} <= set(manifest["tables"]) and "item" not in manifest["tables"]
    export = open_export(tmp_path / "models")
    view = open_scrubbed(catalog_dir)
    users, items = np.asarray(view.train.user)[:300], np.asarray(view.train.item)[:300]
    for name, model in (("dlrm", trained.dlrm), ("l3", trained.l3)):
        loaded = load_model(export, name, device="cpu", with_tables=True)
        assert np.array_equal(score_pairs(loaded, export.arrays, users, items), score_pairs(model, trained.arrays, users, items))  # type: ignore[arg-type]
    vectors = np.load(tmp_path / "models" / "index" / "item_vectors.npy")
    assert vectors.shape == (5_000, 8) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    check_table_versions(export.model_version, {"dlrm_item": export.model_version}, ["dlrm_item"])
    with pytest.raises(FailedPrecondition) as err:
        check_table_versions(export.model_version, {"dlrm_item": "m-000000000000"}, ["dlrm_item"])
    assert "m-000000000000" in str(err.value) and export.model_version in str(err.value) and "dlrm_item" in str(err.value)


def test_an_export_that_crashes_midway_leaves_no_manifest_vouching_for_its_tables(
    catalog_dir: Path, trained: TrainedModels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A re-export that dies after rewriting some shard tables must not leave the old
    # embeddings manifest behind: `recserve shard load` would stamp the mix with the old
    # version and the serving-time version check would pass.
    from embedding_server.bulk_load import source_model_version
    import ranker.export

    out = tmp_path / "models"
    old = export_models(trained, open_scrubbed(catalog_dir), out)["model_version"]
    assert source_model_version(out) == old
    real_save = ranker.export._save

    def crash_after_first_table(path: Path, array: np.ndarray) -> None:
        real_save(path, array)
        raise OSError("disk full")

    monkeypatch.setattr(ranker.export, "_save", crash_after_first_table)
    with pytest.raises(OSError, match="disk full"):
        export_models(trained, open_scrubbed(catalog_dir), out)
    assert source_model_version(out) == ""  # unversioned: check_table_versions refuses it
    assert not (out / "index" / "manifest.json").exists() and not (out / "manifest.json").exists()
