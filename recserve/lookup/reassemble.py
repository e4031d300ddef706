"""Scatter shard replies into per-table unique-row matrices, then build each caller's
result (pure).

Per table a window keeps one fp32 matrix ``rows`` [U, D] over its unique ids, zero
(the default row) until a reply fills it. Replies are scattered in with
``rows[positions] = reply`` (a scatter into the small window matrix, not a gather from a
table). A row counts as arrived when every piece it needs is in: 1 for a full row, C
for a warm row cut into C column slices; rows that never complete stay default and are
counted as ``missing``.

Callers are resolved in groups (everyone whose rows are settled, or whose deadline has
come): unpooled rows with one ``np.take`` per table over the group's occurrences;
pooled bags with one ``torch.nn.functional.embedding_bag`` per table over the unique
rows with the group's indices and offsets — the same kernel, over the same rows in the
same order, as TorchRec's ``EmbeddingBagCollection``, so fp32 sums match it exactly.
With shard-side partial pooling the shards' partial sums are added instead, plus the
pooled rows that arrived as rows (warm column slices, hedges; see :class:`TableAssembly`).
Each caller's result is a view of the group's output, cut with one ``Tensor.split``
per table: per one-feature caller only a few Python objects are made, no tensor op.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.nn.functional as F

from recserve.lookup.types import CallerLookup, LookupResult, TableInput
from recserve.lookup.window import TableWindow

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedTensor

# Whole-array any / all of 1-D arrays as one C call each (``ndarray.any()`` runs
# several Python frames in numpy 2; a window makes dozens of these checks).
_any = np.logical_or.reduce
_all = np.logical_and.reduce
# embedding_bag's mode argument as its ATen enum: the op F.embedding_bag ends in, called
# directly (its Python argument checks cost more than the kernel on a window's bags).
_BAG_MODE = {"sum": 0, "mean": 1}


def _tensor(array: np.ndarray) -> torch.Tensor:
    """Zero-copy torch view of a numpy array (read-only views from wire bytes are
    never written through, so torch's non-writable warning is noise here). Only those
    pay for silencing it: ``catch_warnings`` costs 3-4 times the view itself."""
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


class TableAssembly:
    """The arrival state of one table of one window.

    ``rows``: fp32 [U, D]; ``got`` / ``need``: int16 [U] pieces arrived / required;
    ``not_found``: bool [U] rows a shard answered with its default row (not stored).

    In partial-pooling mode ``pooled`` is fp32 [G, D], the running sum of the primary
    full-row replies' partial sums over the window's G bags, and ``in_pooled`` bool [U]
    marks the rows those sums carry. Every other row arrives as a row into ``rows``:
    warm column slices (so a half-arrived warm row is left out of every column, as in
    unpooled mode) and hedges. A row is counted once: a partial sum always wins over the
    same row delivered by a hedge (whichever comes first), so no row is dropped with a
    reply and none is pooled twice. A caller's bags are ``pooled`` plus its pooled rows.
    """

    def __init__(self, window: TableWindow, dim: int, need: np.ndarray, *, partial: bool = False) -> None:
        self.window = window
        self.dim = dim
        self.need = need.astype(np.int16, copy=False)
        self.got = np.zeros(window.unique, dtype=np.int16)
        self.rows = np.zeros((window.unique, dim), dtype=np.float32)
        self.not_found = np.zeros(window.unique, dtype=bool)
        self.pooled = np.zeros((window.bag_lengths.shape[0], dim), dtype=np.float32) if partial else None
        self.in_pooled = np.zeros(window.unique, dtype=bool) if partial else None
        self.has_rows = False  # partial mode: some row arrived as a row (pool ``rows`` too)
        self.sliced = False  # some column slice arrived (only then can a row be half-arrived)

    def put_rows(self, positions: np.ndarray, rows: np.ndarray, col_start: int, col_end: int, found: np.ndarray, not_owned: np.ndarray) -> int:
        """Scatter a unit's rows [n, w]. Rows the shard does not own are not taken, nor
        (partial mode) rows a partial sum already carries. Returns how many were taken."""
        if self.in_pooled is not None:
            ok = ~not_owned & ~self.in_pooled[positions]
            self.has_rows = True
        elif _any(not_owned):
            ok = ~not_owned
        else:  # the common reply: every row owned, nothing to filter
            ok = None
        if ok is None or _all(ok):
            pos, vals, nf = positions, rows, found
        else:
            pos, vals, nf = positions[ok], rows[ok], found[ok]
        if pos.shape[0] == 0:
            return 0
        if col_start == 0 and col_end == 0:
            self.rows[pos] = vals
            self.got[pos] = self.need.take(pos)  # idempotent: a hedge may deliver the row twice
        else:
            self.rows[pos, col_start:col_end] = vals
            self.sliced = True
            self.got[pos] += 1  # slices are never sent twice (no replicas to hedge to)
        if not _all(nf):
            self.not_found[pos[~nf]] = True
        return int(pos.shape[0])

    def put_cached(self, positions: np.ndarray, rows: np.ndarray) -> None:
        """Rows [n, D] served from the near cache (none: a table the cache does not
        hold, whose empty rows carry no width)."""
        if positions.size == 0:
            return
        self.rows[positions] = rows
        self.got[positions] = self.need[positions]

    def put_partial(self, positions: np.ndarray, partial: np.ndarray, found: np.ndarray, not_owned: np.ndarray) -> bool:
        """Add a primary full-row unit's partial sums [G, D] (rows it does not own
        contribute zeros). Rows a hedge already delivered as rows are dropped from
        ``rows``: the sum carries them now. Returns whether the reply was taken — always,
        since primary units are disjoint and hedges travel as rows; a reply overlapping a
        taken sum would double-count, so it is refused."""
        assert self.pooled is not None and self.in_pooled is not None
        owned = positions[~not_owned] if not_owned.any() else positions
        if bool(self.in_pooled[owned].any()):
            return False
        self.pooled += partial
        self.in_pooled[owned] = True
        self.got[owned] = self.need[owned]
        if self.has_rows:
            self.rows[owned] = 0.0
        self.not_found[positions[~found & ~not_owned]] = True
        return True

    def complete(self) -> np.ndarray:
        """bool [U]: every piece of the row arrived."""
        return self.got >= self.need

    def rows_for_use(self) -> np.ndarray:
        """``rows`` with half-arrived warm rows reset to the default row (a row counts
        only if every slice arrived). Copies only when such rows exist."""
        if not self.sliced:  # full rows only: got is 0 or need, never in between
            return self.rows
        partial = (self.got > 0) & (self.got < self.need)
        if not partial.any():
            return self.rows
        out = self.rows.copy()
        out[partial] = 0.0
        return out


def _segments(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenated index ranges [starts[i], ends[i]) as one int64 array (no loop)."""
    lengths = ends - starts
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return np.arange(total, dtype=np.int64) + offsets


def _per_feature(cum: np.ndarray, w: TableWindow, callers: Sequence[int], parts: Sequence[TableInput]) -> np.ndarray:
    """Counts per (caller, feature) of a flag over occurrences, from its cumulative sum
    ``cum`` [N + 1]: int64 [sum of F over ``parts``], callers' features in order."""
    fc = np.concatenate([p.feature_counts for p in parts])
    nf = np.array([len(p.features) for p in parts], dtype=np.int64)
    ex = np.cumsum(fc) - fc  # exclusive cumsum over all features
    first = np.cumsum(nf) - nf  # index of each caller's first feature
    start = np.repeat(w.id_offsets[np.asarray(callers, dtype=np.int64)] - ex[first], nf) + ex
    return np.asarray(cum[start + fc] - cum[start])


def _pool_rows(w: TableWindow, sel: np.ndarray | None, bag_sel: np.ndarray | None, rows: np.ndarray, mode: str) -> torch.Tensor:
    """Bags [len(bag_sel), D] of the callers ``sel`` pooled over the unique ``rows``
    [U, D]: one embedding_bag, the kernel and order of TorchRec's EmbeddingBagCollection.
    ``sel`` / ``bag_sel`` None: every caller and bag of the window (the common case,
    with no index arithmetic)."""
    if sel is None or bag_sel is None:
        inv, offsets = w.inverse, w.bag_starts()
    else:
        # Always indexed: a selection of every caller in another order is not the window.
        inv = w.inverse[_segments(w.id_offsets[sel], w.id_offsets[sel + 1])]
        lens = w.bag_lengths[bag_sel]
        offsets = np.zeros(lens.shape[0], dtype=np.int64)
        np.cumsum(lens[:-1], out=offsets[1:])
    mode_enum = _BAG_MODE.get(mode)
    if mode_enum is None:  # not a mode the client pools with: F's own checks and message
        return F.embedding_bag(_tensor(inv), _tensor(rows), _tensor(offsets), mode=mode)
    # What F.embedding_bag(inv, rows, offsets, mode=mode) returns, for 1-D indices with
    # offsets and no per-sample weights / max_norm: the same ATen op and arguments.
    return torch.embedding_bag(_tensor(rows), _tensor(inv), _tensor(offsets), False, mode_enum, False, None, False, None)[0]


def _pooled_bags(w: TableWindow, asm: TableAssembly, sel: np.ndarray | None, rows: np.ndarray, mode: str) -> torch.Tensor:
    """fp32 [sum of the callers' bags, D]: the bags of callers ``sel`` (window order
    indices; None = the whole window in window order), callers concatenated in ``sel``
    order, each caller's bags feature-major as in its KJT."""
    bag_sel = None if sel is None else _segments(w.bag_offsets[sel], w.bag_offsets[sel + 1])
    if asm.pooled is None:
        return _pool_rows(w, sel, bag_sel, rows, mode)
    # A copy: later partials of this window must not change a resolved result.
    out = _tensor(asm.pooled.copy() if bag_sel is None else np.take(asm.pooled, bag_sel, axis=0))
    if asm.has_rows:  # rows that arrived as rows (warm slices, hedges)
        out += _pool_rows(w, sel, bag_sel, rows, "sum")
    if mode == "mean":
        lens = w.bag_lengths if bag_sel is None else np.take(w.bag_lengths, bag_sel)
        out = out / _tensor(np.maximum(lens, 1).astype(np.float32))[:, None]
    return out


class _Counts:
    """The group's missing / not-found tallies, built only when some row is missing or
    not found (the common window has neither): per group position j, ``missing[j]``
    feature -> count, ``missing_bags[j]`` feature -> int64 [B], ``not_found[j]``."""

    def __init__(self, callers: Sequence[CallerLookup], group: Sequence[int]) -> None:
        self.missing = [dict.fromkeys(callers[c].keys, 0) for c in group]
        self.missing_bags: list[dict[str, np.ndarray]] = [{} for _ in group]
        self.not_found = [0] * len(group)
        self.any_missing = False

    def add(self, flags: np.ndarray, kind: str, w: TableWindow, callers: Sequence[CallerLookup], group: Sequence[int]) -> None:
        """Count flag ``flags`` bool [U] (``missing`` or ``not_found``) over the
        occurrences of the group's callers of table ``w``."""
        members = [j for j, c in enumerate(group) if w.table in callers[c].tables]
        if not members:
            return
        member_callers = [group[j] for j in members]
        parts = [callers[c].tables[w.table] for c in member_callers]
        self.any_missing |= kind == "missing"
        occ_flags = np.take(flags, w.inverse)
        cum = np.concatenate(([0], np.cumsum(occ_flags)))
        counts = _per_feature(cum, w, member_callers, parts).tolist()
        per_bag = np.bincount(w.occurrence_bags()[occ_flags], minlength=w.bag_lengths.shape[0]) if kind == "missing" else None
        k = 0
        for j, c, part in zip(members, member_callers, parts):
            b = callers[c].batch_size
            for i, f in enumerate(part.features):
                if per_bag is not None:
                    self.missing[j][f] += counts[k]
                    if counts[k]:
                        lo = int(w.bag_offsets[c]) + i * b
                        self.missing_bags[j][f] = per_bag[lo : lo + b]
                else:
                    self.not_found[j] += counts[k]
                k += 1


_KEYED_TENSOR: "type[KeyedTensor] | None" = None  # imported on first use (torchrec is slow to import)


def _keyed_tensor_type() -> "type[KeyedTensor]":
    global _KEYED_TENSOR
    if _KEYED_TENSOR is None:
        from torchrec.sparse.jagged_tensor import KeyedTensor

        _KEYED_TENSOR = KeyedTensor
    return _KEYED_TENSOR


def _pooled_values(caller: CallerLookup, pieces: dict[str, Sequence[torch.Tensor | None]], j: int) -> tuple[torch.Tensor, list[int]]:
    """(values [B, sum of D_f], D_f per key) of a pooled caller with several features:
    its per-table pieces [F * B, D] cut into [B, D] blocks (views) and concatenated in
    key order, as a KeyedTensor lays them out (one copy)."""
    b = caller.batch_size
    blocks: dict[str, torch.Tensor] = {}
    for table, part in caller.tables.items():
        chunk = pieces[table][j]
        assert chunk is not None
        if len(part.features) == 1:
            blocks[part.features[0]] = chunk
        else:
            for i, f in enumerate(part.features):
                blocks[f] = chunk[i * b : (i + 1) * b]
    parts = [blocks[f] for f in caller.keys]
    if not parts:
        return torch.zeros(b, 0), []
    return (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]), [p.shape[1] for p in parts]


def _flat_rows(caller: CallerLookup, flat: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]], j: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(rows, lengths) of an unpooled caller: per feature its rows [L_f, D] and its
    lengths [B], views of its per-table pieces ``flat[table][j]`` ([L, D] rows, [F * B]
    lengths, features in order)."""
    b = caller.batch_size
    rows_out: dict[str, torch.Tensor] = {}
    lengths_out: dict[str, torch.Tensor] = {}
    for table, part in caller.tables.items():
        piece = flat[table][j]
        assert piece is not None
        rows_t, lengths_t = piece
        if len(part.features) == 1:
            rows_out[part.features[0]] = rows_t
            lengths_out[part.features[0]] = lengths_t
            continue
        start = 0
        for k, (f, m) in enumerate(zip(part.features, part.feature_counts.tolist())):
            rows_out[f] = rows_t[start : start + m]
            lengths_out[f] = lengths_t[k * b : (k + 1) * b]
            start += m
    return rows_out, lengths_out


def _single_feature_results(callers: Sequence[CallerLookup], group: Sequence[int], pieces: Sequence[torch.Tensor]) -> list[LookupResult]:
    """The results of ``group``, one-feature pooled callers of a single-table window
    with nothing missing or not found (the common window): caller ``group[j]``'s
    values are ``pieces[j]`` [B, D] as they are. The general loop's results, without
    its per-caller branches (for a one-key caller ``dict.fromkeys(keys, 0)`` is
    ``{key: 0}``)."""
    keyed_tensor = _keyed_tensor_type()
    new, init_kt = object.__new__, keyed_tensor.__init__
    results: list[LookupResult] = []
    append = results.append
    for c, values in zip(group, pieces):
        keys = callers[c].keys
        kt = new(keyed_tensor)  # __new__ + __init__: see resolve_callers
        init_kt(kt, list(keys), [values.shape[1]], values)
        append(LookupResult(kt, {}, {}, 0, {keys[0]: 0}, 0, {}))
    return results


def resolve_callers(
    callers: Sequence[CallerLookup],
    group: Sequence[int],
    windows: dict[str, TableWindow],
    assemblies: dict[str, TableAssembly],
    pooling: dict[str, str],
) -> list[LookupResult]:
    """Results of ``callers[i]`` for i in ``group`` (window order indices), from what
    has arrived so far.

    Array work per table for the whole group: one embedding_bag over the pooled
    callers' bags, split into one [F * B, D] view per caller with a single
    ``Tensor.split``; one gather over the unpooled callers' occurrences and one copy of
    their lengths, each split likewise; the missing / not-found counts, skipped when
    nothing is missing. What is left per caller is a few attribute sets and the result
    objects (no tensor op unless it has several features: their blocks are cut from its
    view, and a pooled caller's concatenated as a KeyedTensor requires). The common
    window (one table, one-feature pooled callers, nothing missing) takes
    :func:`_single_feature_results`, the same results with fewer steps per caller.

    Measured on the bench window (64 pooled callers x 64 ids, U = 1,875, D = 64), in
    isolation: ≈ 145 µs, of which the embedding_bag ≈ 25 and the split ≈ 28; inside
    the closed loop the first torch calls of each window cost several times more (cold
    code after the rest of the window's work), which no per-caller saving touches.
    """
    n = len(group)
    whole = n == len(callers) and list(group) == list(range(n))
    idx = None if whole else np.asarray(group, dtype=np.int64)
    pooled_js = [j for j, c in enumerate(group) if callers[c].pooled]
    all_pooled = len(pooled_js) == n
    flat_js = [] if all_pooled else [j for j, c in enumerate(group) if not callers[c].pooled]
    # Window order indices of the pooled callers (None: the whole window, in order).
    pooled_sel = None if whole and all_pooled else (idx if all_pooled else np.asarray([group[j] for j in pooled_js], dtype=np.int64))
    counts: _Counts | None = None
    # table -> per group position j: the caller's bags [F * B, D] / (rows, first row).
    pieces: dict[str, Sequence[torch.Tensor | None]] = {}
    flat: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}

    for table, w in windows.items():
        asm = assemblies[table]
        complete = asm.got >= asm.need
        if not _all(complete):
            counts = counts or _Counts(callers, group)
            counts.add(~complete, "missing", w, callers, group)
        if _any(asm.not_found):
            counts = counts or _Counts(callers, group)
            counts.add(asm.not_found, "not_found", w, callers, group)
        rows = asm.rows_for_use()
        if pooled_js:
            out = _pooled_bags(w, asm, pooled_sel, rows, pooling[table])
            if pooled_sel is None:
                bags = w.bag_offsets[1:] - w.bag_offsets[:-1]
            else:
                bags = w.bag_offsets[pooled_sel + 1] - w.bag_offsets[pooled_sel]
            # split_with_sizes: Tensor.split's op for a list of sizes, without its wrapper.
            split = out.split_with_sizes(bags.tolist()) if len(pooled_js) > 1 else (out,)
            if all_pooled:
                pieces[table] = split
            else:
                by_j: list[torch.Tensor | None] = [None] * n
                for j, piece in zip(pooled_js, split):
                    by_j[j] = piece
                pieces[table] = by_j
        if flat_js:
            # One gather of the flat callers' rows and one copy of their lengths (the
            # window's bag_lengths are the callers' KJT lengths, concatenated), each split
            # into one view per caller: no per-caller copy or numpy -> torch call.
            sel = np.asarray([group[j] for j in flat_js], dtype=np.int64)
            occ_sel = _segments(w.id_offsets[sel], w.id_offsets[sel + 1])
            gathered = _tensor(np.take(rows, w.inverse[occ_sel], axis=0))
            lengths_t = _tensor(w.bag_lengths[_segments(w.bag_offsets[sel], w.bag_offsets[sel + 1])])
            occ = (w.id_offsets[sel + 1] - w.id_offsets[sel]).tolist()
            bags = (w.bag_offsets[sel + 1] - w.bag_offsets[sel]).tolist()
            by_caller: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n
            for j, r, ln in zip(flat_js, gathered.split(occ), lengths_t.split(bags)):
                by_caller[j] = (r, ln)
            flat[table] = by_caller

    # A single-table window: every pooled caller's bags are the one table's piece.
    single = next(iter(pieces.values())) if len(windows) == 1 and pieces else None
    if counts is None and single is not None and all_pooled and all([len(callers[c].keys) == 1 for c in group]):
        return _single_feature_results(callers, group, cast("Sequence[torch.Tensor]", single))
    return _caller_results(callers, group, pieces, flat, counts, single)


def _caller_results(
    callers: Sequence[CallerLookup],
    group: Sequence[int],
    pieces: dict[str, Sequence[torch.Tensor | None]],
    flat: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]],
    counts: _Counts | None,
    single: Sequence[torch.Tensor | None] | None,
) -> list[LookupResult]:
    """:func:`resolve_callers`' results of any group, from its per-table ``pieces``
    (pooled callers) and ``flat`` (unpooled callers), indexed by group position;
    ``single``: the one table's pieces of a single-table window, else None."""
    keyed_tensor = _keyed_tensor_type()
    init_kt = keyed_tensor.__init__
    results: list[LookupResult] = []
    append = results.append
    for j, c in enumerate(group):
        caller = callers[c]
        keys = caller.keys
        if caller.pooled:
            tables = caller.tables
            if len(keys) == 1 and len(tables) == 1:  # the common caller: its bags are its values
                values = single[j] if single is not None else pieces[next(iter(tables))][j]
                assert values is not None
                dims = [values.shape[1]]
            else:
                values, dims = _pooled_values(caller, pieces, j)
            # __new__ + __init__: the same object as KeyedTensor(...) without torch.fx's
            # proxy metaclass check, which costs more than the rest of a caller's result
            # (KeyedTensor.__new__ is object.__new__).
            kt = object.__new__(keyed_tensor)
            init_kt(kt, list(keys), dims, values)
            rows_out: dict[str, torch.Tensor] = {}
            lengths_out: dict[str, torch.Tensor] = {}
        else:
            kt = None
            rows_out, lengths_out = _flat_rows(caller, flat, j)
        if counts is None:
            append(LookupResult(kt, rows_out, lengths_out, 0, dict.fromkeys(keys, 0), 0, {}))
        else:
            m_j = counts.missing[j]
            append(LookupResult(kt, rows_out, lengths_out, sum(m_j.values()) if counts.any_missing else 0, m_j, counts.not_found[j], counts.missing_bags[j]))
    return results
