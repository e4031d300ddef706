"""What one cascade stage did, and what a response says about all of them.

A :class:`StageReport` is filled by the stage runner after each stage (planned by
:mod:`cascade.budget`) and goes onto the wire as ``recserve.v1.StageReport``
(:func:`to_proto`). :func:`summarize` turns a request's reports into the response's
``coverage``, ``degraded`` and ``degraded_reason`` (docs/architecture.md §8).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from recserve.errors import InternalError
from recserve.v1 import recommender_pb2


class DegradedReason(str, enum.Enum):
    """Why a stage (or a response) did less than intended. The value is the wire string."""

    NONE = ""
    SHRUNK_INPUT = "shrunk_input"  # the budget fitted only the best-scored part of the input
    SKIPPED_BUDGET = "skipped_budget"  # nothing fitted: the previous order passed through
    LOOKUP_MISSING = "lookup_missing"  # some candidates were scored on default / cached rows
    TIMEOUT = "timeout"  # the stage ran past its budget and its answer was dropped or cut
    COLD_START = "cold_start"  # a user the models have never seen: default row / popular items


@dataclasses.dataclass(frozen=True)
class StageReport:
    """One stage of one request.

    ``intended`` is how many candidates the stage should have scored (its whole input for
    L1-L3; for L0, the number of candidates it was asked to retrieve); ``scored`` how many
    it scored with real features (not shrunk away, skipped, or on missed lookups).
    ``in_count`` / ``out_count`` are the candidates entering and leaving the stage (a
    skipped stage passes its input through, so out may equal in).
    """

    stage: str  # "L0".."L3"
    budget_ms: float
    elapsed_ms: float
    in_count: int
    out_count: int
    intended: int
    scored: int
    degraded_reason: DegradedReason = DegradedReason.NONE

    def __post_init__(self) -> None:
        # A report is built by our own stage runner: a bad one is a bug, not bad input.
        if not 0 <= self.scored <= max(self.intended, 0):
            raise InternalError(f"stage {self.stage}: scored = {self.scored} is outside 0..intended ({self.intended})")
        if self.in_count < 0 or self.out_count < 0:
            raise InternalError(f"stage {self.stage}: in_count = {self.in_count}, out_count = {self.out_count}; counts must be >= 0")

    @property
    def degraded(self) -> bool:
        return self.degraded_reason is not DegradedReason.NONE

    @property
    def coverage(self) -> float:
        """``scored / intended`` in [0, 1]; 1.0 when nothing was intended (nothing missed)."""
        return self.scored / self.intended if self.intended > 0 else 1.0

    def to_proto(self) -> recommender_pb2.StageReport:
        """The wire form of this report."""
        return recommender_pb2.StageReport(
            stage=self.stage,
            budget_ms=self.budget_ms,
            elapsed_ms=self.elapsed_ms,
            in_count=self.in_count,
            out_count=self.out_count,
            degraded=self.degraded,
            degraded_reason=self.degraded_reason.value,
            coverage=self.coverage,
        )


def to_proto(report: StageReport) -> recommender_pb2.StageReport:
    """The wire form of one report (``report.to_proto()``)."""
    return report.to_proto()


def overall_coverage(reports: Sequence[StageReport], weights: Sequence[float] | None = None) -> float:
    """The response's coverage: the mean of the stages' coverages, weighted by
    ``weights`` (one per report; default equal).

    A mean, not a product or a minimum: each stage is one refinement step, so a skipped
    L3 after three full stages reads 0.75 (with equal weights), not 0 — the answer is
    still L2's ranking — while a lookup miss on half of L2's candidates reads 0.875.
    Pass the budget shares as weights to read it as "the fraction of the intended work
    done". No reports (nothing ran) is 0.0.
    """
    if not reports:
        return 0.0
    w = [1.0] * len(reports) if weights is None else [float(x) for x in weights]
    if len(w) != len(reports) or any(x < 0 for x in w):
        raise InternalError(f"overall_coverage: {len(w)} weights {w} for {len(reports)} reports; give one weight >= 0 per report")
    total = sum(w)
    if total <= 0:
        return 0.0
    return sum(x * r.coverage for x, r in zip(w, reports)) / total


@dataclasses.dataclass(frozen=True)
class ResponseSummary:
    """The response-level fields derived from a request's stage reports."""

    coverage: float
    degraded: bool
    degraded_reason: DegradedReason  # COLD_START, or the first degraded stage's reason


def summarize(reports: Sequence[StageReport], *, cold_start: bool = False, weights: Sequence[float] | None = None) -> ResponseSummary:
    """``coverage`` (:func:`overall_coverage`), ``degraded`` (cold start or any stage
    degraded) and ``degraded_reason`` ("cold_start" wins: it explains every stage after
    it; otherwise the first degraded stage's reason, in stage order)."""
    first = next((r.degraded_reason for r in reports if r.degraded), DegradedReason.NONE)
    reason = DegradedReason.COLD_START if cold_start else first
    return ResponseSummary(coverage=overall_coverage(reports, weights), degraded=reason is not DegradedReason.NONE, degraded_reason=reason)
