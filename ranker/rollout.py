"""Model rollout without an outage: several versions' shard tables side by side.

A ranker serving version A loads version B beside it, switches atomically once every
table of B is served, and drops A after A's in-flight batches drain. The shards hold both
at once because the tables of every version after the first are served under
*version-prefixed* names::

    version_prefix("m-3fa2c9d1e0b4") == "m_3fa2c9d1e0b4__"
    dlrm_item (A, plain)   m_3fa2c9d1e0b4__dlrm_item (B, prefixed)

The pieces, all without I/O on a request path:

* :func:`stage_exports` writes one shard load source (``recserve shard load --source`` /
  ``shard serve --load-from``) holding several exports' ``embeddings/`` tables — the first
  export's under plain names, every later one's prefixed — as hard links of the exported
  ``.npy`` files, with a ``manifest.json`` whose ``model_versions`` says which version
  each staged table is, so every shard records (and ShardInfo reports) each table's own
  version (:mod:`embedding_server.bulk_load`). It returns the staged tables' configs for
  :func:`recserve.sharding.plan_tables`.
* :func:`served_table_names` finds, from what the shards report, under which name each of
  an export's tables is served at that export's version: the plain name when it carries
  the version (a version staged first, or the only one), else the prefixed one.
* :func:`rename_features` gives the lookup client (and the KJT keys) of a prefixed version
  unique feature names: ``dlrm_user_id`` reading ``dlrm_user`` becomes
  ``m_3fa2c9d1e0b4__dlrm_user_id`` reading ``m_3fa2c9d1e0b4__dlrm_user``, so both
  versions' features fit in one :class:`~recserve.lookup.config.LookupClientConfig`.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from recserve.config.spec import FeatureConfig, TableConfig
from recserve.errors import ConfigError, FailedPrecondition, InvalidArgument, NotFound
from ranker.features import SparseFeature

__all__ = [
    "EMBEDDINGS_FORMAT",
    "LinkKind",
    "StagedSource",
    "feature_renames",
    "rename_features",
    "served_table_names",
    "stage_exports",
    "version_prefix",
]

log = logging.getLogger(__name__)

EMBEDDINGS_FORMAT = "recserve.embeddings"  # what ranker.export writes to embeddings/manifest.json
MANIFEST = "manifest.json"
PREFIX_SEPARATOR = "__"
_NOT_ALNUM = re.compile(r"[^A-Za-z0-9]")

F = TypeVar("F", FeatureConfig, SparseFeature)


def version_prefix(model_version: str) -> str:
    """The table-name prefix of ``model_version``: non-alphanumerics -> ``_``, plus ``__``.

    ``version_prefix("m-3fa2c9d1e0b4") == "m_3fa2c9d1e0b4__"``; the result keeps table
    names within TableConfig's alphabet (ASCII letters, digits, ``_``).
    """
    if not model_version:
        raise InvalidArgument("model_version = '' has no table prefix: only a versioned export can be staged beside another")
    return _NOT_ALNUM.sub("_", model_version) + PREFIX_SEPARATOR


class LinkKind(enum.Enum):
    """How a staged ``.npy`` refers to the exported one."""

    HARDLINK = "hardlink"
    SYMLINK = "symlink"
    COPY = "copy"


@dataclasses.dataclass(frozen=True)
class StagedSource:
    """A staged multi-version shard load source.

    ``path`` is the directory to load from (its ``embeddings/`` holds the ``.npy`` files
    and ``manifest.json``); ``tables`` every staged table under its served name, sorted
    by name, ready for :func:`recserve.sharding.plan_tables`; ``model_versions`` served
    table -> the version it is; ``base_names`` served table -> the export's table name;
    ``versions`` the staged versions in order (the first one is served under plain
    names); ``links`` how each file was staged.
    """

    path: Path
    tables: tuple[TableConfig, ...]
    model_versions: dict[str, str]
    base_names: dict[str, str]
    versions: tuple[str, ...]
    links: dict[str, LinkKind]

    def served_names(self, model_version: str) -> dict[str, str]:
        """base table -> served table of ``model_version`` in this staging ({} if not staged)."""
        return {self.base_names[s]: s for s, v in sorted(self.model_versions.items()) if v == model_version}


@dataclasses.dataclass(frozen=True)
class _ExportTables:
    directory: Path  # the export's embeddings/ directory
    model_version: str
    tables: dict[str, dict[str, Any]]  # table -> {file, rows, dim, pooling}


def _read_embeddings(export: Path) -> _ExportTables:
    """An export's ``embeddings/manifest.json`` (``export`` is MODELS or its ``embeddings/``)."""
    directory = export / "embeddings" if (export / "embeddings").is_dir() else export
    path = directory / MANIFEST
    if not path.is_file():
        raise NotFound(f"{path} is missing; export the models with `recserve train --catalog DIR --out {export}`")
    try:
        body = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise FailedPrecondition(f"{path} is unreadable ({exc}); re-export the models") from exc
    if not isinstance(body, dict) or body.get("format") != EMBEDDINGS_FORMAT:
        got = body.get("format") if isinstance(body, dict) else body
        raise FailedPrecondition(f"{path} is format {got!r}; stage_exports reads {EMBEDDINGS_FORMAT!r} (an export's embeddings/manifest.json)")
    version = body.get("model_version")
    if not isinstance(version, str) or not version:
        raise FailedPrecondition(f"{path} has model_version {version!r}; stage only versioned exports (`recserve train` writes one)")
    tables = body.get("tables")
    if not isinstance(tables, dict) or not tables:
        raise FailedPrecondition(f"{path} lists tables {tables!r}; an export lists at least one table")
    return _ExportTables(directory=directory, model_version=version, tables=tables)


def _check_array(file: Path, name: str, spec: Mapping[str, Any]) -> None:
    """The exported file exists and has the manifest's [rows, dim] (header only: mmap)."""
    if not file.is_file():
        raise NotFound(f"table {name!r}: {file} is missing; re-export the models")
    shape = tuple(np.load(file, mmap_mode="r", allow_pickle=False).shape)
    want = (int(spec["rows"]), int(spec["dim"]))
    if shape != want:
        raise FailedPrecondition(f"table {name!r}: {file} has shape {list(shape)} but its manifest says [{want[0]}, {want[1]}]; re-export the models")


def _link(src: Path, dst: Path) -> LinkKind:
    """Hard link ``src`` at ``dst``; a symlink across filesystems; a copy as a last resort.

    A hard link is a snapshot: ``ranker.export`` replaces files (write + rename), so a
    re-export into the same MODELS leaves the staged inode, and its version, intact. A
    symlink would follow the re-export, hence only the fallback.
    """
    try:
        os.link(src, dst)
        return LinkKind.HARDLINK
    except OSError as exc:
        log.info("hard link %s -> %s failed (%s); trying a symlink", src, dst, errno.errorcode.get(exc.errno or 0, exc))
    try:
        os.symlink(src.resolve(), dst)
        return LinkKind.SYMLINK
    except OSError as exc:
        log.info("symlink %s -> %s failed (%s); copying", src, dst, exc)
    shutil.copy2(src, dst)  # keeps mtime: the shards' load fingerprint stays that of the export
    return LinkKind.COPY


def _is_staged(out: Path) -> bool:
    try:
        body = json.loads((out / "embeddings" / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(body, dict) and isinstance(body.get("model_versions"), dict)


def stage_exports(exports: Sequence[Path | str], out: Path | str) -> StagedSource:
    """Stage several exports' shard tables as one load source in ``out``.

    ``exports``: MODELS directories (or their ``embeddings/``), each of a distinct
    ``model_version``. The first one's tables keep their plain names; every later one's
    are prefixed with :func:`version_prefix`. ``out/embeddings/`` gets a hard link per
    table (``<served>.npy``) and ``manifest.json``: format ``recserve.embeddings``,
    ``tables`` (served name -> file, rows, dim, pooling), ``model_versions`` (served name
    -> version) and ``staged`` (the versions in order).

    Deliberately no single ``model_version``: a loader that does not read
    ``model_versions`` then records the staged tables as unversioned, which
    :func:`served_table_names` refuses, instead of stamping the first export's version on
    the prefixed tables of another.

    ``out`` must not exist, be empty, or be an earlier staging (replaced whole; the
    shards read the source only while loading). The new staging is built beside it and
    renamed into place, so ``out`` never holds a half-staged mix.
    """
    if not exports:
        raise InvalidArgument("stage_exports: exports = [] is empty; give at least one MODELS directory")
    out = Path(out)
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or _is_staged(out))):
        raise InvalidArgument(f"stage_exports: out = {str(out)!r} exists and is not a staged source; give an empty or new directory")
    read = [_read_embeddings(Path(e)) for e in exports]
    first: dict[str, Path] = {}
    for e, path in zip(read, exports):
        if e.model_version in first:
            raise InvalidArgument(f"stage_exports: {str(first[e.model_version])!r} and {str(path)!r} are both model_version {e.model_version!r}; stage each version once")
        first[e.model_version] = Path(path)
    prefixes = [version_prefix(e.model_version) for e in read[1:]]
    if len(set(prefixes)) != len(prefixes):
        raise InvalidArgument(f"stage_exports: model_versions {[e.model_version for e in read[1:]]} map to prefixes {prefixes}, which collide; stage them separately")

    plan: dict[str, tuple[Path, dict[str, Any], str]] = {}  # served -> (file, spec, version)
    base_names: dict[str, str] = {}  # served -> the export's name
    for i, e in enumerate(read):
        prefix = "" if i == 0 else version_prefix(e.model_version)
        for name, spec in sorted(e.tables.items()):
            served = prefix + name
            if served in plan:
                raise InvalidArgument(f"stage_exports: table {served!r} of model_version {e.model_version!r} is also staged for {plan[served][2]!r}; rename one of the tables")
            file = e.directory / str(spec.get("file", f"{name}.npy"))
            _check_array(file, name, spec)
            plan[served] = (file, spec, e.model_version)
            base_names[served] = name
    # TableConfig checks every served name (letters, digits, '_') before anything is written.
    tables = tuple(TableConfig(name=s, rows=int(spec["rows"]), dim=int(spec["dim"]), pooling=str(spec["pooling"])) for s, (_, spec, _) in sorted(plan.items()))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))
    try:
        (tmp / "embeddings").mkdir()
        links = {served: _link(file, tmp / "embeddings" / f"{served}.npy") for served, (file, _, _) in sorted(plan.items())}
        manifest = {
            "format": EMBEDDINGS_FORMAT,
            "tables": {t.name: {"file": f"{t.name}.npy", "rows": t.rows, "dim": t.dim, "pooling": t.pooling} for t in tables},
            "model_versions": {served: version for served, (_, _, version) in sorted(plan.items())},
            "staged": [e.model_version for e in read],
        }
        (tmp / "embeddings" / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)  # empty or an earlier staging (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("staged %d tables of %s in %s", len(tables), [e.model_version for e in read], out)
    return StagedSource(
        path=out,
        tables=tables,
        model_versions={served: version for served, (_, _, version) in sorted(plan.items())},
        base_names=dict(sorted(base_names.items())),
        versions=tuple(e.model_version for e in read),
        links=links,
    )


def served_table_names(manifest_tables: Iterable[str], model_version: str, reported: Mapping[str, str]) -> dict[str, str]:
    """base table -> the name under which the shards serve it at ``model_version``.

    ``manifest_tables``: the export's (base) table names; ``reported``: table -> the
    version the shards report (:func:`ranker.serving.versions_from_shard_info`). The
    plain name wins when it carries ``model_version``; else the prefixed one
    (:func:`version_prefix`). Neither: FailedPrecondition naming the table, the version
    wanted and what the shards report for both names.

    >>> served_table_names(["dlrm_item"], "m-b", {"dlrm_item": "m-a", "m_b__dlrm_item": "m-b"})
    {'dlrm_item': 'm_b__dlrm_item'}
    """
    prefix = version_prefix(model_version)
    out: dict[str, str] = {}
    for base in sorted(set(manifest_tables)):
        candidates = (base, prefix + base)
        match = next((name for name in candidates if reported.get(name) == model_version), None)
        if match is not None:
            out[base] = match
            continue
        seen = [f"{name!r} is model_version {reported[name] or '(none)'!r}" for name in candidates if name in reported]
        if not seen:
            raise FailedPrecondition(
                f"no shard reports table {base!r} or {prefix + base!r}; the dense weights (model_version {model_version!r}) need one of them: "
                "load the shards from this export, or from a source staged with it (ranker.rollout.stage_exports)"
            )
        raise FailedPrecondition(
            f"no shard table serves {base!r} at model_version {model_version!r} (the dense weights'): shard table {'; '.join(seen)}; "
            "load the shards from this export, or from a source staged with it (ranker.rollout.stage_exports)"
        )
    return out


def feature_renames(features: Iterable[FeatureConfig | SparseFeature], names: Mapping[str, str]) -> dict[str, str]:
    """base feature name -> served feature name: the served table's version prefix (if
    any) put in front, so features of two versions never share a name.

    ``names``: base table -> served table (:func:`served_table_names`). A feature whose
    table ``names`` lacks is a ConfigError: it would read the wrong version's rows.
    """
    out: dict[str, str] = {}
    for f in features:
        served = names.get(f.table)
        if served is None:
            raise ConfigError(f"feature {f.name!r} reads table {f.table!r}, which has no served name (served: {dict(names)}); plan it with served_table_names")
        if not served.endswith(f.table):
            raise ConfigError(f"served table {served!r} of {f.table!r} is not {f.table!r} with a version prefix; use served_table_names")
        out[f.name] = served[: len(served) - len(f.table)] + f.name
    return out


def rename_features(features: Sequence[F], names: Mapping[str, str]) -> tuple[F, ...]:
    """``features`` reading their served tables under their served names (see
    :func:`feature_renames`); works on lookup-client :class:`FeatureConfig` and on the
    models' :class:`SparseFeature` (whose ``name`` keys the KJT), so the KJT a model
    builds and the lookup config agree.

    >>> rename_features([FeatureConfig("dlrm_user_id", "dlrm_user")], {"dlrm_user": "m_b__dlrm_user"})
    (FeatureConfig(name='m_b__dlrm_user_id', table='m_b__dlrm_user'),)
    """
    renames = feature_renames(features, names)
    return tuple(dataclasses.replace(f, name=renames[f.name], table=names[f.table]) for f in features)
