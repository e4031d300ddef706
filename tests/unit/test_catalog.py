"""Synthetic catalogs: determinism, Zipf popularity, storage, ground truth, CLI.

Oracles come from outside the code under test: Zipf sums are computed here in plain
Python, AUCs by the Mann-Whitney rank formula written here, click probabilities from the
manifest's parameters with a sigmoid written here.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from recserve.catalog import (
    ARRAY_NAMES,
    Catalog,
    CatalogConfig,
    Csr,
    load_catalog,
    popularity_shares,
    sample_lookup_stream,
    zipf_weights,
)
from recserve.cli import catalog_cmd
from recserve.errors import ConfigError, FailedPrecondition, InvalidArgument, NotFound
from tests.utils_catalog import make_catalog, make_catalog_config


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return make_catalog()


def zipf_theory(n: int, a: float) -> list[float]:
    """Zipf shares by rank, from a harmonic sum computed term by term."""
    terms = [r ** -a for r in range(1, n + 1)]
    h = math.fsum(terms)
    return [t / h for t in terms]


def mann_whitney_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """AUC = (sum of positive ranks - P(P+1)/2) / (P·N), ties given their average rank."""
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    _, inverse, counts = np.unique(sorted_scores, return_inverse=True, return_counts=True)
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based average rank per tie group
    ranks = np.empty(scores.shape[0])
    ranks[order] = avg_rank[inverse]
    pos = labels.astype(bool)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def assert_csr(csr: Csr, rows: int, value_bound: int) -> None:
    assert csr.values.dtype == np.int64 and csr.offsets.dtype == np.int64
    assert csr.values.ndim == 1 and csr.offsets.shape == (rows + 1,)
    assert csr.offsets[0] == 0
    assert np.all(np.diff(csr.offsets) >= 0)
    assert csr.offsets[-1] == csr.values.shape[0]
    assert csr.values.min() >= 0 and csr.values.max() < value_bound


def distinct_within_rows(csr: Csr) -> bool:
    rows = np.repeat(np.arange(csr.num_rows, dtype=np.int64), np.diff(csr.offsets))
    keys = np.sort(rows * (int(csr.values.max()) + 1) + csr.values)
    return bool(np.all(keys[1:] != keys[:-1]))


def test_same_seed_gives_identical_arrays_and_other_seed_differs(catalog: Catalog) -> None:
    again = make_catalog()
    other = make_catalog(seed=12)
    assert set(catalog.arrays()) == set(ARRAY_NAMES)
    for name in ARRAY_NAMES:
        a, b, c = catalog.arrays()[name], again.arrays()[name], other.arrays()[name]
        assert a.dtype == b.dtype and np.array_equal(a, b), name
        assert not np.array_equal(a, c), f"{name} did not change with the seed"
    assert json.dumps(catalog.manifest, sort_keys=True) == json.dumps(again.manifest, sort_keys=True)


def test_shapes_dtypes_and_csr(catalog: Catalog) -> None:
    cfg = catalog.config
    n, u, d = cfg.items, cfg.users, cfg.dim
    assert catalog.category_centroids.shape == (cfg.categories, d) and catalog.category_centroids.dtype == np.float32
    assert catalog.item_vectors.shape == (n, d) and catalog.item_vectors.dtype == np.float32
    assert catalog.user_vectors.shape == (u, d) and catalog.user_vectors.dtype == np.float32
    assert catalog.item_category.shape == (n,) and catalog.item_category.dtype == np.int64
    assert catalog.item_category.min() >= 0 and catalog.item_category.max() < cfg.categories
    assert catalog.item_popularity.shape == (n,) and catalog.item_popularity.dtype == np.float64
    assert np.array_equal(np.sort(catalog.items_by_popularity), np.arange(n))
    for vecs in (catalog.item_vectors, catalog.user_vectors, catalog.category_centroids):
        assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)

    assert_csr(catalog.item_tags, n, cfg.tags)
    tag_lengths = catalog.item_tags.lengths()
    assert tag_lengths.min() >= 1
    assert abs(tag_lengths.mean() - cfg.tags_per_item) < 0.5
    starts = np.zeros(catalog.item_tags.values.shape[0], dtype=bool)
    starts[catalog.item_tags.offsets[:-1]] = True
    assert np.all(np.diff(catalog.item_tags.values)[~starts[1:]] > 0), "tags not distinct and sorted within an item"

    assert_csr(catalog.user_history, u, n)
    h_lengths = catalog.user_history.lengths()
    assert h_lengths.min() >= math.ceil(cfg.history_len / 2) and h_lengths.max() <= cfg.history_len
    assert distinct_within_rows(catalog.user_history)

    assert len(catalog.test) == round(cfg.impressions * cfg.holdout_fraction)
    assert len(catalog.train) + len(catalog.test) == cfg.impressions
    for split in (catalog.train, catalog.test):
        assert split.user.dtype == np.int64 and split.item.dtype == np.int64 and split.label.dtype == np.uint8
        assert split.user.min() >= 0 and split.user.max() < u
        assert split.item.min() >= 0 and split.item.max() < n
        assert set(np.unique(split.label).tolist()) == {0, 1}


def test_items_cluster_around_their_category_centroid(catalog: Catalog) -> None:
    own = np.take(catalog.category_centroids, catalog.item_category, axis=0)
    other = np.take(catalog.category_centroids, (catalog.item_category + 1) % catalog.config.categories, axis=0)
    cos_own = np.einsum("nd,nd->n", catalog.item_vectors, own)
    cos_other = np.einsum("nd,nd->n", catalog.item_vectors, other)
    assert cos_own.mean() > 0.7
    assert abs(cos_other.mean()) < 0.2


def test_popularity_is_zipf_and_head_tail_shares_match_theory(catalog: Catalog) -> None:
    cfg = catalog.config
    theory = np.array(zipf_theory(cfg.items, cfg.zipf))
    np.testing.assert_allclose(np.sort(catalog.item_popularity)[::-1], theory, rtol=1e-9)
    shares = popularity_shares(catalog.item_popularity, 0.01, 0.5)
    assert shares.head_share == pytest.approx(float(theory[: cfg.items // 100].sum()), rel=1e-9)
    assert shares.tail_share == pytest.approx(float(theory[cfg.items // 2 :].sum()), rel=1e-9)


def test_lookup_stream_head_share_matches_zipf_theory() -> None:
    # The one bigger catalog: 1M items (the benchmarks' size), almost nothing else
    # (one tag per item: tags are most of its generation time).
    big = make_catalog(
        items=1_000_000, users=64, dim=4, categories=16, tags_per_item=1.0, candidates=64, history_len=8, users_per_pool=64, impressions=1_000
    )
    n_items, a = big.config.items, big.config.zipf
    theory = zipf_theory(n_items, a)
    n_head, n_tail = n_items // 100, n_items // 2
    head_theory, tail_theory = math.fsum(theory[:n_head]), math.fsum(theory[n_items - n_tail :])
    assert 0.7 < head_theory < 0.8  # docs/architecture.md §5: the top 1% carries ≈75% of lookups

    n = 1_000_000
    stream = sample_lookup_stream(big.item_popularity, n, np.random.default_rng(5))
    assert stream.dtype == np.int64 and stream.shape == (n,)
    # Head and tail sets straight from the weights (Zipf weights are distinct, so a
    # partition is exact), not from the catalog's stored popularity order.
    pop = np.asarray(big.item_popularity)
    in_head = np.zeros(n_items, dtype=bool)
    in_head[np.argpartition(-pop, n_head)[:n_head]] = True
    in_tail = np.zeros(n_items, dtype=bool)
    in_tail[np.argpartition(pop, n_tail)[:n_tail]] = True
    for observed, p in ((in_head[stream].mean(), head_theory), (in_tail[stream].mean(), tail_theory)):
        sigma = math.sqrt(p * (1 - p) / n)  # binomial standard error of a share
        assert abs(observed - p) < 5 * sigma + 1e-12, (observed, p, sigma)


def test_sampler_never_draws_zero_weight_ids_and_validates() -> None:
    pop = np.array([0.0, 3.0, 0.0, 1.0, 0.0])
    stream = sample_lookup_stream(pop, 100_000, np.random.default_rng(0))
    assert set(np.unique(stream).tolist()) == {1, 3}
    assert abs((stream == 1).mean() - 0.75) < 5 * math.sqrt(0.75 * 0.25 / 100_000)
    with pytest.raises(InvalidArgument, match=r"popularity\[1\]"):
        sample_lookup_stream(np.array([1.0, -1.0]), 10, np.random.default_rng(0))
    with pytest.raises(InvalidArgument, match="sums to 0"):
        sample_lookup_stream(np.zeros(3), 10, np.random.default_rng(0))


def test_zipf_weights_against_formula() -> None:
    w = zipf_weights(1000, 1.05)
    assert w.shape == (1000,) and w.dtype == np.float64
    assert w.sum() == pytest.approx(1.0, abs=1e-12)
    assert w[0] / w[1] == pytest.approx(2**1.05, rel=1e-12)
    assert w[9] / w[99] == pytest.approx(10**1.05, rel=1e-12)
    assert np.allclose(zipf_weights(4, 0.0), 0.25)
    with pytest.raises(InvalidArgument, match="a = -1"):
        zipf_weights(10, -1.0)


def test_popularity_not_correlated_with_id(catalog: Catalog) -> None:
    n = catalog.config.items
    rank = np.empty(n)
    rank[np.argsort(-np.asarray(catalog.item_popularity), kind="stable")] = np.arange(n)
    ids = np.arange(n, dtype=np.float64)
    spearman = np.corrcoef(rank, ids)[0, 1]  # Pearson of ranks
    pearson_log = np.corrcoef(np.log(catalog.item_popularity), ids)[0, 1]
    bound = 4.0 / math.sqrt(n)  # |rho| ~ N(0, 1/n) for independent orderings; 1.0 if unshuffled
    assert abs(spearman) < bound and abs(pearson_log) < bound
    top = np.argsort(-np.asarray(catalog.item_popularity))[: n // 100]
    assert abs(top.mean() / n - 0.5) < 4 * math.sqrt(1 / 12 / top.shape[0])


def test_histories_are_popularity_candidates_reweighted_by_affinity(catalog: Catalog) -> None:
    h = catalog.user_history
    users = np.repeat(np.arange(catalog.num_users), h.lengths())
    aff_hist = np.einsum("nd,nd->n", catalog.user_vectors[users], catalog.item_vectors[h.values]).mean()
    rng = np.random.default_rng(1)
    random_items = rng.choice(catalog.num_items, size=users.shape[0], p=np.asarray(catalog.item_popularity))
    aff_pop = np.einsum("nd,nd->n", catalog.user_vectors[users], catalog.item_vectors[random_items]).mean()
    assert aff_hist > aff_pop + 0.15, (aff_hist, aff_pop)
    # Still popularity-driven: the head is over-represented in histories.
    head = np.argsort(-np.asarray(catalog.item_popularity))[: catalog.num_items // 100]
    assert np.isin(h.values, head).mean() > 0.05  # the uniform rate would be 0.01


def test_ground_truth_beats_popularity_on_held_out_log(catalog: Catalog) -> None:
    t = catalog.manifest["ground_truth"]
    n_items = catalog.num_items

    def truth_logit(split: str) -> tuple[np.ndarray, np.ndarray]:
        log = getattr(catalog, split)
        aff = np.einsum("nd,nd->n", catalog.user_vectors[log.user].astype(np.float64), catalog.item_vectors[log.item].astype(np.float64))
        rel_pop = catalog.item_popularity[log.item] * n_items
        return t["affinity_weight"] * aff + t["popularity_weight"] * np.log(rel_pop) + t["bias"], np.asarray(log.label)

    z, y = truth_logit("test")
    auc_truth = mann_whitney_auc(z, y)
    auc_pop = mann_whitney_auc(np.log(catalog.item_popularity[catalog.test.item]), y)
    assert auc_pop > 0.55  # popularity carries real signal...
    assert auc_truth > auc_pop + 0.15 and auc_truth > 0.85, (auc_truth, auc_pop)  # ...affinity much more

    # Labels are Bernoulli(sigmoid(logit)): predicted and observed CTR agree on train.
    z, y = truth_logit("train")
    p = 1.0 / (1.0 + np.exp(-z))
    ctr = y.mean()
    assert 0.02 < ctr < 0.3
    assert abs(p.mean() - ctr) < 5 * math.sqrt(ctr * (1 - ctr) / y.shape[0])


@pytest.mark.parametrize(
    ("overrides", "field", "value"),
    [
        ({"items": 0}, "catalog.items", "0"),
        ({"items": True}, "catalog.items", "True"),
        ({"zipf": -0.5}, "catalog.zipf", "-0.5"),
        ({"holdout_fraction": 1.0}, "catalog.holdout_fraction", "1.0"),
        ({"history_len": 300, "candidates": 256}, "catalog.history_len", "300"),
        ({"tags_per_item": 0.5}, "catalog.tags_per_item", "0.5"),
        ({"user_mixture": 0}, "catalog.user_mixture", "0"),
        ({"impressions": 10, "holdout_fraction": 0.01}, "catalog.holdout_fraction", "0.01"),
    ],
)
def test_config_errors_name_field_and_value(overrides: dict[str, object], field: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_catalog_config(**overrides)
    assert f"{field} = {value}" in info.value.message
    assert "use" in info.value.message or "keep" in info.value.message  # says how to fix it


def test_disk_catalog_is_memory_mapped_and_equals_in_memory(tmp_path: Path, catalog: Catalog) -> None:
    on_disk = make_catalog(tmp_path / "cat")
    for name, arr in on_disk.arrays().items():
        assert isinstance(arr, np.memmap) and not arr.flags.writeable, name
        assert np.array_equal(arr, catalog.arrays()[name]), name
    manifest = json.loads((tmp_path / "cat" / "manifest.json").read_text())
    assert manifest["config"]["seed"] == catalog.config.seed
    assert manifest["arrays"]["item_vectors"] == {"file": "item_vectors.npy", "shape": [catalog.num_items, catalog.dim], "dtype": "<f4"}


def test_load_catalog_rejects_missing_and_inconsistent_directories(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="manifest.json"):
        load_catalog(tmp_path)
    out = tmp_path / "cat"
    make_catalog(out, items=2_000, users=100, impressions=1_000)
    mpath = out / "manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["arrays"]["item_vectors"]["shape"] = [1_999, 32]
    mpath.write_text(json.dumps(manifest))
    with pytest.raises(FailedPrecondition, match="item_vectors.npy has shape"):
        load_catalog(out)
    manifest["format_version"] = 999
    mpath.write_text(json.dumps(manifest))
    with pytest.raises(FailedPrecondition, match="version 999"):
        load_catalog(out)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="recserve")
    catalog_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_cli_generate_then_info_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli_cat"
    flags = ["--items", "3000", "--users", "300", "--dim", "8", "--zipf", "0.9", "--seed", "3", "--categories", "8", "--tags", "64"]
    flags += ["--tags-per-item", "2", "--history-len", "10", "--candidates", "64", "--impressions", "5000", "--holdout-fraction", "0.2"]
    assert _cli(["catalog", "generate", *flags, "--out", str(out), "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["items"] == 3000 and summary["users"] == 300 and summary["test_impressions"] == 1000

    loaded = load_catalog(out)
    assert all(isinstance(a, np.memmap) for a in loaded.arrays().values())
    expected = CatalogConfig(items=3000, users=300, dim=8, zipf=0.9, seed=3, categories=8, tags=64, tags_per_item=2.0, history_len=10, candidates=64, impressions=5000, holdout_fraction=0.2)
    assert loaded.config == expected
    assert np.array_equal(loaded.item_vectors, make_catalog(**{**expected.to_dict()}).item_vectors)

    old_vectors, old_copy = loaded.item_vectors, np.array(loaded.item_vectors)
    with pytest.raises(FailedPrecondition, match="--force"):
        _cli(["catalog", "generate", *flags, "--out", str(out), "--no-progress"])
    assert _cli(["catalog", "generate", *flags, "--seed", "4", "--out", str(out), "--no-progress", "--force", "--json"]) == 0
    capsys.readouterr()
    assert load_catalog(out).config.seed == 4
    # Regenerating in place renames new files over old ones: an open mapping of the old
    # catalog still reads the old rows (truncating in place would SIGBUS here).
    assert np.array_equal(old_vectors, old_copy)
    assert not np.array_equal(load_catalog(out).item_vectors, old_copy)
    assert not list(out.glob("*.tmp"))

    assert _cli(["catalog", "info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "3,000 × 8 dims" in text and "1,000 held out" in text


def test_cli_generate_rejects_an_out_path_that_is_a_file(tmp_path: Path) -> None:
    afile = tmp_path / "not_a_dir"
    afile.write_text("x")
    with pytest.raises(FailedPrecondition, match=r"--out .*not_a_dir is a file"):
        _cli(["catalog", "generate", "--items", "100", "--categories", "4", "--out", str(afile), "--no-progress"])
    assert afile.read_text() == "x"
