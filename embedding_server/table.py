"""One table on one shard: routes a request's ids to the tiers and assembles the reply.

An index built once from the :class:`~embedding_server.layout.TableLayout` and sized to
the rows this shard owns, not to the table (at 10**9 rows and 256 shards a map over
the id space would cost 9 GB per shard): ``owned_ids`` int64 sorted, with parallel
``owned_code`` uint8 and ``owned_slot`` int32 (13 B per owned row). One
``searchsorted`` + two ``np.take`` per request give each id's :class:`Residence` (where
it resides on *this* shard: not owned, hot, cold, or ``WARM0 + j`` = warm slice j of
this shard) and its slot: the row's slot in its DRAM tier, or for cold rows the row's
ordinal among this shard's cold rows, which keys the row cache (so its map is 4 B per
owned cold row too). The state here is
synchronous and does no network I/O; a per-table lock serialises gathers and upserts so
a cold read racing an upsert can never re-cache a stale row.
"""

from __future__ import annotations

import dataclasses
import enum
import threading

import numpy as np

from embedding_server.layout import TableLayout
from embedding_server.quant import RowDType, encode
from embedding_server.store import RowStore
from embedding_server.cache import RowCache
from embedding_server.tiers import ColdTier, StorageTier, build_tier
from recserve.errors import FailedPrecondition, InvalidArgument
from recserve.sharding.plan import Tier


class Residence(enum.IntEnum):
    """Where an id resides on this shard: the uint8 values of :attr:`TableTiers.owned_code`.

    Not the plan's :class:`~recserve.sharding.plan.Tier`: a warm id is stored here as one
    column slice, so warm slice j of this shard is ``WARM0 + j`` (one code per storage
    tier), and ids the shard does not own are ``NOT_OWNED`` (0, the map's zero fill).
    """

    NOT_OWNED = 0
    HOT = 1
    COLD = 2
    WARM0 = 3


MAX_NAMED_IDS = 10  # error messages quote at most this many ids


@dataclasses.dataclass
class TableLookupResult:
    """Reply for one table: ``rows`` [N, W] in the requested dtype's stored layout
    (int8: [N, W + 8] uint8), masks uint8 [N], and per-tier served counts."""

    rows: np.ndarray
    found: np.ndarray
    not_owned: np.ndarray
    served: dict[Tier, int]
    missing: int


@dataclasses.dataclass
class PreparedUpsert:
    """A validated upsert of one table, split into the groups each tier stores:
    ``(tier, ids [M], slots [M], rows fp32 [M, tier width])``."""

    table: str
    groups: list[tuple[StorageTier, np.ndarray, np.ndarray, np.ndarray]]

    def store_writes(self) -> list[tuple[str, np.ndarray, np.ndarray, int, int]]:
        return [(self.table, ids, rows, tier.col_start, tier.col_end) for tier, ids, _, rows in self.groups]

    @property
    def num_rows(self) -> int:
        return sum(len(ids) for _, ids, _, _ in self.groups)


def _quote(ids: np.ndarray) -> str:
    shown = ", ".join(f"{int(i):,}" for i in ids[:MAX_NAMED_IDS])
    return f"[{shown}{', ...' if len(ids) > MAX_NAMED_IDS else ''}] ({len(ids):,} ids)"


class TableTiers:
    """All tiers of one table on this shard, plus its id -> (tier, slot) map."""

    def __init__(self, layout: TableLayout, store: RowStore, *, dtype: RowDType, cache_bytes: int, default_value: float = 0.0) -> None:
        self.layout = layout
        self.name, self.rows, self.dim = layout.name, layout.rows, layout.dim
        self.default_value = default_value
        self.lock = threading.Lock()
        # The cold tier's row cache is keyed by cold ordinal: its key space is the
        # shard's cold rows, not the table's id space.
        common = dict(table=layout.name, store=store, dtype=dtype, cache_bytes=cache_bytes)
        self.tiers: dict[int, StorageTier] = {  # keyed by Residence code
            Residence.HOT: build_tier(Tier.HOT, ids=layout.hot_ids, col_start=0, col_end=layout.dim, id_space=0, **common),  # type: ignore[arg-type]
            Residence.COLD: build_tier(Tier.COLD, ids=layout.cold_ids, col_start=0, col_end=layout.dim, id_space=len(layout.cold_ids), **common),  # type: ignore[arg-type]
        }
        members: list[tuple[np.ndarray, int]] = [(layout.hot_ids, Residence.HOT), (layout.cold_ids, Residence.COLD)]
        for j, warm in enumerate(layout.warm):
            self.tiers[Residence.WARM0 + j] = build_tier(Tier.WARM, ids=warm.ids, col_start=warm.col_start, col_end=warm.col_end, id_space=0, **common)  # type: ignore[arg-type]
            members.append((warm.ids, Residence.WARM0 + j))
        ids = np.concatenate([np.asarray(m, dtype=np.int64) for m, _ in members])
        order = np.argsort(ids, kind="stable")  # start-up, once
        self.owned_ids = np.ascontiguousarray(np.take(ids, order))
        # TableLayout guarantees each id at most one tier here, so the ids are distinct.
        self.owned_code = np.take(np.concatenate([np.full(len(m), code, dtype=np.uint8) for m, code in members]), order)
        self.owned_slot = np.take(np.concatenate([np.arange(len(m), dtype=np.int32) for m, _ in members]), order)

    def residence(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Validated ids [N] -> (uint8 :class:`Residence` [N], int32 slot [N]); ids this
        shard does not own get ``NOT_OWNED`` and an unspecified slot."""
        n_owned = self.owned_ids.size
        if n_owned == 0:
            return np.zeros(len(ids), dtype=np.uint8), np.zeros(len(ids), dtype=np.int32)
        at = np.minimum(np.searchsorted(self.owned_ids, ids), n_owned - 1)
        codes = np.take(self.owned_code, at)
        codes[np.take(self.owned_ids, at) != ids] = Residence.NOT_OWNED
        return codes, np.take(self.owned_slot, at)

    @property
    def index_bytes(self) -> int:
        """Bytes of the id index and the row cache's key map: 13 B per owned row + 4 B
        per owned cold row (``recserve.sharding.simulate.index_bytes`` is the closed form)."""
        return int(self.owned_ids.nbytes + self.owned_code.nbytes + self.owned_slot.nbytes + self.cold_cache.index_bytes)

    # -- validation ----------------------------------------------------------------

    def columns(self, col_start: int, col_end: int) -> tuple[int, int]:
        """Normalise a requested column range (0/0 = the full row) and validate it."""
        if (col_start, col_end) == (0, 0):
            return 0, self.dim
        if not 0 <= col_start < col_end <= self.dim:
            raise InvalidArgument(
                f"table {self.name!r}: column slice {col_start}..{col_end} is invalid; "
                f"use 0 <= col_start < col_end <= {self.dim} (or 0/0 for the full row)"
            )
        return col_start, col_end

    def check_ids(self, ids: np.ndarray, field: str) -> None:
        """Raise InvalidArgument naming the first id outside [0, rows)."""
        if len(ids) == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.rows:
            bad = lo if lo < 0 else hi
            raise InvalidArgument(f"{field}: table {self.name!r} has {self.rows:,} rows; id {bad:,} is out of range [0, {self.rows:,})")

    # -- lookup --------------------------------------------------------------------

    def lookup(self, ids: np.ndarray, col_start: int, col_end: int, out: RowDType) -> TableLookupResult:
        """Rows of validated ``ids`` [N] for columns ``[col_start, col_end)``.

        An id is served when this shard holds a tier covering the wanted columns;
        otherwise it is flagged ``not_owned``. An owned id RocksDB lacks gets the default
        row and ``found = 0``. Never raises for missing or foreign ids.
        """
        n, width = len(ids), col_end - col_start
        codes, slots = self.residence(ids)
        parts: list[tuple[np.ndarray, np.ndarray]] = []  # (positions, rows) per group
        found = np.zeros(n, dtype=np.uint8)
        not_owned = np.ones(n, dtype=np.uint8)
        served = {kind: 0 for kind in Tier}
        with self.lock:
            for code, tier in self.tiers.items():
                if not tier.col_start <= col_start < col_end <= tier.col_end:
                    continue  # this tier cannot serve the slice: its ids stay not_owned
                pos = np.flatnonzero(codes == code)
                if len(pos) == 0:
                    continue
                rows, ok = tier.gather(np.take(ids, pos), np.take(slots, pos), col_start, col_end, out)
                parts.append((pos, rows))
                not_owned[pos] = 0
                found[pos[ok]] = 1
                served[tier.kind] += int(np.count_nonzero(ok))
        missing = int(n - np.count_nonzero(found) - np.count_nonzero(not_owned))
        rows = self._assemble(n, width, out, parts, found)
        return TableLookupResult(rows=rows, found=found, not_owned=not_owned, served=served, missing=missing)

    def _assemble(self, n: int, width: int, out: RowDType, parts: list[tuple[np.ndarray, np.ndarray]], found: np.ndarray) -> np.ndarray:
        """Put each group's rows back in request order (one ``np.take``) and fill the
        default row where nothing was found."""
        if len(parts) == 1 and len(parts[0][0]) == n and found.all():
            return parts[0][1]  # one tier served everything, already in request order
        default = encode(np.full((1, width), self.default_value, dtype=np.float32), out)
        if not parts:
            return np.repeat(default, n, axis=0)
        served_pos = np.concatenate([p for p, _ in parts])
        stacked = np.concatenate([r for _, r in parts] + [default])
        order = np.full(n, len(stacked) - 1, dtype=np.int64)  # the default row unless found
        order[served_pos] = np.arange(len(served_pos))
        order[found == 0] = len(stacked) - 1
        return np.take(stacked, order, axis=0)

    # -- upsert --------------------------------------------------------------------

    def prepare_upsert(self, ids: np.ndarray, rows: np.ndarray, col_start: int, col_end: int) -> PreparedUpsert:
        """Validate an upsert of fp32 ``rows`` [N, col_end - col_start] and split it by
        tier. Every id must be owned here by a tier whose columns the rows cover;
        otherwise FailedPrecondition names the ids (the client's plan is stale)."""
        self.check_ids(ids, f"upsert {self.name}.ids")
        if len(np.unique(ids)) != len(ids):
            raise InvalidArgument(f"upsert {self.name}.ids: ids must be unique within one upsert")
        codes, slots = self.residence(ids)
        covered = np.zeros(len(ids), dtype=bool)
        groups: list[tuple[StorageTier, np.ndarray, np.ndarray, np.ndarray]] = []
        for code, tier in self.tiers.items():
            pos = np.flatnonzero(codes == code)
            if len(pos) == 0 or not col_start <= tier.col_start < tier.col_end <= col_end:
                continue
            group_ids = np.take(ids, pos)
            group_rows = np.take(rows, pos, axis=0)[:, tier.col_start - col_start : tier.col_end - col_start]
            groups.append((tier, group_ids, np.take(slots, pos), np.ascontiguousarray(group_rows, dtype=np.float32)))
            covered[pos] = True
        if not covered.all():
            raise FailedPrecondition(
                f"upsert {self.name}: this shard does not own ids {_quote(ids[~covered])} "
                f"for columns {col_start}..{col_end} under its plan; refresh the plan (GetPlan) and re-route"
            )
        return PreparedUpsert(table=self.name, groups=groups)

    def apply_upsert(self, prepared: PreparedUpsert) -> None:
        """Update DRAM tiers / row cache after RocksDB acknowledged the write.
        Call with :attr:`lock` held across the RocksDB write and this call."""
        for tier, ids, slots, rows in prepared.groups:
            tier.write(ids, slots, rows)

    # -- stats ---------------------------------------------------------------------

    @property
    def cold_cache(self) -> RowCache:
        cold = self.tiers[Residence.COLD]
        assert isinstance(cold, ColdTier)
        return cold.cache

    @property
    def cold_reads(self) -> int:
        """Keys the cold tier has read from RocksDB."""
        cold = self.tiers[Residence.COLD]
        assert isinstance(cold, ColdTier)
        return cold.rocksdb_reads

    def tier_sizes(self) -> dict[str, int]:
        warm = [t for c, t in self.tiers.items() if c >= Residence.WARM0]
        cold = self.tiers[Residence.COLD]
        return {
            "hot_rows": self.tiers[Residence.HOT].num_rows,
            "hot_bytes": self.tiers[Residence.HOT].nbytes,
            "warm_rows": sum(t.num_rows for t in warm),
            "warm_bytes": sum(t.nbytes for t in warm),
            "warm_col_start": min((t.col_start for t in warm), default=0),
            "warm_col_end": max((t.col_end for t in warm), default=0),
            "cold_rows": cold.num_rows,
            "cold_bytes": cold.num_rows * 4 * self.dim,
        }
