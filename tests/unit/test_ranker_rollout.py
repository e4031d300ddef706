"""Version-prefixed shard tables for a model rollout (ranker.rollout) and the per-table
versions a staged source records in a shard's load manifest (embedding_server.bulk_load).

Exports are fakes with the layout ``ranker.export`` writes (``embeddings/<table>.npy`` and
``embeddings/manifest.json``), so no model is trained; the oracle for staged rows is the
arrays the fakes were written from. RocksDB runs in a temp dir; no sockets, no processes.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

from embedding_server.bulk_load import bulk_load, open_source, source_model_version, source_model_versions, table_model_versions
from embedding_server.layout import layouts_from_plan
from embedding_server.store import RowStore
from ranker.features import Source, SparseFeature
from ranker.rollout import LinkKind, feature_renames, rename_features, served_table_names, stage_exports, version_prefix
from recserve.config.spec import FeatureConfig, ShardingConfig, TableConfig
from recserve.errors import ConfigError, FailedPrecondition, InvalidArgument
from recserve.lookup.config import LookupClientConfig
from recserve.sharding import plan_tables

VERSION_A = "m-aaaaaaaaaaaa"
VERSION_B = "m-3fa2c9d1e0b4"
PREFIX_B = "m_3fa2c9d1e0b4__"
SHAPES = {"dlrm_item": (60, 8), "dlrm_user": (40, 4)}
FEATURES = (FeatureConfig(name="dlrm_item_id", table="dlrm_item"), FeatureConfig(name="dlrm_user_id", table="dlrm_user"))


def make_export(root: Path, version: str, seed: int, shapes: dict[str, tuple[int, int]] = SHAPES) -> dict[str, np.ndarray]:
    """A fake MODELS directory at ``root`` (embeddings only); returns table -> [rows, dim] f32."""
    rng = np.random.default_rng(seed)
    arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    (root / "embeddings").mkdir(parents=True)
    for name, array in arrays.items():
        np.save(root / "embeddings" / f"{name}.npy", array)
    tables = {name: {"file": f"{name}.npy", "rows": a.shape[0], "dim": a.shape[1], "pooling": "mean"} for name, a in arrays.items()}
    manifest = {"format": "recserve.embeddings", "model_version": version, "tables": tables}
    (root / "embeddings" / "manifest.json").write_text(json.dumps(manifest))
    return arrays


def test_version_prefix_is_a_valid_table_name_prefix() -> None:
    assert version_prefix(VERSION_B) == PREFIX_B
    assert version_prefix("m-1.2/é") == "m_1_2__" + "__"  # every non-ASCII-alphanumeric becomes '_'
    TableConfig(name=version_prefix("m-1.2/é") + "dlrm_item", rows=1, dim=1)  # passes the spec's name check
    with pytest.raises(InvalidArgument, match="model_version = ''"):
        version_prefix("")


def test_stage_two_exports_links_every_table_and_records_each_version(tmp_path: Path) -> None:
    a = make_export(tmp_path / "a", VERSION_A, seed=1)
    b = make_export(tmp_path / "b", VERSION_B, seed=2)
    staged = stage_exports([tmp_path / "a", tmp_path / "b"], tmp_path / "staged")

    served = {"dlrm_item": a["dlrm_item"], "dlrm_user": a["dlrm_user"], PREFIX_B + "dlrm_item": b["dlrm_item"], PREFIX_B + "dlrm_user": b["dlrm_user"]}
    assert staged.path == tmp_path / "staged"
    assert staged.versions == (VERSION_A, VERSION_B)
    assert [t.name for t in staged.tables] == sorted(served)
    assert {t.name: (t.rows, t.dim, t.pooling) for t in staged.tables} == {n: (*x.shape, "mean") for n, x in served.items()}
    assert staged.model_versions == {"dlrm_item": VERSION_A, "dlrm_user": VERSION_A, PREFIX_B + "dlrm_item": VERSION_B, PREFIX_B + "dlrm_user": VERSION_B}
    assert staged.served_names(VERSION_B) == {"dlrm_item": PREFIX_B + "dlrm_item", "dlrm_user": PREFIX_B + "dlrm_user"}
    assert staged.served_names(VERSION_A) == {"dlrm_item": "dlrm_item", "dlrm_user": "dlrm_user"}

    # Hard links of the exported files: same inode, no copy of the rows.
    assert set(staged.links.values()) == {LinkKind.HARDLINK}
    for version_dir, prefix in (("a", ""), ("b", PREFIX_B)):
        for name in SHAPES:
            src, dst = tmp_path / version_dir / "embeddings" / f"{name}.npy", staged.path / "embeddings" / f"{prefix}{name}.npy"
            assert os.stat(src).st_ino == os.stat(dst).st_ino and not dst.is_symlink()

    manifest = json.loads((staged.path / "embeddings" / "manifest.json").read_text())
    assert manifest["format"] == "recserve.embeddings"
    assert "model_version" not in manifest  # a loader blind to model_versions records them unversioned, never as A
    assert manifest["model_versions"] == staged.model_versions
    assert manifest["staged"] == [VERSION_A, VERSION_B]
    assert manifest["tables"][PREFIX_B + "dlrm_user"] == {"file": PREFIX_B + "dlrm_user.npy", "rows": 40, "dim": 4, "pooling": "mean"}

    # What a shard reads from it: every served table's rows, and the per-table versions.
    arrays, _ = open_source(staged.path, sorted(served))
    assert all(np.array_equal(arrays[n], x) for n, x in served.items())
    assert source_model_versions(staged.path) == staged.model_versions
    assert source_model_version(staged.path) == ""
    # The staged table configs plan as they are.
    plan = plan_tables(list(staged.tables), None, ShardingConfig(num_shards=2, hot_replicas=2)).plan
    assert sorted(plan.tables) == sorted(served)


def test_stage_falls_back_to_symlinks_then_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_export(tmp_path / "a", VERSION_A, seed=1)
    b = make_export(tmp_path / "b", VERSION_B, seed=2)

    def cross_device(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    staged = stage_exports([tmp_path / "a", tmp_path / "b"], tmp_path / "sym")
    assert set(staged.links.values()) == {LinkKind.SYMLINK}
    dst = staged.path / "embeddings" / f"{PREFIX_B}dlrm_item.npy"
    assert dst.is_symlink() and dst.resolve() == (tmp_path / "b" / "embeddings" / "dlrm_item.npy").resolve()

    monkeypatch.setattr(os, "symlink", cross_device)
    staged = stage_exports([tmp_path / "a", tmp_path / "b"], tmp_path / "copy")
    assert set(staged.links.values()) == {LinkKind.COPY}
    dst = staged.path / "embeddings" / f"{PREFIX_B}dlrm_item.npy"
    assert not dst.is_symlink() and os.stat(dst).st_nlink == 1
    assert np.array_equal(np.load(dst), b["dlrm_item"])


def test_restaging_replaces_an_earlier_staging_whole(tmp_path: Path) -> None:
    make_export(tmp_path / "a", VERSION_A, seed=1)
    b = make_export(tmp_path / "b", VERSION_B, seed=2)
    make_export(tmp_path / "c", "m-cccccccccccc", seed=3)
    stage_exports([tmp_path / "a", tmp_path / "c"], tmp_path / "staged")
    # The next rollout: B served plain, nothing of A or C left behind.
    staged = stage_exports([tmp_path / "b"], tmp_path / "staged")
    assert sorted(p.name for p in (tmp_path / "staged" / "embeddings").iterdir()) == ["dlrm_item.npy", "dlrm_user.npy", "manifest.json"]
    assert staged.model_versions == {"dlrm_item": VERSION_B, "dlrm_user": VERSION_B}
    assert np.array_equal(np.load(staged.path / "embeddings" / "dlrm_item.npy"), b["dlrm_item"])
    assert not [p for p in tmp_path.iterdir() if "staging" in p.name]  # no temp dir left


def test_stage_refuses_what_would_mislabel_or_destroy(tmp_path: Path) -> None:
    make_export(tmp_path / "a", VERSION_A, seed=1)
    make_export(tmp_path / "a2", VERSION_A, seed=5)
    with pytest.raises(InvalidArgument, match=f"both model_version '{VERSION_A}'"):
        stage_exports([tmp_path / "a", tmp_path / "a2"], tmp_path / "out")
    # Two versions whose prefixes collide ('-' and '.' both become '_').
    make_export(tmp_path / "x", "m-1", seed=6)
    make_export(tmp_path / "y", "m.1", seed=7)
    with pytest.raises(InvalidArgument, match="collide"):
        stage_exports([tmp_path / "a", tmp_path / "x", tmp_path / "y"], tmp_path / "out")
    # A directory that is not a staging (here: an export) is never replaced.
    with pytest.raises(InvalidArgument, match="is not a staged source"):
        stage_exports([tmp_path / "x"], tmp_path / "a")
    assert (tmp_path / "a" / "embeddings" / "dlrm_item.npy").is_file()
    # A table file that disagrees with its manifest.
    np.save(tmp_path / "x" / "embeddings" / "dlrm_user.npy", np.zeros((3, 4), np.float32))
    with pytest.raises(FailedPrecondition, match=r"'dlrm_user'.*shape \[3, 4\].*\[40, 4\]"):
        stage_exports([tmp_path / "a", tmp_path / "x"], tmp_path / "out")
    # An unversioned export cannot be told apart from another once staged.
    (tmp_path / "u" / "embeddings").mkdir(parents=True)
    (tmp_path / "u" / "embeddings" / "manifest.json").write_text(json.dumps({"format": "recserve.embeddings", "tables": {}}))
    with pytest.raises(FailedPrecondition, match="model_version None"):
        stage_exports([tmp_path / "a", tmp_path / "u"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_served_table_names_prefers_plain_then_prefixed() -> None:
    tables = ["dlrm_item", "dlrm_user"]
    # Only the first version staged: plain names.
    assert served_table_names(tables, VERSION_A, {"dlrm_item": VERSION_A, "dlrm_user": VERSION_A}) == {"dlrm_item": "dlrm_item", "dlrm_user": "dlrm_user"}
    reported = {"dlrm_item": VERSION_A, "dlrm_user": VERSION_A, PREFIX_B + "dlrm_item": VERSION_B, PREFIX_B + "dlrm_user": VERSION_B}
    assert served_table_names(tables, VERSION_B, reported) == {"dlrm_item": PREFIX_B + "dlrm_item", "dlrm_user": PREFIX_B + "dlrm_user"}
    assert served_table_names(tables, VERSION_A, reported) == {"dlrm_item": "dlrm_item", "dlrm_user": "dlrm_user"}
    # The plain name wins when both carry the version (a re-staging that put B first).
    both = {"dlrm_item": VERSION_B, PREFIX_B + "dlrm_item": VERSION_B}
    assert served_table_names(["dlrm_item"], VERSION_B, both) == {"dlrm_item": "dlrm_item"}


def test_served_table_names_refuses_naming_table_version_and_reports() -> None:
    # Neither name reported at all.
    with pytest.raises(FailedPrecondition) as none:
        served_table_names(["dlrm_item", "dlrm_user"], VERSION_B, {"dlrm_item": VERSION_B})
    msg = str(none.value)
    assert f"no shard reports table 'dlrm_user' or '{PREFIX_B}dlrm_user'" in msg and VERSION_B in msg
    # Both reported, at other versions ('' = an unversioned load).
    with pytest.raises(FailedPrecondition) as other:
        served_table_names(["dlrm_item"], VERSION_B, {"dlrm_item": VERSION_A, PREFIX_B + "dlrm_item": ""})
    msg = str(other.value)
    assert f"no shard table serves 'dlrm_item' at model_version '{VERSION_B}'" in msg
    assert f"'dlrm_item' is model_version '{VERSION_A}'" in msg and f"'{PREFIX_B}dlrm_item' is model_version '(none)'" in msg


def test_rename_features_gives_both_versions_unique_names_in_one_lookup_config() -> None:
    names_b = {"dlrm_item": PREFIX_B + "dlrm_item", "dlrm_user": PREFIX_B + "dlrm_user"}
    renamed = rename_features(FEATURES, names_b)
    assert renamed == (FeatureConfig(name=PREFIX_B + "dlrm_item_id", table=PREFIX_B + "dlrm_item"), FeatureConfig(name=PREFIX_B + "dlrm_user_id", table=PREFIX_B + "dlrm_user"))
    assert rename_features(FEATURES, {"dlrm_item": "dlrm_item", "dlrm_user": "dlrm_user"}) == FEATURES  # plain: unchanged
    # The models' SparseFeature (the KJT keys) renames the same way, keeping its source.
    sparse = SparseFeature(name="dlrm_user_id", table="dlrm_user", source=Source.USER_ID)
    assert rename_features([sparse], names_b) == (dataclasses.replace(sparse, name=PREFIX_B + "dlrm_user_id", table=PREFIX_B + "dlrm_user"),)
    assert feature_renames(FEATURES, names_b) == {"dlrm_item_id": PREFIX_B + "dlrm_item_id", "dlrm_user_id": PREFIX_B + "dlrm_user_id"}
    tables = tuple(TableConfig(name=p + n, rows=r, dim=d) for p in ("", PREFIX_B) for n, (r, d) in SHAPES.items())
    config = LookupClientConfig(tables=tables, features=FEATURES + renamed)  # validates unique names and known tables
    assert config.table_of_feature()[PREFIX_B + "dlrm_user_id"] == PREFIX_B + "dlrm_user"
    with pytest.raises(ConfigError, match="feature 'dlrm_user_id' reads table 'dlrm_user', which has no served name"):
        rename_features(FEATURES, {"dlrm_item": "dlrm_item"})


def _load_staged(tmp_path: Path, source: Path, tables: tuple[TableConfig, ...]) -> dict[str, str]:
    plan = plan_tables(list(tables), None, ShardingConfig(num_shards=2, hot_replicas=2)).plan
    layouts = layouts_from_plan(plan, 0)
    store = RowStore(tmp_path / "db", {n: layout.dim for n, layout in layouts.items()})
    try:
        arrays, source_id = open_source(source, sorted(layouts))
        bulk_load(
            store, layouts, arrays, source_id=source_id, plan_version=plan.version, shard_id=0, progress=False,
            model_version=source_model_version(source), model_versions=source_model_versions(source),
        )  # fmt: skip
        return table_model_versions(store)
    finally:
        store.close()


def test_bulk_load_of_a_staged_source_records_each_tables_own_version(tmp_path: Path) -> None:
    make_export(tmp_path / "a", VERSION_A, seed=1)
    make_export(tmp_path / "b", VERSION_B, seed=2)
    staged = stage_exports([tmp_path / "a", tmp_path / "b"], tmp_path / "staged")
    assert _load_staged(tmp_path / "s", staged.path, staged.tables) == staged.model_versions
    # A single-version source records one version for every table, exactly as before.
    assert source_model_versions(tmp_path / "a") is None
    tables = tuple(TableConfig(name=n, rows=r, dim=d) for n, (r, d) in SHAPES.items())
    assert _load_staged(tmp_path / "p", tmp_path / "a", tables) == {"dlrm_item": VERSION_A, "dlrm_user": VERSION_A}


def test_source_model_versions_refuses_a_malformed_map(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "recserve.embeddings", "model_versions": {"dlrm_item": 3}}))
    with pytest.raises(ConfigError, match=r"model_versions = \{'dlrm_item': 3\} is invalid"):
        source_model_versions(tmp_path)
