"""On-disk format of a catalog: one ``.npy`` per array plus ``manifest.json``.

Every array is a plain fixed-dtype ``.npy`` (no object arrays), so readers
``np.load(..., mmap_mode="r")`` it and share the OS page cache instead of copying a
256 MB vector table into every process. Variable-length data (item tags, user
histories) is CSR: ``<name>.values.npy`` ``[nnz]`` int64 plus ``<name>.offsets.npy``
``[rows + 1]`` int64 with row i at ``values[offsets[i]:offsets[i + 1]]``.

The manifest is written last (atomically, by rename) and lists every array's file,
shape and dtype; a directory without one is an unfinished catalog.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from recserve.catalog.config import FORMAT_VERSION, CatalogConfig
from recserve.catalog.model import GroundTruth
from recserve.errors import FailedPrecondition, NotFound

MANIFEST = "manifest.json"
FORMAT_NAME = "recserve.catalog"

# Every array of a catalog, in manifest order.
ARRAY_NAMES: tuple[str, ...] = (
    "category_centroids",
    "item_category",
    "item_tags.values",
    "item_tags.offsets",
    "item_vectors",
    "item_popularity",
    "items_by_popularity",
    "user_vectors",
    "user_history.values",
    "user_history.offsets",
    "train.user",
    "train.item",
    "train.label",
    "test.user",
    "test.item",
    "test.label",
)


@dataclasses.dataclass(frozen=True)
class Csr:
    """Variable-length rows: row i is ``values[offsets[i]:offsets[i + 1]]``.

    ``values`` ``[nnz]`` int64, ``offsets`` ``[rows + 1]`` int64 with ``offsets[0] == 0``
    and ``offsets[-1] == nnz``. The pair is what a torchrec ``KeyedJaggedTensor`` takes
    (values + offsets) for one key.
    """

    values: np.ndarray
    offsets: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def lengths(self) -> np.ndarray:
        """``[rows]`` int64 row lengths."""
        return np.diff(self.offsets)

    def row(self, i: int) -> np.ndarray:
        return self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]


@dataclasses.dataclass(frozen=True)
class ClickLog:
    """One split of the impression log; row j is user ``user[j]`` shown item ``item[j]``.

    ``user`` ``[n]`` int64, ``item`` ``[n]`` int64, ``label`` ``[n]`` uint8 (1 = click).
    """

    user: np.ndarray
    item: np.ndarray
    label: np.ndarray

    def __len__(self) -> int:
        return int(self.label.shape[0])


@dataclasses.dataclass(frozen=True)
class Catalog:
    """A generated catalog: arrays (memory-mapped when loaded from disk) plus manifest.

    Shapes (N items, U users, D dims, C categories): ``category_centroids`` [C, D] f32
    unit rows; ``item_category`` [N] i64; ``item_tags`` CSR over N items of tag ids in
    [0, tags); ``item_vectors`` [N, D] f32 unit rows; ``item_popularity`` [N] f64 summing
    to 1; ``items_by_popularity`` [N] i64 ids, most popular first; ``user_vectors`` [U, D]
    f32 unit rows; ``user_history`` CSR over U users of distinct item ids; ``train`` /
    ``test`` the click log split.
    """

    config: CatalogConfig
    truth: GroundTruth
    manifest: dict[str, Any]
    path: Path | None
    category_centroids: np.ndarray
    item_category: np.ndarray
    item_tags: Csr
    item_vectors: np.ndarray
    item_popularity: np.ndarray
    items_by_popularity: np.ndarray
    user_vectors: np.ndarray
    user_history: Csr
    train: ClickLog
    test: ClickLog

    @property
    def num_items(self) -> int:
        return int(self.item_vectors.shape[0])

    @property
    def num_users(self) -> int:
        return int(self.user_vectors.shape[0])

    @property
    def dim(self) -> int:
        return int(self.item_vectors.shape[1])

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array by its manifest name (see :data:`ARRAY_NAMES`)."""
        return {
            "category_centroids": self.category_centroids,
            "item_category": self.item_category,
            "item_tags.values": self.item_tags.values,
            "item_tags.offsets": self.item_tags.offsets,
            "item_vectors": self.item_vectors,
            "item_popularity": self.item_popularity,
            "items_by_popularity": self.items_by_popularity,
            "user_vectors": self.user_vectors,
            "user_history.values": self.user_history.values,
            "user_history.offsets": self.user_history.offsets,
            "train.user": self.train.user,
            "train.item": self.train.item,
            "train.label": self.train.label,
            "test.user": self.test.user,
            "test.item": self.test.item,
            "test.label": self.test.label,
        }

    @classmethod
    def from_arrays(cls, manifest: dict[str, Any], arrays: dict[str, np.ndarray], path: Path | None) -> Catalog:
        a = arrays
        return cls(
            config=CatalogConfig.from_dict(manifest["config"]),
            truth=GroundTruth.from_dict(manifest["ground_truth"]),
            manifest=manifest,
            path=path,
            category_centroids=a["category_centroids"],
            item_category=a["item_category"],
            item_tags=Csr(a["item_tags.values"], a["item_tags.offsets"]),
            item_vectors=a["item_vectors"],
            item_popularity=a["item_popularity"],
            items_by_popularity=a["items_by_popularity"],
            user_vectors=a["user_vectors"],
            user_history=Csr(a["user_history.values"], a["user_history.offsets"]),
            train=ClickLog(a["train.user"], a["train.item"], a["train.label"]),
            test=ClickLog(a["test.user"], a["test.item"], a["test.label"]),
        )


def _file_name(name: str) -> str:
    return f"{name}.npy"


class ArraySink:
    """Where the generator puts arrays: ``.npy`` files under ``out_dir``, or memory.

    :meth:`alloc` hands out a writable array to fill chunk by chunk (an
    ``open_memmap`` when writing to disk, so a 256 MB table never sits in memory twice);
    :meth:`put` stores a finished array. :meth:`finish` writes the manifest last.

    Files are written as ``<name>.npy.tmp`` and renamed into place only at
    :meth:`finish`: a process that has the previous catalog memory-mapped keeps reading
    the old inodes instead of crashing (SIGBUS) on a truncated file.
    """

    def __init__(self, out_dir: Path | None) -> None:
        self._dir = out_dir
        self._arrays: dict[str, np.ndarray] = {}
        self._pending: list[tuple[Path, Path]] = []  # (tmp, final) files to rename
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            # Drop an old manifest first: a crash mid-run must not leave a manifest that
            # vouches for a mix of old and new arrays.
            (out_dir / MANIFEST).unlink(missing_ok=True)

    def _tmp_path(self, name: str) -> Path:
        assert self._dir is not None
        final = self._dir / _file_name(name)
        tmp = final.with_name(final.name + ".tmp")
        self._pending.append((tmp, final))
        return tmp

    def alloc(self, name: str, shape: tuple[int, ...], dtype: np.dtype[Any] | type) -> np.ndarray:
        if self._dir is None:
            arr = np.empty(shape, dtype=dtype)
        else:
            arr = np.lib.format.open_memmap(self._tmp_path(name), mode="w+", dtype=dtype, shape=shape)
        self._arrays[name] = arr
        return arr

    def put(self, name: str, array: np.ndarray) -> np.ndarray:
        arr = np.ascontiguousarray(array)
        if self._dir is not None:
            with open(self._tmp_path(name), "wb") as f:
                np.save(f, arr, allow_pickle=False)
        self._arrays[name] = arr
        return arr

    def abort(self) -> None:
        """Remove the partial files of a failed generation."""
        self._arrays.clear()
        for tmp, _ in self._pending:
            tmp.unlink(missing_ok=True)
        self._pending.clear()

    def finish(self, manifest_body: dict[str, Any]) -> Catalog:
        """Record array specs in the manifest, flush, and return the catalog (re-opened
        read-only memory-mapped when on disk)."""
        missing = [n for n in ARRAY_NAMES if n not in self._arrays]
        if missing:
            raise FailedPrecondition(f"catalog generation produced no arrays {missing}")
        specs = {n: {"file": _file_name(n), "shape": list(self._arrays[n].shape), "dtype": self._arrays[n].dtype.str} for n in ARRAY_NAMES}
        manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **manifest_body, "arrays": specs}
        if self._dir is None:
            for arr in self._arrays.values():
                arr.flags.writeable = False
            return Catalog.from_arrays(manifest, dict(self._arrays), None)
        for arr in self._arrays.values():
            if isinstance(arr, np.memmap):
                arr.flush()
        self._arrays.clear()
        for tmp, final in self._pending:
            os.replace(tmp, final)
        self._pending.clear()
        tmp_manifest = self._dir / (MANIFEST + ".tmp")
        tmp_manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        os.replace(tmp_manifest, self._dir / MANIFEST)
        return load_catalog(self._dir)


def read_manifest(path: Path | str) -> dict[str, Any]:
    """The parsed ``manifest.json`` of a catalog directory (format checked)."""
    directory = Path(path)
    mpath = directory / MANIFEST
    if not mpath.is_file():
        raise NotFound(f"{directory} holds no catalog ({MANIFEST} missing); create one with `recserve catalog generate --out {directory}`")
    try:
        manifest: dict[str, Any] = json.loads(mpath.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise FailedPrecondition(f"{mpath} is unreadable ({exc}); regenerate the catalog") from exc
    if manifest.get("format") != FORMAT_NAME or manifest.get("format_version") != FORMAT_VERSION:
        raise FailedPrecondition(
            f"{mpath} is format {manifest.get('format')!r} version {manifest.get('format_version')!r}; "
            f"this recserve reads {FORMAT_NAME!r} version {FORMAT_VERSION}: regenerate the catalog"
        )
    return manifest


def load_catalog(path: Path | str) -> Catalog:
    """Open a catalog directory; every array is ``np.load(mmap_mode="r")`` and checked
    against the manifest's shape and dtype. Raises NotFound / FailedPrecondition."""
    directory = Path(path)
    manifest = read_manifest(directory)
    return Catalog.from_arrays(manifest, open_arrays(directory, manifest, ARRAY_NAMES), directory)


def open_arrays(directory: Path, manifest: dict[str, Any], names: Sequence[str]) -> dict[str, np.ndarray]:
    """Memory-map just ``names`` of a catalog directory (``np.load(mmap_mode="r")``), each
    checked against the manifest's shape and dtype; FailedPrecondition otherwise. The
    rankers' scrubbed view opens a subset through this, never the ground-truth arrays."""
    arrays: dict[str, np.ndarray] = {}
    for name in names:
        spec = manifest.get("arrays", {}).get(name)
        if spec is None:
            raise FailedPrecondition(f"{directory / MANIFEST} lists no array {name!r}; regenerate the catalog")
        fpath = directory / spec["file"]
        try:
            arr = np.load(fpath, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise FailedPrecondition(f"{fpath} cannot be memory-mapped ({exc}); regenerate the catalog") from exc
        if list(arr.shape) != list(spec["shape"]) or arr.dtype.str != spec["dtype"]:
            raise FailedPrecondition(
                f"{fpath} has shape {list(arr.shape)} dtype {arr.dtype.str}; the manifest says shape {spec['shape']} dtype {spec['dtype']}: regenerate the catalog"
            )
        arrays[name] = arr
    return arrays
