"""RocksDB key and value encoding of embedding rows (docs/architecture.md §4).

Key: the 8-byte big-endian row id, so RocksDB's bytewise order is numeric order (ids are
non-negative) and SST files can be written in key order straight from a sorted id array.

Value: a 16-byte little-endian header followed by the row bytes::

    magic u8 (0x52 'R') | dtype u8 (1 = float32) | reserved u16 | dim u32 | col_start u32 | col_end u32
    row: (col_end - col_start) float32

The header records the column slice a shard holds for warm ids (hot and cold ids store
the full row, ``0..dim``), so a row read back after a re-plan is checked against the slice
the caller wants instead of being silently misread.

Encoding and decoding are array operations; the only per-row Python work is building the
list of ``bytes`` objects rocksdict's API takes (done by numpy's ``tolist`` in C).

Example::

    keys = encode_keys(np.array([3, 7]))                  # [b'\\0..\\x03', b'\\0..\\x07']
    vals = encode_values(rows, dim=32, col_start=0, col_end=32)
    got, present = decode_values(db.get(keys), dim=32, col_start=0, col_end=32)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from recserve.errors import InternalError

MAGIC = 0x52
DTYPE_FLOAT32 = 1
HEADER_DTYPE = np.dtype(
    [("magic", "u1"), ("dtype", "u1"), ("reserved", "<u2"), ("dim", "<u4"), ("col_start", "<u4"), ("col_end", "<u4")]
)
HEADER_BYTES = HEADER_DTYPE.itemsize  # 16
KEY_BYTES = 8


def encode_keys(ids: np.ndarray) -> list[bytes]:
    """int64 ids [N] -> N 8-byte big-endian keys. Ids must be non-negative."""
    return np.ascontiguousarray(ids, dtype=">i8").view("V8").tolist()  # type: ignore[no-any-return]


def decode_keys(keys: Sequence[bytes]) -> np.ndarray:
    """N 8-byte keys -> int64 ids [N]."""
    if not keys:
        return np.empty(0, dtype=np.int64)
    return np.frombuffer(b"".join(keys), dtype=">i8").astype(np.int64)


def value_bytes(col_start: int, col_end: int) -> int:
    return HEADER_BYTES + 4 * (col_end - col_start)


def encode_values(rows: np.ndarray, *, dim: int, col_start: int, col_end: int) -> list[bytes]:
    """fp32 rows [N, col_end - col_start] -> N values (header + row bytes)."""
    width = col_end - col_start
    if rows.ndim != 2 or rows.shape[1] != width:
        # Callers validate shapes at the edge; a mismatch here is a bug of ours, not bad input.
        raise InternalError(f"rows shape {rows.shape} does not match slice {col_start}..{col_end} (width {width})")
    n = rows.shape[0]
    header = np.zeros(1, dtype=HEADER_DTYPE)
    header["magic"], header["dtype"], header["dim"] = MAGIC, DTYPE_FLOAT32, dim
    header["col_start"], header["col_end"] = col_start, col_end
    buf = np.empty((n, value_bytes(col_start, col_end)), dtype=np.uint8)
    buf[:, :HEADER_BYTES] = header.view(np.uint8)
    buf[:, HEADER_BYTES:] = np.ascontiguousarray(rows, dtype="<f4").view(np.uint8).reshape(n, 4 * width)
    return buf.view(f"V{buf.shape[1]}").ravel().tolist()  # type: ignore[no-any-return]


def decode_values(
    values: Sequence[bytes | None], *, dim: int, col_start: int, col_end: int
) -> tuple[np.ndarray, np.ndarray]:
    """Values from a multi-get -> (rows fp32 [N, col_end - col_start], present bool [N]).

    ``None`` (absent key) and values whose header does not hold exactly this slice of a
    ``dim``-wide float32 row (e.g. left over from an older plan) are reported absent,
    with zero rows; the caller fills its default row.
    """
    n = len(values)
    width = col_end - col_start
    size = value_bytes(col_start, col_end)
    if n == 0:
        return np.zeros((0, width), dtype=np.float32), np.zeros(0, dtype=bool)
    obj = np.empty(n, dtype=object)
    obj[:] = values
    absent = obj == None  # noqa: E711  (elementwise on an object array, in C)
    filler = bytes(size)  # magic 0: never mistaken for a stored row
    if absent.any():
        obj[absent] = filler
    lengths = np.asarray(np.frompyfunc(len, 1, 1)(obj), dtype=np.int64)
    wrong_len = lengths != size
    if wrong_len.any():
        obj[wrong_len] = filler
    buf = np.frombuffer(b"".join(obj.tolist()), dtype=np.uint8).reshape(n, size)
    header = buf[:, :HEADER_BYTES].copy().view(HEADER_DTYPE).reshape(n)
    present = (
        (header["magic"] == MAGIC)
        & (header["dtype"] == DTYPE_FLOAT32)
        & (header["dim"] == dim)
        & (header["col_start"] == col_start)
        & (header["col_end"] == col_end)
    )
    rows = buf[:, HEADER_BYTES:].copy().view("<f4").reshape(n, width)
    if not present.all():
        rows[~present] = 0.0
    return rows, present
