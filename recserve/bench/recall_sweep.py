"""L0's recall against its latency, over the index's search knob (``recserve bench recall``).

Every point searches the same user vectors one at a time (batch 1, one FAISS thread: what
the cascade process does per request) for the top ``k0`` items and measures recall@k0
against FAISS ``IndexFlatIP`` over the same vectors (exact inner product, the oracle),
plus the per-query search time. The ``exact`` row times ``IndexFlatIP`` itself.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import faiss
import numpy as np

from cascade.index import RetrievalIndex, SearchKnob
from recserve.bench.recall_oracles import overlap_fraction

DEFAULT_KNOBS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    knob: str  # "nprobe", "efSearch" or "exact"
    value: int  # the knob's value (0 for exact / Flat)
    recall: float  # mean recall@k0 against IndexFlatIP
    ms_p50: float  # per-query search time, batch 1, one thread
    ms_p99: float
    default: bool  # the value the cascade searches with by default


def exact_top_k(vectors: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(``[B, k]`` int64 exact inner-product top-k ids of ``queries`` ``[B, d]`` over
    ``vectors`` ``[N, d]``, from IndexFlatIP; ``[B]`` seconds per single-query search)."""
    flat = faiss.IndexFlatIP(int(vectors.shape[1]))
    flat.add(np.ascontiguousarray(vectors, dtype=np.float32))
    _, ids = flat.search(np.ascontiguousarray(queries, dtype=np.float32), k)
    seconds = np.empty(queries.shape[0])
    for i in range(queries.shape[0]):  # one timed search per benchmark query
        t0 = time.perf_counter()
        flat.search(queries[i : i + 1], k)
        seconds[i] = time.perf_counter() - t0
    return ids.astype(np.int64), seconds


def sweep(index: RetrievalIndex, queries: np.ndarray, exact: np.ndarray, exact_s: np.ndarray, k0: int, knobs: Sequence[int] = DEFAULT_KNOBS) -> list[SweepPoint]:
    """Recall@k0 and latency of ``index`` at each knob value (IVF: values above nlist are
    dropped; HNSW: values below k0 are raised to k0; Flat: the one default point), plus
    the ``exact`` row. ``queries`` f32 ``[B, d]``; ``exact`` ``[B, k0]`` from
    :func:`exact_top_k`."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    default = index.default_knob(k0)
    if index.knob is SearchKnob.NPROBE:
        values = sorted({v for v in knobs if v <= index.nlist} | {default})
    elif index.knob is SearchKnob.EF_SEARCH:
        values = sorted({max(v, k0) for v in knobs} | {default})
    else:
        values = [0]
    points = []
    for v in values:  # a handful of knob values
        kw = {"nprobe": v} if index.knob is SearchKnob.NPROBE else {"ef_search": v} if index.knob is SearchKnob.EF_SEARCH else {}
        ids, _ = index.search(q, k0, **kw)
        seconds = np.empty(q.shape[0])
        for i in range(q.shape[0]):  # one timed search per query, as served
            t0 = time.perf_counter()
            index.search(q[i : i + 1], k0, **kw)
            seconds[i] = time.perf_counter() - t0
        points.append(SweepPoint(index.knob.value, v, float(overlap_fraction(ids, exact).mean()), *_p50_p99(seconds), default=v == default))
    points.append(SweepPoint("exact", 0, 1.0, *_p50_p99(exact_s), default=False))
    return points


def _p50_p99(seconds: np.ndarray) -> tuple[float, float]:
    return float(np.percentile(seconds, 50) * 1e3), float(np.percentile(seconds, 99) * 1e3)


def plot_sweep(path: str | Path, points: Sequence[SweepPoint], *, title: str, k0: int) -> None:
    """PNG of recall@k0 against p50 search time, one point per knob value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), constrained_layout=True)
    curve = [p for p in points if p.knob != "exact"]
    ax.plot([p.ms_p50 for p in curve], [p.recall for p in curve], marker="o", label=f"index ({curve[0].knob if curve else ''})")
    for p in curve:
        ax.annotate(f"{p.value}" + (" (default)" if p.default else ""), (p.ms_p50, p.recall), fontsize="x-small", xytext=(3, -10), textcoords="offset points")
    for p in points:
        if p.knob == "exact":
            ax.scatter([p.ms_p50], [p.recall], marker="*", s=120, color="black", label="IndexFlatIP (exact)", zorder=3)
    ax.axhline(0.95, color="grey", linestyle="--", linewidth=1, label="goal 0.95")
    ax.set_xscale("log")
    ax.set_xlabel("L0 search time per query, p50 (ms, batch 1, 1 thread)")
    ax.set_ylabel(f"recall@{k0:,} vs exact")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")
    ax.set_title(title, fontsize="medium")
    fig.savefig(path, dpi=110)
    plt.close(fig)
