"""RocksDB row store: the source of truth of a shard (docs/architecture.md §4).

One column family per table, named after the table (so reordering the config remaps
nothing); keys and values as in :mod:`embedding_server.codec`. Every column family uses
a block-based table with a bloom filter (point lookups of absent ids skip the data
block) and one shared, sized block cache. The default column family holds metadata
(the bulk-load manifest and the upsert counter).

Upserts go through the WAL (``write_rows``); bulk loads and migrations use SST ingestion
or WAL-less batches followed by a flush (:mod:`embedding_server.bulk_load`,
:mod:`embedding_server.migrate`). Every ``write_rows`` batch also bumps the persisted
:class:`UpsertCounter` *in the same WriteBatch*, so an acknowledged upsert is always
counted: a later load can tell that the store holds rows its source arrays lack. All
methods are synchronous and thread-safe as RocksDB is; callers run them off the event loop.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import struct
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import rocksdict

from embedding_server.codec import decode_values, encode_keys, encode_values
from recserve.errors import FailedPrecondition

log = logging.getLogger(__name__)

# "1": open RocksDB with use_direct_reads (set by the launcher for a benchmark's tiered run).
DIRECT_READS_ENV = "RECSERVE_ROCKSDB_DIRECT_READS"
READ_THREADS = 8  # threads one multi-get may use (the caller's included); 1 = serial
PARALLEL_READ_MIN_IDS = 32  # ids per part at least: smaller reads are not worth a thread hop
BLOOM_BITS_PER_KEY = 10  # ≈1% false positives: absent-id reads rarely touch a data block
META_PREFIX = b"__recserve__/"
UPSERT_COUNTER_KEY = META_PREFIX + b"upsert_counter"
_COUNTER = struct.Struct("<QQ")  # (batches, rows), little-endian u64


@dataclasses.dataclass(frozen=True)
class UpsertCounter:
    """Upserts this store ever acknowledged: ``seq`` counts ``write_rows`` batches (one
    per shard Upsert RPC), ``rows`` the rows they wrote. Monotonic; never reset (a load
    records the ``seq`` it saw, see :mod:`embedding_server.bulk_load`)."""

    seq: int = 0
    rows: int = 0


class RowStore:
    """A RocksDB database with one column family per table.

    ``tables`` maps table name -> row width ``dim``. Column families for tables the
    database already has but ``tables`` lacks are opened too (RocksDB requires it) and
    left untouched.
    """

    # Test-only (the shard's --fault-hook, "disk_full"): when set, write_rows raises this
    # I/O error instead of writing, as RocksDB does on a full disk.
    fail_writes: str | None = None

    def __init__(
        self,
        path: str | Path,
        tables: Mapping[str, int],
        *,
        block_cache_bytes: int = 64 << 20,
        sync_writes: bool = False,
        background_jobs: int = 2,
        read_threads: int = READ_THREADS,
    ) -> None:
        self.path = Path(path)
        # Big multi-gets are split over these threads: a point read that misses the
        # caches waits on the disk (≈60 µs with direct reads here) and RocksDB's
        # MultiGet issues one such read after another, so parts in parallel overlap
        # their waits (240 cold ids: 63-74 -> 30-34 µs per id with 4-8 threads).
        self._readers = concurrent.futures.ThreadPoolExecutor(read_threads - 1, thread_name_prefix="rowstore-read") if read_threads > 1 else None
        self._read_parts = max(1, read_threads)
        self.path.mkdir(parents=True, exist_ok=True)
        self.dims = dict(tables)
        self._cache = rocksdict.Cache(block_cache_bytes)
        self._background_jobs = background_jobs
        existing: list[str] = []
        if (self.path / "CURRENT").exists():
            existing = rocksdict.Rdict.list_cf(str(self.path), rocksdict.Options(raw_mode=True))
        families = {name: self._options() for name in set(existing) | set(tables) if name != "default"}
        try:
            self._db = rocksdict.Rdict(str(self.path), self._options(), column_families=families)
        except Exception as exc:  # rocksdict raises a bare Exception("IO error: ... LOCK ...")
            if "/LOCK" in str(exc):  # "IO error: While lock file: <path>/LOCK: Resource temporarily unavailable"
                raise FailedPrecondition(
                    f"RocksDB at {str(self.path)!r} is already open (a running shard?): {exc}; stop it first"
                ) from None
            raise
        self._cfs = {name: self._db.get_column_family(name) for name in tables}
        self._handles = {name: self._db.get_column_family_handle(name) for name in tables}
        self._wal_opts = rocksdict.WriteOptions()
        self._wal_opts.sync = sync_writes
        self._nowal_opts = rocksdict.WriteOptions()
        setattr(self._nowal_opts, "disable_wal", True)  # a property at runtime (the stub says method)
        self._counter_lock = threading.Lock()  # orders counter bumps across concurrent upserts
        raw = self._db.get(UPSERT_COUNTER_KEY)
        self._upserts = UpsertCounter(*_COUNTER.unpack(bytes(raw))) if raw is not None else UpsertCounter()
        self._closed = False

    def _options(self) -> rocksdict.Options:
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        opts.set_max_background_jobs(self._background_jobs)
        if os.environ.get(DIRECT_READS_ENV) == "1":
            # O_DIRECT reads: the OS page cache cannot hold the table in hiding, so a
            # benchmark of a table bigger than RAM measures what such a user gets.
            opts.set_use_direct_reads(True)
        table = rocksdict.BlockBasedOptions()
        table.set_bloom_filter(BLOOM_BITS_PER_KEY, False)
        table.set_block_cache(self._cache)
        table.set_cache_index_and_filter_blocks(True)
        opts.set_block_based_table_factory(table)
        return opts

    # -- reads ---------------------------------------------------------------------

    def get_rows(self, table: str, ids: np.ndarray, col_start: int, col_end: int) -> tuple[np.ndarray, np.ndarray]:
        """Multi-get ``ids`` [N] -> (rows fp32 [N, col_end - col_start], present bool [N]).

        A stored value holding a different column slice than asked counts as absent.
        """
        if len(ids) == 0:
            return np.zeros((0, col_end - col_start), dtype=np.float32), np.zeros(0, dtype=bool)
        cf = self._cfs[table]
        parts = min(self._read_parts, len(ids) // PARALLEL_READ_MIN_IDS)
        if parts <= 1 or self._readers is None:
            values = _multi_get(cf, ids)
        else:
            # Contiguous parts in order, the first on the calling thread: the values
            # list comes back in id order, as one multi-get would return it.
            chunks = np.array_split(ids, parts)
            pending = [self._readers.submit(_multi_get, cf, c) for c in chunks[1:]]
            values = _multi_get(cf, chunks[0])
            for f in pending:
                values += f.result()
        return decode_values(values, dim=self.dims[table], col_start=col_start, col_end=col_end)

    # -- writes --------------------------------------------------------------------

    def _batch(self, writes: Sequence[tuple[str, np.ndarray, np.ndarray, int, int]]) -> rocksdict.WriteBatch:
        batch = rocksdict.WriteBatch(raw_mode=True)
        for table, ids, rows, col_start, col_end in writes:
            handle = self._handles[table]
            values = encode_values(rows, dim=self.dims[table], col_start=col_start, col_end=col_end)
            # rocksdict takes one put per key; the values were encoded as one array op.
            for key, value in zip(encode_keys(ids), values):
                batch.put(key, value, handle)
        return batch

    def write_rows(self, writes: Sequence[tuple[str, np.ndarray, np.ndarray, int, int]]) -> None:
        """Upsert: atomically write ``(table, ids [N], rows fp32 [N, W], col_start, col_end)``
        groups in one WAL-logged batch: durable against a process kill once it returns
        (and against power loss with ``sync_writes``). The same batch bumps the
        :class:`UpsertCounter`, so no acknowledged upsert goes uncounted. Writing no rows
        (an empty Upsert) is a no-op: counting it would make a later re-plan load refuse
        to overwrite upserts that hold nothing."""
        rows = sum(len(ids) for _, ids, _, _, _ in writes)
        if rows == 0:
            return
        batch = self._batch(writes)  # encoded outside the lock: upserts of other tables overlap
        with self._counter_lock:
            counter = UpsertCounter(self._upserts.seq + 1, self._upserts.rows + rows)
            batch.put(UPSERT_COUNTER_KEY, _COUNTER.pack(counter.seq, counter.rows))  # default family
            if self.fail_writes:  # the test fault hook's full disk: raised as rocksdict raises one
                raise Exception(self.fail_writes)  # noqa: TRY002
            self._db.write(batch, self._wal_opts)
            self._upserts = counter  # only once RocksDB took the batch

    @property
    def upserts(self) -> UpsertCounter:
        """Upserts acknowledged so far (persisted with them)."""
        return self._upserts

    def write_encoded_unlogged(self, table: str, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        """Write encoded entries skipping the WAL (bulk load and migration only; not
        counted as upserts): they are not durable until :meth:`flush` returns."""
        batch = rocksdict.WriteBatch(raw_mode=True)
        handle = self._handles[table]
        for key, value in zip(keys, values):
            batch.put(key, value, handle)
        self._db.write(batch, self._nowal_opts)

    def ingest(self, table: str, sst_paths: Sequence[str]) -> None:
        """Ingest SST files (written with :func:`sst_options`) into ``table``'s family.
        Ingested files are durable on return; newer writes to the same keys are
        overwritten (the file gets a newer sequence number)."""
        opts = rocksdict.IngestExternalFileOptions()
        opts.set_move_files(True)
        self._cfs[table].ingest_external_file(list(sst_paths), opts)

    def flush(self) -> None:
        """Flush every table's memtable to SST files (makes WAL-less writes durable)."""
        for cf in self._cfs.values():
            cf.flush(True)
        self._db.flush(True)

    # -- metadata ------------------------------------------------------------------

    def get_meta(self, name: str) -> bytes | None:
        value = self._db.get(META_PREFIX + name.encode())
        return value if value is None else bytes(value)

    def put_meta(self, name: str, value: bytes) -> None:
        self._db.put(META_PREFIX + name.encode(), value, self._wal_opts)
        self._db.flush_wal(True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        for cf in self._cfs.values():
            cf.close()
        self._cfs.clear()
        self._handles.clear()
        self._db.close()


def _multi_get(cf: rocksdict.Rdict, ids: np.ndarray) -> list[bytes | None]:
    """One RocksDB multi-get of ``ids`` [N]: N values, None where absent."""
    keys: list[Any] = encode_keys(ids)
    return cast("list[bytes | None]", cf.get(keys))


def sst_options() -> rocksdict.Options:
    """Options for an SstFileWriter whose output :meth:`RowStore.ingest` accepts."""
    return rocksdict.Options(raw_mode=True)
