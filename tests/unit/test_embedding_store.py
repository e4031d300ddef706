"""RocksDB row store, value codec, shard layouts and bulk load (real RocksDB in a temp dir)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embedding_server.bulk_load import LoadMethod, bulk_load, open_source, read_manifest
from embedding_server.codec import HEADER_BYTES, decode_keys, decode_values, encode_keys, encode_values
from embedding_server.layout import TableLayout, WarmSlice, layouts_from_plan
from embedding_server.store import RowStore
from recserve.errors import ConfigError
from recserve.sharding.plan import ShardingPlan, TablePlan

ROWS, DIM = 2000, 12


def make_plan(num_shards: int = 3, column_splits: int = 2) -> ShardingPlan:
    table = TablePlan(
        name="item", rows=ROWS, dim=DIM, hot_ids=np.arange(20), warm_ids=np.arange(20, 220),
        hot_replicas=2, column_splits=column_splits, cold_replicas=1,
    )  # fmt: skip
    return ShardingPlan(version=3, num_shards=num_shards, tables={"item": table})


def source() -> np.ndarray:
    return np.random.default_rng(7).standard_normal((ROWS, DIM)).astype(np.float32)


def test_keys_sort_numerically_and_round_trip() -> None:
    ids = np.array([0, 1, 255, 256, 70_000, 2**40], dtype=np.int64)
    keys = encode_keys(ids)
    assert all(len(k) == 8 for k in keys)
    assert keys == sorted(keys)  # big-endian: byte order is numeric order
    assert keys[3] == (256).to_bytes(8, "big")
    assert np.array_equal(decode_keys(keys), ids)


def test_values_carry_header_and_reject_other_slices() -> None:
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    values = encode_values(rows, dim=9, col_start=3, col_end=6)
    assert len(values[0]) == HEADER_BYTES + 12
    got, present = decode_values(values + [None], dim=9, col_start=3, col_end=6)
    assert present.tolist() == [True, True, False]
    assert np.array_equal(got[:2], rows) and not got[2].any()
    # The same bytes read as another slice or another width are not this row.
    _, present_other = decode_values(values, dim=9, col_start=0, col_end=3)
    assert not present_other.any()
    _, present_short = decode_values([values[0][:-4]], dim=9, col_start=3, col_end=6)
    assert not present_short.any()


def test_store_writes_are_per_table_and_survive_reopen(tmp_path: Path) -> None:
    store = RowStore(tmp_path / "db", {"a": 4, "b": 2})
    ids = np.array([5, 1, 9], dtype=np.int64)
    store.write_rows([("a", ids, np.ones((3, 4), np.float32) * ids[:, None], 0, 4), ("b", ids[:1], np.full((1, 2), 7, np.float32), 0, 2)])
    store.close()
    store = RowStore(tmp_path / "db", {"a": 4, "b": 2})
    rows, present = store.get_rows("a", np.array([1, 2, 9]), 0, 4)
    assert present.tolist() == [True, False, True]
    assert np.array_equal(rows[[0, 2]], np.array([[1.0] * 4, [9.0] * 4], np.float32))
    rows_b, present_b = store.get_rows("b", np.array([5, 1]), 0, 2)
    assert present_b.tolist() == [True, False] and np.array_equal(rows_b[0], [7.0, 7.0])
    store.close()


def test_layouts_follow_the_plan_assignment() -> None:
    plan = make_plan()
    owned_hot, owned_warm, owned_cold = [], [], []
    for shard in range(plan.num_shards):
        layout = layouts_from_plan(plan, shard)["item"]
        a = plan.assignment(shard, "item")
        assert np.array_equal(layout.hot_ids, a.hot_ids)
        assert np.array_equal(layout.cold_ids, a.cold_ids)
        owned_hot.append(layout.hot_ids)
        owned_cold.append(layout.cold_ids)
        for w in layout.warm:
            assert (w.col_start, w.col_end) == plan.tables["item"].col_bounds()[w.index]
            owned_warm.append((w.index, w.ids))
    # Every hot id twice (2 replicas), every warm id once per slice, every cold id once.
    assert np.array_equal(np.bincount(np.concatenate(owned_hot), minlength=20)[:20], np.full(20, 2))
    for k in range(2):
        ids = np.concatenate([ids for idx, ids in owned_warm if idx == k])
        assert np.array_equal(np.sort(ids), np.arange(20, 220))
    assert np.array_equal(np.sort(np.concatenate(owned_cold)), np.arange(220, ROWS))
    with pytest.raises(ConfigError, match="outside the plan's 3 shards"):
        layouts_from_plan(plan, 3)


def test_layout_rejects_an_id_in_two_tiers() -> None:
    with pytest.raises(ConfigError, match="placed twice"):
        TableLayout(name="t", rows=10, dim=4, hot_ids=np.array([1, 2]), warm=(WarmSlice(0, 0, 2, np.array([2])),), cold_ids=np.array([3]))


@pytest.mark.parametrize("method", [LoadMethod.SST, LoadMethod.BATCH])
def test_bulk_load_stores_exactly_the_owned_rows(tmp_path: Path, method: LoadMethod) -> None:
    plan, src = make_plan(), source()
    layouts = layouts_from_plan(plan, 1)
    store = RowStore(tmp_path / "db", {"item": DIM})
    report = bulk_load(store, layouts, {"item": src}, source_id="s", plan_version=plan.version, shard_id=1, method=method, progress=False)
    assert not report.skipped
    layout = layouts["item"]
    assert report.rows_written == {"item": sum(len(ids) for ids, _, _ in layout.owned_ids())}
    for ids, cs, ce in layout.owned_ids():
        rows, present = store.get_rows("item", ids, cs, ce)
        assert present.all() and np.array_equal(rows, src[ids][:, cs:ce])
    # An id this shard does not own was not written.
    foreign = np.setdiff1d(np.arange(ROWS), np.concatenate([ids for ids, _, _ in layout.owned_ids()]))
    _, present = store.get_rows("item", foreign, 0, DIM)
    assert len(foreign) > 0 and not present.any()
    store.close()


def test_bulk_load_rerun_is_skipped_and_keeps_upserts(tmp_path: Path) -> None:
    plan, src = make_plan(), source()
    layouts = layouts_from_plan(plan, 0)
    cold_id = layouts["item"].cold_ids[:1]
    store = RowStore(tmp_path / "db", {"item": DIM})
    kwargs = dict(source_id="s", plan_version=plan.version, shard_id=0, progress=False)
    first = bulk_load(store, layouts, {"item": src}, **kwargs)  # type: ignore[arg-type]
    store.write_rows([("item", cold_id, np.full((1, DIM), 42.0, np.float32), 0, DIM)])
    store.close()
    store = RowStore(tmp_path / "db", {"item": DIM})
    second = bulk_load(store, layouts, {"item": src}, **kwargs)  # type: ignore[arg-type]
    assert not first.skipped and second.skipped and second.rows_written == {}
    assert list(read_manifest(store)) == [first.key]
    rows, _ = store.get_rows("item", cold_id, 0, DIM)
    assert (rows == 42.0).all()  # the re-run did not overwrite the upsert
    forced = bulk_load(store, layouts, {"item": src}, force=True, **kwargs)  # type: ignore[arg-type]
    rows, _ = store.get_rows("item", cold_id, 0, DIM)
    assert not forced.skipped and np.array_equal(rows[0], src[cold_id[0]])
    store.close()


def test_bulk_load_rejects_a_source_of_the_wrong_shape(tmp_path: Path) -> None:
    plan = make_plan()
    store = RowStore(tmp_path / "db", {"item": DIM})
    with pytest.raises(Exception, match=r"shape \[2000, 11\]; the plan needs \[2000, 12\]"):
        bulk_load(store, layouts_from_plan(plan, 0), {"item": source()[:, :11]}, source_id="s", plan_version=1, shard_id=0, progress=False)
    assert read_manifest(store) == {}
    store.close()


def test_open_source_forms_and_fingerprint(tmp_path: Path) -> None:
    src = source()
    (tmp_path / "dir").mkdir()
    np.save(tmp_path / "dir" / "item.npy", src)
    np.savez(tmp_path / "all.npz", item=src)
    np.save(tmp_path / "one.npy", src)
    fingerprints = set()
    for path in (tmp_path / "dir", tmp_path / "all.npz", tmp_path / "one.npy"):
        arrays, fp = open_source(path, ["item"])
        assert np.array_equal(np.asarray(arrays["item"]), src)
        fingerprints.add(fp)
    assert len(fingerprints) == 3
    assert open_source(tmp_path / "dir", ["item"])[1] == open_source(tmp_path / "dir", ["item"])[1]
    with pytest.raises(ConfigError, match="do not exist"):
        open_source(tmp_path / "dir", ["user"])


def test_encoding_rows_of_the_wrong_width_is_an_internal_recserve_error() -> None:
    import numpy as np

    from embedding_server.codec import encode_values
    from recserve.errors import InternalError

    with pytest.raises(InternalError, match=r"rows shape \(2, 3\) does not match slice 0..4 \(width 4\)"):
        encode_values(np.zeros((2, 3), dtype=np.float32), dim=4, col_start=0, col_end=4)


def test_a_big_multi_get_split_over_read_threads_answers_as_one_serial_get(tmp_path: Path) -> None:
    """RowStore.get_rows splits a big multi-get over its read threads (cold reads wait on
    the disk one after another otherwise; issue 9's tiered run): same rows, same order,
    same absent ids as the serial read, for ids in any order."""
    rng = np.random.default_rng(3)
    stored = rng.choice(5000, 1500, replace=False)
    rows = rng.standard_normal((stored.size, DIM)).astype(np.float32)
    serial = RowStore(tmp_path / "serial", {"item": DIM}, read_threads=1)
    parallel = RowStore(tmp_path / "parallel", {"item": DIM}, read_threads=8)
    try:
        for store in (serial, parallel):
            store.write_rows([("item", stored, rows, 0, DIM)])
        asked = rng.permutation(np.concatenate([rng.choice(stored, 700, replace=False), rng.choice(np.setdiff1d(np.arange(5000), stored), 300)]))
        want_rows, want_present = serial.get_rows("item", asked, 0, DIM)
        got_rows, got_present = parallel.get_rows("item", asked, 0, DIM)
        assert parallel._read_parts == 8 and asked.size >= 8 * 32  # the split path ran
        assert want_present.sum() == 700 and np.array_equal(got_present, want_present)
        assert np.array_equal(got_rows, want_rows)
        order = np.argsort(stored)
        at = np.searchsorted(stored[order], asked[got_present])
        assert np.array_equal(got_rows[got_present], rows[order][at])  # each id its own row
    finally:
        serial.close()
        parallel.close()
