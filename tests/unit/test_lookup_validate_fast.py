"""The one-feature validation shortcut (issue 9's lean caller path): it builds exactly
the CallerLookup the general path builds, and every bad or unusual input falls through
to the general path, which names the field and value."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recserve.errors import InvalidArgument
from recserve.lookup import validate
from recserve.lookup.types import CallerLookup

TABLE_OF = {"item_id": "item", "user_id": "user"}
ROWS = {"item": 50, "user": 7}


def _check(kjt: KeyedJaggedTensor) -> CallerLookup:
    return validate.validate_features(kjt, table_of_feature=TABLE_OF, table_rows=ROWS, pooled=True, deadline=3.5)


def _general(kjt: KeyedJaggedTensor, monkeypatch: pytest.MonkeyPatch) -> CallerLookup:
    with monkeypatch.context() as m:
        m.setattr(validate, "_one_feature", lambda *a: None)
        return _check(kjt)


def _same(a: CallerLookup, b: CallerLookup) -> None:
    assert (a.keys, a.batch_size, a.pooled, a.deadline, a.n_ids) == (b.keys, b.batch_size, b.pooled, b.deadline, b.n_ids)
    assert list(a.tables) == list(b.tables)
    for name in a.tables:
        x, y = a.tables[name], b.tables[name]
        assert x.features == y.features
        for field in ("ids", "lengths", "feature_counts"):
            got, want = getattr(x, field), getattr(y, field)
            assert got.dtype == want.dtype == np.int64 and np.array_equal(got, want), field


@pytest.mark.parametrize("seed", range(6))
def test_the_shortcut_builds_what_the_general_path_builds(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(seed)
    key = ["item_id", "user_id"][seed % 2]
    lengths = rng.integers(0, 5, size=int(rng.integers(0, 9)))
    values = rng.integers(0, ROWS[TABLE_OF[key]], size=int(lengths.sum()))
    kjt = KeyedJaggedTensor(keys=[key], values=torch.from_numpy(values), lengths=torch.from_numpy(lengths))
    assert validate._one_feature(kjt, (key,), TABLE_OF, ROWS, True, 3.5) is not None  # the shortcut did serve it
    _same(_check(kjt), _general(kjt, monkeypatch))


@pytest.mark.parametrize(
    ("values", "lengths", "message"),
    [
        ([1, 50], [2], "id 50 is out of range [0, 50)"),
        ([-1, 3], [2], "id -1 is out of range [0, 50)"),
        ([1, 2, 3], [2], "add up to 2 but features.values has 3 ids"),
        ([1, 2], [3, -1], "features.lengths[1] = -1 is negative"),
    ],
)
def test_bad_one_feature_input_falls_through_to_the_named_error(values: list[int], lengths: list[int], message: str) -> None:
    kjt = KeyedJaggedTensor(keys=["item_id"], values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths, dtype=torch.int64))
    assert validate._one_feature(kjt, ("item_id",), TABLE_OF, ROWS, True, math.inf) is None
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        _check(kjt)


def test_unusual_one_feature_input_takes_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """int32 ids, more bags than the shortcut checks as a list, an unknown key: the
    general path answers (cast, numpy reductions, the named error)."""
    int32 = KeyedJaggedTensor(keys=["item_id"], values=torch.tensor([3, 4], dtype=torch.int32), lengths=torch.tensor([1, 1], dtype=torch.int32))
    assert validate._one_feature(int32, ("item_id",), TABLE_OF, ROWS, True, 3.5) is None
    assert _check(int32).tables["item"].ids.tolist() == [3, 4]
    many = KeyedJaggedTensor(keys=["item_id"], values=torch.arange(40, dtype=torch.int64), lengths=torch.ones(40, dtype=torch.int64))
    assert validate._one_feature(many, ("item_id",), TABLE_OF, ROWS, True, 3.5) is None
    assert _check(many).batch_size == 40
    unknown = KeyedJaggedTensor(keys=["nope"], values=torch.tensor([1], dtype=torch.int64), lengths=torch.tensor([1], dtype=torch.int64))
    with pytest.raises(InvalidArgument, match="unknown feature"):
        _check(unknown)
