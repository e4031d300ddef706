"""Per-caller input validation, done before a caller joins a window.

A bad caller (unknown feature, bad shape, out-of-range id) fails alone with
``INVALID_ARGUMENT``; the window it would have joined never sees it. The checks are
array operations per feature (a loop over features, never over ids).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from recserve.errors import InvalidArgument
from recserve.lookup.types import CallerLookup, TableInput

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


_INT_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})
_SMALL = 32  # up to this many lengths, check them as a Python list


def _as_int64(tensor: torch.Tensor, field: str) -> np.ndarray:
    """A 1-D int64 numpy view of an integer tensor (copied only when cast or moved)."""
    if getattr(tensor, "dtype", None) not in _INT_DTYPES:
        raise InvalidArgument(f"{field} has dtype {getattr(tensor, 'dtype', type(tensor).__name__)}; use an integer dtype (int64 or int32)")
    try:
        array = tensor.numpy()  # the common case: a CPU tensor without grad, zero-copy
    except RuntimeError:  # on a device, or requires grad
        array = tensor.detach().cpu().numpy()
    if array.ndim != 1:
        raise InvalidArgument(f"{field} has shape {list(array.shape)}; it must be 1-D")
    return array if array.dtype == np.int64 else array.astype(np.int64)


def _one_feature(
    features: "KeyedJaggedTensor", keys: tuple[str, ...], table_of_feature: dict[str, str], table_rows: dict[str, int], pooled: bool, deadline: float
) -> CallerLookup | None:
    """The common caller, checked with the fewest calls: one feature, int64 CPU
    tensors, no weights, one stride, at most ``_SMALL`` bags. None: anything else, or
    anything wrong (:func:`validate_features`' general path then names the error)."""
    table = table_of_feature.get(keys[0])
    values_t, lengths_t = features.values(), features.lengths()
    if table is None or values_t.dtype is not torch.int64 or lengths_t.dtype is not torch.int64 or lengths_t.dim() != 1 or values_t.dim() != 1:
        return None
    if lengths_t.shape[0] > _SMALL or features.weights_or_none() is not None or features.variable_stride_per_key():
        return None
    small = lengths_t.tolist()
    n = values_t.shape[0]
    if (small and min(small) < 0) or sum(small) != n:
        return None
    try:
        values, lengths = values_t.numpy(), lengths_t.numpy()
    except RuntimeError:  # on a device, or requires grad
        return None
    rows = table_rows[table]
    # Viewed as unsigned, a negative id is huge: one max() checks both ends of [0, rows).
    if n and int(values.view(np.uint64).max()) >= rows:
        return None
    part = TableInput(features=keys, ids=values, lengths=lengths, feature_counts=np.array((n,), dtype=np.int64))
    return CallerLookup(keys=keys, batch_size=len(small), tables={table: part}, pooled=pooled, deadline=deadline, n_ids=n)


def validate_features(
    features: "KeyedJaggedTensor",
    *,
    table_of_feature: dict[str, str],
    table_rows: dict[str, int],
    pooled: bool,
    deadline: float,
) -> CallerLookup:
    """Check one caller's KJT and regroup it per table.

    Raises :class:`InvalidArgument` naming the feature and the value for: unknown or
    repeated keys, weighted or variable-batch KJTs, lengths that are negative or do
    not add up to the values, non-integer ids, ids outside ``[0, rows)``.

    Example: keys ``["user_hist", "item"]`` both on table ``item`` with B = 2 become one
    :class:`TableInput` for ``item`` whose ``ids`` are user_hist's ids then item's ids
    and whose ``lengths`` are ``[len(user_hist[0]), len(user_hist[1]), len(item[0]), ...]``.
    """
    keys = tuple(features.keys())
    if len(keys) == 1:
        fast = _one_feature(features, keys, table_of_feature, table_rows, pooled, deadline)
        if fast is not None:
            return fast
    tables_of = [table_of_feature.get(k) for k in keys]
    if None in tables_of:
        unknown = [k for k in keys if k not in table_of_feature]
        raise InvalidArgument(f"unknown feature(s) {unknown}; configured features: {sorted(table_of_feature)}")
    n_keys = len(keys)
    if n_keys > 1 and len(set(keys)) != n_keys:
        raise InvalidArgument(f"feature keys {list(keys)} repeat a feature; give each feature once")
    if features.weights_or_none() is not None:
        raise InvalidArgument("weighted KeyedJaggedTensors are not supported by the lookup client; drop the weights")
    if features.variable_stride_per_key():
        raise InvalidArgument("variable-batch (per-key stride) KeyedJaggedTensors are not supported; use one batch size for every feature")
    values = _as_int64(features.values(), "features.values")
    lengths = _as_int64(features.lengths(), "features.lengths")
    batch = lengths.shape[0] // n_keys if n_keys else 0
    if lengths.shape[0] != batch * n_keys:
        raise InvalidArgument(f"features.lengths has {lengths.shape[0]} entries, not a multiple of the {n_keys} features")
    if lengths.shape[0] <= _SMALL:
        # A handful of bags (the common case): Python over the list is cheaper than two
        # numpy reductions' call overhead.
        small = lengths.tolist()
        negative = bool(small) and min(small) < 0
        total = sum(small)
    else:
        negative = bool(lengths.size) and int(lengths.min()) < 0
        total = int(lengths.sum())
    if negative:
        bad = int(np.flatnonzero(lengths < 0)[0])
        raise InvalidArgument(f"features.lengths[{bad}] = {int(lengths[bad])} is negative")
    # Ids per feature (a handful of features; arrays inside). One key, the common case,
    # needs no per-key split.
    counts = [total] if n_keys == 1 else lengths.reshape(n_keys, batch).sum(axis=1).tolist()
    if sum(counts) != values.shape[0]:
        raise InvalidArgument(f"features.lengths add up to {sum(counts)} but features.values has {values.shape[0]} ids")

    # Range checks and regrouping: one pass per feature. Viewed as unsigned, a negative
    # id is huge, so one max() checks both ends of [0, rows).
    if n_keys == 1:  # the common case, without the regrouping machinery (same result)
        key, table = keys[0], tables_of[0]
        assert table is not None
        rows = table_rows[table]
        if values.size and int(values.view(np.uint64).max()) >= rows:
            bad = int(values[(values < 0) | (values >= rows)][0])
            raise InvalidArgument(f"feature {key!r}: table {table!r} has {rows:,} rows; id {bad:,} is out of range [0, {rows:,})")
        n = int(values.shape[0])
        part = TableInput(features=keys, ids=values, lengths=lengths, feature_counts=np.array((n,), dtype=np.int64))
        return CallerLookup(keys=keys, batch_size=batch, tables={table: part}, pooled=pooled, deadline=deadline, n_ids=n)
    by_table: dict[str, tuple[list[str], list[np.ndarray], list[np.ndarray]]] = {}
    start = 0
    for k, key in enumerate(keys):
        table = tables_of[k]
        assert table is not None
        end = start + counts[k]
        ids = values[start:end] if n_keys > 1 else values
        start = end
        rows = table_rows[table]
        if ids.size and int(ids.view(np.uint64).max()) >= rows:
            bad = int(ids[(ids < 0) | (ids >= rows)][0])
            raise InvalidArgument(f"feature {key!r}: table {table!r} has {rows:,} rows; id {bad:,} is out of range [0, {rows:,})")
        names, id_parts, len_parts = by_table.setdefault(table, ([], [], []))
        names.append(key)
        id_parts.append(ids)
        len_parts.append(lengths[k * batch : (k + 1) * batch] if n_keys > 1 else lengths)
    tables = {
        t: TableInput(
            features=tuple(names),
            ids=id_parts[0] if len(id_parts) == 1 else np.concatenate(id_parts),
            lengths=len_parts[0] if len(len_parts) == 1 else np.concatenate(len_parts),
            feature_counts=np.array([p.shape[0] for p in id_parts], dtype=np.int64),
        )
        for t, (names, id_parts, len_parts) in by_table.items()
    }
    return CallerLookup(keys=keys, batch_size=batch, tables=tables, pooled=pooled, deadline=deadline, n_ids=int(values.shape[0]))
