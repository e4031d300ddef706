"""The L0 retrieval index: FAISS over the exported item-tower vectors, by inner product.

The cascade's first stage asks "which ~l0_out of the catalog's items score highest against
this user vector?" and accepts an approximate answer, since L1 re-scores the survivors
exactly. :func:`build_index` builds a :class:`RetrievalIndex` from ``[N, d]`` unit vectors
(MODELS/index/item_vectors.npy, see ``ranker/export.py``); :class:`IndexHolder` is what the
service keeps, so that a refresh is one reference assignment under traffic.

Example::

    vectors, model_version = open_item_vectors(models_dir)     # [N, d] f32, mmap
    index = build_index(vectors, None, IndexConfig(), model_version=model_version)
    ids, scores = index.search(user_vectors, k=1000)          # [B, 1000] int64 / f32
    ids[~valid_mask(ids)]                                      # FAISS's -1 padding

Thread safety. FAISS CPU indexes are safe for concurrent *searches* (const methods) from
several threads, but not for a mutation (``add_with_ids``) concurrent with anything (FAISS
wiki, "Threads and asynchronous calls": mutation needs mutual exclusion). So a
:class:`RetrievalIndex` guards its FAISS object with a readers-writer lock: searches share
it, :meth:`RetrievalIndex.add` takes it alone (adding a few new items takes microseconds
to milliseconds, so searches wait that long at most; copy-on-write would clone a 1M-item
index per ``AddItems`` call). Search knobs go in per-call ``SearchParameters``, never in
the shared index's fields, which another thread may be searching with. FAISS releases the
GIL in search/add/train, and runs a one-query search in the calling thread (no OpenMP
fan-out), so executor threads searching one request each do run in parallel.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from recserve.errors import FailedPrecondition, InvalidArgument, require

log = logging.getLogger(__name__)
# faiss's SWIG module: its partial type info lacks SearchParametersHNSW and the keyword
# constructors, so the search-parameter classes are reached through an untyped alias.
_faiss: Any = faiss

FORMAT = "recserve.index"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX_FILE = "index.faiss"
IDS_FILE = "ids.npy"
# Below this many items "auto" is exact: a Flat scan of 20k × 64 floats costs about what
# one IVF probe list costs to find, and PQ's 256-centroid codebooks want ≥ 39 × 256 ≈ 10k
# training vectors (FAISS warns below that).
AUTO_FLAT_BELOW = 20_000
PQ_CENTROIDS = 256  # 8-bit codes
# FAISS warns when k-means gets fewer than 39 training points per centroid.
MIN_POINTS_PER_CENTROID = 39

_FACTORY = re.compile(r"^(?:Flat|IVF(?P<ivf>\d+),(?:Flat|PQ(?P<pq>\d+)(?:x(?P<bits>\d+))?)|HNSW(?P<hnsw>\d+)(?:,Flat)?)$")


class SearchKnob(enum.Enum):
    """The one search-time knob of an index type: what trades recall for time."""

    NONE = "none"  # Flat: exact, nothing to tune
    NPROBE = "nprobe"  # IVF: inverted lists scanned per query
    EF_SEARCH = "efSearch"  # HNSW: candidate queue length of the graph walk


@dataclasses.dataclass(frozen=True)
class IndexConfig:
    """How to build and search the L0 index.

    ``factory`` is a FAISS ``index_factory`` string: ``"Flat"``, ``"IVF{n},Flat"``,
    ``"IVF{n},PQ{m}"`` (optionally ``PQ{m}x{bits}``), ``"HNSW{M}"``; or ``"auto"``
    (:meth:`resolve`): exact ``Flat`` below :data:`AUTO_FLAT_BELOW` items, else
    ``IVF{n},PQ{m}`` with n ≈ 4·√N lists (a power of two; the usual FAISS guidance of
    4–16·√N, at the low end because every list must be trained from ``train_sample``
    vectors) and m = d/2 sub-quantizers of 8 bits, i.e. one byte per two dimensions, 8×
    smaller than f32. d/2 rather than d/4: on 200k clustered 64-d unit vectors, recall@1000
    vs exact at nprobe 64 was 0.833 for ``IVF2048,PQ32`` against 0.839 for ``IVF2048,Flat``
    but only 0.753 for ``PQ16`` — the coarser codes lose the items at the boundary, which
    L1 cannot get back.

    Knobs (``None`` = automatic, from k; an explicit ``search(nprobe=…)`` wins over both):
    ``nprobe`` defaults to enough lists to scan ``scan_factor`` · k vectors (at least
    ``min_nprobe``), since a list of N/n vectors can only hold so many of the top k;
    ``ef_search`` defaults to max(64, 2·k): the graph walk keeps ef candidates and returns
    the best k of them.

    ``train_sample`` caps the vectors k-means sees (a seeded sample, ``seed``);
    ``add_batch`` is the chunk size of ``add`` (one progress-bar tick each).
    """

    factory: str = "auto"
    nprobe: int | None = None
    ef_search: int | None = None
    scan_factor: float = 8.0
    min_nprobe: int = 8
    train_sample: int = 200_000
    add_batch: int = 65_536
    seed: int = 0

    def __post_init__(self) -> None:
        require(
            self.factory == "auto" or _FACTORY.match(self.factory) is not None,
            "index.factory",
            self.factory,
            'use "auto", "Flat", "IVF{n},Flat", "IVF{n},PQ{m}" or "HNSW{M}" (FAISS index_factory grammar, e.g. "IVF1024,PQ32")',
        )
        m = _FACTORY.match(self.factory)
        if m is not None:
            for group in ("ivf", "pq", "hnsw", "bits"):
                if m.group(group) is not None:
                    require(int(m.group(group)) > 0, "index.factory", self.factory, f"the {group.upper()} number must be positive")
            if m.group("bits") is not None:
                require(int(m.group("bits")) <= 16, "index.factory", self.factory, "use at most 16 bits per PQ code (8 is the fast path)")
        require(self.nprobe is None or self.nprobe >= 1, "index.nprobe", self.nprobe, "use >= 1 list, or leave unset for the automatic value")
        require(self.ef_search is None or self.ef_search >= 1, "index.ef_search", self.ef_search, "use >= 1, or leave unset for the automatic value")
        require(math.isfinite(self.scan_factor) and self.scan_factor > 0, "index.scan_factor", self.scan_factor, "use a positive multiple of k")
        require(self.min_nprobe >= 1, "index.min_nprobe", self.min_nprobe, "use >= 1 list")
        require(self.train_sample >= 1, "index.train_sample", self.train_sample, "use >= 1 training vector")
        require(self.add_batch >= 1, "index.add_batch", self.add_batch, "use >= 1 vector per chunk")

    def resolve(self, n: int, d: int) -> str:
        """The concrete factory string for ``n`` vectors of dim ``d`` ("auto" resolved)."""
        if self.factory != "auto":
            return self.factory
        if n < AUTO_FLAT_BELOW:
            return "Flat"
        lists = 1 << round(math.log2(4 * math.sqrt(n)))
        lists = min(lists, max(1, min(n, self.train_sample) // MIN_POINTS_PER_CENTROID))
        # m must divide d: the largest divisor of d that is at most d/2 (d/2 for even d).
        m = max(k for k in range(1, max(1, d // 2) + 1) if d % k == 0)
        return f"IVF{lists},PQ{m}"


def valid_mask(ids: np.ndarray) -> np.ndarray:
    """``[B, k]`` bool: True where ``ids`` holds a real item, False at FAISS's -1 padding."""
    return np.asarray(ids) >= 0


def open_item_vectors(models_dir: Path | str) -> tuple[np.ndarray, str]:
    """The export's ``[N, d]`` f32 unit item vectors (memory-mapped) and their model_version.

    Reads MODELS/index/item_vectors.npy and MODELS/index/manifest.json directly (the cascade
    does not import ``ranker``); refuses a manifest whose rows/dim disagree with the array.
    """
    root = Path(models_dir) / "index"
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise FailedPrecondition(f"models dir {str(models_dir)!r} has no index/{MANIFEST}: export it with `recserve train --out`")
    manifest = json.loads(manifest_path.read_text())
    vectors = np.load(root / "item_vectors.npy", mmap_mode="r")
    if vectors.ndim != 2 or vectors.dtype != np.float32:
        raise FailedPrecondition(f"{root / 'item_vectors.npy'} is {vectors.dtype} {list(vectors.shape)}; expected float32 [N, d]")
    rows, dim = int(manifest.get("rows", -1)), int(manifest.get("dim", -1))
    if (rows, dim) != tuple(vectors.shape):
        raise FailedPrecondition(f"{manifest_path} says rows={rows:,} dim={dim}, but item_vectors.npy is {list(vectors.shape)}: the export is mixed; re-export it")
    return vectors, str(manifest["model_version"])


class _ReadWriteLock:
    """Many readers or one writer; a waiting writer blocks new readers (no starvation
    under steady search traffic)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


def _as_vectors(vectors: np.ndarray, d: int | None, field: str) -> np.ndarray:
    v = np.asarray(vectors)
    if v.ndim != 2 or (d is not None and v.shape[1] != d):
        want = f"[n, {d}]" if d is not None else "[n, d]"
        raise InvalidArgument(f"{field} has shape {list(v.shape)}; expected {want}")
    if not np.issubdtype(v.dtype, np.floating):
        raise InvalidArgument(f"{field} has dtype {v.dtype}; expected float32")
    return np.ascontiguousarray(v, dtype=np.float32)


def _as_ids(ids: np.ndarray, n: int, field: str) -> np.ndarray:
    a = np.asarray(ids)
    if a.ndim != 1 or a.shape[0] != n:
        raise InvalidArgument(f"{field} has shape {list(a.shape)}; expected [{n:,}] (one id per vector)")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise InvalidArgument(f"{field} has dtype {a.dtype}; expected int64")
    a = np.ascontiguousarray(a, dtype=np.int64)
    if a.size and int(a.min()) < 0:
        # -1 is FAISS's "nothing found"; a real id there would be dropped as padding.
        raise InvalidArgument(f"{field} holds {int(a.min()):,}; ids must be >= 0 (-1 is FAISS's padding)")
    return a


def _duplicates(ids: np.ndarray) -> np.ndarray:
    """The ids occurring more than once in ``ids`` (sorted, unique)."""
    s = np.sort(ids)
    return np.unique(s[1:][s[1:] == s[:-1]])


class RetrievalIndex:
    """A FAISS index of item vectors by inner product, with ids and versions.

    ``search`` returns FAISS's answer as is: ``ids`` int64 ``[B, k]`` best first, -1 where
    fewer than k were found (k > ntotal, or an IVF search whose probed lists hold fewer
    than k vectors); ``scores`` f32 ``[B, k]``, -inf at the padding (FAISS writes
    -FLT_MAX there). Callers drop the padding with :func:`valid_mask`.

    ``index_version`` is ``"<model_version>/<build id>.<adds>"``: a random build id per
    build (so a rebuild from the same vectors is a new version: the refresh test watches
    it change), and the number of :meth:`add` calls since that build. ``save``/``load``
    keep it.

    Built by :func:`build_index` or :meth:`load`; not constructed directly.
    """

    def __init__(self, index: Any, sub_index: Any, ids_sorted: np.ndarray, *, factory: str, model_version: str, build_id: str, adds: int, config: IndexConfig) -> None:
        self._index = index
        self._sub = sub_index  # the wrapped index under IndexIDMap2 (kept alive here)
        self._ids_sorted = ids_sorted  # every id in the index, for the duplicate check
        self._factory = factory
        self._model_version = model_version
        self._build_id = build_id
        self._adds = adds
        self._config = config
        self._lock = _ReadWriteLock()
        ivf = faiss.try_extract_index_ivf(index)
        self._nlist = int(ivf.nlist) if ivf is not None else 0
        self._knob = SearchKnob.NPROBE if ivf is not None else SearchKnob.EF_SEARCH if isinstance(sub_index, faiss.IndexHNSW) else SearchKnob.NONE

    # --- what it is ---------------------------------------------------------------
    @property
    def ntotal(self) -> int:
        return int(self._index.ntotal)

    @property
    def d(self) -> int:
        return int(self._index.d)

    @property
    def factory(self) -> str:
        return self._factory

    @property
    def model_version(self) -> str:
        return self._model_version

    @property
    def index_version(self) -> str:
        return f"{self._model_version}/{self._build_id}.{self._adds}"

    @property
    def config(self) -> IndexConfig:
        return self._config

    @property
    def knob(self) -> SearchKnob:
        return self._knob

    @property
    def nlist(self) -> int:
        """IVF inverted lists (the largest useful nprobe); 0 for other types."""
        return self._nlist

    # --- search -------------------------------------------------------------------
    def default_knob(self, k: int) -> int:
        """The knob value used when a search gives none (see :class:`IndexConfig`); 0 for Flat."""
        c = self._config
        if self._knob is SearchKnob.NPROBE:
            if c.nprobe is not None:
                return min(c.nprobe, self._nlist)
            per_list = max(1.0, self.ntotal / self._nlist)
            return min(self._nlist, max(c.min_nprobe, math.ceil(c.scan_factor * k / per_list)))
        if self._knob is SearchKnob.EF_SEARCH:
            return c.ef_search if c.ef_search is not None else max(64, 2 * k)
        return 0

    def _params(self, k: int, nprobe: int | None, ef_search: int | None) -> Any:
        for name, value in (("nprobe", nprobe), ("ef_search", ef_search)):
            if value is not None and value < 1:
                raise InvalidArgument(f"{name} = {value} is invalid: use >= 1")
        if self._knob is SearchKnob.NPROBE:
            return _faiss.SearchParametersIVF(nprobe=min(nprobe, self._nlist) if nprobe is not None else self.default_knob(k))
        if self._knob is SearchKnob.EF_SEARCH:
            return _faiss.SearchParametersHNSW(efSearch=ef_search if ef_search is not None else self.default_knob(k))
        return None

    def search(self, queries: np.ndarray, k: int, *, nprobe: int | None = None, ef_search: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top ``k`` items per query by inner product.

        ``queries`` f32 ``[B, d]`` -> ``(ids int64 [B, k], scores f32 [B, k])``, best first,
        -1 / -inf padded (class docstring). ``nprobe`` applies to IVF types, ``ef_search``
        to HNSW; the other is ignored. Safe from any number of threads at once, and
        concurrently with :meth:`add`.
        """
        ids, scores, _ = self.search_versioned(queries, k, nprobe=nprobe, ef_search=ef_search)
        return ids, scores

    def search_versioned(self, queries: np.ndarray, k: int, *, nprobe: int | None = None, ef_search: int | None = None) -> tuple[np.ndarray, np.ndarray, str]:
        """:meth:`search`, plus the ``index_version`` that answered it (read under the
        same lock, so a concurrent :meth:`add` cannot make the two disagree)."""
        q = _as_vectors(queries, self.d, "queries")
        if k < 0:
            raise InvalidArgument(f"k = {k} is invalid: use k >= 0")
        if k == 0 or q.shape[0] == 0:
            with self._lock.read():
                return np.empty((q.shape[0], k), np.int64), np.empty((q.shape[0], k), np.float32), self.index_version
        params = self._params(k, nprobe, ef_search)
        with self._lock.read():
            if params is None:
                scores, ids = self._index.search(q, k)
            else:
                scores, ids = self._index.search(q, k, params=params)
            version = self.index_version
        scores[ids < 0] = -np.inf
        return ids, scores, version

    # --- mutation -----------------------------------------------------------------
    def add(self, ids: np.ndarray, vectors: np.ndarray) -> str:
        """Add new items: ``ids`` int64 ``[n]`` (>= 0, not yet in the index), ``vectors`` f32
        ``[n, d]`` unit rows. Retrievable by the next search, no retraining (IVF assigns
        them to their nearest trained list; PQ encodes them with the trained codebooks).
        Returns the new ``index_version``. Raises InvalidArgument for a bad shape, a
        negative id, or an id already present (this adds items; it does not update them).
        """
        v = _as_vectors(vectors, self.d, "vectors")
        new = _as_ids(ids, v.shape[0], "ids")
        dup = _duplicates(new)
        if dup.size:
            raise InvalidArgument(f"ids repeat {dup.size:,} id(s), e.g. {int(dup[0]):,}; give each new item once")
        new_sorted = np.sort(new)
        with self._lock.write():
            known = self._ids_sorted
            pos = np.searchsorted(known, new_sorted)
            present = known[np.minimum(pos, known.size - 1)] == new_sorted if known.size else np.zeros(new.size, bool)
            if present.any():
                raise InvalidArgument(f"ids holds {int(present.sum()):,} id(s) already in the index, e.g. {int(new_sorted[present][0]):,}; AddItems adds new items only")
            if new.size:
                self._index.add_with_ids(v, new)
                # Sorted new ids at their insertion points keep the array sorted, ties included.
                self._ids_sorted = np.insert(known, pos, new_sorted)
            self._adds += 1
            return self.index_version

    # --- persistence --------------------------------------------------------------
    def save(self, directory: Path | str) -> Path:
        """Write ``index.faiss``, ``ids.npy`` and ``manifest.json`` into ``directory``.

        Each file goes to a temporary name and is renamed into place; the old manifest is
        removed first and the new one written last, so a directory with a manifest always
        holds the files it describes (a crash leaves no manifest, which :meth:`load`
        refuses). Returns the directory.
        """
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / MANIFEST).unlink(missing_ok=True)
        with self._lock.read():  # a consistent snapshot: no add between the files
            tmp = out / (INDEX_FILE + ".tmp")
            faiss.write_index(self._index, str(tmp))
            os.replace(tmp, out / INDEX_FILE)
            tmp_ids = out / (IDS_FILE + ".tmp")
            with open(tmp_ids, "wb") as f:
                np.save(f, self._ids_sorted, allow_pickle=False)
            os.replace(tmp_ids, out / IDS_FILE)
            manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "model_version": self._model_version,
                "index_version": self.index_version,
                "build_id": self._build_id,
                "adds": self._adds,
                "factory": self._factory,
                "d": self.d,
                "ntotal": self.ntotal,
                "metric": "inner_product",
                "params": dataclasses.asdict(self._config),
            }
        tmp_manifest = out / (MANIFEST + ".tmp")
        tmp_manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        os.replace(tmp_manifest, out / MANIFEST)
        return out

    @classmethod
    def load(cls, directory: Path | str, *, dim: int | None = None, model_version: str | None = None) -> RetrievalIndex:
        """Read an index written by :meth:`save`.

        Raises FailedPrecondition when there is no manifest, when the manifest disagrees
        with the FAISS file (d, ntotal) or the ids, or when ``dim`` / ``model_version``
        (the serving export's vector dim and version) are given and differ from it.
        """
        root = Path(directory)
        manifest_path = root / MANIFEST
        try:
            present = manifest_path.is_file()
        except OSError as exc:  # a name no filesystem holds (ENAMETOOLONG): Admin.RefreshIndex passes the caller's index_path here
            raise InvalidArgument(f"index_path {str(root)[:80]!r}{'...' if len(str(root)) > 80 else ''} ({len(str(root)):,} characters) is not a usable path: {exc.strerror}") from exc
        if not present:
            raise FailedPrecondition(f"index dir {str(root)!r} has no {MANIFEST}: not a saved index (or its save did not finish)")
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != FORMAT:
            raise FailedPrecondition(f"{manifest_path} has format {manifest.get('format')!r}; expected {FORMAT!r}")
        d = int(manifest["d"])
        if dim is not None and dim != d:
            raise FailedPrecondition(f"index at {str(root)!r} has d = {d}, but the serving item vectors have d = {dim}: rebuild the index from this export")
        if model_version is not None and model_version != manifest["model_version"]:
            raise FailedPrecondition(f"index at {str(root)!r} was built for model_version {manifest['model_version']!r}; serving {model_version!r}: rebuild it")
        index = faiss.read_index(str(root / INDEX_FILE))
        if int(index.d) != d or int(index.ntotal) != int(manifest["ntotal"]):
            raise FailedPrecondition(f"{root / INDEX_FILE} has d = {index.d}, ntotal = {index.ntotal:,}; its manifest says d = {d}, ntotal = {int(manifest['ntotal']):,}: the directory is mixed")
        ids = np.load(root / IDS_FILE)
        if ids.shape != (index.ntotal,):
            raise FailedPrecondition(f"{root / IDS_FILE} holds {ids.shape[0]:,} ids for {index.ntotal:,} vectors: the directory is mixed")
        sub = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexIDMap2) else index
        fields = {f.name for f in dataclasses.fields(IndexConfig)}
        config = IndexConfig(**{k: v for k, v in manifest.get("params", {}).items() if k in fields})
        return cls(index, sub, ids.astype(np.int64), factory=str(manifest["factory"]), model_version=str(manifest["model_version"]), build_id=str(manifest["build_id"]), adds=int(manifest["adds"]), config=config)


def build_index(vectors: np.ndarray, ids: np.ndarray | None, config: IndexConfig, *, model_version: str = "", progress: bool = True, build_id: str | None = None) -> RetrievalIndex:
    """Build the L0 index over ``vectors`` f32 ``[N, d]`` (unit rows; may be a memmap).

    ``ids`` int64 ``[N]`` (>= 0, unique; ``None`` = row numbers 0..N-1) are what searches
    return. Trains (IVF, PQ) on a seeded sample of at most ``config.train_sample`` rows,
    then adds in chunks of ``config.add_batch`` with a tqdm bar on stderr (``progress``).
    Types that cannot store ids themselves (Flat, HNSW) are wrapped in ``IndexIDMap2``.
    ``build_id`` fixes the version's build part (default: random, see
    :class:`RetrievalIndex`). Raises ConfigError when the factory does not fit the data
    (PQ m not dividing d, fewer training vectors than lists or codes).
    """
    from tqdm import tqdm

    n = int(np.shape(vectors)[0]) if np.ndim(vectors) == 2 else -1
    if np.ndim(vectors) != 2 or n < 1:
        raise InvalidArgument(f"vectors has shape {list(np.shape(vectors))}; expected [N, d] with N >= 1")
    d = int(np.shape(vectors)[1])
    all_ids = np.arange(n, dtype=np.int64) if ids is None else _as_ids(ids, n, "ids")
    dup = _duplicates(all_ids)
    if dup.size:
        raise InvalidArgument(f"ids repeat {dup.size:,} id(s), e.g. {int(dup[0]):,}; give each item once")
    factory = config.resolve(n, d)
    m = _FACTORY.match(factory)
    assert m is not None  # IndexConfig validated the grammar, resolve() only emits valid strings
    sample = min(n, config.train_sample)
    if m.group("pq") is not None:
        require(d % int(m.group("pq")) == 0, "index.factory", factory, f"PQ{m.group('pq')} needs m dividing d = {d}; use one of {[k for k in range(1, d + 1) if d % k == 0]}")
        codes = 1 << int(m.group("bits") or 8)
        require(sample >= codes, "index.factory", factory, f"PQ codes of {int(m.group('bits') or 8)} bits train {codes} centroids from {sample:,} vectors; use more items or a smaller PQ{m.group('pq')}x<bits>")
    if m.group("ivf") is not None:
        require(sample >= int(m.group("ivf")), "index.factory", factory, f"IVF{m.group('ivf')} needs >= {m.group('ivf')} training vectors; there are {sample:,} (use fewer lists, e.g. IVF{max(1, sample // MIN_POINTS_PER_CENTROID)})")

    t0 = time.monotonic()
    inner: Any = faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
    ivf = faiss.try_extract_index_ivf(inner)
    if ivf is not None:
        ivf.cp.seed = config.seed
        pq = getattr(inner, "pq", None)
        if pq is not None:
            pq.cp.seed = config.seed
            # The factory's IVF-PQ also trains polysemous codes (for Hamming pre-filtering,
            # which L0 does not use): 5-20x the training time for nothing here.
            inner.do_polysemous_training = False
        index, sub = inner, inner
    else:
        # Flat / HNSW have no add_with_ids; IndexIDMap2 maps FAISS's row numbers to ids.
        index, sub = faiss.IndexIDMap2(inner), inner
    if not inner.is_trained:
        rng = np.random.default_rng(config.seed)
        rows = np.sort(rng.choice(n, size=sample, replace=False)) if sample < n else np.arange(n)
        train = np.ascontiguousarray(np.take(vectors, rows, axis=0), dtype=np.float32)
        log.info("training %s on %s of %s vectors (d=%d)", factory, f"{sample:,}", f"{n:,}", d)
        index.train(train)
    with tqdm(total=n, desc=f"index {factory}", unit="vec", file=sys.stderr, disable=not progress, leave=False) as bar:
        for start in range(0, n, config.add_batch):
            stop = min(n, start + config.add_batch)
            index.add_with_ids(np.ascontiguousarray(vectors[start:stop], dtype=np.float32), all_ids[start:stop])
            bar.update(stop - start)
    log.info("built %s over %s vectors in %.1f s", factory, f"{n:,}", time.monotonic() - t0)
    return RetrievalIndex(
        index, sub, np.sort(all_ids), factory=factory, model_version=model_version, build_id=build_id or secrets.token_hex(4), adds=0, config=config
    )


class IndexHolder:
    """The serving process's current :class:`RetrievalIndex`; a refresh swaps it.

    A request reads :attr:`current` once and searches that object to the end, so a swap
    (one reference assignment) never changes the index under a running search; the old
    index is freed when its last search drops the reference. Adds go to
    ``holder.current.add(...)`` (safe under concurrent searches, see the module docstring).
    """

    def __init__(self, index: RetrievalIndex) -> None:
        self._current = index
        self._swap_lock = threading.Lock()  # swaps are serialised so each returns the one it replaced

    @property
    def current(self) -> RetrievalIndex:
        return self._current

    def swap(self, new: RetrievalIndex) -> RetrievalIndex:
        """Make ``new`` current; returns the index it replaced."""
        with self._swap_lock:
            old, self._current = self._current, new
        return old


def search_knob_for_budget(budget_ms: float, *, cost_per_unit_ms: float, fixed_ms: float = 0.0, min_knob: int = 1, max_knob: int | None = None) -> int:
    """The largest nprobe / efSearch whose predicted search time fits ``budget_ms``.

    Search time is modelled as ``fixed_ms + knob · cost_per_unit_ms``: an IVF search
    scans nprobe lists of about N/nlist codes each, an HNSW walk visits about efSearch
    nodes, so both grow linearly in the knob; ``fixed_ms`` (quantizer search, result
    copy) and ``cost_per_unit_ms`` come from measured searches of the same batch size.
    Returns ``floor((budget_ms - fixed_ms) / cost_per_unit_ms)`` clamped to
    ``[min_knob, max_knob]``, or 0 when not even ``min_knob`` fits (the stage should
    skip or fall back). Pure: no clock, no index.

    >>> search_knob_for_budget(5.0, cost_per_unit_ms=0.1, fixed_ms=1.0, max_knob=1024)
    40
    """
    if not (math.isfinite(cost_per_unit_ms) and cost_per_unit_ms > 0):
        raise InvalidArgument(f"cost_per_unit_ms = {cost_per_unit_ms} is invalid: use a positive measured cost")
    if min_knob < 1 or (max_knob is not None and max_knob < min_knob):
        raise InvalidArgument(f"knob range [{min_knob}, {max_knob}] is invalid: use 1 <= min_knob <= max_knob")
    if math.isnan(budget_ms) or budget_ms <= 0:
        return 0
    if math.isinf(budget_ms):
        if max_knob is None:
            raise InvalidArgument("budget_ms = inf needs a max_knob (nlist for IVF, or an efSearch cap)")
        return max_knob
    knob = math.floor((budget_ms - fixed_ms) / cost_per_unit_ms + 1e-9)
    if knob < min_knob:
        return 0
    return min(knob, max_knob) if max_knob is not None else knob
