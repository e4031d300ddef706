"""The L0 retrieval index (cascade/index.py) against FAISS's exact ``IndexFlatIP``.

Random unit vectors (4,000 × 16, fixed seed) are the hard case for IVF: no clusters to
exploit, so the recall floors below are low and say so; the benchmark measures real
item-tower vectors. Each factory type is built once per module (about 1 s in all).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import faiss
import numpy as np
import pytest

from cascade.index import IndexConfig, IndexHolder, RetrievalIndex, SearchKnob, build_index, open_item_vectors, search_knob_for_budget, valid_mask
from recserve.errors import ConfigError, FailedPrecondition, InvalidArgument

N, D, K, Q = 4_000, 16, 20, 64
MODEL_VERSION = "m-0123456789ab"
# Recall@20 floors at each type's default knobs on random unit vectors (measured on this
# seed: IVF64,Flat 0.742 and IVF64,PQ8 0.728 at the default nprobe 8 of 64 lists; HNSW16
# 0.997 at efSearch 64).
FLOORS = {"Flat": 1.0, "IVF64,Flat": 0.65, "IVF64,PQ8": 0.6, "HNSW16": 0.9}


def unit(rng: np.random.Generator, n: int, d: int = D) -> np.ndarray:
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def recall(found: np.ndarray, exact: np.ndarray) -> float:
    """Mean over queries of |found ∩ exact| / k (padding never matches an exact id)."""
    return float(np.mean([np.isin(f, e).mean() for f, e in zip(found, exact, strict=True)]))


@pytest.fixture(scope="module", autouse=True)
def one_omp_thread() -> Iterator[None]:
    # OpenMP spin-waits on the shared 2-core machine make small builds 5x slower.
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(items [N, D], queries [Q, D], exact top-K ids [Q, K] from IndexFlatIP)."""
    rng = np.random.default_rng(0)
    items, queries = unit(rng, N), unit(rng, Q)
    exact = faiss.IndexFlatIP(D)
    exact.add(items)
    _, top = exact.search(queries, K)
    return items, queries, top


@pytest.fixture(scope="module")
def built(data: tuple[np.ndarray, np.ndarray, np.ndarray]) -> dict[str, RetrievalIndex]:
    items = data[0]
    return {f: build_index(items, None, IndexConfig(factory=f), model_version=MODEL_VERSION, progress=False) for f in FLOORS}


@pytest.mark.parametrize("factory", list(FLOORS))
def test_recall_at_default_knobs_vs_exact(factory: str, data: tuple[np.ndarray, np.ndarray, np.ndarray], built: dict[str, RetrievalIndex]) -> None:
    _, queries, exact = data
    ids, scores = built[factory].search(queries, K)
    assert ids.shape == scores.shape == (Q, K) and ids.dtype == np.int64 and scores.dtype == np.float32
    assert recall(ids, exact) >= FLOORS[factory]
    assert np.all(np.diff(scores, axis=1) <= 1e-6)  # best first


def test_flat_is_exact_ids_and_scores(data: tuple[np.ndarray, np.ndarray, np.ndarray], built: dict[str, RetrievalIndex]) -> None:
    items, queries, exact = data
    ids, scores = built["Flat"].search(queries, K)
    assert recall(ids, exact) == 1.0
    np.testing.assert_allclose(scores, np.einsum("qd,qkd->qk", queries, items[ids]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("factory", ["IVF64,Flat", "IVF64,PQ8"])
def test_more_probes_never_lower_recall(factory: str, data: tuple[np.ndarray, np.ndarray, np.ndarray], built: dict[str, RetrievalIndex]) -> None:
    _, queries, exact = data
    index = built[factory]
    assert index.knob is SearchKnob.NPROBE and index.nlist == 64
    curve = [recall(index.search(queries, K, nprobe=p)[0], exact) for p in (1, 2, 4, 8, 16, 32, 64)]
    assert curve == sorted(curve), curve
    assert curve[-1] > curve[0]  # the knob does something
    if factory == "IVF64,Flat":
        assert curve[-1] == 1.0  # every list probed: exact


def test_more_ef_search_never_lowers_recall(data: tuple[np.ndarray, np.ndarray, np.ndarray], built: dict[str, RetrievalIndex]) -> None:
    _, queries, exact = data
    index = built["HNSW16"]
    assert index.knob is SearchKnob.EF_SEARCH
    curve = [recall(index.search(queries, K, ef_search=ef)[0], exact) for ef in (1, 4, 16, 64, 256)]
    assert curve == sorted(curve) and curve[-1] > curve[0], curve


def test_padding_when_k_exceeds_ntotal() -> None:
    rng = np.random.default_rng(1)
    items = unit(rng, 10)
    for factory in ("Flat", "HNSW16"):
        index = build_index(items, np.arange(100, 110), IndexConfig(factory=factory), progress=False)
        ids, scores = index.search(unit(rng, 3), 15)
        mask = valid_mask(ids)
        assert mask.sum(axis=1).tolist() == [10, 10, 10]
        assert np.all(mask[:, :10]) and np.all(ids[:, 10:] == -1)  # padding is a suffix
        assert np.all(scores[:, 10:] == -np.inf) and np.all(np.isfinite(scores[:, :10]))
        assert all(sorted(row[:10].tolist()) == list(range(100, 110)) for row in ids)


def test_padding_when_ivf_probes_too_few_lists(data: tuple[np.ndarray, np.ndarray, np.ndarray], built: dict[str, RetrievalIndex]) -> None:
    _, queries, _ = data
    index = built["IVF64,Flat"]
    k = 400  # about 6 lists' worth: one list holds ~62 vectors
    ids, scores = index.search(queries, k, nprobe=1)
    mask = valid_mask(ids)
    assert np.all(mask.sum(axis=1) < k)
    assert np.all(mask == (np.arange(k) < mask.sum(axis=1, keepdims=True)))  # padding is a suffix
    assert np.all(scores[~mask] == -np.inf)
    ids_all, _ = index.search(queries, k, nprobe=64)
    assert np.all(valid_mask(ids_all))


@pytest.mark.parametrize("factory", ["Flat", "IVF64,PQ8", "HNSW16"])
def test_save_load_round_trip(factory: str, tmp_path: Path, data: tuple[np.ndarray, np.ndarray, np.ndarray], built: dict[str, RetrievalIndex]) -> None:
    _, queries, _ = data
    index = built[factory]
    index.save(tmp_path / "idx")
    loaded = RetrievalIndex.load(tmp_path / "idx", dim=D, model_version=MODEL_VERSION)
    assert (loaded.index_version, loaded.model_version, loaded.factory, loaded.ntotal, loaded.d) == (index.index_version, MODEL_VERSION, factory, N, D)
    assert loaded.config == index.config
    want, want_scores = index.search(queries, K)
    got, got_scores = loaded.search(queries, K)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_scores, want_scores)
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert (manifest["d"], manifest["ntotal"], manifest["factory"], manifest["model_version"]) == (D, N, factory, MODEL_VERSION)
    assert not list((tmp_path / "idx").glob("*.tmp"))
    # A loaded index takes new items like a built one, and knows the ids it already has.
    new = unit(np.random.default_rng(7), 1)
    assert loaded.add(np.array([10**9]), new) != index.index_version
    assert loaded.search(new, 1)[0][0, 0] == 10**9
    with pytest.raises(InvalidArgument, match="already in the index"):
        loaded.add(np.array([N - 1]), new)


@pytest.mark.parametrize("factory", list(FLOORS))
def test_add_is_retrievable_without_rebuild(factory: str, data: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    items = data[0]
    index = build_index(items, None, IndexConfig(factory=factory), model_version=MODEL_VERSION, progress=False, build_id="b1")
    before = index.index_version
    assert before == f"{MODEL_VERSION}/b1.0"
    new = unit(np.random.default_rng(2), 3)
    new_ids = np.array([10**9, 10**9 + 5, 7_000_000])
    after = index.add(new_ids, new)
    assert after != before and after == index.index_version == f"{MODEL_VERSION}/b1.1"
    assert index.ntotal == N + 3
    ids, _ = index.search(new, 1)
    np.testing.assert_array_equal(ids[:, 0], new_ids)


def test_rebuild_changes_index_version(data: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    items = data[0]
    a = build_index(items, None, IndexConfig(factory="Flat"), model_version=MODEL_VERSION, progress=False)
    b = build_index(items, None, IndexConfig(factory="Flat"), model_version=MODEL_VERSION, progress=False)
    assert a.index_version != b.index_version
    assert a.index_version.startswith(MODEL_VERSION + "/") and b.index_version.startswith(MODEL_VERSION + "/")


def test_add_refuses_present_repeated_or_negative_ids(data: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    index = build_index(data[0][:100], None, IndexConfig(factory="Flat"), progress=False)
    v = unit(np.random.default_rng(3), 2)
    with pytest.raises(InvalidArgument, match="already in the index, e.g. 5"):
        index.add(np.array([200, 5]), v)
    with pytest.raises(InvalidArgument, match="repeat"):
        index.add(np.array([300, 300]), v)
    with pytest.raises(InvalidArgument, match=">= 0"):
        index.add(np.array([-1, 301]), v)
    with pytest.raises(InvalidArgument, match=r"\[n, 16\]"):
        index.add(np.array([400]), unit(np.random.default_rng(3), 1, d=8))
    assert index.ntotal == 100 and index.index_version.endswith(".0")  # nothing half-added


def test_load_refuses_dim_and_version_mismatch(tmp_path: Path, built: dict[str, RetrievalIndex]) -> None:
    built["Flat"].save(tmp_path / "idx")
    with pytest.raises(FailedPrecondition, match="d = 16, but the serving item vectors have d = 32"):
        RetrievalIndex.load(tmp_path / "idx", dim=32)
    with pytest.raises(FailedPrecondition, match="model_version"):
        RetrievalIndex.load(tmp_path / "idx", model_version="m-other")
    manifest_path = tmp_path / "idx" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["d"] = 32
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(FailedPrecondition, match="manifest says d = 32"):
        RetrievalIndex.load(tmp_path / "idx")
    manifest_path.unlink()
    with pytest.raises(FailedPrecondition, match="no manifest.json"):
        RetrievalIndex.load(tmp_path / "idx")


def test_open_item_vectors_reads_export_layout(tmp_path: Path) -> None:
    vectors = unit(np.random.default_rng(4), 50)
    (tmp_path / "index").mkdir()
    np.save(tmp_path / "index" / "item_vectors.npy", vectors)
    (tmp_path / "index" / "manifest.json").write_text(json.dumps({"model_version": MODEL_VERSION, "rows": 50, "dim": D}))
    got, version = open_item_vectors(tmp_path)
    assert version == MODEL_VERSION and isinstance(got, np.memmap)
    np.testing.assert_array_equal(got, vectors)
    (tmp_path / "index" / "manifest.json").write_text(json.dumps({"model_version": MODEL_VERSION, "rows": 50, "dim": 8}))
    with pytest.raises(FailedPrecondition, match="dim=8"):
        open_item_vectors(tmp_path)


def test_config_validation_and_auto_factory() -> None:
    with pytest.raises(ConfigError, match="index.factory = 'IVF,PQ'"):
        IndexConfig(factory="IVF,PQ")
    with pytest.raises(ConfigError, match="index.nprobe = 0"):
        IndexConfig(nprobe=0)
    auto = IndexConfig()
    assert auto.resolve(5_000, 64) == "Flat"  # small catalogs: exact is cheapest
    assert auto.resolve(1_000_000, 64) == "IVF4096,PQ32"  # 4·√N lists, d/2 sub-quantizers
    assert auto.resolve(200_000, 8) == "IVF2048,PQ4"
    assert auto.resolve(1_000_000, 15) == "IVF4096,PQ5"  # m must divide d
    assert IndexConfig(train_sample=39_000).resolve(1_000_000, 64) == "IVF1000,PQ32"  # >= 39 training vectors per list
    with pytest.raises(ConfigError, match="PQ5 needs m dividing d = 16"):
        build_index(unit(np.random.default_rng(5), 300), None, IndexConfig(factory="IVF4,PQ5"), progress=False)
    with pytest.raises(ConfigError, match="IVF64 needs >= 64 training vectors; there are 50"):
        build_index(unit(np.random.default_rng(5), 50), None, IndexConfig(factory="IVF64,Flat"), progress=False)


def test_search_rejects_bad_queries_and_knobs(built: dict[str, RetrievalIndex]) -> None:
    index = built["IVF64,Flat"]
    with pytest.raises(InvalidArgument, match=r"queries has shape \[3, 8\]"):
        index.search(np.zeros((3, 8), np.float32), 5)
    with pytest.raises(InvalidArgument, match="nprobe = 0"):
        index.search(np.zeros((1, D), np.float32), 5, nprobe=0)
    ids, scores = index.search(np.zeros((2, D), np.float32), 0)
    assert ids.shape == scores.shape == (2, 0)


def test_holder_swap_keeps_running_searches_on_their_index(data: tuple[np.ndarray, np.ndarray, np.ndarray], built: dict[str, RetrievalIndex]) -> None:
    _, queries, _ = data
    old, new = built["Flat"], built["HNSW16"]
    holder = IndexHolder(old)
    in_flight = holder.current  # what a request read before the refresh
    assert holder.swap(new) is old
    assert holder.current is new
    ids, _ = in_flight.search(queries, K)  # the old index still answers
    np.testing.assert_array_equal(ids, old.search(queries, K)[0])


def test_add_while_searching_from_threads(data: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    items, queries, _ = data
    index = build_index(items, None, IndexConfig(factory="IVF64,Flat"), progress=False)
    stop, started = threading.Event(), threading.Barrier(3)
    errors: list[BaseException] = []
    searches = [0, 0]

    def searcher(slot: int) -> None:
        started.wait()
        try:
            while not stop.is_set():
                ids, _, version = index.search_versioned(queries[:8], K)
                assert ids.shape == (8, K) and version.count(".") >= 1
                searches[slot] += 1
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=searcher, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait()
    new = unit(np.random.default_rng(6), 50)
    for i in range(50):
        index.add(np.array([N + i]), new[i : i + 1])
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors
    assert index.ntotal == N + 50 and index.index_version.endswith(".50")
    ids, _ = index.search(new, 1, nprobe=64)
    np.testing.assert_array_equal(ids[:, 0], np.arange(N, N + 50))


def test_search_knob_for_budget() -> None:
    assert search_knob_for_budget(5.0, cost_per_unit_ms=0.1, fixed_ms=1.0, max_knob=1024) == 40
    assert search_knob_for_budget(500.0, cost_per_unit_ms=0.1, max_knob=1024) == 1024  # clamped to nlist
    assert search_knob_for_budget(1.05, cost_per_unit_ms=0.1, fixed_ms=1.0, min_knob=8) == 0  # not even 8 fits
    assert search_knob_for_budget(0.0, cost_per_unit_ms=0.1) == 0
    assert search_knob_for_budget(float("inf"), cost_per_unit_ms=0.1, max_knob=64) == 64
    with pytest.raises(InvalidArgument, match="cost_per_unit_ms = 0"):
        search_knob_for_budget(5.0, cost_per_unit_ms=0)
