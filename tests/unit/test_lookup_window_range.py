"""The id range check a window makes for its callers (issue 9's lean caller path): the
client defers a one-feature caller's range check to its window, which checks every id
at once and fails only the callers with an id out of range, with the error the
per-caller check gives, before any id indexes anything."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recserve.errors import InvalidArgument
from recserve.lookup.client import LookupClient
from recserve.lookup.types import CallerLookup, LookupResult
from recserve.lookup.validate import validate_features
from recserve.lookup.window import OutOfRange, merge_window
from tests.unit.test_lookup_fakes import FakeShards, make_config, make_plan, make_weights

TABLE_OF = {"item_id": "item", "also_item": "item", "user_id": "user"}
ROWS = {"item": 50, "user": 7}


def _kjt(keys: list[str], lengths: list[int], values: list[int]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=keys, values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths, dtype=torch.int64))


def _caller(kjt: KeyedJaggedTensor, *, defer: bool) -> CallerLookup:
    return validate_features(kjt, table_of_feature=TABLE_OF, table_rows=ROWS, pooled=True, deadline=math.inf, defer_range_check=defer)


def _error_of(kjt: KeyedJaggedTensor) -> str:
    """The per-caller check's message for ``kjt`` (the oracle)."""
    with pytest.raises(InvalidArgument) as info:
        _caller(kjt, defer=False)
    return str(info.value)


def test_a_deferred_caller_keeps_its_tensors_and_skips_only_the_range_check() -> None:
    kjt = _kjt(["item_id"], [2, 1], [3, 99, -4])  # 99 and -4 are out of [0, 50)
    caller = _caller(kjt, defer=True)
    part = caller.tables["item"]
    assert part.ids is kjt.values() and part.lengths is kjt.lengths()  # no copy, no .numpy()
    assert (caller.n_ids, caller.batch_size, part.feature_counts.tolist()) == (3, 2, [3])
    with pytest.raises(InvalidArgument, match="id 99 is out of range"):
        _caller(kjt, defer=False)
    # Every other check still runs at once, deferred or not.
    with pytest.raises(InvalidArgument, match="add up to 2"):
        _caller(_kjt(["item_id"], [2], [1, 2, 3]), defer=True)
    with pytest.raises(InvalidArgument, match="is negative"):
        _caller(_kjt(["item_id"], [3, -1], [1, 2]), defer=True)
    with pytest.raises(InvalidArgument, match="unknown feature"):
        _caller(_kjt(["nope"], [1], [1]), defer=True)


@pytest.mark.parametrize("seed", range(8))
def test_the_window_names_exactly_the_callers_with_an_id_out_of_range(seed: int) -> None:
    rng = np.random.default_rng(seed)
    kjts, bad = [], set()
    for c in range(int(rng.integers(2, 12))):
        key = ["item_id", "user_id"][int(rng.integers(0, 2))]
        rows = ROWS[TABLE_OF[key]]
        values = rng.integers(0, rows, size=int(rng.integers(1, 9)))
        if rng.random() < 0.35:
            values[int(rng.integers(0, values.size))] = int(rng.choice([-1, -(2**40), rows, rows + 5, 2**62]))
            bad.add(c)
        kjts.append(_kjt([key], [int(values.size)], values.tolist()))
    # A multi-feature caller is checked whole at once (the general path): never deferred.
    kjts.append(_kjt(["item_id", "also_item"], [2, 1], [1, 49, 0]))
    callers = [_caller(k, defer=True) for k in kjts]
    if not bad:
        windows = merge_window(callers, ROWS)
        assert sum(w.occurrences for w in windows.values()) == sum(c.n_ids for c in callers)
        return
    with pytest.raises(OutOfRange) as info:
        merge_window(callers, ROWS)
    assert set(info.value.errors) == bad
    for c, error in info.value.errors.items():
        assert isinstance(error, InvalidArgument) and str(error) == _error_of(kjts[c])
    # Without them the window merges, and equals the merge of the per-caller-checked ones.
    sound = [c for i, c in enumerate(callers) if i not in bad]
    oracle = [_caller(k, defer=False) for i, k in enumerate(kjts) if i not in bad]
    got, want = merge_window(sound, ROWS), merge_window(oracle, ROWS)
    assert list(got) == list(want)
    for name in got:
        for field in ("unique_ids", "inverse", "id_offsets", "bag_lengths", "bag_offsets"):
            assert np.array_equal(getattr(got[name], field), getattr(want[name], field)), (name, field)


def test_numpy_and_tensor_parts_merge_alike() -> None:
    """Callers checked whole (numpy ids) and deferred ones (tensors) share a window;
    the merge equals np.unique over the concatenated ids."""
    kjts = [_kjt(["item_id"], [3], [5, 3, 5]), _kjt(["item_id", "also_item"], [1, 1], [3, 9]), _kjt(["item_id"], [2], [9, 0])]
    callers = [_caller(kjts[0], defer=True), _caller(kjts[1], defer=True), _caller(kjts[2], defer=False)]
    assert isinstance(callers[0].tables["item"].ids, torch.Tensor) and isinstance(callers[2].tables["item"].ids, np.ndarray)
    w = merge_window(callers, ROWS)["item"]
    ids = np.array([5, 3, 5, 3, 9, 9, 0])
    unique, inverse = np.unique(ids, return_inverse=True)
    assert w.unique_ids.tolist() == unique.tolist() and w.inverse.tolist() == inverse.tolist()
    assert w.id_offsets.tolist() == [0, 3, 5, 7] and w.bag_lengths.tolist() == [3, 1, 1, 2] and w.bag_offsets.tolist() == [0, 1, 3, 4]


def test_a_window_of_only_bad_callers_fails_them_all_and_sends_nothing() -> None:
    plan, _ = make_plan()
    fake = FakeShards(plan, make_weights())
    client = LookupClient(make_config(), plan, fake)
    bad = [KeyedJaggedTensor(keys=["item_id"], values=torch.tensor([1, v]), lengths=torch.tensor([2])) for v in (2000, -1, 2**40)]

    async def body() -> list[object]:
        await client.start()
        try:
            out = list(await asyncio.gather(*(client.lookup(k, pooled=True, timeout_s=5) for k in bad), return_exceptions=True))
            # The client keeps serving: a good caller after them is answered.
            good = await client.lookup(KeyedJaggedTensor(keys=["item_id"], values=torch.tensor([1, 2]), lengths=torch.tensor([2])), pooled=True, timeout_s=5)
            return out + [good]
        finally:
            await client.aclose()

    calls_before = len(fake.calls)
    out = asyncio.run(body())
    for res, value in zip(out[:3], (2000, -1, 2**40)):
        assert isinstance(res, InvalidArgument) and f"id {value:,} is out of range [0, 2,000)" in str(res), res
    assert isinstance(out[3], LookupResult) and not out[3].degraded
    assert client.stats.callers_rejected == 3
    # Only the good caller's window reached a shard.
    assert client.stats.windows == 2 and len(fake.calls) - calls_before == len({c.shard for c in fake.calls})


def test_ids_that_numpy_cannot_view_are_copied_or_named() -> None:
    """A tensor ``.numpy()`` refuses with TypeError (sparse, another device: CUDA on a GPU
    host, meta) takes the general path: copied to a dense CPU array when it has data, a
    named InvalidArgument when it has none, never a crash."""
    values = torch.tensor([3, 4, 5]).to_sparse()
    sparse = KeyedJaggedTensor(keys=["item_id"], values=values, lengths=torch.tensor([3]))
    caller = _caller(sparse, defer=True)
    assert np.asarray(caller.tables["item"].ids).tolist() == [3, 4, 5] and caller.n_ids == 3
    meta = KeyedJaggedTensor(keys=["item_id"], values=torch.empty(3, dtype=torch.int64, device="meta"), lengths=torch.tensor([3]))
    with pytest.raises(InvalidArgument, match="features.values cannot be read as a CPU array"):
        _caller(meta, defer=True)
