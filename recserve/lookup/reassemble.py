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
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from recserve.lookup.types import CallerLookup, LookupResult, TableInput
from recserve.lookup.window import TableWindow


def _tensor(array: np.ndarray) -> torch.Tensor:
    """Zero-copy torch view of a numpy array (read-only views from wire bytes are
    never written through, so torch's non-writable warning is noise here)."""
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

    def put_rows(self, positions: np.ndarray, rows: np.ndarray, col_start: int, col_end: int, found: np.ndarray, not_owned: np.ndarray) -> int:
        """Scatter a unit's rows [n, w]. Rows the shard does not own are not taken, nor
        (partial mode) rows a partial sum already carries. Returns how many were taken."""
        ok = ~not_owned
        if self.in_pooled is not None:
            ok &= ~self.in_pooled[positions]
            self.has_rows = True
        pos = positions[ok] if not ok.all() else positions
        if pos.size == 0:
            return 0
        vals = rows[ok] if pos.size != positions.size else rows
        if col_start == 0 and col_end == 0:
            self.rows[pos] = vals
            self.got[pos] = self.need[pos]  # idempotent: a hedge may deliver the row twice
        else:
            self.rows[pos, col_start:col_end] = vals
            self.got[pos] += 1  # slices are never sent twice (no replicas to hedge to)
        nf = found[ok] if pos.size != positions.size else found
        self.not_found[pos[~nf]] = True
        return int(pos.size)

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
    return F.embedding_bag(_tensor(inv), _tensor(rows), _tensor(offsets), mode=mode)


def resolve_callers(
    callers: Sequence[CallerLookup],
    group: Sequence[int],
    windows: dict[str, TableWindow],
    assemblies: dict[str, TableAssembly],
    pooling: dict[str, str],
) -> list[LookupResult]:
    """Results of ``callers[i]`` for i in ``group`` (window order indices), from what
    has arrived so far. One gather / embedding_bag per table for the whole group; the
    missing / not-found counts are array work too, skipped when nothing is missing."""
    from torchrec.sparse.jagged_tensor import KeyedTensor

    idx = np.asarray(group, dtype=np.int64)
    blocks: list[dict[str, torch.Tensor]] = [{} for _ in group]
    rows_out: list[dict[str, torch.Tensor]] = [{} for _ in group]
    lengths_out: list[dict[str, torch.Tensor]] = [{} for _ in group]
    missing = [dict.fromkeys(callers[c].keys, 0) for c in group]
    missing_bags: list[dict[str, np.ndarray]] = [{} for _ in group]
    not_found = [0] * len(group)
    any_missing = False
    # The whole window in window order (the usual group): pooling needs no index arithmetic.
    whole = idx.shape[0] == len(callers) and bool((idx == np.arange(len(callers))).all())

    for table, w in windows.items():
        asm = assemblies[table]
        members = [j for j, c in enumerate(group) if table in callers[c].tables]
        if not members:
            continue
        member_callers = [group[j] for j in members]
        parts = [callers[c].tables[table] for c in member_callers]
        complete = asm.complete()
        for flags, kind in ((~complete, "missing"), (asm.not_found, "not_found")):
            if not flags.any():
                continue  # the common case: nothing to count
            any_missing |= kind == "missing"
            occ_flags = np.take(flags, w.inverse)
            cum = np.concatenate(([0], np.cumsum(occ_flags)))
            counts = _per_feature(cum, w, member_callers, parts).tolist()
            per_bag = np.bincount(w.occurrence_bags()[occ_flags], minlength=w.bag_lengths.shape[0]) if kind == "missing" else None
            k = 0
            for j, (c, part) in zip(members, zip(member_callers, parts)):
                b = callers[c].batch_size
                for i, f in enumerate(part.features):
                    if kind == "missing":
                        missing[j][f] += counts[k]
                        if counts[k] and per_bag is not None:
                            lo = int(w.bag_offsets[c]) + i * b
                            missing_bags[j][f] = per_bag[lo : lo + b]
                    else:
                        not_found[j] += counts[k]
                    k += 1

        rows = asm.rows_for_use()
        pooled_members = [j for j, c in zip(members, member_callers) if callers[c].pooled]
        flat_members = [j for j, c in zip(members, member_callers) if not callers[c].pooled]
        if pooled_members:
            sel = None if whole and len(pooled_members) == len(group) else idx[pooled_members]
            bag_sel = None if sel is None else _segments(w.bag_offsets[sel], w.bag_offsets[sel + 1])
            if asm.pooled is not None:
                # A copy: later partials of this window must not change a resolved result.
                out = _tensor(asm.pooled.copy() if bag_sel is None else np.take(asm.pooled, bag_sel, axis=0))
                if asm.has_rows:  # rows that arrived as rows (warm slices, hedges)
                    out += _pool_rows(w, sel, bag_sel, rows, "sum")
                if pooling[table] == "mean":
                    lens = w.bag_lengths if bag_sel is None else np.take(w.bag_lengths, bag_sel)
                    out = out / _tensor(np.maximum(lens, 1).astype(np.float32))[:, None]
            else:
                out = _pool_rows(w, sel, bag_sel, rows, pooling[table])
            # One split into every (caller, feature) block [B, D]: views, one torch call.
            sizes: list[int] = []
            for j in pooled_members:
                caller = callers[group[j]]
                sizes += [caller.batch_size] * len(caller.tables[table].features)
            pieces = out.split(sizes) if len(sizes) > 1 else (out,)
            k = 0
            for j in pooled_members:
                block = blocks[j]
                for f in callers[group[j]].tables[table].features:
                    block[f] = pieces[k]
                    k += 1
        if flat_members:
            sel = idx[flat_members]
            occ_sel = _segments(w.id_offsets[sel], w.id_offsets[sel + 1])
            gathered = _tensor(np.take(rows, w.inverse[occ_sel], axis=0))
            start = 0
            for j in flat_members:
                caller = callers[group[j]]
                part, b = caller.tables[table], caller.batch_size
                for k, (f, n) in enumerate(zip(part.features, part.feature_counts.tolist())):
                    rows_out[j][f] = gathered[start : start + n]
                    lengths_out[j][f] = _tensor(part.lengths[k * b : (k + 1) * b].copy())
                    start += n

    results = []
    for j, c in enumerate(group):
        caller = callers[c]
        pooled_kt = None
        if caller.pooled:
            keys = caller.keys
            if len(keys) == 1:
                values = blocks[j][keys[0]]
                dims = [values.shape[1]]
            else:
                parts_kt = [blocks[j][f] for f in keys]
                values = torch.cat(parts_kt, dim=1) if parts_kt else torch.zeros(caller.batch_size, 0)
                dims = [p.shape[1] for p in parts_kt]
            # __new__ + __init__: the same object as KeyedTensor(...) without torch.fx's
            # proxy metaclass check, which costs more than the rest of a caller's result.
            pooled_kt = KeyedTensor.__new__(KeyedTensor)
            pooled_kt.__init__(keys=list(keys), length_per_key=dims, values=values)
        m = missing[j]
        results.append(LookupResult(pooled_kt, rows_out[j], lengths_out[j], sum(m.values()) if any_missing else 0, m, not_found[j], missing_bags[j]))
    return results
