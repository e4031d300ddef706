"""One table's placement: the plan's :class:`Tier` and :class:`TablePlan` (docs/architecture.md §4).

Per table the ids fall into three tiers (:mod:`recserve.sharding.plan` describes them).
This module is the data of one table and its JSON form; it sits below both
:mod:`recserve.sharding.router` (which routes one table's ids) and
:mod:`recserve.sharding.plan` (the whole plan, which caches a router per table), so the
plan can build routers without the router importing the plan. Import these names from
either module: ``recserve.sharding.plan`` re-exports them.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import zlib
from typing import Any

import numpy as np

from recserve.config.spec import DTYPES
from recserve.errors import ConfigError


class Tier(enum.IntEnum):
    """The tier a plan assigns an id to (see :mod:`recserve.sharding.plan`): the one
    tier enum. Routers return these as uint8 codes; a shard's storage tiers
    (:class:`embedding_server.tiers.StorageTier`) are keyed by it."""

    HOT = 0
    WARM = 1
    COLD = 2


def _sorted_id_array(values: Any, what: str) -> np.ndarray:
    arr = np.ascontiguousarray(np.asarray(values, dtype=np.int64).reshape(-1))
    if arr.size > 1 and not bool(np.all(arr[1:] > arr[:-1])):
        raise ConfigError(f"{what} must be sorted ascending without repeats")
    arr.setflags(write=False)
    return arr


@dataclasses.dataclass(frozen=True, eq=False)
class TablePlan:
    """Placement of one table. ``hot_ids``: int64 [H] sorted; ``warm_ids``: int64 [W]
    sorted, disjoint from ``hot_ids``; both within ``[0, rows)``. Cold = the rest."""

    name: str
    rows: int
    dim: int
    hot_ids: np.ndarray
    warm_ids: np.ndarray
    hot_replicas: int
    column_splits: int
    cold_replicas: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        f = f"sharding plan table {self.name!r}"
        if not self.name:
            raise ConfigError("sharding plan table name must be non-empty")
        if self.rows < 1 or self.dim < 1:
            raise ConfigError(f"{f}: rows ({self.rows}) and dim ({self.dim}) must be positive")
        hot = _sorted_id_array(self.hot_ids, f"{f}: hot_ids")
        warm = _sorted_id_array(self.warm_ids, f"{f}: warm_ids")
        for label, arr in (("hot_ids", hot), ("warm_ids", warm)):
            if arr.size and (arr[0] < 0 or arr[-1] >= self.rows):
                raise ConfigError(f"{f}: {label} must lie in [0, {self.rows:,}); got {int(arr[0]):,}..{int(arr[-1]):,}")
        if hot.size and warm.size and np.intersect1d(hot, warm, assume_unique=True).size:
            raise ConfigError(f"{f}: an id cannot be both hot and warm")
        if self.hot_replicas < 1 or self.cold_replicas < 1:
            raise ConfigError(f"{f}: hot_replicas ({self.hot_replicas}) and cold_replicas ({self.cold_replicas}) must be >= 1")
        if not 1 <= self.column_splits <= self.dim:
            raise ConfigError(f"{f}: column_splits = {self.column_splits} must be in 1..dim ({self.dim})")
        if self.dtype not in DTYPES:
            raise ConfigError(f"{f}: dtype {self.dtype!r} must be one of {DTYPES}")
        object.__setattr__(self, "hot_ids", hot)
        object.__setattr__(self, "warm_ids", warm)

    @property
    def num_cold(self) -> int:
        return self.rows - int(self.hot_ids.size) - int(self.warm_ids.size)

    @property
    def max_fanout(self) -> int:
        """Most distinct shards one id of this table can need (R, C or cold replicas)."""
        return max(self.hot_replicas, self.column_splits, self.cold_replicas)

    def col_bounds(self) -> list[tuple[int, int]]:
        """``column_splits`` contiguous ``[start, end)`` slices covering ``[0, dim)``;
        widths differ by at most 1 (dim=10, C=3 -> [(0, 4), (4, 7), (7, 10)])."""
        base, extra = divmod(self.dim, self.column_splits)
        bounds, start = [], 0
        for k in range(self.column_splits):
            end = start + base + (1 if k < extra else 0)
            bounds.append((start, end))
            start = end
        return bounds

    def slice_of(self, col_start: int, col_end: int) -> int | None:
        """Map a wire column range to a slice index; ``0/0`` (the full row) -> None.

        ``(0, dim)`` is slice 0 when ``column_splits == 1`` (the full row is the only
        slice) and None otherwise. Raises ConfigError for a range that is not a slice."""
        if (col_start, col_end) == (0, 0):
            return None
        bounds = self.col_bounds()
        if (col_start, col_end) in bounds:
            return bounds.index((col_start, col_end))
        if (col_start, col_end) == (0, self.dim):
            return None
        raise ConfigError(f"table {self.name!r}: columns [{col_start}, {col_end}) are not a slice of the plan; slices are {bounds}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "dim": self.dim,
            "dtype": self.dtype,
            "hot_replicas": self.hot_replicas,
            "column_splits": self.column_splits,
            "cold_replicas": self.cold_replicas,
            "hot_ids": _encode_ids(self.hot_ids),
            "warm_ids": _encode_ids(self.warm_ids),
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TablePlan):
            return NotImplemented
        return (
            (self.name, self.rows, self.dim, self.dtype, self.hot_replicas, self.column_splits, self.cold_replicas)
            == (other.name, other.rows, other.dim, other.dtype, other.hot_replicas, other.column_splits, other.cold_replicas)
            and np.array_equal(self.hot_ids, other.hot_ids)
            and np.array_equal(self.warm_ids, other.warm_ids)
        )

    __hash__ = None  # type: ignore[assignment]


def _encode_ids(ids: np.ndarray) -> str:
    """Sorted int64 ids -> base64(zlib(little-endian deltas)): sorted tiers compress
    to about a byte per id, where a JSON list costs ~8."""
    deltas = np.diff(ids, prepend=np.int64(0)).astype("<i8")
    return base64.b64encode(zlib.compress(deltas.tobytes(), 6)).decode("ascii")


def _decode_ids(s: str, what: str) -> np.ndarray:
    raw = zlib.decompress(base64.b64decode(s, validate=True))
    if len(raw) % 8:
        raise ConfigError(f"{what} decodes to {len(raw)} bytes, not a multiple of 8")
    return np.cumsum(np.frombuffer(raw, dtype="<i8").astype(np.int64))


def json_field(doc: dict[str, Any], key: str, typ: type) -> Any:
    """``doc[key]``, checked to be a ``typ`` (never a bool); ConfigError naming the field."""
    if key not in doc:
        raise ConfigError(f"sharding plan is missing field {key!r}")
    v = doc[key]
    if not isinstance(v, typ) or isinstance(v, bool):
        raise ConfigError(f"sharding plan field {key!r} = {v!r} has the wrong type; expected {typ.__name__}")
    return v


def json_int(doc: dict[str, Any], key: str) -> int:
    """``doc[key]`` as an int; ConfigError naming the field."""
    v: int = json_field(doc, key, int)
    return v


def table_plan_from_dict(name: str, td: Any) -> TablePlan:
    """Parse :meth:`TablePlan.to_dict` output (one entry of a plan's ``tables``)."""
    if not isinstance(td, dict):
        raise ConfigError(f"sharding plan table {name!r} should be a JSON object")
    return TablePlan(
        name=name,
        rows=json_int(td, "rows"),
        dim=json_int(td, "dim"),
        dtype=json_field(td, "dtype", str),
        hot_ids=_decode_ids(json_field(td, "hot_ids", str), f"table {name!r} hot_ids"),
        warm_ids=_decode_ids(json_field(td, "warm_ids", str), f"table {name!r} warm_ids"),
        hot_replicas=json_int(td, "hot_replicas"),
        column_splits=json_int(td, "column_splits"),
        cold_replicas=json_int(td, "cold_replicas"),
    )
