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

from recserve.errors import InternalError, InvalidArgument
from recserve.lookup.route import FetchUnit
from recserve.lookup.window import TableWindow
from recserve.rpc.tensors import INT8_EXTRA_BYTES, NP_DTYPE_OF, dequantize_int8, pack_into, unpack
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
    window's bags, column-slice units row bags (see the module docstring).

    Built in place (``tables.add`` and :func:`pack_into` the final message's fields):
    constructing sub-messages first would copy every id array again into the request.
    """
    request = embedding_pb2.LookupRequest(
        row_dtype=ROW_DTYPE_ENUM[row_dtype],  # type: ignore[arg-type]
        pooled=occurrence_bags is not None,
        plan_version=plan_version,
    )
    request.header.CopyFrom(header)
    add = request.tables.add
    for u in units:
        w = windows[u.table]
        tl = add(table=u.table, col_start=u.col_start, col_end=u.col_end)
        pack_into(tl.ids, w.unique_ids.take(u.positions))
        if occurrence_bags is not None:
            if u.full_row:
                idx, off = unit_bags(w, occurrence_bags[u.table], u.positions)
            else:
                idx, off = np.arange(len(u), dtype=np.int64), np.arange(len(u) + 1, dtype=np.int64)
            pack_into(tl.bag_indices, idx)
            pack_into(tl.bag_offsets, off)
    return request


def _reply_array(tensor: common_pb2.Tensor, field: str, dtype: int, shape: list[int]) -> np.ndarray:
    """A reply tensor that must be exactly ``dtype`` and ``shape`` ([n] or [n, w]),
    decoded as a read-only view over its bytes.

    The well-formed reply (every reply of a healthy shard) is checked with one
    comparison each for dtype, shape and byte count, without the rank, sign and
    overflow checks :func:`unpack` pays on every tensor (an exact expected shape makes
    them moot: a hostile shape cannot equal it). Anything else goes
    through :func:`unpack`'s checks for the message naming what is wrong, raised as
    :class:`InternalError` (a shard's bad reply is the server's fault, not the caller's).
    """
    if tensor.dtype == dtype and tensor.shape == shape:
        np_dtype = NP_DTYPE_OF[dtype]
        data = tensor.data  # read once: every read of a bytes field copies it
        if len(data) == (shape[0] * shape[1] if len(shape) == 2 else shape[0]) * np_dtype.itemsize:
            flat = np.frombuffer(data, dtype=np_dtype)
            return flat if len(shape) == 1 else flat.reshape(shape)
    try:
        array = unpack(tensor, field, expect_dtype=dtype, expect_ndim=len(shape))
    except InvalidArgument as e:
        raise InternalError(e.message) from e
    _check_shape(array.shape, tuple(shape), field)
    return array


def decode_rows(tensor: common_pb2.Tensor, field: str, n: int, width: int, row_dtype: str) -> np.ndarray:
    """Rows on the wire -> fp32 [n, width] (fp16 widened, int8 rowwise dequantised).
    Raises InternalError naming ``field`` when dtype, shape or byte count is wrong."""
    if row_dtype == "int8":
        return dequantize_int8(_reply_array(tensor, field, common_pb2.INT8_ROWWISE, [n, width + INT8_EXTRA_BYTES]))
    rows = _reply_array(tensor, field, ROW_DTYPE_ENUM[row_dtype], [n, width])
    return rows if row_dtype == "float32" else rows.astype(np.float32)


def _check_shape(got: tuple[int, ...], want: tuple[int, ...], field: str) -> None:
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

    Raises InternalError naming the field when the reply does not fit the request
    (count, table, dtype, shape or byte-count mismatch): the caller treats that shard
    call as failed, not retryable.
    """
    tables = response.tables
    if len(tables) != len(units):
        raise InternalError(f"shard answered {len(tables)} tables for {len(units)} lookups")
    out = []
    uint8 = common_pb2.UINT8
    for i, (tr, u) in enumerate(zip(tables, units)):
        if tr.table != u.table:
            raise InternalError(f"reply table {i} is {tr.table!r}, expected {u.table!r}")
        n = u.positions.shape[0]
        full = u.col_start == 0 and u.col_end == 0
        width = dims[u.table] if full else u.col_end - u.col_start
        found = _reply_array(tr.found, f"reply.tables[{i}].found", uint8, [n])
        not_owned = _reply_array(tr.not_owned, f"reply.tables[{i}].not_owned", uint8, [n])
        # astype(bool): any non-zero byte is True, so a sloppy shard's 2 cannot make a
        # mask whose ~ is still true.
        found_b, not_owned_b = found.astype(bool), not_owned.astype(bool)
        if pooled:
            assert num_bags is not None
            part = _reply_array(tr.pooled, f"reply.tables[{i}].pooled", common_pb2.FLOAT32, [num_bags[u.table] if full else n, width])
            if full:
                out.append(UnitReply(None, found_b, not_owned_b, part))
            else:  # row bags: one bag per id, so the sums are the rows
                out.append(UnitReply(part, found_b, not_owned_b, None))
        else:
            rows = decode_rows(tr.rows, f"reply.tables[{i}].rows", n, width, row_dtype)
            out.append(UnitReply(rows, found_b, not_owned_b, None))
    return out

