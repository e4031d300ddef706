"""The model's forward cost and the batching gain it allows (``recserve bench rank``).

A DLRM forward on ``B`` candidate pairs costs about ``fixed + per_candidate * B``: the
fixed part is what every forward pays whatever its size (Python and torch dispatch of
the dense arch, interaction and over arch, allocator work), the slope what each pair
adds (the matmuls' rows). :func:`measure_forward_cost` times
:meth:`ranker.models.dlrm.DlrmRanker.score_pooled` on random pooled blocks at several
batch sizes, in this process, and :func:`fit_line` fits the two numbers by least
squares on *relative* error (weights ``1 / t``), so the small batches that pin the
intercept count as much as the large ones that pin the slope.

:func:`batching_cap` turns them into the most batching can gain on the forward alone:
unbatched, every request of ``C`` candidates pays ``fixed + per_candidate * C``; in
batches of ``B`` requests it pays ``fixed / B + per_candidate * C``, so::

    cap = (fixed + per_candidate * C) / (fixed / B + per_candidate * C)

It is a cap on the forward's share only: lookups (which batching also deduplicates) and
per-request work (gRPC, validation, sorting) are outside it, so a measured knee ratio
can sit on either side of it.

Example::

    cost = measure_forward_cost(dlrm, sizes=(1, 64, 500, 2000), device="cpu")
    cost.fixed_ms, cost.per_candidate_us            # e.g. 0.21, 0.95
    batching_cap(cost, candidates=500, mean_batch_requests=6.0)   # e.g. 1.36
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from recserve.errors import InvalidArgument, require

if TYPE_CHECKING:
    from ranker.models.dlrm import DlrmRanker

CAP_FORMULA = "(fixed + per_candidate * C) / (fixed / B + per_candidate * C), B = mean requests per batched forward, C = candidates per request"


@dataclasses.dataclass(frozen=True)
class ForwardCost:
    """``fixed_ms + per_candidate_us * 1e-3 * B`` ms for a forward over ``B`` pairs on
    ``device``, fitted to ``times_ms[k]`` measured at ``batch_sizes[k]`` (median of the
    repeats); ``max_rel_error``: the worst relative miss of the fit over those points."""

    fixed_ms: float
    per_candidate_us: float
    device: str
    batch_sizes: tuple[int, ...]
    times_ms: tuple[float, ...]
    max_rel_error: float

    def predict_ms(self, pairs: float) -> float:
        return self.fixed_ms + self.per_candidate_us * 1e-3 * pairs

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "batch_sizes": list(self.batch_sizes), "times_ms": list(self.times_ms)}


def fit_line(sizes: Sequence[float], times_ms: Sequence[float]) -> tuple[float, float]:
    """``(fixed_ms, per_unit_ms)`` of ``t = fixed + per_unit * size`` by least squares
    on relative error (each row scaled by ``1 / t``). Needs two distinct sizes and
    positive times. Example: ``fit_line([1, 3], [2.0, 4.0])`` -> ``(1.0, 1.0)``."""
    x = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times_ms, dtype=np.float64)
    if x.shape != t.shape or x.ndim != 1:
        raise InvalidArgument(f"fit_line: {x.shape[0] if x.ndim else x} sizes and {t.shape[0] if t.ndim else t} times; give one time per size")
    require(np.unique(x).size >= 2, "fit_line.sizes", x.tolist(), "give at least two distinct sizes")
    require(bool(np.all(t > 0)), "fit_line.times_ms", t.tolist(), "give positive times")
    a = np.stack([np.ones_like(x), x], axis=1) / t[:, None]  # [K, 2], relative-error rows
    (fixed, slope), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return float(fixed), float(slope)


def batching_cap(cost: ForwardCost, *, candidates: int, mean_batch_requests: float) -> float:
    """The forward-only batching gain cap (module docstring): ``(f + s*C) / (f/B + s*C)``.
    A negative fitted ``fixed`` (noise around 0) counts as 0, i.e. cap 1."""
    require(candidates > 0, "batching_cap.candidates", candidates, "use a positive candidate count")
    require(mean_batch_requests >= 1, "batching_cap.mean_batch_requests", mean_batch_requests, "use a mean of at least 1 request per batch")
    fixed = max(cost.fixed_ms, 0.0)
    per_request = cost.per_candidate_us * 1e-3 * candidates
    return (fixed + per_request) / (fixed / mean_batch_requests + per_request)


def measure_forward_cost(model: DlrmRanker, *, sizes: Sequence[int], device: str = "cpu", repeats: int = 7, seed: int = 0) -> ForwardCost:
    """Time ``model.score_pooled`` on random ``dense [B, NUM_DENSE]`` and pooled
    ``[B, D]`` blocks per feature for each ``B`` in ``sizes`` (one warm-up, then the
    median of ``repeats``; CUDA timings synchronise before reading the clock)."""
    import torch

    from ranker.features import NUM_DENSE

    require(len(sizes) >= 2 and all(s > 0 for s in sizes), "forward_cost.sizes", list(sizes), "give at least two positive batch sizes")
    require(repeats >= 1, "forward_cost.repeats", repeats, "use at least one repeat")
    dev = torch.device(device)
    model = model.to(dev).eval()
    gen = torch.Generator().manual_seed(seed)
    d = model.config.embedding_dim
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    medians: list[float] = []
    with torch.no_grad():
        for b in sizes:
            dense = torch.rand((b, NUM_DENSE), generator=gen).to(dev)
            pooled = {name: torch.randn((b, d), generator=gen).to(dev) for name in model.feature_names}
            model.score_pooled(dense, pooled)  # warm-up: first-call allocations, kernel selection
            sync()
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                model.score_pooled(dense, pooled)
                sync()
                samples.append((time.perf_counter() - t0) * 1e3)
            medians.append(float(np.median(samples)))
    fixed, slope = fit_line(sizes, medians)
    predicted = fixed + slope * np.asarray(sizes, dtype=np.float64)
    rel = float(np.max(np.abs(predicted - medians) / np.asarray(medians)))
    return ForwardCost(fixed_ms=fixed, per_candidate_us=slope * 1e3, device=str(dev), batch_sizes=tuple(int(s) for s in sizes),
                       times_ms=tuple(medians), max_rel_error=rel)
