"""Row element types of the DRAM tiers and the wire: float32, float16, int8 rowwise.

int8 rowwise is fbgemm's fused format: per row ``D`` uint8 codes, then an fp32 scale
and an fp32 bias (``D + 8`` bytes), value = code * scale + bias. Quantisation uses
``torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized``; torch and fbgemm_gpu are
imported on first use only (≈3-7 s and ≈220 MB here), so a shard serving float32 or
float16 never loads them. Dequantisation is :func:`recserve.rpc.tensors.dequantize_int8`,
the documented affine formula in numpy that the lookup client uses too (it agrees with
``Fused8BitRowwiseQuantizedToFloat`` to ≈1 ulp).
"""

from __future__ import annotations

import enum
import threading
from typing import Any

import numpy as np

from recserve.errors import InvalidArgument
from recserve.rpc.tensors import INT8_EXTRA_BYTES, dequantize_int8
from recserve.v1 import common_pb2


class RowDType(enum.Enum):
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    INT8 = "int8"

    @property
    def wire(self) -> int:
        return _WIRE_OF[self]

    def stored_width(self, width: int) -> int:
        """Elements per stored row of ``width`` values (int8 adds scale + bias)."""
        return width + INT8_EXTRA_BYTES if self is RowDType.INT8 else width

    @property
    def numpy(self) -> np.dtype[Any]:
        return _NUMPY_OF[self]


_NUMPY_OF: dict[RowDType, np.dtype[Any]] = {RowDType.FLOAT32: np.dtype("<f4"), RowDType.FLOAT16: np.dtype("<f2"), RowDType.INT8: np.dtype("u1")}
_WIRE_OF = {RowDType.FLOAT32: common_pb2.FLOAT32, RowDType.FLOAT16: common_pb2.FLOAT16, RowDType.INT8: common_pb2.INT8_ROWWISE}


def from_wire(dtype: int) -> RowDType:
    """Map a request's ``row_dtype`` enum to a RowDType (unspecified = FLOAT32)."""
    if dtype in (common_pb2.DTYPE_UNSPECIFIED, common_pb2.FLOAT32):
        return RowDType.FLOAT32
    if dtype == common_pb2.FLOAT16:
        return RowDType.FLOAT16
    if dtype == common_pb2.INT8_ROWWISE:
        return RowDType.INT8
    raise InvalidArgument(f"row_dtype {dtype} is not a row type; use FLOAT32 (1), FLOAT16 (2) or INT8_ROWWISE (3)")


_torch_lock = threading.Lock()
_torch: Any = None
_threads = 1


def set_threads(threads: int) -> None:
    """Thread count torch gets when (and if) it is loaded; several shard processes
    share the cores, so never torch's default of all of them."""
    global _threads
    _threads = threads
    if _torch is not None:
        _torch.set_num_threads(threads)


def _fbgemm_torch() -> Any:
    """Import torch + fbgemm_gpu once (registers ``torch.ops.fbgemm``)."""
    global _torch
    with _torch_lock:
        if _torch is None:
            import torch
            import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

            torch.set_num_threads(_threads)
            _torch = torch
    return _torch


def quantize_int8(rows: np.ndarray) -> np.ndarray:
    """fp32 rows [N, W] -> fused int8 rowwise uint8 [N, W + 8] via fbgemm."""
    if rows.shape[0] == 0:
        return np.zeros((0, rows.shape[1] + INT8_EXTRA_BYTES), dtype=np.uint8)
    torch = _fbgemm_torch()
    src = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
    return torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(src).numpy()  # type: ignore[no-any-return]


def encode(rows: np.ndarray, dtype: RowDType) -> np.ndarray:
    """fp32 rows [N, W] -> rows stored as ``dtype`` ([N, W] or [N, W + 8] uint8)."""
    if dtype is RowDType.FLOAT32:
        return np.ascontiguousarray(rows, dtype=np.float32)
    if dtype is RowDType.FLOAT16:
        return rows.astype(np.float16)
    return quantize_int8(rows)


def decode(rows: np.ndarray, dtype: RowDType) -> np.ndarray:
    """Rows stored as ``dtype`` -> fp32 [N, W]."""
    if dtype is RowDType.FLOAT32:
        return rows
    if dtype is RowDType.FLOAT16:
        return rows.astype(np.float32)
    return dequantize_int8(rows)
