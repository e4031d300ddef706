"""Move a fleet's rows from an old sharding plan to a new one, keeping upserts.

A re-plan (``recserve.sharding.replan``: a shard joins or leaves) changes which shard
owns which rows. Re-loading the new shards from the source arrays would lose every
upsert acknowledged since the first load, so instead :func:`migrate` copies the rows
from the old owners' RocksDB to the new owners' under the new plan — every owner: each
hot replica, each warm column slice (re-cut if the split changed), each cold owner and
cold replica.

It runs **offline**, on the data directories of stopped shards: opening a store takes
RocksDB's lock, so a shard still running fails the migration with a clear error instead
of letting it miss that shard's later upserts. The old stores are only read; the new
stores are separate directories (copying, not moving in place, so a crash half-way
cannot lose the only copy of a row, and the old directories stay as the rollback).
Each old store's newest manifest record must name its own slot and a plan no later than
``--from-plan`` (:func:`check_old_stores`): rows are read where the old plan places
them, so a wrong plan or swapped directories would otherwise drop rows silently.

Work is vectorised per id-range chunk: every old owner's rows of the chunk are read with
multi-gets into one full-width buffer plus a per-column "held" mask, then each new
owner takes its rows (or column slice) with one ``np.take`` and writes them as a
WAL-less batch; the new stores are flushed before anything is recorded. Columns no old
owner held (a row never loaded) are not written, so they stay missing — read as the
default row, exactly as before.

Idempotent: re-running rewrites the same values. Each new store's load manifest records
the migration (carrying the old owners' upsert count), so the new shards start without
``--load-from`` and a later ``--load-from`` is refused rather than silently overwriting
the migrated upserts; a re-run is refused once a new shard acknowledged upserts of its
own, unless ``overwrite``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import numpy as np

from embedding_server.bulk_load import table_model_versions
from embedding_server.codec import encode_keys, encode_values
from embedding_server.layout import TableLayout, layouts_from_plan
from embedding_server.manifest import StoreState, check_no_upserts_lost, key_plan_shard, manifest_key, record_load, store_state
from embedding_server.store import RowStore
from recserve.errors import ConfigError
from recserve.sharding.plan import ShardingPlan

log = logging.getLogger(__name__)

CHUNK_BYTES = 32 << 20  # full-width fp32 buffer per chunk
MIN_CHUNK_IDS = 1024


@dataclasses.dataclass(frozen=True)
class MigrationReport:
    """What :func:`migrate` wrote. ``rows_written``: new shard -> table -> rows (a warm
    slice counts as a row); ``ids_incomplete``: table -> ids no old owner held in full
    (not written where a new owner needs the missing columns: they stay missing)."""

    from_version: int
    to_version: int
    rows_written: dict[int, dict[str, int]]
    ids_incomplete: dict[str, int]
    carried_upserts: int
    carried_rows: int
    tables_dropped: list[str]
    seconds: float


def migration_key(from_version: int, to_version: int, shard_id: int) -> str:
    """The new store's manifest key of a migration from plan ``from_version``."""
    return manifest_key(f"migrate-from-v{from_version}", to_version, shard_id)


def check_plans(old: ShardingPlan, new: ShardingPlan) -> list[str]:
    """Raise ConfigError unless every table of ``new`` exists in ``old`` with the same
    shape; return the tables only ``old`` has (not migrated)."""
    for name, t in sorted(new.tables.items()):
        if name not in old.tables:
            raise ConfigError(f"table {name!r} of plan v{new.version} is not in plan v{old.version}; migrate the shared tables first, then load new ones")
        o = old.tables[name]
        if (o.rows, o.dim) != (t.rows, t.dim):
            raise ConfigError(f"table {name!r} is [{o.rows:,}, {o.dim}] in plan v{old.version} but [{t.rows:,}, {t.dim}] in plan v{new.version}; a migration cannot reshape rows")
    return sorted(set(old.tables) - set(new.tables))


def check_old_stores(old: ShardingPlan, stores: Sequence[RowStore], states: Sequence[StoreState]) -> None:
    """Raise ConfigError when an old store's newest manifest record shows it was not
    shard ``i`` of plan ``old`` (or an earlier version of it): the migration reads each
    store's rows where ``old`` places them, so a wrong ``--from-plan`` or a swapped data
    directory would silently drop the rows (upserts included) it looks for elsewhere.
    A store with no record (never loaded) and one loaded under an *earlier* version
    (a plan bump served without a re-load) pass."""
    for i, (store, state) in enumerate(zip(stores, states)):
        recorded = None if state.last_key is None else key_plan_shard(state.last_key)
        if recorded is None:
            continue
        version, shard = recorded
        if shard != i or version > old.version:
            raise ConfigError(
                f"old store {str(store.path)!r} is slot {i} of plan v{old.version}, but its last load {state.last_key!r} "
                f"was for shard {shard} of plan v{version}; pass the plan those shards served as --from-plan "
                "and each shard's own data directory"
            )


def _in_range(layout: TableLayout, lo: int, hi: int) -> list[tuple[np.ndarray, int, int]]:
    """The (ids, col_start, col_end) groups of ``layout`` with ids in ``[lo, hi)``."""
    out = []
    for ids, cs, ce in layout.owned_ids():
        a, b = np.searchsorted(ids, [lo, hi])
        if b > a:
            out.append((ids[a:b], cs, ce))
    return out


def _gather(table: str, lo: int, hi: int, dim: int, layouts: Sequence[TableLayout], stores: Sequence[RowStore]) -> tuple[np.ndarray, np.ndarray]:
    """Rows fp32 [hi - lo, dim] of ids ``lo..hi`` from their old owners, and held bool
    [hi - lo, dim] (which columns some owner had). Replicas hold equal rows once an
    upsert was acknowledged, so whichever is read last wins."""
    rows = np.zeros((hi - lo, dim), dtype=np.float32)
    held = np.zeros((hi - lo, dim), dtype=bool)
    for layout, store in zip(layouts, stores):
        for ids, cs, ce in _in_range(layout, lo, hi):
            got, present = store.get_rows(table, ids, cs, ce)
            pos = ids[present] - lo
            rows[pos, cs:ce] = got[present]
            held[pos, cs:ce] = True
    return rows, held


def migrate(
    old_plan: ShardingPlan,
    new_plan: ShardingPlan,
    old_stores: Sequence[RowStore],
    new_stores: Sequence[RowStore],
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> MigrationReport:
    """Copy every row from ``old_stores`` (one per slot of ``old_plan``) to its owners in
    ``new_stores`` (one per slot of ``new_plan``), then record it in each new store's
    manifest. The caller opens and closes the stores (shards stopped)."""
    from tqdm import tqdm

    start = time.monotonic()
    if len(old_stores) != old_plan.num_shards or len(new_stores) != new_plan.num_shards:
        raise ConfigError(
            f"migrate: got {len(old_stores)} old and {len(new_stores)} new stores; "
            f"plan v{old_plan.version} has {old_plan.num_shards} shards and plan v{new_plan.version} {new_plan.num_shards}"
        )
    dropped = check_plans(old_plan, new_plan)
    keys = [migration_key(old_plan.version, new_plan.version, j) for j in range(new_plan.num_shards)]
    if not overwrite:
        for j, store in enumerate(new_stores):
            check_no_upserts_lost(store, keys[j], shard_id=j, action="migrate", rerun_ok=True)
    states = [store_state(s) for s in old_stores]
    check_old_stores(old_plan, old_stores, states)
    versions = carried_model_versions(new_plan, old_stores)
    carried = sum(s.pending_upserts for s in states)
    carried_rows = sum(s.new_rows + s.carried_rows for s in states)
    old_layouts = [layouts_from_plan(old_plan, i) for i in range(old_plan.num_shards)]
    new_layouts = [layouts_from_plan(new_plan, j) for j in range(new_plan.num_shards)]
    written = {j: {name: 0 for name in new_plan.tables} for j in range(new_plan.num_shards)}
    incomplete = {name: 0 for name in new_plan.tables}
    total = sum(t.rows for t in new_plan.tables.values())
    with tqdm(total=total, desc=f"migrate plan v{old_plan.version} -> v{new_plan.version}", unit="id", disable=not progress) as bar:
        for name, table in sorted(new_plan.tables.items()):
            chunk = max(MIN_CHUNK_IDS, CHUNK_BYTES // (4 * table.dim))
            olds = [lay[name] for lay in old_layouts]
            for lo in range(0, table.rows, chunk):
                hi = min(lo + chunk, table.rows)
                rows, held = _gather(name, lo, hi, table.dim, olds, old_stores)
                incomplete[name] += int(np.count_nonzero(~held.all(axis=1)))
                for j, store in enumerate(new_stores):
                    written[j][name] += _write_owned(store, new_layouts[j][name], rows, held, lo, hi)
                bar.update(hi - lo)
    for j, store in enumerate(new_stores):
        store.flush()  # WAL-less rows reach SST files before the migration is recorded
        record = {
            "kind": "migrate", "from_plan_version": old_plan.version, "rows": written[j], "method": "batch", "wal": False,
            "model_versions": versions,
        }
        record_load(store, keys[j], record, carried_upserts=carried, carried_rows=carried_rows)
    report = MigrationReport(
        from_version=old_plan.version,
        to_version=new_plan.version,
        rows_written=written,
        ids_incomplete=incomplete,
        carried_upserts=carried,
        carried_rows=carried_rows,
        tables_dropped=dropped,
        seconds=time.monotonic() - start,
    )
    log.info("migrated plan v%d -> v%d in %.2f s: %d rows written", old_plan.version, new_plan.version, report.seconds, sum(sum(r.values()) for r in written.values()))
    return report


def carried_model_versions(new_plan: ShardingPlan, old_stores: Sequence[RowStore]) -> dict[str, str]:
    """table -> the ``model_version`` its old owners were loaded from, for the new stores'
    migration record (the ranker refuses tables whose version differs from its weights,
    so a migrated shard must keep reporting it). Old owners that disagree hold rows of
    different exports: mixing them would serve a table no model was trained with."""
    per_store = [table_model_versions(store) for store in old_stores]
    out: dict[str, str] = {}
    for name in sorted(new_plan.tables):
        seen = sorted({v[name] for v in per_store if v.get(name)})
        if len(seen) > 1:
            raise ConfigError(
                f"table {name!r}: the old shards were loaded from different exports {seen}; "
                "reload them from one export before migrating"
            )
        out[name] = seen[0] if seen else ""
    return out


def _write_owned(store: RowStore, layout: TableLayout, rows: np.ndarray, held: np.ndarray, lo: int, hi: int) -> int:
    """Write the rows (slices) ``layout`` owns among ids ``lo..hi`` whose columns are
    held; returns how many."""
    keys: list[bytes] = []
    values: list[bytes] = []
    for ids, cs, ce in _in_range(layout, lo, hi):
        pos = ids - lo
        ok = held[pos, cs:ce].all(axis=1)
        keep = pos[ok]
        keys += encode_keys(ids[ok])
        values += encode_values(np.take(rows, keep, axis=0)[:, cs:ce], dim=layout.dim, col_start=cs, col_end=ce)
    if keys:
        store.write_encoded_unlogged(layout.name, keys, values)
    return len(keys)
