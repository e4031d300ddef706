"""Upsert counter, the load guard and the offline migration (real RocksDB in a temp dir).

The oracle is the source array with the upserted rows written over it, computed without
the code under test; every new owner's rows (full rows and column slices) must equal it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embedding_server.bulk_load import bulk_load, read_manifest
from embedding_server.layout import layouts_from_plan
from embedding_server.manifest import store_state
from embedding_server.migrate import migrate, migration_key
from embedding_server.store import RowStore
from recserve.errors import ConfigError, FailedPrecondition
from recserve.sharding.plan import ShardingPlan, TablePlan
from recserve.sharding.replan import replan_add_shard

ROWS, DIM = 2000, 12


def make_plan(num_shards: int = 3, version: int = 1) -> ShardingPlan:
    table = TablePlan(
        name="item", rows=ROWS, dim=DIM, hot_ids=np.arange(20), warm_ids=np.arange(20, 220),
        hot_replicas=2, column_splits=2, cold_replicas=1,
    )  # fmt: skip
    return ShardingPlan(version=version, num_shards=num_shards, tables={"item": table})


def source() -> np.ndarray:
    return np.random.default_rng(7).standard_normal((ROWS, DIM)).astype(np.float32)


def open_stores(root: Path, n: int) -> list[RowStore]:
    return [RowStore(root / f"shard-{k}", {"item": DIM}) for k in range(n)]


def load_all(plan: ShardingPlan, stores: list[RowStore], src: np.ndarray) -> None:
    for k, store in enumerate(stores):
        bulk_load(store, layouts_from_plan(plan, k), {"item": src}, source_id="s", plan_version=plan.version, shard_id=k, progress=False)


def upsert_everywhere(plan: ShardingPlan, stores: list[RowStore], ids: np.ndarray, rows: np.ndarray) -> None:
    """What the client does: write each id's columns to every owner (one batch per shard)."""
    for k, store in enumerate(stores):
        writes = []
        for owned, cs, ce in layouts_from_plan(plan, k)["item"].owned_ids():
            mask = np.isin(ids, owned)
            if mask.any():
                writes.append(("item", ids[mask], rows[mask][:, cs:ce], cs, ce))
        if writes:
            store.write_rows(writes)


def assert_owners_hold(plan: ShardingPlan, stores: list[RowStore], oracle: np.ndarray) -> None:
    for k, store in enumerate(stores):
        for ids, cs, ce in layouts_from_plan(plan, k)["item"].owned_ids():
            got, present = store.get_rows("item", ids, cs, ce)
            assert present.all(), f"shard {k} lacks {int((~present).sum())} of its rows {cs}..{ce}"
            np.testing.assert_array_equal(got, oracle[ids][:, cs:ce])


def test_the_upsert_counter_is_written_with_the_rows_and_survives_reopen(tmp_path: Path) -> None:
    store = RowStore(tmp_path / "db", {"item": DIM})
    assert (store.upserts.seq, store.upserts.rows) == (0, 0)
    store.write_rows([("item", np.array([3, 5]), np.ones((2, DIM), np.float32), 0, DIM)])
    store.write_rows([("item", np.array([7]), np.ones((1, 6), np.float32), 6, 12)])
    store.close()
    store = RowStore(tmp_path / "db", {"item": DIM})
    try:
        assert (store.upserts.seq, store.upserts.rows) == (2, 3)
    finally:
        store.close()


def test_an_empty_upsert_is_not_counted_and_does_not_block_a_reload(tmp_path: Path) -> None:
    plan, src = make_plan(), source()
    layouts = layouts_from_plan(plan, 0)
    store = RowStore(tmp_path / "db", {"item": DIM})
    try:
        bulk_load(store, layouts, {"item": src}, source_id="s", plan_version=1, shard_id=0, progress=False)
        store.write_rows([])  # an Upsert RPC with no tables
        store.write_rows([("item", np.zeros(0, np.int64), np.zeros((0, DIM), np.float32), 0, DIM)])  # one with no ids
        assert (store.upserts.seq, store.upserts.rows) == (0, 0)
        assert not bulk_load(store, layouts, {"item": src}, source_id="s", plan_version=2, shard_id=0, progress=False).skipped
    finally:
        store.close()


def test_a_new_load_over_upserts_is_refused_naming_both(tmp_path: Path) -> None:
    plan, src = make_plan(), source()
    layouts = layouts_from_plan(plan, 0)
    cold = layouts["item"].cold_ids[:2]
    store = RowStore(tmp_path / "db", {"item": DIM})
    try:
        first = bulk_load(store, layouts, {"item": src}, source_id="s", plan_version=1, shard_id=0, progress=False)
        store.write_rows([("item", cold, np.full((2, DIM), 9.0, np.float32), 0, DIM)])
        # The same load again: skipped, as before (never overwrote upserts).
        assert bulk_load(store, layouts, {"item": src}, source_id="s", plan_version=1, shard_id=0, progress=False).skipped
        # A re-plan's load (plan v2): refused, naming the last load and the upserts.
        with pytest.raises(FailedPrecondition) as err:
            bulk_load(store, layouts, {"item": src}, source_id="s", plan_version=2, shard_id=0, progress=False)
        msg = err.value.message
        assert "refusing to load 's|plan=2|shard=0'" in msg and f"last load {first.key!r}" in msg
        assert "1 upsert (2 rows, newest upsert #1)" in msg and "--overwrite" in msg
        rows, _ = store.get_rows("item", cold, 0, DIM)
        assert (rows == 9.0).all()
        assert list(read_manifest(store)) == [first.key]
        forced = bulk_load(store, layouts, {"item": src}, source_id="s", plan_version=2, shard_id=0, overwrite=True, progress=False)
        assert not forced.skipped and forced.overwritten_upserts == 1
        rows, _ = store.get_rows("item", cold, 0, DIM)
        np.testing.assert_array_equal(rows, src[cold])
        assert store_state(store).pending_upserts == 0  # the new load is the reference now
    finally:
        store.close()


def test_migration_to_one_more_shard_keeps_every_upsert_and_is_idempotent(tmp_path: Path) -> None:
    old, src = make_plan(), source()
    new, _ = replan_add_shard(old)
    olds = open_stores(tmp_path / "old", old.num_shards)
    load_all(old, olds, src)
    # Upserts in every tier; the hot and warm ones land on several owners.
    ids = np.array([0, 7, 19, 25, 150, 219, 500, 1999], dtype=np.int64)
    rows = np.random.default_rng(3).standard_normal((len(ids), DIM)).astype(np.float32) + 10
    upsert_everywhere(old, olds, ids, rows)
    oracle = src.copy()
    oracle[ids] = rows
    news = open_stores(tmp_path / "new", new.num_shards)
    try:
        report = migrate(old, new, olds, news, progress=False)
        assert_owners_hold(new, news, oracle)
        assert report.ids_incomplete == {"item": 0}
        assert report.carried_upserts == 3  # one upsert batch per old shard
        for j, store in enumerate(news):
            assert report.rows_written[j]["item"] == sum(len(g) for g, _, _ in layouts_from_plan(new, j)["item"].owned_ids())
            assert list(read_manifest(store)) == [migration_key(1, 2, j)]
        # Idempotent: a re-run writes the same rows.
        migrate(old, new, olds, news, progress=False)
        assert_owners_hold(new, news, oracle)
        # The migrated upserts are protected from a load of the source arrays ...
        with pytest.raises(FailedPrecondition, match="migrated in by 'migrate-from-v1|plan=2|shard=0'"):
            bulk_load(news[0], layouts_from_plan(new, 0), {"item": src}, source_id="s", plan_version=2, shard_id=0, progress=False)
        # ... and a new shard's own upserts from a re-run of the migration.
        upsert_everywhere(new, news, ids[:1], rows[:1] + 1)
        with pytest.raises(FailedPrecondition, match="refusing to migrate"):
            migrate(old, new, olds, news, progress=False)
        migrate(old, new, olds, news, overwrite=True, progress=False)
        assert_owners_hold(new, news, oracle)  # asked to: the old fleet's rows again
    finally:
        for store in olds + news:
            store.close()


def test_migration_recuts_warm_slices_and_leaves_missing_rows_missing(tmp_path: Path) -> None:
    old, src = make_plan(), source()
    t = old.tables["item"]
    one_split = TablePlan(
        name="item", rows=ROWS, dim=DIM, hot_ids=t.hot_ids, warm_ids=t.warm_ids, hot_replicas=2, column_splits=3, cold_replicas=2,
    )  # fmt: skip
    new = ShardingPlan(version=2, num_shards=4, tables={"item": one_split})
    olds = open_stores(tmp_path / "old", old.num_shards)
    load_all(old, olds, src)
    # One warm id loses slice 1 on its owner: no old shard holds it in full any more.
    warm_id = np.array([30], dtype=np.int64)
    slice_owner = int(old.router("item").warm_shards_of(warm_id)[0, 1])
    olds[slice_owner].write_rows([("item", warm_id, np.ones((1, DIM), np.float32), 0, DIM)])  # a full row where slice 1 was
    news = open_stores(tmp_path / "new", new.num_shards)
    try:
        report = migrate(old, new, olds, news, progress=False)
        assert report.ids_incomplete == {"item": 1}
        keep = np.setdiff1d(np.arange(ROWS), warm_id)
        for j, store in enumerate(news):
            for ids, cs, ce in layouts_from_plan(new, j)["item"].owned_ids():
                got, present = store.get_rows("item", ids, cs, ce)
                ok = np.isin(ids, keep)
                assert present[ok].all()
                np.testing.assert_array_equal(got[ok], src[ids[ok]][:, cs:ce])
                # Slice 0 (cols 0..6 of the old split) survived: new slices inside it are copied.
                lost = ~ok
                if lost.any():
                    assert present[lost].all() == (ce <= 6)
    finally:
        for store in olds + news:
            store.close()


def test_migration_refuses_stores_that_were_not_the_old_plans_shards(tmp_path: Path) -> None:
    old, src = make_plan(version=2), source()
    olds = open_stores(tmp_path / "old", old.num_shards)
    load_all(old, olds, src)
    news = open_stores(tmp_path / "new", 4)
    try:
        # Data directories swapped: shard 2's store read as slot 0 would lose its rows.
        swapped = [olds[2], olds[1], olds[0]]
        with pytest.raises(ConfigError, match=r"is slot 0 of plan v2, but its last load 's\|plan=2\|shard=2' was for shard 2"):
            migrate(old, make_plan(4, version=3), swapped, news, progress=False)
        # --from-plan older than what the stores were loaded for.
        with pytest.raises(ConfigError, match=r"slot 0 of plan v1, but its last load 's\|plan=2\|shard=0' was for shard 0 of plan v2"):
            migrate(make_plan(version=1), make_plan(4, version=3), olds, news, progress=False)
        assert all(not read_manifest(s) for s in news)  # refused before writing anything
        # A plan bump served without a re-load (stores loaded for v2, serving v4) is fine.
        report = migrate(make_plan(version=4), make_plan(4, version=5), olds, news, progress=False)
        assert report.ids_incomplete == {"item": 0}
        assert_owners_hold(make_plan(4, version=5), news, src)
    finally:
        for store in olds + news:
            store.close()


def test_migration_rejects_incompatible_plans(tmp_path: Path) -> None:
    old = make_plan()
    t = old.tables["item"]
    wider = TablePlan(name="item", rows=ROWS, dim=DIM + 1, hot_ids=t.hot_ids, warm_ids=t.warm_ids, hot_replicas=2, column_splits=2, cold_replicas=1)
    stores = open_stores(tmp_path, 3)
    try:
        with pytest.raises(ConfigError, match=r"is \[2,000, 12\] in plan v1 but \[2,000, 13\] in plan v2"):
            migrate(old, ShardingPlan(version=2, num_shards=3, tables={"item": wider}), stores, stores, progress=False)
        with pytest.raises(ConfigError, match="got 3 old and 2 new stores"):
            migrate(old, make_plan(version=2), stores, stores[:2], progress=False)
    finally:
        for store in stores:
            store.close()


def test_migrated_stores_keep_the_model_version_their_rows_were_loaded_from(tmp_path: Path) -> None:
    """The ranker refuses shard tables whose model_version differs from its weights, so a
    store filled only by a migration must report the export its rows came from."""
    from embedding_server.bulk_load import table_model_versions

    old, src = make_plan(), source()
    new, _ = replan_add_shard(old)
    olds = open_stores(tmp_path / "old", old.num_shards)
    for k, store in enumerate(olds):
        bulk_load(store, layouts_from_plan(old, k), {"item": src}, source_id="s", plan_version=1, shard_id=k,
                  progress=False, model_version="m-abc")
    news = open_stores(tmp_path / "new", new.num_shards)
    try:
        migrate(old, new, olds, news, progress=False)
        assert [table_model_versions(s) for s in news] == [{"item": "m-abc"}] * new.num_shards
        # Old shards loaded from two different exports: refused, naming both.
        bulk_load(olds[1], layouts_from_plan(old, 1), {"item": src}, source_id="s2", plan_version=1, shard_id=1,
                  progress=False, model_version="m-def")
        with pytest.raises(ConfigError, match=r"table 'item': the old shards were loaded from different exports \['m-abc', 'm-def'\]"):
            migrate(old, new, olds, news, overwrite=True, progress=False)
    finally:
        for store in olds + news:
            store.close()
