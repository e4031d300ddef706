"""Bounded LRU row cache in front of RocksDB for cold rows (docs/architecture.md §4).

A slot array, not a dict: rows live in one fp32 matrix ``[capacity, W]``, a dense
``id -> slot`` map (int32 over the table's id space) finds them, and a last-use tick per
slot orders eviction. Lookups, inserts and evictions are array operations over a whole
request's ids — no Python work per id. Eviction is LRU in batches: when free slots run
out, the ``max(needed, capacity / 8)`` least recently used slots are freed with one
``argpartition``, so its O(capacity) cost is paid once per eighth of the cache.

The byte bound covers rows and per-slot bookkeeping (row bytes + 16 B per slot); the
dense key map (4 B per key of ``id_space``) is index overhead reported by
:attr:`index_bytes`. The cold tier keys it by each row's ordinal among the shard's cold
rows, so the map is sized to the rows the shard owns, not to the table.
Not thread-safe: the owning tier serialises access.

Example::

    cache = RowCache(id_space=5000, width=32, capacity_bytes=1 << 20)
    rows, hit = cache.get(np.array([3, 9]))     # rows fp32 [2, 32] (zeros where ~hit)
    cache.put(np.array([3]), fetched)           # fetched: fp32 [1, 32]
"""

from __future__ import annotations

import numpy as np

SLOT_OVERHEAD_BYTES = 16  # id (int64) + last-use tick (int64) per slot
EVICT_BATCH_FRACTION = 8


class RowCache:
    """LRU cache of fp32 rows ``[W]`` keyed by ids in ``[0, id_space)``."""

    def __init__(self, *, id_space: int, width: int, capacity_bytes: int) -> None:
        self.width = width
        self.capacity = max(0, capacity_bytes // (4 * width + SLOT_OVERHEAD_BYTES))
        # The id map is only needed when the cache can hold something.
        self._slot_of = np.full(id_space if self.capacity else 0, -1, dtype=np.int32)
        self._ids = np.full(self.capacity, -1, dtype=np.int64)
        self._rows = np.zeros((self.capacity, width), dtype=np.float32)
        self._tick = np.zeros(self.capacity, dtype=np.int64)
        self._free = np.arange(self.capacity, dtype=np.int64)[::-1].copy()  # stack of free slots
        self._n_free = self.capacity
        self._clock = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0  # rows evicted to make room (not invalidations)

    # -- stats ---------------------------------------------------------------------

    @property
    def size(self) -> int:
        return self.capacity - self._n_free

    @property
    def nbytes(self) -> int:
        return int(self._rows.nbytes + self._ids.nbytes + self._tick.nbytes)

    @property
    def index_bytes(self) -> int:
        return int(self._slot_of.nbytes)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    # -- operations ----------------------------------------------------------------

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids int64 [N] (in range) -> (rows fp32 [N, W], hit bool [N]); counts hits and
        misses and marks hit slots as most recently used."""
        n = len(ids)
        if self.capacity == 0:
            self.misses += n
            return np.zeros((n, self.width), dtype=np.float32), np.zeros(n, dtype=bool)
        slots = np.take(self._slot_of, ids)
        hit = slots >= 0
        n_hit = int(np.count_nonzero(hit))
        self.hits += n_hit
        self.misses += n - n_hit
        self._clock += 1
        if n_hit == n:
            self._tick[slots] = self._clock
            return np.take(self._rows, slots, axis=0), hit
        rows = np.zeros((n, self.width), dtype=np.float32)
        if n_hit:
            hit_slots = slots[hit]
            self._tick[hit_slots] = self._clock
            rows[hit] = np.take(self._rows, hit_slots, axis=0)
        return rows, hit

    def put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Insert or overwrite unique ids [N] with fp32 rows [N, W] as most recently used.
        Beyond capacity only the last ``capacity`` ids are kept."""
        if self.capacity == 0 or len(ids) == 0:
            return
        if len(ids) > self.capacity:
            ids, rows = ids[-self.capacity :], rows[-self.capacity :]
        self._clock += 1
        slots = np.take(self._slot_of, ids)
        known = slots >= 0
        if known.any():
            known_slots = slots[known]
            self._rows[known_slots] = rows[known]
            self._tick[known_slots] = self._clock
        new = ~known
        n_new = int(np.count_nonzero(new))
        if n_new == 0:
            return
        if n_new > self._n_free:
            self._evict(max(n_new - self._n_free, self.capacity // EVICT_BATCH_FRACTION), keep=slots[known])
        taken = self._free[self._n_free - n_new : self._n_free][::-1]
        self._n_free -= n_new
        new_ids = ids[new]
        self._slot_of[new_ids] = taken
        self._ids[taken] = new_ids
        self._rows[taken] = rows[new]
        self._tick[taken] = self._clock

    def invalidate(self, ids: np.ndarray) -> None:
        """Drop ids [N] from the cache (absent ids are ignored)."""
        if self.capacity == 0 or len(ids) == 0:
            return
        slots = np.take(self._slot_of, ids)
        self._release(slots[slots >= 0])

    # -- internals -----------------------------------------------------------------

    def _evict(self, count: int, keep: np.ndarray) -> None:
        """Free the ``count`` least recently used occupied slots, sparing ``keep``."""
        ticks = self._tick.copy()
        ticks[self._ids < 0] = np.iinfo(np.int64).max  # free slots are not candidates
        ticks[keep] = np.iinfo(np.int64).max
        occupied = self.capacity - self._n_free - len(keep)
        count = min(count, occupied)
        if count <= 0:
            return
        victims = np.argpartition(ticks, count - 1)[:count]
        self._release(victims)
        self.evictions += count

    def _release(self, slots: np.ndarray) -> None:
        if len(slots) == 0:
            return
        self._slot_of[self._ids[slots]] = -1
        self._ids[slots] = -1
        self._tick[slots] = 0
        self._free[self._n_free : self._n_free + len(slots)] = slots
        self._n_free += len(slots)
