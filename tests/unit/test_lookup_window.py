"""Per-caller validation and the window merge / dedup (pure)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recserve.errors import InvalidArgument
from recserve.lookup.validate import validate_features
from recserve.lookup.window import dedup_ratio, merge_window

TABLE_OF = {"item_id": "item", "hist": "item", "user_id": "user"}
ROWS = {"item": 100, "user": 10}


def kjt(keys: list[str], lengths: list[int], values: list[int], **kw: object) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=keys, values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths, dtype=torch.int64), **kw)  # type: ignore[arg-type]


def check(k: KeyedJaggedTensor):  # type: ignore[no-untyped-def]
    return validate_features(k, table_of_feature=TABLE_OF, table_rows=ROWS, pooled=True, deadline=math.inf)


def test_features_of_one_table_are_grouped_in_key_order() -> None:
    c = check(kjt(["hist", "user_id", "item_id"], [2, 0, 1, 1, 1, 1], [5, 6, 3, 9, 7, 8]))
    assert c.batch_size == 2 and c.n_ids == 6
    assert c.tables["item"].features == ("hist", "item_id")
    np.testing.assert_array_equal(c.tables["item"].ids, [5, 6, 7, 8])
    np.testing.assert_array_equal(c.tables["item"].lengths, [2, 0, 1, 1])
    np.testing.assert_array_equal(c.tables["user"].ids, [3, 9])


@pytest.mark.parametrize(
    ("k", "needle"),
    [
        (kjt(["nope"], [1], [1]), "unknown feature"),
        (kjt(["item_id"], [1], [100]), "id 100 is out of range [0, 100)"),
        (kjt(["user_id"], [2], [3, -1]), "id -1 is out of range"),
        (kjt(["item_id"], [1], [1], weights=torch.tensor([1.0])), "weighted"),
    ],
)
def test_bad_inputs_name_the_problem(k: KeyedJaggedTensor, needle: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        check(k)
    assert needle in str(e.value)


def test_out_of_range_message_names_feature_and_table() -> None:
    with pytest.raises(InvalidArgument) as e:
        check(kjt(["item_id", "user_id"], [1, 1], [4, 12]))
    assert "'user_id'" in str(e.value) and "'user'" in str(e.value) and "10 rows" in str(e.value)


def test_lengths_that_do_not_add_up_are_rejected() -> None:
    bad = KeyedJaggedTensor(keys=["item_id"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1]))
    with pytest.raises(InvalidArgument, match="add up to 2"):
        check(bad)
    neg = KeyedJaggedTensor(keys=["item_id"], values=torch.tensor([1]), lengths=torch.tensor([2, -1]))
    with pytest.raises(InvalidArgument, match="negative"):
        check(neg)


def test_float_ids_are_rejected() -> None:
    bad = KeyedJaggedTensor(keys=["item_id"], values=torch.tensor([1.0]), lengths=torch.tensor([1]))
    with pytest.raises(InvalidArgument, match="integer dtype"):
        check(bad)


def test_merge_dedups_per_table_across_callers_and_features() -> None:
    a = check(kjt(["item_id", "hist"], [1, 2], [5, 5, 3]))
    b = check(kjt(["hist", "user_id"], [2, 1], [3, 9, 4]))
    c = check(kjt(["user_id"], [1], [4]))
    w = merge_window([a, b, c])
    item = w["item"]
    np.testing.assert_array_equal(item.unique_ids, [3, 5, 9])
    # The inverse reconstructs every caller's ids in order.
    np.testing.assert_array_equal(item.unique_ids[item.inverse], [5, 5, 3, 3, 9])
    np.testing.assert_array_equal(item.id_offsets, [0, 3, 5, 5])
    np.testing.assert_array_equal(item.bag_lengths, [1, 2, 2])
    np.testing.assert_array_equal(item.bag_offsets, [0, 2, 3, 3])
    np.testing.assert_array_equal(w["user"].unique_ids, [4])
    np.testing.assert_array_equal(w["user"].id_offsets, [0, 0, 1, 2])
    assert dedup_ratio(w) == pytest.approx(7 / 4)
    np.testing.assert_array_equal(item.occurrence_bags(), [0, 1, 1, 2, 2])


def test_empty_callers_and_empty_bags_merge() -> None:
    a = check(kjt(["item_id"], [0, 0], []))
    b = check(kjt(["item_id"], [0, 2], [7, 7]))
    w = merge_window([a, b])["item"]
    np.testing.assert_array_equal(w.unique_ids, [7])
    np.testing.assert_array_equal(w.inverse, [0, 0])
    np.testing.assert_array_equal(w.bag_lengths, [0, 0, 0, 2])
