"""Packed-array codec for the wire contract (docs/architecture.md §4).

Arrays travel as ``recserve.v1.Tensor``: a dtype enum, a shape and little-endian
bytes. Decoding validates length against dtype and shape and raises
:class:`~recserve.errors.InvalidArgument` naming the field, so malformed bytes become
``INVALID_ARGUMENT`` instead of a crash.

Example::

    t = pack(np.arange(4, dtype=np.int64))      # Tensor(dtype=INT64, shape=[4], ...)
    unpack(t, "ids")                            # array([0, 1, 2, 3])
"""

from __future__ import annotations

import math

import numpy as np

from recserve.errors import InvalidArgument
from recserve.v1 import common_pb2

# INT8_ROWWISE rows are uint8 on the wire: D quantised bytes + fp32 scale + fp32 bias.
INT8_EXTRA_BYTES = 8  # fp32 scale + fp32 bias after a row's D codes
NP_DTYPE_OF: dict[int, np.dtype] = {  # wire dtype enum -> numpy dtype
    common_pb2.FLOAT32: np.dtype("<f4"),
    common_pb2.FLOAT16: np.dtype("<f2"),
    common_pb2.INT8_ROWWISE: np.dtype("u1"),
    common_pb2.INT64: np.dtype("<i8"),
    common_pb2.INT32: np.dtype("<i4"),
    common_pb2.UINT8: np.dtype("u1"),
}
_ENUM_OF: dict[str, int] = {
    "float32": common_pb2.FLOAT32,
    "float16": common_pb2.FLOAT16,
    "int64": common_pb2.INT64,
    "int32": common_pb2.INT32,
    "uint8": common_pb2.UINT8,
    "bool": common_pb2.UINT8,
}
# The same, keyed by the dtype object: ``dtype.name`` is computed in Python by numpy
# (≈ 3 µs a call), a dict hit on the dtype itself is not.
_ENUM_OF_DTYPE: dict[np.dtype, int] = {np.dtype(name): enum for name, enum in _ENUM_OF.items()}


def pack(array: np.ndarray, dtype: int | None = None) -> common_pb2.Tensor:
    """Pack ``array`` (any shape) into a Tensor. ``dtype`` overrides the enum
    (used for INT8_ROWWISE, whose numpy dtype is uint8)."""
    tensor = common_pb2.Tensor()
    pack_into(tensor, array, dtype)
    return tensor


def pack_into(out: common_pb2.Tensor, array: np.ndarray, dtype: int | None = None) -> None:
    """:func:`pack` straight into a message field (``reply.rows``): the bytes are
    copied once, not into a Tensor and then again by ``CopyFrom`` (a 1,000-row reply is
    256 kB)."""
    if dtype is None:
        found = _ENUM_OF_DTYPE.get(array.dtype)
        if found is None:  # e.g. a big-endian float32: by name, cast below
            found = _ENUM_OF.get(array.dtype.name)
        if found is None:
            raise InvalidArgument(f"cannot pack dtype {array.dtype.name!r}; use one of {sorted(_ENUM_OF)}")
        dtype = found
    out.dtype = dtype  # type: ignore[assignment]
    out.shape[:] = array.shape
    wire = NP_DTYPE_OF[dtype]
    # tobytes writes C order whatever the array's strides: one copy, plus the cast's
    # only where the dtype differs (bool masks, a few bytes per id).
    out.data = (array if array.dtype == wire else array.astype(wire)).tobytes()


def unpack(
    tensor: common_pb2.Tensor,
    field: str,
    *,
    expect_dtype: int | None = None,
    expect_ndim: int | None = None,
) -> np.ndarray:
    """Decode a Tensor into a read-only numpy view over its bytes (no copy).

    Raises InvalidArgument naming ``field`` when the dtype is unknown or unexpected,
    the shape is negative / of the wrong rank, or the byte length does not match.
    """
    # Every line here runs for each tensor of each RPC (ids, bags, masks): plain dict
    # and tuple work, ≈ 1 µs, where per-element generators cost ≈ 4 µs.
    dtype = tensor.dtype
    np_dtype = NP_DTYPE_OF.get(dtype)
    if np_dtype is None:
        raise InvalidArgument(f"{field}: unknown dtype enum {dtype}; set dtype to one of FLOAT32, FLOAT16, INT8_ROWWISE, INT64, INT32, UINT8")
    if expect_dtype is not None and dtype != expect_dtype:
        want = common_pb2.DType.Name(expect_dtype)  # type: ignore[arg-type]
        got = common_pb2.DType.Name(dtype)
        raise InvalidArgument(f"{field}: dtype is {got}, expected {want}")
    shape = tuple(tensor.shape)  # Python ints (int64 on the wire)
    if expect_ndim is not None and len(shape) != expect_ndim:
        raise InvalidArgument(f"{field}: shape {list(shape)} has rank {len(shape)}, expected rank {expect_ndim}")
    if shape and min(shape) < 0:
        raise InvalidArgument(f"{field}: shape {list(shape)} has a negative dimension")
    # Python ints: np.prod in int64 wraps for a hostile shape like [2**62, 4] to 0, which
    # would "match" empty data and then crash reshape instead of answering INVALID_ARGUMENT.
    count = math.prod(shape)
    data = tensor.data  # read once: every read of a bytes field copies it (a reply's rows are ~250 kB)
    if len(data) != count * np_dtype.itemsize:
        raise InvalidArgument(
            f"{field}: {len(data)} bytes do not match shape {list(shape)} of "
            f"{common_pb2.DType.Name(dtype)} ({count * np_dtype.itemsize} bytes expected; "
            f"byte length must be a multiple of {np_dtype.itemsize})"
        )
    flat = np.frombuffer(data, dtype=np_dtype)
    return flat if len(shape) == 1 else flat.reshape(shape)


def dequantize_int8(fused: np.ndarray) -> np.ndarray:
    """Fused int8-rowwise uint8 ``[N, W + 8]`` -> fp32 ``[N, W]``: code * scale + bias.

    The one int8 decoder, shared by the shard (tier conversions) and the lookup client
    (wire replies). It is fbgemm's documented affine formula in numpy, agreeing with
    ``torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat`` to about 1 ulp, so neither
    side imports torch to read int8 rows (only quantising needs fbgemm).

    Example: a row with codes ``[0, 255]``, scale 0.5 and bias -1 decodes to
    ``[-1.0, 126.5]``.
    """
    width = fused.shape[1] - INT8_EXTRA_BYTES
    tail = np.ascontiguousarray(fused[:, width:]).view("<f4")  # [N, 2]: scale, bias
    out = fused[:, :width].astype(np.float32)
    out *= tail[:, :1]
    out += tail[:, 1:2]
    return out


def ids_from(tensor: common_pb2.Tensor, field: str) -> np.ndarray:
    """An optional rank-1 id tensor (INT64 or INT32; unset = empty) -> int64 ``[n]``.
    InvalidArgument naming ``field`` for any other dtype or rank."""
    if not tensor.data and not tensor.shape:
        return np.zeros(0, dtype=np.int64)
    array = unpack(tensor, field, expect_ndim=1)
    if array.dtype.kind not in "iu":
        raise InvalidArgument(f"{field}: dtype is {common_pb2.DType.Name(tensor.dtype)}; send ids as INT64")
    return array.astype(np.int64, copy=False)
