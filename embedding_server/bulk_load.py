"""Idempotent bulk load of a shard's rows from source arrays into RocksDB.

A shard loads exactly what it owns under its plan (:class:`TableLayout`): hot and cold
ids as full rows, warm ids as their column slice. Rows are written in id-range chunks,
each chunk's keys merged into sorted order, either as SST files ingested at the end
(``LoadMethod.SST``, the default: no WAL, no memtable, durable on ingestion) or as large
WAL-less write batches (``LoadMethod.BATCH``) that are flushed to SST before the load is
recorded.

Idempotency: a load manifest in the database's metadata (:mod:`embedding_server.manifest`)
records each completed load, keyed by (source fingerprint, plan version, shard id).
Re-running the same load is a no-op — in particular it never overwrites rows upserted
since — unless ``force``. A *different* load (a new plan version after a re-plan, a
regenerated source) into a store that holds upserts newer than its last load is refused
(FailedPrecondition naming both) unless ``overwrite``: the source arrays lack those rows.

Sources (:func:`open_source`): a directory of ``<table>.npy`` files (or its
``embeddings/`` subdirectory, as ``recserve train`` exports them), an ``.npz`` keyed by
table name, or one ``.npy`` when the plan has a single table; arrays are memory-mapped,
``[rows, dim]`` float. A catalog's ``<table>_vectors.npy`` is never a source: those are
the click model's ground truth, and a shard must not serve them by accident.

Model versions: a source directory whose ``manifest.json`` carries a ``model_version``
(an export's ``embeddings/manifest.json``) stamps it on the load record;
:func:`table_model_versions` reads back the version each table was last loaded from. A
source staged from several exports (:func:`ranker.rollout.stage_exports`: one version
under plain table names, the others version-prefixed beside it) carries
``model_versions`` (table -> version) instead; :func:`source_model_versions` reads it and
the load records each table's own version, so ShardInfo reports each table's own.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import rocksdict

from embedding_server.codec import encode_keys, encode_values
from embedding_server.layout import TableLayout
from embedding_server.manifest import check_no_upserts_lost, manifest_key, read_manifest, record_load, store_state
from embedding_server.store import RowStore, sst_options
from recserve.errors import ConfigError, InvalidArgument

__all__ = [
    "LoadMethod",
    "LoadReport",
    "bulk_load",
    "manifest_key",
    "open_source",
    "read_manifest",
    "source_model_version",
    "source_model_versions",
    "table_model_versions",
]

log = logging.getLogger(__name__)

CHUNK_IDS = 65_536  # id-space span per SST file / write batch


class LoadMethod(enum.Enum):
    SST = "sst"
    BATCH = "batch"


@dataclasses.dataclass(frozen=True)
class LoadReport:
    key: str
    skipped: bool
    rows_written: dict[str, int]
    seconds: float
    method: LoadMethod
    overwritten_upserts: int = 0  # upsert batches discarded by an ``overwrite`` / ``force`` load


def open_source(path: str | Path, tables: list[str]) -> tuple[dict[str, np.ndarray], str]:
    """Open source arrays for ``tables`` -> (table -> [rows, dim] array, fingerprint).

    The fingerprint hashes each file's resolved path, size and mtime, so an unchanged
    source is recognised as already loaded.
    """
    src = Path(path)
    files: dict[str, Path] = {}
    if src.is_dir():
        base = src / "embeddings" if (src / "embeddings").is_dir() else src
        files = {t: base / f"{t}.npy" for t in tables}
    elif src.suffix == ".npz":
        files = {t: src for t in tables}
    elif src.suffix == ".npy" and len(tables) == 1:
        files = {tables[0]: src}
    else:
        raise ConfigError(f"load source {str(src)!r}: use a directory of <table>.npy, an .npz, or one .npy for a single-table plan")
    missing = sorted(str(f) for f in set(files.values()) if not f.exists())
    if missing:
        raise ConfigError(f"load source: files {missing} do not exist (tables {tables})")
    arrays: dict[str, np.ndarray] = {}
    npz = np.load(src) if src.suffix == ".npz" else None
    for table, file in files.items():
        if npz is not None:
            if table not in npz.files:
                raise ConfigError(f"load source {str(src)!r} has no array {table!r}; it has {npz.files}")
            arrays[table] = npz[table]
        else:
            arrays[table] = np.load(file, mmap_mode="r")
    digest = hashlib.sha1()
    for file in sorted(set(files.values())):
        stat = file.stat()
        digest.update(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return arrays, digest.hexdigest()[:16]


def _source_manifest(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """(manifest path, body) of a source directory's ``manifest.json`` (its
    ``embeddings/`` subdirectory first, as :func:`open_source` reads it); body {} when
    the source is no directory or has no readable manifest."""
    src = Path(path)
    base = src / "embeddings" if (src / "embeddings").is_dir() else src
    file = base / "manifest.json"
    if not src.is_dir():
        return file, {}
    try:
        body = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return file, {}
    return file, body if isinstance(body, dict) else {}


def source_model_version(path: str | Path) -> str:
    """The ``model_version`` in a source directory's ``manifest.json`` (its
    ``embeddings/`` subdirectory first, as :func:`open_source` reads it); '' when the
    source carries none."""
    version = _source_manifest(path)[1].get("model_version")
    return version if isinstance(version, str) else ""


def source_model_versions(path: str | Path) -> dict[str, str] | None:
    """table -> ``model_version`` from a staged multi-version source's ``manifest.json``
    (its ``model_versions``, as :func:`ranker.rollout.stage_exports` writes it); None
    for every other source, whose load keeps recording one ``model_version``.

    A ``model_versions`` that is not an object of strings is a ConfigError: loading the
    tables under a version guessed from half a manifest could serve one training run's
    rows to another's dense weights.
    """
    file, body = _source_manifest(path)
    if "model_versions" not in body:
        return None
    versions = body["model_versions"]
    if not isinstance(versions, dict) or not all(isinstance(t, str) and isinstance(v, str) for t, v in versions.items()):
        raise ConfigError(f"load source {str(file)!r}: model_versions = {versions!r} is invalid; use an object of table name -> model_version strings (re-stage the source)")
    return dict(versions)


def table_model_versions(store: RowStore) -> dict[str, str]:
    """table -> ``model_version`` of its newest recorded load or migration ('' = an
    unversioned source). A load records one ``model_version`` for its tables; a
    migration records per table (``model_versions``) what its old owners held, so a store
    filled only by ``recserve shard migrate`` reports the version its rows came from.
    Records with neither field (older migrations) keep the previously loaded version."""
    newest: dict[str, tuple[float, str]] = {}
    for record in read_manifest(store).values():
        when = float(record.get("finished_unix_s", 0.0))
        if isinstance(record.get("model_versions"), dict):
            versions = {str(t): str(v) for t, v in record["model_versions"].items()}
        elif "model_version" in record:
            versions = {str(t): str(record["model_version"]) for t in record.get("rows", {})}
        else:
            continue
        for table, version in versions.items():
            if table not in newest or when >= newest[table][0]:
                newest[table] = (when, version)
    return {t: v for t, (_, v) in newest.items()}


def _check_source(layouts: Mapping[str, TableLayout], source: Mapping[str, np.ndarray]) -> None:
    for name, layout in layouts.items():
        if name not in source:
            raise ConfigError(f"load source has no array for table {name!r}; it has {sorted(source)}")
        shape = tuple(source[name].shape)
        if shape != (layout.rows, layout.dim):
            raise InvalidArgument(f"load source table {name!r} has shape {list(shape)}; the plan needs [{layout.rows}, {layout.dim}]")


def _chunk_entries(layout: TableLayout, source: np.ndarray, lo: int, hi: int) -> tuple[list[bytes], list[bytes]]:
    """Keys and values of every owned row with id in [lo, hi), in key order."""
    ids_parts: list[np.ndarray] = []
    value_parts: list[np.ndarray] = []
    for ids, col_start, col_end in layout.owned_ids():
        a, b = np.searchsorted(ids, [lo, hi])
        if a == b:
            continue
        chunk = ids[a:b]
        rows = np.asarray(np.take(source, chunk, axis=0)[:, col_start:col_end], dtype=np.float32)
        values = np.empty(len(chunk), dtype=object)
        values[:] = encode_values(rows, dim=layout.dim, col_start=col_start, col_end=col_end)
        ids_parts.append(chunk)
        value_parts.append(values)
    if not ids_parts:
        return [], []
    all_ids = np.concatenate(ids_parts)
    order = np.argsort(all_ids, kind="stable")
    return encode_keys(all_ids[order]), np.concatenate(value_parts)[order].tolist()


def bulk_load(
    store: RowStore,
    layouts: Mapping[str, TableLayout],
    source: Mapping[str, np.ndarray],
    *,
    source_id: str,
    plan_version: int,
    shard_id: int,
    method: LoadMethod = LoadMethod.SST,
    force: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    model_version: str = "",
    model_versions: Mapping[str, str] | None = None,
) -> LoadReport:
    """Load this shard's owned rows of every table from ``source`` (table -> [rows, dim]).

    Skipped (``skipped=True``) when the manifest already records this load and not
    ``force``. Refused (FailedPrecondition) when the store holds upserts newer than its
    last load, unless ``overwrite`` (or ``force``, which re-runs a load regardless).
    The manifest entry is written only after the rows are durable; it records
    ``model_version`` (:func:`source_model_version` of the source) for every table, or,
    when ``model_versions`` is given (:func:`source_model_versions` of a staged source),
    each loaded table's own version (``model_version`` for a table it does not name).
    """
    from tqdm import tqdm

    start = time.monotonic()
    key = manifest_key(source_id, plan_version, shard_id)
    manifest = read_manifest(store)
    if key in manifest and not force:
        log.info("bulk load %s already recorded; skipping", key)
        return LoadReport(key=key, skipped=True, rows_written={}, seconds=time.monotonic() - start, method=method)
    _check_source(layouts, source)
    if overwrite or force:
        state = store_state(store, manifest)
        if state.pending_upserts:
            log.warning("shard %d: load %s overwrites %s (asked to)", shard_id, key, state.describe())
    else:
        state = check_no_upserts_lost(store, key, shard_id=shard_id, action="load")
    total = sum(len(ids) for layout in layouts.values() for ids, _, _ in layout.owned_ids())
    written: dict[str, int] = {}
    tmp = Path(tempfile.mkdtemp(prefix="bulk-", dir=store.path.parent))
    try:
        with tqdm(total=total, desc=f"shard {shard_id} load", unit="row", disable=not progress) as bar:
            for name, layout in layouts.items():
                written[name] = _load_table(store, layout, source[name], method, tmp, bar)
        if method is LoadMethod.BATCH:
            store.flush()  # WAL-less rows must reach SST files before the load is recorded
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record: dict[str, Any] = {"kind": "load", "rows": written, "method": method.value, "wal": False}
    if model_versions is None:
        record["model_version"] = model_version
    else:  # a staged source: versions side by side, each table its own
        record["model_versions"] = {name: model_versions.get(name, model_version) for name in layouts}
    record_load(store, key, record)
    return LoadReport(key=key, skipped=False, rows_written=written, seconds=time.monotonic() - start, method=method, overwritten_upserts=state.pending_upserts)


def _load_table(store: RowStore, layout: TableLayout, source: np.ndarray, method: LoadMethod, tmp: Path, bar: object) -> int:
    ssts: list[str] = []
    count = 0
    for lo in range(0, layout.rows, CHUNK_IDS):
        keys, values = _chunk_entries(layout, source, lo, min(lo + CHUNK_IDS, layout.rows))
        if not keys:
            continue
        if method is LoadMethod.SST:
            path = str(tmp / f"{layout.name}-{lo:012d}.sst")
            writer = rocksdict.SstFileWriter(sst_options())
            writer.open(path)
            for k, v in zip(keys, values):  # rocksdict: one call per key, in key order
                writer[k] = v
            writer.finish()
            ssts.append(path)
        else:
            store.write_encoded_unlogged(layout.name, keys, values)
        count += len(keys)
        bar.update(len(keys))  # type: ignore[attr-defined]
    if ssts:
        store.ingest(layout.name, ssts)  # chunks cover disjoint id ranges: files never overlap
    return count
