"""Route a window's unique ids to shards (pure, vectorised).

Per table the plan's router gives each unique id its tier and candidate shards; this
module picks *one* destination per fetch and groups the fetches into
:class:`FetchUnit` s — (shard, table, column slice, positions) — which the fan-out packs
into one RPC per shard.

* **cold** ids go to their ring owner (the first live owner when ``cold_replicas > 1``,
  a fast one before a slow one);
  the other live owners are kept as failover alternatives.
* **warm** ids go to every column slice's shard; a warm row whose slices are not all on
  live shards cannot be completed and is not requested.
* **hot** ids are spread evenly over their live replicas by rotation (id position + a
  per-window offset), never by a per-id argmin over a load signal that does not move
  within the window — that would herd the whole window onto one replica. Across
  windows, power of two choices on in-flight work applies per (shard, alternative)
  pair: each hot id's two choices are its rotation replica and the next one, and a
  loaded shard hands over just enough ids to its pair partner to level their load
  (water-filling in aggregate). Shards the window does not otherwise contact receive
  hot ids only when enough of them travel to pay for the extra RPC; otherwise the ids go
  to an already-contacted replica.

Shards marked not ``live`` (open breaker) are skipped; shards marked ``slow`` (latency
far above the fleet's) receive hot ids only when no other replica is live and fast.
Ids with no live owner are returned as ``unroutable`` (default rows, degraded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
import numpy as np

from recserve.sharding.plan import TablePlan
from recserve.sharding.router import TableRouter

_NONE = np.zeros(0, dtype=np.int64)
_MASK_GROUPS = 4  # up to this many destination shards, _group splits by masks, not a sort


@dataclasses.dataclass(slots=True)
class FetchUnit:
    """Rows of one table to fetch from one shard.

    ``positions``: int64 [n] into the table window's unique ids. ``col_start`` /
    ``col_end``: the column slice (0/0 = the full row). ``alternatives``: int32 [n, A]
    other live owners of each row, in preference order, -1 padded (A = 0 when the rows
    have no other copy: warm slices, unreplicated cold rows); hedges and failover use it.
    """

    shard: int
    table: str
    positions: np.ndarray
    col_start: int = 0
    col_end: int = 0
    alternatives: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0), dtype=np.int32))

    @property
    def full_row(self) -> bool:
        return self.col_start == 0 and self.col_end == 0

    def __len__(self) -> int:
        return int(self.positions.shape[0])


@dataclasses.dataclass(slots=True)
class RoutePlan:
    """Units of a window plus the positions nothing live can serve (per table)."""

    units: list[FetchUnit]
    unroutable: dict[str, np.ndarray]

    def by_shard(self) -> dict[int, list[FetchUnit]]:
        out: dict[int, list[FetchUnit]] = {}
        for u in self.units:
            out.setdefault(u.shard, []).append(u)
        return out


def chunk_units(units: list[FetchUnit], max_ids: int) -> list[list[FetchUnit]]:
    """Split one shard's units into RPCs of at most ``max_ids`` ids each (a shard
    answers RESOURCE_EXHAUSTED above its ``max_ids_per_rpc``; docs/architecture.md §4).

    Units are packed in order and cut where an RPC fills up, so every RPC but the last is
    full and a unit spans at most ``ceil(len / max_ids) + 1`` RPCs. A loop over units and
    cuts (a few per shard), never over ids. Example: units of 5 and 4 ids, ``max_ids`` 3
    -> RPCs [5a:3], [5b:2 + 4a:1], [4b:3].
    """
    if sum(len(u) for u in units) <= max_ids:
        return [units]  # the common case: one RPC per shard
    rpcs: list[list[FetchUnit]] = []
    current: list[FetchUnit] = []
    room = max_ids
    for u in units:
        start, n = 0, len(u)
        while start < n:
            take = min(room, n - start)
            end = start + take
            part = u if (start, end) == (0, n) else dataclasses.replace(u, positions=u.positions[start:end], alternatives=u.alternatives[start:end])
            current.append(part)
            room -= take
            start = end
            if room == 0:
                rpcs.append(current)
                current, room = [], max_ids
    if current:
        rpcs.append(current)
    return rpcs


@dataclasses.dataclass(frozen=True, slots=True)
class ShardState:
    """What routing knows about the shards, as arrays over shard ids.

    ``live``: bool [S] (breaker not open). ``slow``: bool [S] (avoid for hot ids).
    ``inflight_ids``: int64 [S] ids sent and not yet answered, over all windows."""

    live: np.ndarray
    slow: np.ndarray
    inflight_ids: np.ndarray

    @classmethod
    def healthy(cls, num_shards: int) -> "ShardState":
        return cls(np.ones(num_shards, bool), np.zeros(num_shards, bool), np.zeros(num_shards, np.int64))


def _group(shards: np.ndarray, positions: np.ndarray, alternatives: np.ndarray, table: str, col: tuple[int, int]) -> list[FetchUnit]:
    """Split ``positions`` [n] by destination ``shards`` [n]: one unit per shard."""
    if shards.size == 0:
        return []
    present = np.flatnonzero(np.bincount(shards))
    if present.size == 1:  # one destination: the unit is the input, no copy
        return [FetchUnit(int(present[0]), table, positions, col[0], col[1], alternatives)]
    if present.size <= _MASK_GROUPS:
        # A few destinations: one boolean mask each beats a sort (same units, same order).
        units = []
        for s in present.tolist():
            m = shards == s
            units.append(FetchUnit(s, table, np.compress(m, positions), col[0], col[1], np.compress(m, alternatives, axis=0)))
        return units
    order = np.argsort(shards, kind="stable")
    s_sorted = shards[order]
    cut = np.flatnonzero(np.diff(s_sorted)) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [s_sorted.size]))
    return [
        FetchUnit(int(s_sorted[a]), table, positions[order[a:b]], col[0], col[1], alternatives[order[a:b]])
        for a, b in zip(starts.tolist(), ends.tolist())
    ]


def first_live(cands: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``cands`` [n, K] (columns already in preference order) with ``ok``
    [n, K]: (has_any [n], chosen shard [n], other ok shards [n, K-1] in order, -1 padded)."""
    n, k = cands.shape
    if k == 1:  # one candidate (unreplicated cold rows): nothing to choose
        return ok[:, 0].copy(), cands[:, 0].copy(), np.zeros((n, 0), dtype=np.int32)
    has = np.asarray(ok.any(axis=1), dtype=bool)
    first = np.argmax(ok, axis=1)
    chosen = np.take_along_axis(cands, first[:, None], axis=1)[:, 0]
    rest_ok = ok.copy()
    rest_ok[np.arange(n), first] = False
    # Stable-pack the remaining ok columns to the left (preference order kept).
    key = np.where(rest_ok, np.arange(k)[None, :], k)
    idx = np.sort(key, axis=1)[:, : max(k - 1, 0)]
    valid = idx < k
    alts = np.where(valid, np.take_along_axis(cands, np.minimum(idx, k - 1), axis=1), -1)
    return has, chosen, alts.astype(np.int32)


def _fast_first(cands: np.ndarray, live: np.ndarray, slow: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``cands`` [n, K] and ``live`` [n, K] reordered per row: live and fast, then live
    and slow, then the rest, each group in its original order."""
    k = cands.shape[1]
    fast = live & ~np.take(slow, cands)
    order = np.argsort(np.where(fast, 0, np.where(live, 1, 2)) * k + np.arange(k)[None, :], axis=1, kind="stable")
    return np.take_along_axis(cands, order, axis=1), np.take_along_axis(live, order, axis=1)


def route_window(
    unique_ids: Mapping[str, np.ndarray],
    fetch_positions: Mapping[str, np.ndarray],
    plans: Mapping[str, TablePlan],
    routers: Mapping[str, TableRouter],
    state: ShardState,
    *,
    rotation: int = 0,
    min_ids_per_extra_rpc: int = 64,
) -> RoutePlan:
    """Route every table's ``unique_ids[t][fetch_positions[t]]`` (near-cache misses).

    ``rotation`` varies the hot replica rotation between windows (e.g. a window counter)
    so repeated small windows do not always start on the same replica.
    """
    num_shards = state.live.shape[0]
    all_live = bool(state.live.all())
    units: list[FetchUnit] = []
    unroutable: dict[str, np.ndarray] = {}
    planned = np.zeros(num_shards, dtype=np.int64)  # ids this window sends to each shard
    hot_work: list[tuple[str, np.ndarray, np.ndarray]] = []

    # Phase 1: cold and warm (no choice except failover order) fix which shards this
    # window contacts anyway.
    for table, uids in unique_ids.items():
        pos_all = fetch_positions[table]
        # Window ids are unique ids of validated callers: no second range check.
        routes = routers[table].route(uids[pos_all], validated=True) if pos_all.size else None
        lost: list[np.ndarray] = []
        if routes is None:
            unroutable[table] = _NONE
            continue
        if routes.cold_index.size:
            pos = pos_all[routes.cold_index]
            owners = routes.cold_shards
            live = np.take(state.live, owners)
            if owners.shape[1] > 1 and bool(state.slow.any()):
                # Replicated cold rows avoid a slow owner as hot ones do: fast live owners
                # first, a slow one kept as the failover (a shard slow for seconds would
                # otherwise hold every window's cold rows until the hedge budget ran dry).
                owners, live = _fast_first(owners, live, state.slow)
            has, chosen, alts = first_live(owners, live)
            lost.append(pos[~has])
            units += _group(chosen[has], pos[has], alts[has], table, (0, 0))
            planned += np.bincount(chosen[has], minlength=num_shards)
        if routes.warm_index.size:
            pos = pos_all[routes.warm_index]
            shards = routes.warm_shards
            if all_live:  # every slice's shard is up (the common case): nothing is lost
                ok_pos, ok_shards = pos, shards
            else:
                ok = np.take(state.live, shards).all(axis=1)
                lost.append(pos[~ok])
                ok_pos, ok_shards = pos[ok], shards[ok]
            plan = plans[table]
            bounds = plan.col_bounds() if plan.column_splits > 1 else [(0, 0)]
            no_alt = np.zeros((ok_pos.shape[0], 0), dtype=np.int32)
            for k, col in enumerate(bounds):
                units += _group(ok_shards[:, k], ok_pos, no_alt, table, col)
                planned += np.bincount(ok_shards[:, k], minlength=num_shards)
        if routes.hot_index.size:
            hot_work.append((table, pos_all[routes.hot_index], routes.hot_shards))
        unroutable[table] = np.concatenate(lost) if lost else _NONE

    contacted = planned > 0
    for table, pos, cands in hot_work:
        chosen, alts, has = _assign_hot(cands, state, planned, contacted, rotation, min_ids_per_extra_rpc)
        lost_hot = pos[~has]
        if lost_hot.size:
            unroutable[table] = np.concatenate((unroutable[table], lost_hot))
        units += _group(chosen[has], pos[has], alts[has], table, (0, 0))
        counts = np.bincount(chosen[has], minlength=num_shards)
        planned += counts
        contacted |= counts > 0
    return RoutePlan(units=units, unroutable=unroutable)


def rotate_replicas(cands: np.ndarray, rotation: int) -> np.ndarray:
    """``cands`` [H, R] with row i rotated left by ``(i + rotation) % R``: column j of
    the result is ``cands[i, (i + rotation + j) % R]``, so each replica column leads for
    an equal share of the rows."""
    h, r = cands.shape
    if r == 2:  # the default hot_replicas: odd rows swap their two columns (no 2-D modulo)
        odd = (np.arange(rotation, rotation + h) & 1).astype(bool)
        return np.where(odd[:, None], cands[:, ::-1], cands)
    rot = (np.arange(h)[:, None] + rotation + np.arange(r)[None, :]) % r
    return np.take_along_axis(cands, rot, axis=1)


def _assign_hot(
    cands: np.ndarray,
    state: ShardState,
    planned: np.ndarray,
    contacted: np.ndarray,
    rotation: int,
    min_ids_per_extra_rpc: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pick one replica per hot id. ``cands``: int32 [H, R]. Returns (chosen [H],
    alternatives [H, R-1] in preference order, has_live [H])."""
    h, r = cands.shape
    # Rotate each row's replica order: id i starts at column (i + rotation) % R, so each
    # replica column gets an equal share of the window.
    ordered = rotate_replicas(cands, rotation)
    if bool(state.live.all()) and not bool(state.slow.any()):
        # Every replica live and fast (the common case): the rotation is the preference
        # order, so no per-row sort is needed (same result as the general path).
        has = np.ones(h, dtype=bool)
        chosen = ordered[:, 0].copy()
        alts = ordered[:, 1:].astype(np.int32)
    else:
        live = np.take(state.live, ordered)
        fast = live & ~np.take(state.slow, ordered)
        # Slow replicas go last: keep their relative order but prefer any fast live one.
        pref = np.where(fast, 0, np.where(live, 1, 2)) * r + np.arange(r)[None, :]
        order = np.argsort(pref, axis=1, kind="stable")
        ordered = np.take_along_axis(ordered, order, axis=1)
        live = np.take_along_axis(live, order, axis=1)
        has, chosen, alts = first_live(ordered, live)
    if r < 2 or not has.any():
        return chosen, alts, has

    load = state.inflight_ids + planned
    second = alts[:, 0]
    movable = has & (second >= 0) & ~np.take(state.slow, np.maximum(second, 0))
    counts = np.bincount(chosen[has], minlength=load.shape[0])
    total = load + counts
    # Two choices per (shard, partner) pair, in aggregate: hand over half the load gap.
    src_all = np.flatnonzero(counts)
    for src in src_all[np.argsort(-total[src_all])].tolist():
        mine = np.flatnonzero(movable & (chosen == src))
        if mine.size == 0:
            continue
        partners = second[mine]
        for dst in np.flatnonzero(np.bincount(partners, minlength=load.shape[0])).tolist():
            gap = int(total[src] - total[dst])
            if gap < 2:
                continue
            group = mine[partners == dst]
            move = group[: min(group.size, gap // 2)]
            chosen[move], alts[move, 0] = dst, src
            total[src] -= move.size
            total[dst] += move.size

    # Do not open an RPC to an otherwise-uncontacted shard for a handful of ids.
    counts = np.bincount(chosen[has], minlength=load.shape[0])
    reach = contacted | (counts >= max(min_ids_per_extra_rpc, 1))
    small = np.flatnonzero((counts > 0) & ~reach)
    for src in small.tolist():
        mine = np.flatnonzero(has & (chosen == src))
        ok = (alts[mine] >= 0) & np.take(reach, np.maximum(alts[mine], 0))
        can = ok.any(axis=1)
        col = np.argmax(ok, axis=1)
        movers = mine[can]
        dst = alts[movers, col[can]]
        alts[movers, col[can]] = src
        chosen[movers] = dst
    return chosen, alts, has
