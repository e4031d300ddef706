"""Optional near cache: the hottest rows kept in the client process (pure; clock passed in).

Which rows: per table, up to ``near_cache_rows`` of the plan's hot ids (the planner's
top by access frequency; on a Zipf(1.05) stream the top 1% carries about 75% of
lookups). A row is served while it is younger than the staleness bound, so only rows
asked for more often than that stay cached; the hit rate is reported. Slots are fixed at
construction, so a lookup is array work with no per-id Python: one ``np.take`` into a
dense id -> slot map (int16/int32 over ``[0, max cached id]``, at most 16 MB, built
once) where the cached ids are below ``DENSE_SLOT_MAX_ID``, else a ``np.searchsorted``
over the sorted ids (≈ 3 µs against ≈ 20 µs for a 1,400-id window here).

**Staleness bound.** A hit returns a row that a shard served at most ``staleness_s``
ago. An upsert made through this client's upsert path invalidates the row at once (it
is never served stale after the upsert is acknowledged); an upsert made by any other
writer becomes visible within ``staleness_s`` (plus one lookup round trip).

**Row versions.** Every slot has a version, bumped by :meth:`invalidate`. A lookup
snapshots the versions of the rows it fetches when it sends; :meth:`fill` stores a
fetched row only if its version is unchanged, so a reply that left the shard before an
upsert cannot re-insert the old row after the upsert invalidated it.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Mapping

import numpy as np


DENSE_SLOT_MAX_ID = 1 << 22  # cached ids below this get a dense id -> slot map


@dataclasses.dataclass
class _TableCache:
    """``fetched_at`` and ``version`` carry one sentinel entry past the K slots (-inf,
    -1), so slot -1 (an uncached id) reads as never fetched, version -1, in one
    ``np.take`` without masking; nothing ever writes it."""

    ids: np.ndarray  # int64 [K] sorted
    rows: np.ndarray  # fp32 [K, D]
    fetched_at: np.ndarray  # float64 [K + 1] monotonic s; -inf = never
    version: np.ndarray  # int64 [K + 1]
    # int16/int32 [max id + 3]: entry i + 1 is the slot of id i, -1 if not cached; the
    # -1 at each end catches every other id under ``np.take(..., mode="clip")`` of
    # ``id + 1`` (negative ids clip to 0, ids past the last cached one to the end).
    # None when the ids reach DENSE_SLOT_MAX_ID: searchsorted instead.
    slot_of: np.ndarray | None = None

    @classmethod
    def build(cls, ids: np.ndarray, dim: int) -> "_TableCache":
        """Empty slots for the sorted ``ids`` [K > 0] of rows ``dim`` wide."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        k = ids.shape[0]
        slot_of = None
        if 0 <= int(ids[0]) and int(ids[-1]) < DENSE_SLOT_MAX_ID:
            slot_of = np.full(int(ids[-1]) + 3, -1, dtype=np.int16 if k < (1 << 15) else np.int32)
            slot_of[ids + 1] = np.arange(k)  # once, at construction
            slot_of.setflags(write=False)
        return cls(
            ids=ids,
            rows=np.zeros((k, dim), dtype=np.float32),
            fetched_at=np.full(k + 1, -np.inf),
            version=np.concatenate((np.zeros(k, dtype=np.int64), [-1])),
            slot_of=slot_of,
        )

    def slots(self, ids: np.ndarray) -> np.ndarray:
        """int64 [N]: slot of each of ``ids`` (any int64 values), -1 where not held."""
        if self.slot_of is not None:
            return np.take(self.slot_of, ids + 1, mode="clip").astype(np.int64)
        i = np.minimum(np.searchsorted(self.ids, ids), self.ids.shape[0] - 1)
        return np.where(np.take(self.ids, i) == ids, i, -1)


class NearCache:
    """Fixed-slot cache of hot rows with version invalidation and a staleness bound."""

    def __init__(self, tables: Mapping[str, tuple[np.ndarray, int]], staleness_s: float) -> None:
        """``tables``: name -> (ids to cache, int64 sorted [K]; row width D)."""
        self.staleness_s = staleness_s
        self._tables = {name: _TableCache.build(ids, dim) for name, (ids, dim) in tables.items() if ids.shape[0] > 0}
        # Windows big enough to be prepared on a worker thread read the cache while the
        # event loop fills it from replies: one lock keeps a row and its stamp together.
        self._lock = threading.Lock()
        self.lookups = 0  # unique ids asked for, per window
        self.hits = 0
        self.occurrence_lookups = 0  # callers' id lookups (with repeats)
        self.occurrence_hits = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of callers' id lookups (with repeats) answered from the cache."""
        return self.occurrence_hits / self.occurrence_lookups if self.occurrence_lookups else 0.0

    @property
    def unique_hit_rate(self) -> float:
        """Fraction of the unique ids of windows answered from the cache (the rows it
        kept off the wire)."""
        return self.hits / self.lookups if self.lookups else 0.0

    def slots(self, table: str, ids: np.ndarray) -> np.ndarray:
        """int64 [N]: slot of each id, -1 for ids the cache does not hold."""
        t = self._tables.get(table)
        if t is None or ids.size == 0:
            return np.full(ids.shape[0], -1, dtype=np.int64)
        return t.slots(ids)

    def get(self, table: str, ids: np.ndarray, now: float, occurrences: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Look up unique ``ids`` [N]; ``occurrences`` (int [N], default 1 each) says how
        many caller lookups each id stands for, for the hit rate.

        Returns (hit bool [N], rows fp32 [h, D] for the hits in order, slot int64 [N]
        with -1 for uncached ids).
        """
        t = self._tables.get(table)
        n = int(ids.shape[0])
        # One window's call: a handful of numpy calls, each ≈ 1-3 µs here, so no
        # temporaries beyond the hit mask and the hit slots (the occurrence-weighted hit
        # count is one integer dot product, not a masked copy and a sum).
        slot = t.slots(ids) if t is not None and n else np.full(n, -1, dtype=np.int64)
        with self._lock:
            self.lookups += n
            self.occurrence_lookups += n if occurrences is None else int(occurrences.sum())
            if t is None:
                return np.zeros(n, dtype=bool), np.zeros((0, 0), dtype=np.float32), slot
            # Never fetched (-inf, also slot -1's sentinel) is never fresh, even with an
            # infinite staleness bound.
            oldest = max(now - self.staleness_s, -sys.float_info.max)
            fresh = np.take(t.fetched_at, slot) >= oldest
            hits = int(np.count_nonzero(fresh))
            self.hits += hits
            if occurrences is None:
                self.occurrence_hits += hits
            elif occurrences.dtype == np.int64:  # np.dot sums in the input dtype: int64 only
                self.occurrence_hits += int(np.dot(occurrences, fresh))
            else:
                self.occurrence_hits += int(occurrences[fresh].sum())
            if hits == 0:
                return fresh, np.zeros((0, t.rows.shape[1]), dtype=np.float32), slot
            return fresh, np.take(t.rows, np.compress(fresh, slot), axis=0), slot

    def versions(self, table: str, slot: np.ndarray) -> np.ndarray:
        """int64 [N]: current versions of ``slot`` (-1 entries for uncached slots)."""
        t = self._tables.get(table)
        if t is None:
            return np.full(slot.shape[0], -1, dtype=np.int64)
        with self._lock:
            return np.take(t.version, slot)  # slot -1: the -1 sentinel

    def fill(self, table: str, slot: np.ndarray, version_at_send: np.ndarray, rows: np.ndarray, now: float) -> int:
        """Store fetched ``rows`` [n, D] into ``slot`` [n] unless the row was invalidated
        since the fetch was sent. Returns how many were stored."""
        t = self._tables.get(table)
        if t is None or slot.size == 0:
            return 0
        with self._lock:
            ok = t.version.take(slot) == version_at_send
            ok &= slot >= 0
            if np.logical_and.reduce(ok):  # the common fill: no row invalidated meanwhile
                s, vals = slot, rows
            else:
                s, vals = slot[ok], rows[ok]
            t.rows[s] = vals
            t.fetched_at[s] = now
            return int(s.shape[0])

    def invalidate(self, table: str, ids: np.ndarray) -> int:
        """Drop ``ids`` and bump their versions (upsert path). Returns how many were held."""
        t = self._tables.get(table)
        if t is None:
            return 0
        slot = self.slots(table, np.asarray(ids, dtype=np.int64))
        s = slot[slot >= 0]
        with self._lock:
            t.version[s] += 1
            t.fetched_at[s] = -np.inf
        return int(s.size)
