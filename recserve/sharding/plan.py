"""The sharding plan: which shard stores which rows of which table (docs/architecture.md §4).

Per table the ids fall into three tiers:

* HOT  — ``hot_ids``, each row replicated on ``hot_replicas`` distinct shards;
* WARM — ``warm_ids``, each row cut into ``column_splits`` contiguous column slices
  (:meth:`TablePlan.col_bounds`), slice k on the k-th of as many distinct shards;
* COLD — every other id in ``[0, rows)``, whole rows on the ring owner, plus
  ``cold_replicas - 1`` further distinct clockwise ring successors (so when an owner
  leaves, its ids fall to a shard that already holds them).

Where a hot or warm id lives also comes from the ring: its shard set is the id's ring
owner ``o`` followed by slots ``o+1, o+2, ... (mod num_shards)``, so hot and warm
traffic spreads evenly over every shard instead of landing on the first R. The plan is immutable;
re-planning produces a new plan with a higher ``version``. One table's data
(:class:`Tier`, :class:`TablePlan`) lives in :mod:`recserve.sharding.table_plan` and its
routing in :mod:`recserve.sharding.router`; this module holds the whole plan, its JSON
form and the cached router of each table. The imports run one way (table_plan <- router
<- plan), so there is no import cycle.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import threading
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from recserve.errors import ConfigError, NotFound
from recserve.sharding.ring import Ring, balanced_tokens
from recserve.sharding.router import DENSE_MAP_MAX_ROWS, TableRouter
from recserve.sharding.table_plan import TablePlan, Tier, json_field, json_int, table_plan_from_dict

__all__ = ["PLAN_FORMAT", "PLAN_FORMAT_VERSION", "ShardAssignment", "ShardingPlan", "TablePlan", "Tier"]

PLAN_FORMAT = "recserve.sharding.plan"
PLAN_FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True, eq=False)
class ShardAssignment:
    """What one shard stores of one table (all arrays int64, sorted)."""

    table: str
    hot_ids: np.ndarray
    warm_ids: dict[int, np.ndarray]  # slice index k -> ids whose slice k lives here
    cold_ids: np.ndarray  # includes ids held as a cold replica


@dataclasses.dataclass(frozen=True, eq=False)
class ShardingPlan:
    """A versioned, immutable plan for ``num_shards`` shard slots.

    ``ring_tokens`` (uint64 [num_shards, virtual_nodes]) defaults to the balanced ring
    of :func:`recserve.sharding.ring.balanced_tokens`. ``shard_keys`` (default
    ``0..num_shards-1``) names the physical shard behind each slot, so removing slot 2
    renumbers later slots without pretending their data moved.

    ``dense_route_max_rows``: tables up to this many rows route through a dense
    per-row code map, larger ones by ring arithmetic plus their sorted hot / warm sets
    (:mod:`recserve.sharding.router`). Both give identical answers, so it is not part
    of equality; it travels in the JSON (optional there) so every process of a
    deployment builds the same structures."""

    version: int
    num_shards: int
    tables: Mapping[str, TablePlan]
    virtual_nodes: int = 64
    seed: int = 0
    ring_tokens: np.ndarray | None = None
    shard_keys: tuple[int, ...] | None = None
    dense_route_max_rows: int = DENSE_MAP_MAX_ROWS
    _routers: dict[str, TableRouter] = dataclasses.field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False, repr=False)
    _ring: Ring = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.version < 1:
            raise ConfigError(f"sharding plan version = {self.version} must be >= 1")
        if self.num_shards < 1:
            raise ConfigError(f"sharding plan num_shards = {self.num_shards} must be >= 1")
        if not 1 <= self.virtual_nodes <= 4096:
            raise ConfigError(f"sharding plan virtual_nodes = {self.virtual_nodes} must be in 1..4096")
        tables = dict(self.tables)
        for key, t in tables.items():
            if key != t.name:
                raise ConfigError(f"sharding plan table key {key!r} does not match its TablePlan name {t.name!r}")
            if t.max_fanout > self.num_shards:
                raise ConfigError(
                    f"sharding plan table {key!r} needs {t.max_fanout} distinct shards "
                    f"(hot_replicas={t.hot_replicas}, column_splits={t.column_splits}, cold_replicas={t.cold_replicas}) "
                    f"but the plan has {self.num_shards}"
                )
        object.__setattr__(self, "tables", tables)
        if self.ring_tokens is None:
            tokens = balanced_tokens(self.num_shards, self.virtual_nodes, self.seed)
        else:
            tokens = np.array(self.ring_tokens, dtype=np.uint64)
            if tokens.shape != (self.num_shards, self.virtual_nodes):
                raise ConfigError(f"sharding plan ring_tokens has shape {tokens.shape}; expected ({self.num_shards}, {self.virtual_nodes})")
        tokens.setflags(write=False)
        object.__setattr__(self, "ring_tokens", tokens)
        keys = tuple(range(self.num_shards)) if self.shard_keys is None else tuple(int(k) for k in self.shard_keys)
        if len(keys) != self.num_shards or len(set(keys)) != len(keys):
            raise ConfigError(f"sharding plan shard_keys {list(keys)} must be {self.num_shards} distinct integers")
        object.__setattr__(self, "shard_keys", keys)
        if self.dense_route_max_rows < 0:
            raise ConfigError(f"sharding plan dense_route_max_rows = {self.dense_route_max_rows} must be >= 0 (0 = always ring arithmetic)")
        object.__setattr__(self, "_ring", Ring(tokens))

    @property
    def ring(self) -> Ring:
        return self._ring

    @property
    def tokens(self) -> np.ndarray:
        """uint64 [num_shards, virtual_nodes] (``ring_tokens``, never None after init)."""
        assert self.ring_tokens is not None
        return self.ring_tokens

    @property
    def keys(self) -> tuple[int, ...]:
        """``shard_keys``, never None after init."""
        assert self.shard_keys is not None
        return self.shard_keys

    def table(self, name: str) -> TablePlan:
        try:
            return self.tables[name]
        except KeyError:
            raise NotFound(f"table {name!r} is not in sharding plan v{self.version}; tables: {sorted(self.tables)}") from None

    def router(self, table: str) -> TableRouter:
        """The cached :class:`~recserve.sharding.router.TableRouter` of ``table``."""
        with self._lock:
            r = self._routers.get(table)
            if r is None:
                r = TableRouter(self.table(table), self.ring, seed=self.seed, dense_max_rows=self.dense_route_max_rows)
                self._routers[table] = r
            return r

    def assignment(self, shard_id: int, table: str) -> ShardAssignment:
        """What shard ``shard_id`` stores of ``table``. O(rows): meant for start-up and
        bulk load, not for request paths."""
        if not 0 <= shard_id < self.num_shards:
            raise NotFound(f"shard {shard_id} is not in sharding plan v{self.version} (shards 0..{self.num_shards - 1})")
        t = self.table(table)
        r = self.router(table)
        hot = t.hot_ids[(r.hot_replicas_of(t.hot_ids) == shard_id).any(axis=1)] if t.hot_ids.size else t.hot_ids
        warm_shards = r.warm_shards_of(t.warm_ids)
        warm = {k: t.warm_ids[warm_shards[:, k] == shard_id] for k in range(t.column_splits)}
        cold = r.owned_cold_ids(shard_id)
        return ShardAssignment(table=table, hot_ids=hot, warm_ids=warm, cold_ids=cold)

    # ---- JSON ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "format_version": PLAN_FORMAT_VERSION,
            "version": self.version,
            "num_shards": self.num_shards,
            "virtual_nodes": self.virtual_nodes,
            "seed": self.seed,
            "shard_keys": list(self.keys),
            "dense_route_max_rows": self.dense_route_max_rows,
            "ring_tokens": base64.b64encode(self.tokens.astype("<u8").tobytes()).decode("ascii"),
            "tables": {name: t.to_dict() for name, t in sorted(self.tables.items())},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, s: str | bytes) -> ShardingPlan:
        """Parse :meth:`to_json` output; ConfigError (naming the problem) on bad input."""
        try:
            doc = json.loads(s)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"sharding plan is not valid JSON: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
            raise ConfigError(f"not a sharding plan: expected a JSON object with format = {PLAN_FORMAT!r}")
        fv = doc.get("format_version")
        if fv != PLAN_FORMAT_VERSION:
            raise ConfigError(f"sharding plan format_version = {fv!r} is not supported; this build reads format_version {PLAN_FORMAT_VERSION}")
        try:
            num_shards = json_int(doc, "num_shards")
            vnodes = json_int(doc, "virtual_nodes")
            raw = base64.b64decode(json_field(doc, "ring_tokens", str), validate=True)
            if len(raw) != 8 * num_shards * vnodes:
                raise ConfigError(f"sharding plan ring_tokens holds {len(raw)} bytes; expected 8 * {num_shards} * {vnodes}")
            tokens = np.frombuffer(raw, dtype="<u8").astype(np.uint64).reshape(num_shards, vnodes)
            tables = {name: table_plan_from_dict(name, td) for name, td in json_field(doc, "tables", dict).items()}
            keys = json_field(doc, "shard_keys", list)
            if not all(isinstance(k, int) for k in keys):
                raise ConfigError("sharding plan shard_keys must be a list of integers")
            return cls(
                version=json_int(doc, "version"),
                num_shards=num_shards,
                tables=tables,
                virtual_nodes=vnodes,
                seed=json_int(doc, "seed"),
                ring_tokens=tokens,
                shard_keys=tuple(keys),
                # Optional: plans written before the field route with the default.
                dense_route_max_rows=json_int(doc, "dense_route_max_rows") if "dense_route_max_rows" in doc else DENSE_MAP_MAX_ROWS,
            )
        except (ValueError, TypeError, zlib.error) as e:  # base64 / numpy decode errors
            raise ConfigError(f"sharding plan is malformed: {e}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (temp file + rename) so readers never see half a plan."""
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, p)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ShardingPlan:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read sharding plan {str(path)!r}: {e.strerror}") from None
        return cls.from_json(text)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # Pickle (spawned processes, deepcopy) through the JSON form: the router cache
        # and its lock are rebuilt on the other side instead of being copied.
        return (ShardingPlan.from_json, (self.to_json(),))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardingPlan):
            return NotImplemented
        return (
            (self.version, self.num_shards, self.virtual_nodes, self.seed, self.keys)
            == (other.version, other.num_shards, other.virtual_nodes, other.seed, other.keys)
            and np.array_equal(self.tokens, other.tokens)
            and dict(self.tables) == dict(other.tables)
        )

    __hash__ = None  # type: ignore[assignment]
