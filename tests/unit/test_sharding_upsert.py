"""split_upsert: every owner gets its copy, and the copies reassemble the rows."""

from __future__ import annotations

import numpy as np
import pytest

from recserve.errors import InvalidArgument
from recserve.sharding.upsert import split_upsert
from tests.unit.test_sharding_reference import RefRouter, make_plan


@pytest.mark.parametrize("column_splits, cold_replicas", [(3, 1), (1, 2), (4, 2)])
def test_parts_reach_every_owner_and_reassemble(column_splits: int, cold_replicas: int) -> None:
    plan = make_plan(rows=2_000, dim=10, hot=40, warm=300, hot_replicas=2, column_splits=column_splits, cold_replicas=cold_replicas, num_shards=5)
    t = plan.table("item")
    ref = RefRouter(plan, "item")
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((t.rows, t.dim)).astype(np.float32)
    ids = rng.permutation(t.rows)[:1_200]
    parts = split_upsert(plan, "item", ids, matrix[ids])
    # Replay the parts into per-shard stores: (shard, id) -> row with NaN where not sent.
    store: dict[tuple[int, int], np.ndarray] = {}
    copies = 0
    for shard, plist in parts.items():
        for pids, rows, start, end in plist:
            assert rows.dtype == np.float32 and rows.shape == (pids.size, end - start)
            k = t.slice_of(start, end)
            assert plan.router("item").owns(shard, pids, k).all()
            for i, row in zip(pids.tolist(), rows):
                store.setdefault((shard, i), np.full(t.dim, np.nan, dtype=np.float32))[start:end] = row
            copies += pids.size
    bounds = t.col_bounds()
    for i in ids.tolist():
        tier = ref.tier(i)
        if tier == 1:
            got = np.concatenate([store[(s, i)][a:b] for s, (a, b) in zip(ref.warm_shards(i), bounds)])
            np.testing.assert_array_equal(got, matrix[i])
        else:
            for s in ref.hot_replicas(i) if tier == 0 else ref.cold_owners(i):
                np.testing.assert_array_equal(store[(s, i)], matrix[i])
    tiers = np.array([ref.tier(i) for i in ids.tolist()])
    want = (tiers == 0).sum() * 2 + (tiers == 1).sum() * column_splits + (tiers == 2).sum() * cold_replicas
    assert copies == want  # no shard receives anything it does not own


def test_full_rows_share_one_part_per_shard_and_keep_input_order() -> None:
    plan = make_plan(rows=500, dim=4, hot=0, warm=0, column_splits=1, num_shards=2, hot_replicas=1)
    owner = int(plan.router("item").cold_owners_of([7])[0, 0])
    rows = np.array([[1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]], dtype=np.float32)
    parts = split_upsert(plan, "item", [7, 7, 7], rows)
    assert list(parts) == [owner] and len(parts[owner]) == 1
    pids, prow, start, end = parts[owner][0]
    assert pids.tolist() == [7, 7, 7] and prow[:, 0].tolist() == [1, 2, 3] and (start, end) == (0, 4)


def test_bad_upserts_are_rejected() -> None:
    plan = make_plan(rows=100, dim=10)
    with pytest.raises(InvalidArgument, match=r"shape \(2, 9\); expected \(2, 10\)"):
        split_upsert(plan, "item", [1, 2], np.zeros((2, 9)))
    with pytest.raises(InvalidArgument, match="id 100 is out of range"):
        split_upsert(plan, "item", [100], np.zeros((1, 10)))
    assert split_upsert(plan, "item", [], np.zeros((0, 10))) == {}
