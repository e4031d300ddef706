"""The load manifest: what bulk loads and migrations wrote into a shard's RocksDB, and
whether acknowledged upserts have landed since (docs/architecture.md §4).

The manifest is one JSON object in the store's metadata: manifest key -> record. A record
(``LoadRecord``) says what was written (rows per table, method) and, crucially, the
store's :class:`~embedding_server.store.UpsertCounter` when it finished. Upserts bump
that counter in the same WriteBatch as their rows, so ``counter - record`` is exactly the
upserts acknowledged since the load, across restarts and SIGKILLs. A migration
(:mod:`embedding_server.migrate`) also records how many upserts the old owners held
(``carried_upserts``): the migrated rows include them, so they too would be lost to a
re-load from the source arrays.

:func:`check_no_upserts_lost` is the one guard every writer that overwrites rows with
older data (a bulk load, a re-run migration) calls before writing.

Example::

    state = store_state(store)
    state.pending_upserts     # 3: a load from the source arrays would overwrite them
    check_no_upserts_lost(store, "src|plan=2|shard=1", shard_id=1, action="load")  # raises
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import time
from typing import Any

from embedding_server.store import RowStore, UpsertCounter
from recserve.errors import FailedPrecondition

MANIFEST_KEY = "load_manifest"
_KEY_TAIL = re.compile(r"\|plan=(\d+)\|shard=(\d+)$")


def read_manifest(store: RowStore) -> dict[str, dict[str, Any]]:
    """Completed loads and migrations: manifest key -> record."""
    raw = store.get_meta(MANIFEST_KEY)
    return {} if raw is None else dict(json.loads(raw.decode()))


def manifest_key(source_id: str, plan_version: int, shard_id: int) -> str:
    return f"{source_id}|plan={plan_version}|shard={shard_id}"


def key_plan_shard(key: str) -> tuple[int, int] | None:
    """(plan version, shard id) a :func:`manifest_key` was written for; None when ``key``
    is not of that form. Example: ``"src|plan=2|shard=1"`` -> ``(2, 1)``."""
    match = _KEY_TAIL.search(key)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def record_load(store: RowStore, key: str, record: dict[str, Any], *, carried_upserts: int = 0, carried_rows: int = 0) -> None:
    """Add ``record`` under ``key``, stamped with the store's upsert counter and the time.

    Call only once the written rows are durable (SST ingested or memtables flushed) and
    before the store accepts upserts again (shards load before they serve)."""
    manifest = read_manifest(store)
    counter = store.upserts
    manifest[key] = {
        **record,
        "finished_unix_s": time.time(),
        "upsert_seq": counter.seq,
        "upsert_rows": counter.rows,
        "carried_upserts": carried_upserts,
        "carried_rows": carried_rows,
    }
    store.put_meta(MANIFEST_KEY, json.dumps(manifest, sort_keys=True).encode())


@dataclasses.dataclass(frozen=True)
class StoreState:
    """A store's rows relative to its newest manifest record.

    ``new_upserts`` / ``new_rows``: acknowledged on this store since that record (all of
    them when there is no record); ``carried_upserts`` / ``carried_rows``: upserts the
    record's migration copied in from the old owners (0 for a load)."""

    last_key: str | None
    last_finished_unix_s: float | None
    counter: UpsertCounter
    new_upserts: int
    new_rows: int
    carried_upserts: int
    carried_rows: int

    @property
    def pending_upserts(self) -> int:
        """Upsert batches whose rows the source arrays lack."""
        return self.new_upserts + self.carried_upserts

    def describe(self) -> str:
        """One phrase naming the upserts and the record, for error messages."""
        when = "never loaded"
        if self.last_key is not None:
            finished = "?" if self.last_finished_unix_s is None else _iso(self.last_finished_unix_s)
            when = f"after its last load {self.last_key!r} (finished {finished})"
        parts = []
        if self.new_upserts:
            parts.append(f"{_count(self.new_upserts, 'upsert')} ({_count(self.new_rows, 'row')}, newest upsert #{self.counter.seq:,}) acknowledged {when}")
        if self.carried_upserts:
            parts.append(f"{_count(self.carried_upserts, 'upsert')} ({_count(self.carried_rows, 'row')}) migrated in by {self.last_key!r}")
        return " and ".join(parts) or "no upserts"


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _iso(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _int(record: dict[str, Any], field: str) -> int:
    return int(record.get(field, 0) or 0)  # records from before the counter existed: 0


def store_state(store: RowStore, manifest: dict[str, dict[str, Any]] | None = None) -> StoreState:
    """Where ``store`` stands against its newest manifest record (by upsert sequence,
    then finish time)."""
    manifest = read_manifest(store) if manifest is None else manifest
    counter = store.upserts
    if not manifest:
        return StoreState(None, None, counter, counter.seq, counter.rows, 0, 0)
    key, rec = max(manifest.items(), key=lambda kv: (_int(kv[1], "upsert_seq"), float(kv[1].get("finished_unix_s", 0.0))))
    return StoreState(
        last_key=key,
        last_finished_unix_s=float(rec["finished_unix_s"]) if "finished_unix_s" in rec else None,
        counter=counter,
        new_upserts=max(0, counter.seq - _int(rec, "upsert_seq")),
        new_rows=max(0, counter.rows - _int(rec, "upsert_rows")),
        carried_upserts=_int(rec, "carried_upserts"),
        carried_rows=_int(rec, "carried_rows"),
    )


def check_no_upserts_lost(store: RowStore, key: str, *, shard_id: int, action: str, rerun_ok: bool = False) -> StoreState:
    """Raise FailedPrecondition when writing ``key`` would overwrite upserts.

    ``rerun_ok``: re-writing the store's own newest record (a re-run migration) only
    endangers upserts acknowledged after it, not the ones it carried in."""
    state = store_state(store)
    pending = state.new_upserts if rerun_ok and state.last_key == key else state.pending_upserts
    if pending:
        raise FailedPrecondition(
            f"shard {shard_id}: refusing to {action} {key!r} into {str(store.path)!r}: the store holds {state.describe()}; "
            f"the {action} would overwrite them. To keep them, start the shard without --load-from "
            "(after a re-plan, move them with `recserve shard migrate`); to discard them, pass --overwrite"
        )
    return state
