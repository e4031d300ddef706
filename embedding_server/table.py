"""One table on one shard: routes a request's ids to the tiers and assembles the reply.

An index built once from the :class:`~embedding_server.layout.TableLayout` and sized to
the rows this shard owns, not to the table (at 10**9 rows and 256 shards a map over
the id space would cost 9 GB per shard): ``owned_ids`` int64 sorted, with parallel
``owned_code`` uint8 and ``owned_slot`` int32 (13 B per owned row). One
``searchsorted`` + two ``np.take`` per request give each id's :class:`Residence` (where
it resides on *this* shard: not owned, hot, cold, or ``WARM0 + j`` = warm slice j of
this shard) and its slot: the row's slot in its DRAM tier, or for cold rows the row's
ordinal among this shard's cold rows, which keys the row cache (so its map is 4 B per
owned cold row too). A table small enough also gets a *dense* map over its id space
(``dense_code`` uint8 + ``dense_slot`` int32, 5 B per table row: 1 MB for 200k rows),
which answers the same question with two ``np.take`` and no ``searchsorted`` (whose
binary search over an index larger than L2 was the costliest step of a lookup: ≈ 55 µs
of a 650-id request); it is built only while it stays small next to the rows it
indexes (:func:`dense_index_fits`). The state here is
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
TIERS = tuple(Tier)  # iterating the Enum class per request costs ~1 µs of enum machinery
DENSE_INDEX_BYTES_PER_ROW = 5  # dense_code uint8 + dense_slot int32
# A dense map is built while it costs at most this much per table ...
DENSE_INDEX_MAX_BYTES = 32 << 20
# ... and no more than the DRAM rows it indexes, or this floor (small tables always get one).
DENSE_INDEX_FLOOR_BYTES = 1 << 20


def dense_index_fits(rows: int, dram_bytes: int) -> bool:
    """Whether a table of ``rows`` ids, whose DRAM tiers on this shard hold
    ``dram_bytes``, gets a dense id map (5 B per table row): at most
    :data:`DENSE_INDEX_MAX_BYTES`, and at most the larger of ``dram_bytes`` and
    :data:`DENSE_INDEX_FLOOR_BYTES`, so a shard owning a sliver of a big table keeps
    the owned-size index alone (the module docstring's 10**9-row case)."""
    need = rows * DENSE_INDEX_BYTES_PER_ROW
    return need <= DENSE_INDEX_MAX_BYTES and need <= max(dram_bytes, DENSE_INDEX_FLOOR_BYTES)


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
        self.num_codes = int(Residence.WARM0) + len(layout.warm)  # bincount length over owned_code
        self.dense_code: np.ndarray | None = None  # uint8 [rows]: Residence of every table id
        self.dense_slot: np.ndarray | None = None  # int32 [rows]: its slot (0 where not owned)
        dram_bytes = sum(t.nbytes for code, t in self.tiers.items() if code != Residence.COLD)
        if dense_index_fits(self.rows, dram_bytes):
            self.dense_code = np.zeros(self.rows, dtype=np.uint8)  # 0 = NOT_OWNED
            self.dense_code[self.owned_ids] = self.owned_code
            self.dense_slot = np.zeros(self.rows, dtype=np.int32)
            self.dense_slot[self.owned_ids] = self.owned_slot
        # (RowDType, width) -> the default row [1, stored width], encoded once (int8 quantises)
        self._default_rows: dict[tuple[RowDType, int], np.ndarray] = {}

    def residence(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Validated ids [N] -> (uint8 :class:`Residence` [N], int32 slot [N]); ids this
        shard does not own get ``NOT_OWNED`` and an unspecified slot."""
        if self.dense_code is not None and self.dense_slot is not None:
            return self.dense_code.take(ids), self.dense_slot.take(ids)  # methods: np.take's wrapper costs ≈ 1 µs a call
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
        per owned cold row (``recserve.sharding.simulate.index_bytes`` is the closed form),
        plus the dense map's 5 B per table row where one is built (bounded by
        :data:`DENSE_INDEX_MAX_BYTES`; not in the closed form, which sizes big tables)."""
        dense = 0 if self.dense_code is None or self.dense_slot is None else self.dense_code.nbytes + self.dense_slot.nbytes
        return int(self.owned_ids.nbytes + self.owned_code.nbytes + self.owned_slot.nbytes + self.cold_cache.index_bytes + dense)

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

    def check_ids(self, ids: np.ndarray, field: str) -> bool:
        """Raise InvalidArgument naming the first id outside [0, rows). Returns whether
        ``ids`` [N] are strictly increasing (the lookup client sends ``np.unique``
        output): then they hold no duplicate, and their ends are their min and max, so
        the one compare replaces the two reductions a range check needs otherwise."""
        n = len(ids)
        if n == 0:
            return True
        increasing = n == 1 or bool((ids[1:] > ids[:-1]).all())
        lo, hi = (int(ids[0]), int(ids[-1])) if increasing else (int(ids.min()), int(ids.max()))
        if lo < 0 or hi >= self.rows:
            bad = lo if lo < 0 else hi
            raise InvalidArgument(f"{field}: table {self.name!r} has {self.rows:,} rows; id {bad:,} is out of range [0, {self.rows:,})")
        return increasing

    # -- lookup --------------------------------------------------------------------

    def lookup(self, ids: np.ndarray, col_start: int, col_end: int, out: RowDType) -> TableLookupResult:
        """Rows of validated ``ids`` [N] for columns ``[col_start, col_end)``.

        An id is served when this shard holds a tier covering the wanted columns;
        otherwise it is flagged ``not_owned``. An owned id RocksDB lacks gets the default
        row and ``found = 0``. Never raises for missing or foreign ids.

        One ``bincount`` of the residence codes says which tiers the ids touch. When one
        tier serves them all (the common case: the lookup client sends a table's hot and
        its warm ids as separate entries) that tier gathers ``ids`` as they are, already
        in request order: no per-tier masks, index takes or reply scatter. Otherwise each
        touched tier gathers its ids and writes them into one reply array (one copy per
        row after the gather, where concatenating the parts and re-ordering took two).
        """
        n, width = len(ids), col_end - col_start
        codes, slots = self.residence(ids)
        counts = np.bincount(codes, minlength=self.num_codes)
        served = dict.fromkeys(TIERS, 0)
        with self.lock:
            serving = [
                (code, tier)
                for code, tier in self.tiers.items()
                if counts[code] and tier.col_start <= col_start < col_end <= tier.col_end  # else its ids stay not_owned
            ]
            if len(serving) == 1 and counts[serving[0][0]] == n:
                tier = serving[0][1]
                rows, ok = tier.gather(ids, slots, col_start, col_end, out)
                found = ok.view(np.uint8)  # bool -> uint8 in place: the gather's own fresh array
                not_owned = np.zeros(n, dtype=np.uint8)
                n_found = int(np.count_nonzero(ok))
                served[tier.kind] = n_found
            else:
                found = np.zeros(n, dtype=np.uint8)
                not_owned = np.ones(n, dtype=np.uint8)
                rows = np.empty((n, out.stored_width(width)), dtype=out.numpy)
                for code, tier in serving:
                    pos = np.flatnonzero(codes == code)
                    part, ok = tier.gather(ids.take(pos), slots.take(pos), col_start, col_end, out)
                    rows[pos] = part
                    not_owned[pos] = 0
                    found[pos] = ok
                    served[tier.kind] += int(np.count_nonzero(ok))
                n_found = int(np.count_nonzero(found))
        missing = n - n_found - int(np.count_nonzero(not_owned))
        if n_found < n:
            # Not found and not owned alike answer the default row (rows from a gather
            # are fresh arrays, so this never writes into a tier).
            rows[found == 0] = self.default_row(out, width)
        return TableLookupResult(rows=rows, found=found, not_owned=not_owned, served=served, missing=missing)

    def default_row(self, out: RowDType, width: int) -> np.ndarray:
        """The default row [1, stored width] in ``out``'s layout, encoded once per
        (dtype, width): an int8 one is quantised by fbgemm, not per request."""
        key = (out, width)
        row = self._default_rows.get(key)
        if row is None:
            row = encode(np.full((1, width), self.default_value, dtype=np.float32), out)
            self._default_rows[key] = row
        return row

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
