"""Shards never serve a catalog's ground truth by accident; exports carry a version."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from embedding_server.bulk_load import open_source, source_model_version
from recserve.errors import ConfigError


def test_a_catalog_directory_is_not_a_source_for_item_or_user_tables(tmp_path: Path) -> None:
    # A catalog's latent vectors are the click model's answer: `item` must not resolve to them.
    np.save(tmp_path / "item_vectors.npy", np.ones((4, 2), np.float32))
    np.save(tmp_path / "user_vectors.npy", np.ones((3, 2), np.float32))
    with pytest.raises(ConfigError, match="item.npy"):
        open_source(tmp_path, ["item", "user"])
    np.save(tmp_path / "item.npy", np.zeros((4, 2), np.float32))
    np.save(tmp_path / "user.npy", np.zeros((3, 2), np.float32))
    arrays, _ = open_source(tmp_path, ["item", "user"])
    assert not arrays["item"].any() and not arrays["user"].any()  # the trained tables, not the vectors


def test_source_model_version_reads_the_export_manifest(tmp_path: Path) -> None:
    assert source_model_version(tmp_path) == ""
    (tmp_path / "embeddings").mkdir()
    (tmp_path / "embeddings" / "manifest.json").write_text(json.dumps({"model_version": "m-0123456789ab"}))
    assert source_model_version(tmp_path) == "m-0123456789ab"
    assert source_model_version(tmp_path / "embeddings") == "m-0123456789ab"
    (tmp_path / "embeddings" / "manifest.json").write_text("{not json")
    assert source_model_version(tmp_path) == ""
