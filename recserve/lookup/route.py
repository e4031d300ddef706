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

This runs once per window, where numpy's fixed cost per call (≈1-2 µs here) is most of
the time, so calls are counted. On a healthy fleet (every shard live, none slow: the
common case) the per-row preference passes are skipped, since their answer is known: a
cold or warm id goes to its owner (one stable sort by destination,
:meth:`~recserve.sharding.router.TableRouter.route_by_shard`, gives every such unit) and
a hot id's rotation is its preference order. Per-shard bookkeeping is in Python lists.
The result is the general path's, unit for unit (tests/unit/test_route_fast.py).
Measured on the bench world's 64-caller window (1,400 fetched ids, 2 shards): ≈ 40 µs,
from ≈ 105 µs; a 1-caller window ≈ 30 µs, from ≈ 85 µs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
import numpy as np

from recserve.sharding.plan import TablePlan
from recserve.sharding.router import ShardRoutes, TableRouter

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


def _group(
    shards: np.ndarray,
    positions: np.ndarray,
    alternatives: np.ndarray,
    table: str,
    col: tuple[int, int],
    planned: list[int] | None = None,
) -> list[FetchUnit]:
    """Split ``positions`` [n] by destination ``shards`` [n]: one unit per shard, in
    shard order, positions in input order within a unit. ``planned`` (ids per shard, as
    a list over shards) is increased by the ids each shard gets, from the same count."""
    if shards.size == 0:
        return []
    counts = np.bincount(shards).tolist()
    if planned is not None:
        for s, c in enumerate(counts):
            planned[s] += c
    present = [s for s, c in enumerate(counts) if c]
    if len(present) == 1:  # one destination: the unit is the input, no copy
        return [FetchUnit(present[0], table, positions, col[0], col[1], alternatives)]
    if len(present) <= _MASK_GROUPS:
        # A few destinations: one boolean mask each beats a sort (same units, same order).
        units = []
        width = alternatives.shape[1]
        for s in present:
            m = shards == s
            if width == 0:  # warm slices, unreplicated cold rows: nothing to compress
                alts = np.empty((counts[s], 0), dtype=alternatives.dtype)
            elif width == 1:  # two replicas: a 1-D compress is ≈2x faster than along axis 0
                alts = np.compress(m, alternatives[:, 0])[:, None]
            else:
                alts = np.compress(m, alternatives, axis=0)
            units.append(FetchUnit(s, table, np.compress(m, positions), col[0], col[1], alts))
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
    live, slow = state.live, state.slow
    num_shards = live.shape[0]
    # [S] bools: Python's all/any over a list beat ndarray.all/any's fixed cost (≈1.5 µs).
    all_live = all(live.tolist())
    any_slow = any(slow.tolist())
    units: list[FetchUnit] = []
    unroutable: dict[str, np.ndarray] = {}
    # Ids this window sends to each shard, as a list: a few shards, read and summed per
    # table in Python (a numpy call on an [S] array costs more than the S additions).
    planned = [0] * num_shards
    hot_work: list[tuple[str, np.ndarray, np.ndarray]] = []

    # Phase 1: cold and warm (no choice except failover order) fix which shards this
    # window contacts anyway.
    for table, uids in unique_ids.items():
        pos_all = fetch_positions[table]
        if pos_all.size == 0:
            unroutable[table] = _NONE
            continue
        router = routers[table]
        # Window ids are unique ids of validated callers: no second range check.
        ids = np.take(uids, pos_all)
        if all_live and (plans[table].cold_replicas == 1 or not any_slow):
            # Every owner live and no replicated cold row to move behind a fast one (the
            # common case): each cold / warm id's destination is its owner, so one sort
            # by destination gives the units (same units as below, fewer passes).
            by_shard = router.route_by_shard(ids)
            if by_shard is not None:
                units += _units_by_shard(by_shard, pos_all, table, planned)
                if by_shard.hot_codes.size:
                    start = by_shard.num_cold + by_shard.num_warm
                    hot_work.append((table, np.take(pos_all, by_shard.order[start:]), router.hot_shards_of_codes(by_shard.hot_codes)))
                unroutable[table] = _NONE
                continue
        routes = router.route(ids, validated=True)
        lost: list[np.ndarray] = []
        if routes.cold_index.size:
            pos = np.take(pos_all, routes.cold_index)
            owners = routes.cold_shards
            if all_live and (owners.shape[1] == 1 or not any_slow):
                # Every owner live and none to move behind a fast one (the common case):
                # first_live would take column 0 and keep the rest, in order, as
                # alternatives. Same result, no per-row passes.
                units += _group(owners[:, 0], pos, owners[:, 1:], table, (0, 0), planned)
            else:
                ok = np.take(live, owners)
                if owners.shape[1] > 1 and any_slow:
                    # Replicated cold rows avoid a slow owner as hot ones do: fast live owners
                    # first, a slow one kept as the failover (a shard slow for seconds would
                    # otherwise hold every window's cold rows until the hedge budget ran dry).
                    owners, ok = _fast_first(owners, ok, slow)
                has, chosen, alts = first_live(owners, ok)
                lost.append(pos[~has])
                units += _group(chosen[has], pos[has], alts[has], table, (0, 0), planned)
        if routes.warm_index.size:
            pos = np.take(pos_all, routes.warm_index)
            shards = routes.warm_shards
            if not all_live:  # a warm row needs every slice's shard
                whole = np.take(live, shards).all(axis=1)
                lost.append(pos[~whole])
                pos, shards = pos[whole], shards[whole]
            plan = plans[table]
            bounds = plan.col_bounds() if plan.column_splits > 1 else [(0, 0)]
            no_alt = np.zeros((pos.shape[0], 0), dtype=np.int32)
            for k, col in enumerate(bounds):
                units += _group(shards[:, k], pos, no_alt, table, col, planned)
        if routes.hot_index.size:
            hot_work.append((table, np.take(pos_all, routes.hot_index), routes.hot_shards))
        unroutable[table] = np.concatenate(lost) if lost else _NONE

    healthy = all_live and not any_slow
    for table, pos, cands in hot_work:
        chosen, alts, reached = _assign_hot(cands, state, planned, rotation, min_ids_per_extra_rpc, healthy=healthy)
        if reached is None:  # every hot id has a live replica
            units += _group(chosen, pos, alts, table, (0, 0), planned)
            continue
        lost_hot = pos[~reached]
        if lost_hot.size:
            unroutable[table] = np.concatenate((unroutable[table], lost_hot))
        units += _group(chosen[reached], pos[reached], alts[reached], table, (0, 0), planned)
    return RoutePlan(units=units, unroutable=unroutable)


def _units_by_shard(routes: ShardRoutes, pos_all: np.ndarray, table: str, planned: list[int]) -> list[FetchUnit]:
    """The cold and warm units of ``routes`` (one per owner shard, cold first), their
    positions slices of ``pos_all`` [n] in destination order; ``planned`` gets their ids."""
    spos = np.take(pos_all, routes.order[: routes.num_cold + routes.num_warm])
    units: list[FetchUnit] = []
    start = 0
    for counts, alts in ((routes.cold_counts, routes.cold_alternatives), (routes.warm_counts, None)):
        first = start
        for shard, c in enumerate(counts):
            if c:
                a = np.empty((c, 0), dtype=np.int32) if alts is None else alts[start - first : start - first + c]
                units.append(FetchUnit(shard, table, spos[start : start + c], 0, 0, a))
                planned[shard] += c
                start += c
    return units


_odd_rows = np.zeros(0, dtype=bool)  # row i: i is odd; grown on demand, never written


def _odd_from(rotation: int, n: int) -> np.ndarray:
    """bool [n] read-only view: row i says ``(i + rotation)`` is odd."""
    global _odd_rows
    rows = _odd_rows
    if rows.shape[0] < n + 1:
        rows = (np.arange(max(2 * (n + 1), 8192)) & 1).astype(bool)
        rows.setflags(write=False)
        _odd_rows = rows  # one assignment: a reader on another thread sees either array
    start = rotation & 1
    return rows[start : start + n]


def rotate_replicas(cands: np.ndarray, rotation: int) -> np.ndarray:
    """``cands`` [H, R] with row i rotated left by ``(i + rotation) % R``: column j of
    the result is ``cands[i, (i + rotation + j) % R]``, so each replica column leads for
    an equal share of the rows."""
    h, r = cands.shape
    if r == 2:  # the default hot_replicas: odd rows swap their two columns (no 2-D modulo)
        return np.where(_odd_from(rotation, h)[:, None], cands[:, ::-1], cands)
    rot = (np.arange(h)[:, None] + rotation + np.arange(r)[None, :]) % r
    return np.take_along_axis(cands, rot, axis=1)


def _assign_hot(
    cands: np.ndarray,
    state: ShardState,
    planned: list[int],
    rotation: int,
    min_ids_per_extra_rpc: int,
    *,
    healthy: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Pick one replica per hot id. ``cands``: int32 [H, R]; ``planned``: ids the window
    already sends to each shard (a shard is *contacted* when its count is > 0);
    ``healthy``: every shard live and none slow. Returns (chosen [H], alternatives
    [H, R-1] in preference order, has_live bool [H], or None when every id has one)."""
    h, r = cands.shape
    num_shards = len(planned)
    has: np.ndarray | None = None
    if healthy and r == 2:
        # The rotation is the preference order (no per-row sort): even rows keep their
        # columns, odd ones swap them (rotate_replicas, without the 2-D copy).
        odd = _odd_from(rotation, h)
        c0, c1 = cands[:, 0], cands[:, 1]
        chosen = np.where(odd, c1, c0)
        alts = np.where(odd, c0, c1)[:, None]  # a writable [H, 1] view of its own array
    elif healthy:
        ordered = rotate_replicas(cands, rotation)
        chosen = ordered[:, 0].copy()
        alts = ordered[:, 1:].astype(np.int32)
    else:
        # Rotate each row's replica order: id i starts at column (i + rotation) % R, so
        # each replica column gets an equal share of the window.
        ordered = rotate_replicas(cands, rotation)
        live = np.take(state.live, ordered)
        fast = live & ~np.take(state.slow, ordered)
        # Slow replicas go last: keep their relative order but prefer any fast live one.
        pref = np.where(fast, 0, np.where(live, 1, 2)) * r + np.arange(r)[None, :]
        order = np.argsort(pref, axis=1, kind="stable")
        ordered = np.take_along_axis(ordered, order, axis=1)
        live = np.take_along_axis(live, order, axis=1)
        has, chosen, alts = first_live(ordered, live)
        if not has.any():
            return chosen, alts, has
    if r < 2:
        return chosen, alts, has

    # Per-shard bookkeeping in Python lists: S is a shard count, and each numpy call on
    # an [S] array costs more than S list operations.
    load = [a + b for a, b in zip(state.inflight_ids.tolist(), planned)]
    second = alts[:, 0]  # a view: hand-overs below rewrite it
    # Which ids may move to their second choice; None = every one. Healthy, the
    # alternatives are the plan's other replicas, R distinct shards per hot row (R <= S,
    # checked when the plan is built).
    movable: np.ndarray | None = None
    if has is not None:
        movable = has & (second >= 0) & ~np.take(state.slow, np.maximum(second, 0))
        if bool(movable.all()):
            movable = None
    counts = np.bincount(chosen if has is None else chosen[has], minlength=num_shards).tolist()
    total = [a + b for a, b in zip(load, counts)]
    # Two choices per (shard, partner) pair, in aggregate: hand over half the load gap,
    # the most loaded shard first (a stable order: ties keep shard order).
    for src in sorted((s for s in range(num_shards) if counts[s]), key=lambda s: -total[s]):
        if total[src] - min(total) < 2:  # no shard could take an id: skip the passes
            continue
        sel = chosen == src
        mine = (sel if movable is None else sel & movable).nonzero()[0]
        if mine.size == 0:
            continue
        partners = second[mine]
        dsts = [d for d, c in enumerate(np.bincount(partners, minlength=num_shards).tolist()) if c]
        for dst in dsts:
            gap = total[src] - total[dst]
            if gap < 2:
                continue
            group = mine if len(dsts) == 1 else mine[partners == dst]
            move = group[: min(group.size, gap // 2)]
            chosen[move], alts[move, 0] = dst, src
            total[src] -= move.size
            total[dst] += move.size

    # Do not open an RPC to an otherwise-uncontacted shard for a handful of ids. The
    # hand-overs moved ids between shards and ``total`` with them: counts = total - load.
    counts = [t - l for t, l in zip(total, load)]
    need = max(min_ids_per_extra_rpc, 1)
    reach_list = [planned[s] > 0 or counts[s] >= need for s in range(num_shards)]
    small = [s for s in range(num_shards) if counts[s] > 0 and not reach_list[s]]
    if not small:
        return chosen, alts, has
    reach = np.array(reach_list, dtype=bool)
    for src in small:
        sel = chosen == src
        mine = (sel if has is None else sel & has).nonzero()[0]
        ok = (alts[mine] >= 0) & np.take(reach, np.maximum(alts[mine], 0))
        can = ok.any(axis=1)
        col = np.argmax(ok, axis=1)
        movers = mine[can]
        dst = alts[movers, col[can]]
        alts[movers, col[can]] = src
        chosen[movers] = dst
    return chosen, alts, has
