"""Merge the callers of one window and deduplicate their ids per table (pure).

Every caller of a window contributes, per table, a run of ids and a run of bags. The
runs are concatenated in window order and deduplicated with one
:func:`dedup` per table (a bitmap for catalog-sized tables, else ``np.unique``), so a row wanted by several features
and several callers is fetched once. ``inverse`` maps every occurrence back to its
unique row; reassembly gathers / pools through it.

With ``table_rows`` given, the merge also checks every id's range, one reduction per
table: a caller whose id is outside ``[0, rows)`` (its check deferred by the client,
``validate_features(defer_range_check=True)``) raises :class:`OutOfRange` naming those
callers, before any id indexes anything.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from itertools import chain

import numpy as np
import torch

from recserve.errors import InvalidArgument
from recserve.lookup.types import CallerLookup, TableInput
from recserve.lookup.validate import out_of_range

_EMPTY = np.zeros(0, dtype=np.int64)
_ZERO = (0,)


class OutOfRange(Exception):
    """Callers of a window with an id out of their table's range: ``errors`` maps the
    caller's window index to its InvalidArgument (the first bad id of its first bad
    feature). The rest of the window is sound; merge it again without them."""

    def __init__(self, errors: dict[int, InvalidArgument]) -> None:
        super().__init__(f"{len(errors)} caller(s) with ids out of range")
        self.errors = errors


def _concat(parts: "list[np.ndarray | torch.Tensor]") -> np.ndarray:
    """int64 [sum of lengths]: ``parts`` (numpy arrays or dense CPU int64 tensors)
    concatenated. All tensors (the client's callers): one ``torch.cat``, ~6x cheaper
    than a ``.numpy()`` per part."""
    if len(parts) == 1:
        only = parts[0]
        return only.numpy() if isinstance(only, torch.Tensor) else only
    try:
        return torch.cat(parts).numpy()  # type: ignore[arg-type]
    except TypeError:  # some parts are numpy arrays
        return np.concatenate([p.numpy() if isinstance(p, torch.Tensor) else p for p in parts])


def _range_errors(table: str, rows: int, ids: np.ndarray, id_offsets: np.ndarray, parts: "list[TableInput | None]") -> dict[int, InvalidArgument]:
    """The callers (window index -> error) with an id of ``table`` outside ``[0, rows)``:
    ``ids`` int64 [N] is the window's merged ids, caller c's at
    ``id_offsets[c]:id_offsets[c + 1]``. Runs only when a window has such an id."""
    bad = np.flatnonzero(ids.view(np.uint64) >= rows)
    owners = np.searchsorted(id_offsets, bad, side="right") - 1
    errors: dict[int, InvalidArgument] = {}
    for c, first in zip(*np.unique(owners, return_index=True)):  # one pass per bad caller
        part = parts[int(c)]
        assert part is not None
        at = int(bad[first] - id_offsets[c])  # its first bad id, within its ids of this table
        feature = part.features[int(np.searchsorted(np.cumsum(part.feature_counts), at, side="right"))]
        errors[int(c)] = out_of_range(feature, table, rows, int(ids[bad[first]]))
    return errors


@dataclasses.dataclass(slots=True)
class TableWindow:
    """One table's merged, deduplicated ids of a window.

    ``unique_ids``: int64 [U] sorted. ``inverse``: int64 [N], the position in
    ``unique_ids`` of every occurrence, callers concatenated in window order.
    ``id_offsets``: int64 [C + 1], caller c's occurrences are
    ``inverse[id_offsets[c]:id_offsets[c + 1]]`` (empty for callers without this table).
    ``bag_lengths``: int64 [G], every caller's bags for this table (feature-major within
    a caller, as in its KJT). ``bag_offsets``: int64 [C + 1], caller c's bags are
    ``bag_lengths[bag_offsets[c]:bag_offsets[c + 1]]``.
    """

    table: str
    unique_ids: np.ndarray
    inverse: np.ndarray
    id_offsets: np.ndarray
    bag_lengths: np.ndarray
    bag_offsets: np.ndarray
    _bag_starts: np.ndarray | None = dataclasses.field(default=None, init=False, repr=False)

    def bag_starts(self) -> np.ndarray:
        """int64 [G]: where each bag's occurrences start (exclusive cumsum of
        ``bag_lengths``; the offsets embedding_bag takes for the whole window)."""
        if self._bag_starts is None:
            starts = np.zeros(self.bag_lengths.shape[0], dtype=np.int64)
            np.cumsum(self.bag_lengths[:-1], out=starts[1:])
            self._bag_starts = starts
        return self._bag_starts

    @property
    def occurrences(self) -> int:
        return int(self.inverse.shape[0])

    @property
    def unique(self) -> int:
        return int(self.unique_ids.shape[0])

    def occurrence_bags(self) -> np.ndarray:
        """int64 [N]: the window-wide bag index of every occurrence (bags in order)."""
        return np.repeat(np.arange(self.bag_lengths.shape[0], dtype=np.int64), self.bag_lengths)


# Dense dedup needs a per-thread scratch of 5 bytes per table row: tables up to this
# size. A window with at least one id per this many rows is deduplicated through a
# bitmap (one scan of it costs less than the alternative's sort), a smaller one without
# touching the table-sized parts it does not need.
DENSE_MAX_ROWS = 1 << 24
DENSE_ROWS_PER_ID = 256


class _Scratch(threading.local):
    """Per-thread scratch of :func:`dedup` (windows prepare on the event loop and, when
    big, on the executor at the same time): table rows -> (seen bool [rows], slot int32 [rows])."""

    def __init__(self) -> None:
        self.by_rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}


_SCRATCH = _Scratch()


def dedup(ids: np.ndarray, rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(unique_ids int64 [U] sorted, inverse int64 [N]) of ``ids`` int64 [N] in ``[0, rows)``.

    With ``rows`` known (a catalog table), through a reused per-thread scratch; else
    (``rows`` None or huge) ``np.unique``. All give identical results.

    - At least one id per ``DENSE_ROWS_PER_ID`` rows: mark ids in a bitmap and read them
      back with one ``flatnonzero``, O(N + rows / 8) with no sort; ≈ 4× faster than
      ``np.unique`` for a 4,096-id window over 200k rows.
    - Fewer ids: write every occurrence's index into a per-row slot and keep the
      occurrence whose index survived, one per id, then sort only the U unique ids
      (no pass over the table); ≈ 1.5× faster than ``np.unique`` for 64 ids.
    """
    n = ids.shape[0]
    if rows is None or n == 0 or rows > DENSE_MAX_ROWS:
        unique_ids, inverse = np.unique(ids, return_inverse=True)
        return unique_ids.astype(np.int64, copy=False), inverse.reshape(-1).astype(np.int64, copy=False)
    scratch = _SCRATCH.by_rows.get(rows)
    if scratch is None:
        scratch = _SCRATCH.by_rows[rows] = (np.zeros(rows, dtype=bool), np.zeros(rows, dtype=np.int32))
    seen, slot = scratch
    if rows <= DENSE_ROWS_PER_ID * n:
        seen[ids] = True
        unique_ids = np.flatnonzero(seen)
        seen[unique_ids] = False  # clean for the next window: touch only what was set
        slot[unique_ids] = np.arange(unique_ids.shape[0], dtype=np.int32)
    else:
        order = np.arange(n, dtype=np.int32)
        slot[ids] = order  # whichever occurrence of an id is written last, exactly one survives
        unique_ids = np.sort(ids[np.take(slot, ids) == order])
        slot[unique_ids] = order[: unique_ids.shape[0]]
    return unique_ids.astype(np.int64, copy=False), np.take(slot, ids).astype(np.int64)


def merge_window(callers: Sequence[CallerLookup], table_rows: Mapping[str, int] | None = None) -> dict[str, TableWindow]:
    """Merge ``callers`` per table and deduplicate: one :func:`dedup` per table
    (``table_rows``, when given, lets it use the dense bitmap, and checks every id's
    range first: :class:`OutOfRange` names the callers with an id outside it).

    Example: caller 0 asks table ``t`` for ids [5, 3, 5], caller 1 for [3, 9] ->
    ``unique_ids`` [3, 5, 9], ``inverse`` [1, 0, 1, 0, 2], ``id_offsets`` [0, 3, 5].
    """
    n = len(callers)
    tables = dict.fromkeys(name for caller in callers for name in caller.tables)  # first-seen order
    out: dict[str, TableWindow] = {}
    errors: dict[int, InvalidArgument] = {}
    for name in tables:
        parts = [caller.tables.get(name) for caller in callers]
        present = [p for p in parts if p is not None]
        ids = _concat([p.ids for p in present]) if present else _EMPTY
        lengths = _concat([p.lengths for p in present]) if present else _EMPTY
        # Per-caller offsets: one fromiter and one cumsum each (0 for callers without
        # this table). In a one-table window a caller's ids and bags are all in it, and
        # ints on the caller are cheaper to read than a tensor's shape.
        if len(tables) == 1:
            id_gen = (c.n_ids for c in callers)
            bag_gen = (len(c.keys) * c.batch_size for c in callers)
        else:
            id_gen = (0 if p is None else p.ids.shape[0] for p in parts)
            bag_gen = (0 if p is None else p.lengths.shape[0] for p in parts)
        id_offsets = np.cumsum(np.fromiter(chain(_ZERO, id_gen), dtype=np.int64, count=n + 1))
        bag_offsets = np.cumsum(np.fromiter(chain(_ZERO, bag_gen), dtype=np.int64, count=n + 1))
        rows = None if table_rows is None else table_rows.get(name)
        # Viewed as unsigned, a negative id is huge: one max() checks both ends of [0, rows).
        if rows is not None and ids.shape[0] and int(ids.view(np.uint64).max()) >= rows:
            errors.update((c, e) for c, e in _range_errors(name, rows, ids, id_offsets, parts).items() if c not in errors)
            continue
        unique_ids, inverse = dedup(ids, rows)
        out[name] = TableWindow(
            table=name,
            unique_ids=unique_ids,
            inverse=inverse,
            id_offsets=id_offsets,
            bag_lengths=lengths.astype(np.int64, copy=False),
            bag_offsets=bag_offsets,
        )
    if errors:
        raise OutOfRange(errors)
    return out


def dedup_ratio(windows: dict[str, TableWindow]) -> float:
    """Ids requested / unique ids fetched, over all tables (1.0 for an empty window)."""
    requested = sum(w.occurrences for w in windows.values())
    unique = sum(w.unique for w in windows.values())
    return requested / unique if unique else 1.0
