"""Cheap windows (issue 9), the wire half: requests built in place and replies decoded
with one comparison per check give exactly what the general codec gives, and every
malformed reply is still refused — as InternalError (the shard's fault) naming the field.
"""

from __future__ import annotations

import numpy as np
import pytest

from recserve.errors import InternalError
from recserve.lookup.route import FetchUnit
from recserve.lookup.window import TableWindow
from recserve.lookup.wire import ROW_DTYPE_ENUM, UnitReply, build_request, parse_response, unit_bags
from recserve.rpc.deadline import make_header
from recserve.rpc.tensors import INT8_EXTRA_BYTES, dequantize_int8, pack, unpack
from recserve.v1 import common_pb2, embedding_pb2

DIM = 8
SPLIT = 4  # warm slices [0, 4) and [4, 8)


def _window(rng: np.random.Generator) -> TableWindow:
    """One caller's window of 30 occurrences over 12 unique ids, 6 bags."""
    unique = np.sort(rng.choice(1000, size=12, replace=False)).astype(np.int64)
    inverse = np.concatenate([np.arange(12), rng.integers(0, 12, size=18)]).astype(np.int64)
    lengths = np.array([5, 0, 7, 6, 4, 8], dtype=np.int64)
    return TableWindow("t", unique, inverse, np.array([0, 30]), lengths, np.array([0, 6]))


def _units() -> list[FetchUnit]:
    """A full-row unit, both column slices of two warm rows, and an empty unit."""
    return [
        FetchUnit(0, "t", np.array([0, 2, 3, 5, 7, 8, 11], dtype=np.int64)),
        FetchUnit(0, "t", np.array([4, 9], dtype=np.int64), 0, SPLIT),
        FetchUnit(0, "t", np.array([4, 9], dtype=np.int64), SPLIT, DIM),
        FetchUnit(0, "t", np.zeros(0, dtype=np.int64)),
    ]


def _reference_request(units: list[FetchUnit], w: TableWindow, header: common_pb2.RequestHeader, bags: dict[str, np.ndarray] | None) -> embedding_pb2.LookupRequest:
    """The request built the plain way: sub-messages constructed, then copied in."""
    lookups = []
    for u in units:
        tl = embedding_pb2.TableLookup(table=u.table, ids=pack(np.take(w.unique_ids, u.positions)), col_start=u.col_start, col_end=u.col_end)
        if bags is not None:
            if u.full_row:
                idx, off = unit_bags(w, bags[u.table], u.positions)
            else:
                idx, off = np.arange(len(u), dtype=np.int64), np.arange(len(u) + 1, dtype=np.int64)
            tl.bag_indices.CopyFrom(pack(idx))
            tl.bag_offsets.CopyFrom(pack(off))
        lookups.append(tl)
    return embedding_pb2.LookupRequest(header=header, tables=lookups, row_dtype=common_pb2.FLOAT16, pooled=bags is not None, plan_version=7)


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("header", [make_header(timeout_s=0.5, tenant="a", request_id="w-1"), common_pb2.RequestHeader()], ids=["header", "empty-header"])
def test_a_request_built_in_place_is_the_plain_request(pooled: bool, header: common_pb2.RequestHeader) -> None:
    w = _window(np.random.default_rng(1))
    bags = {"t": w.occurrence_bags()} if pooled else None
    got = build_request(_units(), {"t": w}, row_dtype="float16", header=header, plan_version=7, occurrence_bags=bags)
    want = _reference_request(_units(), w, header, bags)
    assert got == want
    assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)


def _masks(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    return (rng.random(n) > 0.3).astype(np.uint8), (rng.random(n) > 0.8).astype(np.uint8)


def _rows_tensor(rows: np.ndarray, row_dtype: str) -> common_pb2.Tensor:
    if row_dtype == "float32":
        return pack(rows)
    if row_dtype == "float16":
        return pack(rows.astype(np.float16))
    # int8 rowwise: codes, then fp32 scale and bias per row (the fused layout)
    codes = np.arange(rows.size, dtype=np.uint8).reshape(rows.shape) % 200
    tail = np.stack([np.full(rows.shape[0], 0.25, np.float32), np.linspace(-1, 1, rows.shape[0], dtype=np.float32)], axis=1)
    fused = np.concatenate([codes, tail.view(np.uint8)], axis=1)
    assert fused.shape == (rows.shape[0], rows.shape[1] + INT8_EXTRA_BYTES)
    return pack(fused, dtype=common_pb2.INT8_ROWWISE)


def _reply(rng: np.random.Generator, units: list[FetchUnit], row_dtype: str, num_bags: int | None) -> embedding_pb2.LookupResponse:
    """A well-formed reply to ``units`` (``num_bags``: partial-pooling mode)."""
    tables = []
    for u in units:
        n, width = len(u), (DIM if u.full_row else u.col_end - u.col_start)
        found, not_owned = _masks(rng, n)
        tr = embedding_pb2.TableRows(table=u.table, found=pack(found), not_owned=pack(not_owned), col_start=u.col_start, col_end=u.col_end)
        if num_bags is None:
            tr.rows.CopyFrom(_rows_tensor(rng.standard_normal((n, width)).astype(np.float32), row_dtype))
        else:
            tr.pooled.CopyFrom(pack(rng.standard_normal((num_bags if u.full_row else n, width)).astype(np.float32)))
        tables.append(tr)
    return embedding_pb2.LookupResponse(plan_version=7, tables=tables)


def _general_decode(response: embedding_pb2.LookupResponse, units: list[FetchUnit], row_dtype: str, pooled: bool) -> list[UnitReply]:
    """The reply decoded with the general codec (:func:`unpack`, every check)."""
    out = []
    for tr, u in zip(response.tables, units):
        found = unpack(tr.found, "f", expect_dtype=common_pb2.UINT8, expect_ndim=1).astype(bool)
        not_owned = unpack(tr.not_owned, "n", expect_dtype=common_pb2.UINT8, expect_ndim=1).astype(bool)
        if pooled:
            part = unpack(tr.pooled, "p", expect_dtype=common_pb2.FLOAT32, expect_ndim=2)
            out.append(UnitReply(None, found, not_owned, part) if u.full_row else UnitReply(part, found, not_owned, None))
        elif row_dtype == "int8":
            out.append(UnitReply(dequantize_int8(unpack(tr.rows, "r", expect_dtype=common_pb2.INT8_ROWWISE)), found, not_owned, None))
        else:
            rows = unpack(tr.rows, "r", expect_dtype=ROW_DTYPE_ENUM[row_dtype], expect_ndim=2).astype(np.float32)
            out.append(UnitReply(rows, found, not_owned, None))
    return out


@pytest.mark.parametrize("mode", ["float32", "float16", "int8", "pooled"])
def test_a_well_formed_reply_decodes_as_the_general_codec_decodes_it(mode: str) -> None:
    rng = np.random.default_rng(2)
    units = _units()
    pooled = mode == "pooled"
    row_dtype = "float32" if pooled else mode
    response = _reply(rng, units, row_dtype, 6 if pooled else None)
    got = parse_response(response, units, {"t": DIM}, row_dtype=row_dtype, pooled=pooled, num_bags={"t": 6})
    want = _general_decode(response, units, row_dtype, pooled)
    assert len(got) == len(want) == len(units)
    for g, x in zip(got, want):
        for name in ("rows", "found", "not_owned", "pooled"):
            a, b = getattr(g, name), getattr(x, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape, name
                np.testing.assert_array_equal(a, b)
        assert g.found.dtype == bool and g.not_owned.dtype == bool
        if g.rows is not None:
            assert g.rows.dtype == np.float32


def test_a_mask_byte_other_than_one_still_reads_as_true() -> None:
    """A shard's mask byte 2 is True, and its negation False (not a non-zero byte)."""
    u = [FetchUnit(0, "t", np.arange(3, dtype=np.int64))]
    tr = embedding_pb2.TableRows(table="t", rows=pack(np.zeros((3, DIM), np.float32)), found=pack(np.array([2, 0, 1], np.uint8)), not_owned=pack(np.zeros(3, np.uint8)))
    (r,) = parse_response(embedding_pb2.LookupResponse(tables=[tr]), u, {"t": DIM}, row_dtype="float32", pooled=False)
    assert r.found.tolist() == [True, False, True] and (~r.found).tolist() == [False, True, False]


def _bad(field: str, value: common_pb2.Tensor) -> embedding_pb2.LookupResponse:
    """A one-unit reply (3 full rows) with one of its tensors replaced."""
    tr = embedding_pb2.TableRows(table="t", rows=pack(np.zeros((3, DIM), np.float32)), found=pack(np.ones(3, np.uint8)), not_owned=pack(np.zeros(3, np.uint8)))
    getattr(tr, field).CopyFrom(value)
    return embedding_pb2.LookupResponse(tables=[tr])


def _hostile_shape() -> common_pb2.Tensor:
    t = pack(np.zeros((3, DIM), np.float32))
    t.shape[:] = [2**62, 4]  # int64 product wraps; must not "match" any byte count
    return t


def _short_bytes() -> common_pb2.Tensor:
    t = pack(np.zeros((3, DIM), np.float32))
    t.data = t.data[:-4]
    return t


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("found", pack(np.ones(3, np.int64)), "dtype is INT64, expected UINT8"),
        ("not_owned", pack(np.zeros(4, np.uint8)), "shape [4], expected [3]"),
        ("found", pack(np.ones((3, 1), np.uint8)), "rank 2, expected rank 1"),
        ("rows", pack(np.zeros((3, DIM), np.float16)), "dtype is FLOAT16, expected FLOAT32"),
        ("rows", pack(np.zeros((3, DIM - 1), np.float32)), f"shape [3, {DIM - 1}], expected [3, {DIM}]"),
        ("rows", pack(np.zeros(3 * DIM, np.float32)), "rank 1, expected rank 2"),
        ("rows", _short_bytes(), "bytes do not match shape"),
        ("rows", _hostile_shape(), "do not match shape [4611686018427387904, 4]"),
        ("rows", common_pb2.Tensor(), "unknown dtype"),
    ],
    ids=["found-dtype", "mask-length", "mask-rank", "rows-dtype", "rows-width", "rows-rank", "rows-short", "rows-hostile", "rows-unset"],
)
def test_a_malformed_reply_is_an_internal_error_naming_the_field(field: str, value: common_pb2.Tensor, words: str) -> None:
    u = [FetchUnit(0, "t", np.arange(3, dtype=np.int64))]
    with pytest.raises(InternalError) as err:
        parse_response(_bad(field, value), u, {"t": DIM}, row_dtype="float32", pooled=False)
    assert f"reply.tables[0].{field}" in err.value.message and words in err.value.message, err.value.message


def test_a_malformed_partial_sum_or_table_list_is_refused() -> None:
    u = [FetchUnit(0, "t", np.arange(3, dtype=np.int64))]
    tr = embedding_pb2.TableRows(table="t", pooled=pack(np.zeros((5, DIM), np.float32)), found=pack(np.ones(3, np.uint8)), not_owned=pack(np.zeros(3, np.uint8)))
    with pytest.raises(InternalError, match=r"reply.tables\[0\].pooled: shard answered shape \[5, 8\], expected \[6, 8\]"):
        parse_response(embedding_pb2.LookupResponse(tables=[tr]), u, {"t": DIM}, row_dtype="float32", pooled=True, num_bags={"t": 6})
    with pytest.raises(InternalError, match="reply table 0 is 'x', expected 't'"):
        parse_response(embedding_pb2.LookupResponse(tables=[embedding_pb2.TableRows(table="x")]), u, {"t": DIM}, row_dtype="float32", pooled=False)
    with pytest.raises(InternalError, match="shard answered 2 tables for 1 lookups"):
        parse_response(embedding_pb2.LookupResponse(tables=[tr, tr]), u, {"t": DIM}, row_dtype="float32", pooled=False)
