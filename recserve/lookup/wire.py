"""Pack fetch units into ``LookupRequest`` s and decode ``LookupResponse`` s (pure).

One request per shard carries one ``TableLookup`` per unit (table, column slice); the
shard answers ``TableRows`` in the same order. Rows arrive as fp32, fp16 or fbgemm's
fused int8-rowwise layout (``D`` uint8 codes + fp32 scale + fp32 bias per row) and are
decoded to fp32 here, with numpy (int8 through :func:`recserve.rpc.tensors.dequantize_int8`,
fbgemm's documented affine formula, so the client needs no fbgemm import).

In shard-side partial pooling mode a full-row unit also carries its bags: for every
window bag, the positions (into the unit's own ids) of the bag's ids that this unit
fetches. The shard returns fp32 partial sums per bag, which the client adds up. A
column-slice unit (warm rows) carries *row bags* instead, one bag per id, so its "partial
sums" are its rows, exactly: a warm row counts only if every slice arrives, and a sum
could not drop a row whose other slice went missing (the client pools those rows itself).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from recserve.errors import InternalError
from recserve.lookup.route import FetchUnit
from recserve.lookup.window import TableWindow
from recserve.rpc.tensors import INT8_EXTRA_BYTES, dequantize_int8, pack, unpack
from recserve.v1 import common_pb2, embedding_pb2

ROW_DTYPE_ENUM = {"float32": common_pb2.FLOAT32, "float16": common_pb2.FLOAT16, "int8": common_pb2.INT8_ROWWISE}


@dataclasses.dataclass(slots=True)
class UnitReply:
    """A shard's answer for one unit. ``rows``: fp32 [n, w] (None in pooled mode);
    ``found`` / ``not_owned``: bool [n]; ``pooled``: fp32 [G, w] partial sums over the
    table window's G bags (None in row mode)."""

    rows: np.ndarray | None
    found: np.ndarray
    not_owned: np.ndarray
    pooled: np.ndarray | None


def unit_bags(window: TableWindow, occurrence_bags: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR bags of one unit: (bag_indices int64 [L_u], bag_offsets int64 [G + 1]).

    ``occurrence_bags``: int64 [N], the bag of every window occurrence
    (:meth:`TableWindow.occurrence_bags`). Occurrences whose unique row is not in
    ``positions`` are left out; order within a bag is kept.
    """
    local = np.full(window.unique, -1, dtype=np.int64)
    local[positions] = np.arange(positions.shape[0], dtype=np.int64)
    occ_local = np.take(local, window.inverse)
    mine = occ_local >= 0
    counts = np.bincount(occurrence_bags[mine], minlength=window.bag_lengths.shape[0])
    offsets = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return occ_local[mine], offsets


def build_request(
    units: list[FetchUnit],
    windows: dict[str, TableWindow],
    *,
    row_dtype: str,
    header: common_pb2.RequestHeader,
    plan_version: int,
    occurrence_bags: dict[str, np.ndarray] | None = None,
) -> embedding_pb2.LookupRequest:
    """One shard's request: a TableLookup per unit, in unit order. ``occurrence_bags``
    (table -> [N]) switches on shard-side partial pooling: full-row units carry the
    window's bags, column-slice units row bags (see the module docstring)."""
    lookups = []
    for u in units:
        w = windows[u.table]
        tl = embedding_pb2.TableLookup(
            table=u.table, ids=pack(np.take(w.unique_ids, u.positions)), col_start=u.col_start, col_end=u.col_end
        )
        if occurrence_bags is not None:
            if u.full_row:
                idx, off = unit_bags(w, occurrence_bags[u.table], u.positions)
            else:
                idx, off = np.arange(len(u), dtype=np.int64), np.arange(len(u) + 1, dtype=np.int64)
            tl.bag_indices.CopyFrom(pack(idx))
            tl.bag_offsets.CopyFrom(pack(off))
        lookups.append(tl)
    return embedding_pb2.LookupRequest(
        header=header,
        tables=lookups,
        row_dtype=ROW_DTYPE_ENUM[row_dtype],  # type: ignore[arg-type]
        pooled=occurrence_bags is not None,
        plan_version=plan_version,
    )


def decode_rows(tensor: common_pb2.Tensor, field: str, n: int, width: int, row_dtype: str) -> np.ndarray:
    """Rows on the wire -> fp32 [n, width] (fp16 widened, int8 rowwise dequantised)."""
    if row_dtype == "int8":
        fused = unpack(tensor, field, expect_dtype=common_pb2.INT8_ROWWISE, expect_ndim=2)
        _check_shape(fused.shape, (n, width + INT8_EXTRA_BYTES), field)
        return dequantize_int8(fused)
    rows = unpack(tensor, field, expect_dtype=ROW_DTYPE_ENUM[row_dtype], expect_ndim=2)
    _check_shape(rows.shape, (n, width), field)
    return rows if row_dtype == "float32" else rows.astype(np.float32)


def _check_shape(got: tuple[int, ...], want: tuple[int, int], field: str) -> None:
    if tuple(got) != want:
        raise InternalError(f"{field}: shard answered shape {list(got)}, expected {list(want)}")


def parse_response(
    response: embedding_pb2.LookupResponse,
    units: list[FetchUnit],
    dims: dict[str, int],
    *,
    row_dtype: str,
    pooled: bool,
    num_bags: dict[str, int] | None = None,
) -> list[UnitReply]:
    """Match ``response.tables`` to ``units`` (same order) and decode each. With
    ``pooled`` (a partial-pooling request), full-row units reply partial sums over the
    table window's bags and column-slice units their rows (row bags).

    Raises InternalError when the reply does not fit the request (count, table, slice
    or shape mismatch): the caller treats that shard call as failed, not retryable.
    """
    if len(response.tables) != len(units):
        raise InternalError(f"shard answered {len(response.tables)} tables for {len(units)} lookups")
    out = []
    for i, (tr, u) in enumerate(zip(response.tables, units)):
        if tr.table != u.table:
            raise InternalError(f"reply table {i} is {tr.table!r}, expected {u.table!r}")
        n = len(u)
        width = dims[u.table] if u.full_row else u.col_end - u.col_start
        field = f"reply.tables[{i}]"
        found = unpack(tr.found, f"{field}.found", expect_dtype=common_pb2.UINT8, expect_ndim=1)
        not_owned = unpack(tr.not_owned, f"{field}.not_owned", expect_dtype=common_pb2.UINT8, expect_ndim=1)
        if found.shape[0] != n or not_owned.shape[0] != n:
            raise InternalError(f"{field}: found/not_owned hold {found.shape[0]}/{not_owned.shape[0]} entries for {n} ids")
        if pooled:
            assert num_bags is not None
            part = unpack(tr.pooled, f"{field}.pooled", expect_dtype=common_pb2.FLOAT32, expect_ndim=2)
            _check_shape(part.shape, (num_bags[u.table] if u.full_row else n, width), f"{field}.pooled")
            if u.full_row:
                out.append(UnitReply(None, found.astype(bool), not_owned.astype(bool), part))
            else:  # row bags: one bag per id, so the sums are the rows
                out.append(UnitReply(part, found.astype(bool), not_owned.astype(bool), None))
        else:
            rows = decode_rows(tr.rows, f"{field}.rows", n, width, row_dtype)
            out.append(UnitReply(rows, found.astype(bool), not_owned.astype(bool), None))
    return out
