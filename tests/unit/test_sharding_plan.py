"""TablePlan / ShardingPlan: slices, validation, versioned JSON, per-shard assignments."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from recserve.errors import ConfigError, NotFound
from recserve.sharding.plan import ShardingPlan, TablePlan
from tests.unit.test_sharding_reference import make_plan


def table(**kw: object) -> TablePlan:
    args: dict = dict(name="t", rows=100, dim=10, hot_ids=[1, 2], warm_ids=[5, 6, 7], hot_replicas=2, column_splits=3, cold_replicas=1)
    args.update(kw)
    return TablePlan(**args)


def test_col_bounds_are_contiguous_and_cover_the_row() -> None:
    assert table(dim=10, column_splits=3).col_bounds() == [(0, 4), (4, 7), (7, 10)]
    assert table(dim=8, column_splits=1).col_bounds() == [(0, 8)]
    b = table(dim=257, column_splits=4).col_bounds()
    assert b[0][0] == 0 and b[-1][1] == 257
    assert all(b[i][1] == b[i + 1][0] for i in range(3))
    widths = [e - s for s, e in b]
    assert max(widths) - min(widths) <= 1


def test_slice_of_maps_wire_ranges() -> None:
    t = table(dim=10, column_splits=3)
    assert t.slice_of(0, 0) is None
    assert t.slice_of(0, 10) is None
    assert t.slice_of(4, 7) == 1
    assert table(dim=10, column_splits=1).slice_of(0, 10) == 0
    with pytest.raises(ConfigError, match=r"columns \[3, 7\) are not a slice"):
        t.slice_of(3, 7)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(hot_ids=[3, 1]), "sorted"),
        (dict(hot_ids=[1, 1]), "sorted"),
        (dict(warm_ids=[2, 9]), "both hot and warm"),
        (dict(warm_ids=[5, 100]), r"\[0, 100\)"),
        (dict(hot_ids=[-1, 2]), r"\[0, 100\)"),
        (dict(column_splits=11), "column_splits = 11"),
        (dict(hot_replicas=0), "hot_replicas"),
        (dict(dtype="bf16"), "dtype"),
    ],
)
def test_table_plan_validation(kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        table(**kw)


def test_plan_rejects_fanout_beyond_shards_and_mismatched_keys() -> None:
    with pytest.raises(ConfigError, match="needs 3 distinct shards"):
        ShardingPlan(version=1, num_shards=2, tables={"t": table(column_splits=3)})
    with pytest.raises(ConfigError, match="does not match"):
        ShardingPlan(version=1, num_shards=3, tables={"x": table()})
    with pytest.raises(ConfigError, match="shard_keys"):
        ShardingPlan(version=1, num_shards=3, tables={"t": table()}, shard_keys=(0, 0, 1))
    with pytest.raises(ConfigError, match="version = 0"):
        ShardingPlan(version=0, num_shards=3, tables={"t": table()})


def test_json_round_trip_keeps_plan_and_owners() -> None:
    plan = make_plan(rows=3_000, cold_replicas=2)
    back = ShardingPlan.from_json(plan.to_json())
    assert back == plan
    assert back is not plan
    ids = np.arange(3_000)
    a, b = plan.router("item"), back.router("item")
    np.testing.assert_array_equal(a.cold_owners_of(ids), b.cold_owners_of(ids))
    np.testing.assert_array_equal(a.hot_replicas_of(ids), b.hot_replicas_of(ids))
    np.testing.assert_array_equal(a.warm_shards_of(ids), b.warm_shards_of(ids))
    # A different seed is a different placement (the comparison above can fail).
    other = make_plan(rows=3_000, cold_replicas=2, seed=9).router("item")
    assert not np.array_equal(a.cold_owners_of(ids), other.cold_owners_of(ids))


def test_empty_tiers_round_trip_and_plans_pickle() -> None:
    import copy
    import pickle

    plan = make_plan(hot=0, warm=0, column_splits=1)
    plan.router("item")  # populate the cache: it must not travel
    back = ShardingPlan.from_json(plan.to_json())
    assert back == plan and back.table("item").hot_ids.size == 0
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert copy.deepcopy(plan) == plan


def test_same_inputs_give_the_same_owners() -> None:
    ids = np.arange(3_000)
    a = make_plan(rows=3_000).router("item").cold_owners_of(ids)
    b = make_plan(rows=3_000).router("item").cold_owners_of(ids)
    np.testing.assert_array_equal(a, b)


def test_json_is_versioned_and_validated() -> None:
    doc = json.loads(make_plan().to_json())
    assert doc["format_version"] == 1 and doc["version"] == 1
    for mutate, message in [
        (lambda d: d.update(format_version=2), "format_version = 2 is not supported; this build reads format_version 1"),
        (lambda d: d.pop("format"), "not a sharding plan"),
        (lambda d: d.pop("num_shards"), "missing field 'num_shards'"),
        (lambda d: d.update(version="3"), "'version' = '3' has the wrong type; expected int"),
        (lambda d: d.update(ring_tokens="AAAA"), "ring_tokens holds 3 bytes"),
        (lambda d: d["tables"]["item"].update(hot_ids="!!"), "malformed"),
        (lambda d: d["tables"]["item"].update(column_splits=9), "needs 9 distinct shards"),
            (lambda d: d["tables"]["item"].update(column_splits=11), "column_splits = 11 must be in 1..dim"),
    ]:
        bad = json.loads(json.dumps(doc))
        mutate(bad)
        with pytest.raises(ConfigError, match=message):
            ShardingPlan.from_json(json.dumps(bad))
    with pytest.raises(ConfigError, match="not valid JSON"):
        ShardingPlan.from_json("{")


def test_save_and_load(tmp_path: Path) -> None:
    plan = make_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert ShardingPlan.load(path) == plan
    with pytest.raises(ConfigError, match="cannot read sharding plan"):
        ShardingPlan.load(tmp_path / "missing.json")


@pytest.mark.parametrize("cold_replicas", [1, 2])
def test_assignments_agree_with_owns_and_cover_every_copy(cold_replicas: int) -> None:
    plan = make_plan(rows=4_000, hot=80, warm=400, hot_replicas=2, column_splits=3, cold_replicas=cold_replicas)
    t = plan.table("item")
    r = plan.router("item")
    everything = np.arange(t.rows)
    hot_copies = np.zeros(t.rows, dtype=int)
    slice_copies = np.zeros((3, t.rows), dtype=int)
    cold_copies = np.zeros(t.rows, dtype=int)
    for shard in range(plan.num_shards):
        a = plan.assignment(shard, "item")
        assert a.table == "item"
        hot_mask = np.isin(t.hot_ids, a.hot_ids)
        np.testing.assert_array_equal(r.owns(shard, t.hot_ids), hot_mask)
        hot_copies[a.hot_ids] += 1
        for k in range(3):
            np.testing.assert_array_equal(r.owns(shard, t.warm_ids, k), np.isin(t.warm_ids, a.warm_ids[k]))
            slice_copies[k, a.warm_ids[k]] += 1
        cold = np.setdiff1d(everything, np.concatenate([t.hot_ids, t.warm_ids]))
        np.testing.assert_array_equal(r.owns(shard, cold), np.isin(cold, a.cold_ids))
        assert np.all(np.diff(a.cold_ids) > 0)
        cold_copies[a.cold_ids] += 1
    assert (hot_copies[t.hot_ids] == 2).all() and hot_copies.sum() == 2 * t.hot_ids.size
    assert (slice_copies[:, t.warm_ids] == 1).all() and slice_copies.sum() == 3 * t.warm_ids.size
    assert cold_copies.sum() == cold_replicas * t.num_cold
    with pytest.raises(NotFound):
        plan.assignment(5, "item")
