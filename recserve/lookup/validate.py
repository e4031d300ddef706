"""Per-caller input validation, done before a caller joins a window.

A bad caller (unknown feature, bad shape, out-of-range id) fails alone with
``INVALID_ARGUMENT``. The checks are array operations per feature (a loop over
features, never over ids). The client defers one of them, the id range of a
one-feature caller: a window checks all its ids at once (one reduction over the
merged ids, :func:`recserve.lookup.window.merge_window`) and fails only the callers
with an id out of range, with the same error, before any id is used.
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
_I64, _STRIDED = torch.int64, torch.strided


def out_of_range(feature: str, table: str, rows: int, bad_id: int) -> InvalidArgument:
    """The error of a caller whose ``feature`` holds ``bad_id`` outside ``[0, rows)``."""
    return InvalidArgument(f"feature {feature!r}: table {table!r} has {rows:,} rows; id {bad_id:,} is out of range [0, {rows:,})")


def _as_int64(tensor: torch.Tensor, field: str) -> np.ndarray:
    """A 1-D int64 numpy view of an integer tensor (copied only when cast or moved)."""
    if getattr(tensor, "dtype", None) not in _INT_DTYPES:
        raise InvalidArgument(f"{field} has dtype {getattr(tensor, 'dtype', type(tensor).__name__)}; use an integer dtype (int64 or int32)")
    try:
        array = tensor.numpy()  # the common case: a dense CPU tensor, zero-copy
    except (RuntimeError, TypeError):  # on a device (TypeError), sparse, or requires grad
        try:
            array = tensor.detach().to_dense().cpu().numpy()
        except Exception as e:  # a meta tensor, or a layout without a dense form
            raise InvalidArgument(f"{field} cannot be read as a CPU array ({type(e).__name__}: {e}); give a dense tensor") from None
    if array.ndim != 1:
        raise InvalidArgument(f"{field} has shape {list(array.shape)}; it must be 1-D")
    return array if array.dtype == np.int64 else array.astype(np.int64)


# Read-only [1] feature counts by id count: a one-feature caller's TableInput.feature_counts,
# shared rather than built per caller (nothing writes them).
_ONE_COUNT: dict[int, np.ndarray] = {}


def _one_count(n: int) -> np.ndarray:
    """A new read-only [1] array ``[n]``, kept in ``_ONE_COUNT`` while it has room
    (callers look there first)."""
    counts = np.array((n,), dtype=np.int64)
    counts.flags.writeable = False
    if len(_ONE_COUNT) < 4096:
        _ONE_COUNT[n] = counts
    return counts


def _one_feature(
    features: "KeyedJaggedTensor", keys: tuple[str, ...], table_of_feature: dict[str, str], table_rows: dict[str, int] | None, pooled: bool, deadline: float
) -> CallerLookup | None:
    """The common caller, checked with the fewest calls: one feature, dense int64 CPU
    tensors, no weights, one stride, at most ``_SMALL`` bags. None: anything else, or
    anything wrong (:func:`validate_features`' general path then names the error).

    ``table_rows`` None defers the id range check to the window (the client's path):
    the ids stay the caller's tensors, which the window concatenates in one call."""
    table = table_of_feature.get(keys[0])
    if table is None:
        return None
    values_t, lengths_t = features.values(), features.lengths()
    # Attribute reads only: a torch call costs ~1 µs, an attribute ~0.1 µs. A dense CPU
    # int64 1-D tensor is what torch.cat and .numpy() take without a copy or an error.
    if values_t.dtype is not _I64 or lengths_t.dtype is not _I64 or values_t.layout is not _STRIDED or lengths_t.layout is not _STRIDED:
        return None
    if not (values_t.is_cpu and lengths_t.is_cpu) or values_t.dim() != 1 or lengths_t.dim() != 1:
        return None
    small = lengths_t.tolist()
    if len(small) > _SMALL or features.weights_or_none() is not None or features.variable_stride_per_key():
        return None
    n = values_t.shape[0]
    if (small and min(small) < 0) or sum(small) != n:
        return None
    if table_rows is None:
        ids, lengths = values_t, lengths_t
    else:
        ids, lengths = values_t.numpy(), lengths_t.numpy()
        rows = table_rows[table]
        # Viewed as unsigned, a negative id is huge: one max() checks both ends of [0, rows).
        if n and int(ids.view(np.uint64).max()) >= rows:
            return None
    counts = _ONE_COUNT.get(n)
    if counts is None:
        counts = _one_count(n)
    part = TableInput(features=keys, ids=ids, lengths=lengths, feature_counts=counts)
    return CallerLookup(keys=keys, batch_size=len(small), tables={table: part}, pooled=pooled, deadline=deadline, n_ids=n)


def validate_features(
    features: "KeyedJaggedTensor",
    *,
    table_of_feature: dict[str, str],
    table_rows: dict[str, int],
    pooled: bool,
    deadline: float,
    defer_range_check: bool = False,
) -> CallerLookup:
    """Check one caller's KJT and regroup it per table.

    ``defer_range_check`` (the client's path): a one-feature caller that passes every
    other check is returned without its id range checked, its ids and lengths the
    KJT's own tensors; the window it joins checks them (:func:`out_of_range`).

    Raises :class:`InvalidArgument` naming the feature and the value for: unknown or
    repeated keys, weighted or variable-batch KJTs, lengths that are negative or do
    not add up to the values, non-integer ids, ids outside ``[0, rows)``.

    Example: keys ``["user_hist", "item"]`` both on table ``item`` with B = 2 become one
    :class:`TableInput` for ``item`` whose ``ids`` are user_hist's ids then item's ids
    and whose ``lengths`` are ``[len(user_hist[0]), len(user_hist[1]), len(item[0]), ...]``.
    """
    keys = tuple(features.keys())
    if len(keys) == 1:
        fast = _one_feature(features, keys, table_of_feature, None if defer_range_check else table_rows, pooled, deadline)
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
            raise out_of_range(key, table, rows, int(values[(values < 0) | (values >= rows)][0]))
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
            raise out_of_range(key, table, rows, int(ids[(ids < 0) | (ids >= rows)][0]))
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
