"""Per-stage budgets, the online stage cost model, and the stage plan (docs/architecture.md §8).

A synchronous state machine with no I/O; every method takes ``now_s`` (monotonic
seconds) from the caller. The stage runner does, per request::

    budget = RequestBudget.open(config, deadline_s, now_s)  # DEADLINE_EXCEEDED if past
    for stage in Stage:
        decision = planner.plan(budget, stage, n_in=len(candidates), now_s=clock())
        ... run the stage on the first decision.n_run candidates (best-scored first),
            bounded by decision.deadline_s; pass the rest through in their old order ...
        report = planner.finish(decision, elapsed_s, out_count, scored=..., reason=...)

**Budget rule.** When stage i starts with ``R = deadline - reply_margin - now`` left, its
budget is ``R * share[i] / sum(share[i:])``. If every stage used exactly its budget,
stage i would get ``share[i]`` of the whole; a stage that finishes early leaves more
``R`` to the later ones, which split it in their shares' proportions, and one that
overruns takes from them. No stage is planned past ``deadline - reply_margin``.

**Decision.** With the stage's cost model ``predict(n)`` (fit plus safety margin): RUN
when ``predict(n_in)`` fits the budget; SHRINK to the largest ``n' < n_in`` that fits
(the cost model inverted) when ``n' >= min_n``; otherwise SKIP, and the previous order
passes through. A budget under ``min_stage_ms`` is a SKIP without asking the model.

**Learning.** :meth:`StagePlanner.finish` feeds ``(n_run, elapsed)`` to the stage's
model when the run measured its cost (:meth:`StagePlanner.teaches`: not a failure
before the deadline, not a run that scored nothing). A model that overestimates
would skip its stage forever and never be corrected, so after ``probe_after_skips``
consecutive budget skips one request runs the stage on ``min_n`` candidates, still
bounded by its stage deadline.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping

import numpy as np

from cascade.report import DegradedReason, StageReport
from recserve.config import CascadeConfig
from recserve.errors import DeadlineExceeded, InvalidArgument, require


class Stage(enum.IntEnum):
    """The cascade's stages; the value indexes ``CascadeConfig.budget_shares``."""

    L0 = 0  # ANN retrieval (+ popular source)
    L1 = 1  # exact two-tower re-score
    L2 = 2  # DLRM over the Ranking service
    L3 = 3  # sequence reranker over the Ranking service


# ---------------------------------------------------------------------------- sizes


@dataclasses.dataclass(frozen=True)
class StageSizes:
    """How many candidates each stage outputs for one request (``l3`` is k)."""

    l0: int
    l1: int
    l2: int
    l3: int

    def out(self, stage: Stage) -> int:
        return (self.l0, self.l1, self.l2, self.l3)[stage]


def resolve_k(config: CascadeConfig, k: int, num_items: int) -> int:
    """The k a request gets: ``k = 0`` means ``l3_out`` (capped at the catalog). Raises
    InvalidArgument for k < 0, k > ``max_k`` or k > the catalog."""
    if k < 0:
        raise InvalidArgument(f"k = {k:,} is invalid: use 0 (the default, {config.l3_out}) or 1..{min(config.max_k, num_items):,}")
    if k > config.max_k:
        raise InvalidArgument(f"k = {k:,} is invalid: it exceeds cascade.max_k = {config.max_k:,}; ask for fewer items")
    if k > num_items:
        raise InvalidArgument(f"k = {k:,} is invalid: the catalog has {num_items:,} items; ask for at most that many")
    return k if k > 0 else min(config.l3_out, num_items)


def stage_sizes_for(config: CascadeConfig, num_items: int, k: int = 0) -> StageSizes:
    """Stage output sizes for a catalog of ``num_items`` and a request for ``k`` items.

    Table 28 scaled (see :class:`CascadeConfig`): L0 = ``l0_out`` or ``l0_fraction`` of
    the catalog, L1..L3 = ``l1_out``, ``l2_out``, k. Each stage keeps at least as many as
    the next one needs (a k above ``l2_out`` widens L2, and so on up) and none more than
    the catalog. E.g. Table 28's sizes (``l1_out`` 1,000) give 10,000 / 1,000 / 100 / 10 at
    1M items, 2,000 / 1,000 / 100 / 10 at 200k, and 500 / 500 / 100 / 10 at 500; the
    default ``l1_out`` of 2,000 gives 10,000 / 2,000 / 100 / 10 at 1M.
    """
    require(num_items > 0, "num_items", num_items, "index at least one item")
    k_eff = resolve_k(config, k, num_items)
    l2 = max(config.l2_out, k_eff)
    l1 = max(config.l1_out, l2)
    l0 = config.l0_out if config.l0_out > 0 else math.ceil(config.l0_fraction * num_items)
    l0 = max(l0, l1)
    return StageSizes(l0=min(l0, num_items), l1=min(l1, num_items), l2=min(l2, num_items), l3=k_eff)


# ---------------------------------------------------------------------------- cost model


class StageCostModel:
    """Online model of one stage's cost: ``seconds(n) = fixed + per_item * n``.

    **Fit.** Exponentially weighted least squares over measured ``(n, seconds)`` pairs:
    EWMAs (weight ``alpha``; ``1/count`` for the first ``1/alpha`` samples, so the first
    one is not averaged with zeros) of n, t, n² and n·t give the slope as cov(n, t) /
    var(n) and the fixed part as ``mean_t - slope * mean_n``, so the prediction at the
    usual n is the EWMA of its cost whatever the split. The slope is pulled toward the
    prior's (ridge ``ridge * mean_n²`` added to var and ``ridge * mean_n² * prior`` to
    cov): a stage that always sees the same n (L3 at 100) has no variance to split its
    cost by, yet must predict smaller n to shrink; with spread in n the data wins.
    (``recserve.scheduling.ServiceTimeEstimator`` fits the same line but, without
    spread, predicts the mean for every smaller n, so a shrink would never fit.) A
    negative fixed part from noise is refitted through the origin.

    **Cold.** Before ``min_samples`` measurements the prediction is at least the prior
    (conservative: a cold process shrinks rather than overruns).

    **Margin.** With ``quantile`` > 0, predictions are multiplied by ``1 + q``, q the
    quantile of the last ``window`` relative errors ``t / fit(n) - 1`` (measured before
    each update, so out of sample); a jittery stage plans with headroom, a steady one
    with none.
    """

    def __init__(
        self,
        fixed_prior_s: float,
        per_item_prior_s: float,
        *,
        alpha: float = 0.1,
        quantile: float = 0.9,
        min_samples: int = 3,
        window: int = 64,
        ridge: float = 1e-4,
    ) -> None:
        require(fixed_prior_s >= 0 and per_item_prior_s >= 0, "StageCostModel prior", (fixed_prior_s, per_item_prior_s), "use costs >= 0 s")
        require(0.0 < alpha <= 1.0, "StageCostModel.alpha", alpha, "use an EWMA weight in (0, 1]")
        require(quantile == 0.0 or 0.5 <= quantile < 1.0, "StageCostModel.quantile", quantile, "use 0 (no margin) or [0.5, 1)")
        require(window >= 2 and min_samples >= 0 and ridge >= 0, "StageCostModel window/min_samples/ridge", (window, min_samples, ridge), "use window >= 2, min_samples >= 0, ridge >= 0")
        self.fixed_prior_s = fixed_prior_s
        self.per_item_prior_s = per_item_prior_s
        self.alpha = alpha
        self.quantile = quantile
        self.min_samples = min_samples
        self.ridge = ridge
        self.count = 0
        self._mn = self._mt = self._mnn = self._mnt = 0.0
        self._fixed_s = fixed_prior_s
        self._per_item_s = per_item_prior_s
        self._errors = np.zeros(window, dtype=np.float64)  # ring of relative errors
        self._n_errors = 0
        self._margin = 0.0

    @classmethod
    def from_config(cls, config: CascadeConfig, stage: Stage) -> StageCostModel:
        return cls(
            config.cost_prior_fixed_ms[stage] / 1e3,
            config.cost_prior_per_item_us[stage] / 1e6,
            alpha=config.cost_alpha,
            quantile=config.cost_quantile,
        )

    @property
    def warm(self) -> bool:
        return self.count >= self.min_samples

    @property
    def fixed_s(self) -> float:
        """The fitted fixed part (the prior's before any measurement)."""
        return self._fixed_s

    @property
    def per_item_s(self) -> float:
        """The fitted cost per candidate (the prior's before any measurement)."""
        return self._per_item_s

    @property
    def margin(self) -> float:
        """The relative safety margin applied to predictions (0 without ``quantile``)."""
        return self._margin

    def fit(self, n: float) -> float:
        """The point estimate for ``n`` candidates, seconds (no margin, no prior floor)."""
        return self._fixed_s + self._per_item_s * n

    def predict(self, n: float) -> float:
        """The cost to plan with for ``n`` candidates, seconds: the fit times
        ``1 + margin``, and at least the prior while cold."""
        p = self.fit(n) * (1.0 + self._margin) if self.count else 0.0
        if not self.warm:
            p = max(p, self.fixed_prior_s + self.per_item_prior_s * n)
        return p

    def max_fit(self, budget_s: float) -> float:
        """The largest n with ``predict(n) <= budget_s``: ``math.inf`` when cost does
        not grow with n and the fixed part fits, negative when not even n = 0 fits."""
        lines = [(self._fixed_s * (1.0 + self._margin), self._per_item_s * (1.0 + self._margin))] if self.count else []
        if not self.warm:
            lines.append((self.fixed_prior_s, self.per_item_prior_s))
        best = math.inf
        for fixed, slope in lines:  # at most 2 lines: the fit and the cold prior
            if budget_s < fixed:
                return -1.0
            if slope > 0:
                best = min(best, (budget_s - fixed) / slope)
        return best

    def observe(self, n: float, seconds: float) -> None:
        """Record that the stage took ``seconds`` on ``n`` candidates."""
        if self.count and self.quantile > 0:
            # Out-of-sample error of the current fit; the floor keeps a ~0 s fit from
            # turning one slow call into an unbounded ratio.
            self._errors[self._n_errors % self._errors.size] = seconds / max(self.fit(n), 1e-5) - 1.0
            self._n_errors += 1
            filled = self._errors[: min(self._n_errors, self._errors.size)]
            self._margin = max(0.0, float(np.quantile(filled, self.quantile))) if filled.size >= 2 else 0.0
        self.count += 1
        a = max(self.alpha, 1.0 / self.count)
        self._mn += a * (n - self._mn)
        self._mt += a * (seconds - self._mt)
        self._mnn += a * (n * n - self._mnn)
        self._mnt += a * (n * seconds - self._mnt)
        var = max(self._mnn - self._mn * self._mn, 0.0)
        cov = self._mnt - self._mn * self._mt
        lam = self.ridge * (self._mn * self._mn + 1.0)
        slope = (cov + lam * self.per_item_prior_s) / (var + lam) if var + lam > 0 else self.per_item_prior_s
        slope = max(slope, 0.0)
        fixed = self._mt - slope * self._mn
        if fixed < 0.0:
            fixed, slope = 0.0, (self._mt / self._mn if self._mn > 0 else 0.0)
        self._fixed_s, self._per_item_s = fixed, slope


# ---------------------------------------------------------------------------- plan


class DecisionKind(enum.Enum):
    RUN = "run"  # score all n_in candidates
    SHRINK = "shrink"  # score the best-scored n_run < n_in; the rest keep their order after them
    SKIP = "skip"  # score nothing; the previous order passes through


@dataclasses.dataclass(frozen=True)
class StageDecision:
    """The plan for one stage of one request."""

    stage: Stage
    kind: DecisionKind
    n_in: int  # candidates entering the stage
    n_run: int  # candidates to score (n_in for RUN, 0 for SKIP)
    budget_s: float  # this stage's budget
    deadline_s: float  # monotonic: bound the stage's work (RPC deadline) by this
    predicted_s: float  # the cost model's prediction for n_run (0 for SKIP)
    probe: bool = False  # a SHRINK run past the prediction so a stale model can recover

    @property
    def budget_ms(self) -> float:
        return self.budget_s * 1e3

    @property
    def reason(self) -> DegradedReason:
        if self.kind is DecisionKind.SKIP:
            return DegradedReason.SKIPPED_BUDGET
        return DegradedReason.SHRUNK_INPUT if self.kind is DecisionKind.SHRINK else DegradedReason.NONE


@dataclasses.dataclass(frozen=True)
class RequestBudget:
    """One request's time: its effective deadline and the reply margin before it."""

    deadline_s: float  # monotonic effective deadline
    reply_by_s: float  # deadline_s - reply margin: no stage is planned past this
    started_s: float

    @classmethod
    def open(cls, config: CascadeConfig, deadline_s: float, now_s: float) -> RequestBudget:
        """Start a request at ``now_s`` with the effective deadline (``math.inf`` = none:
        ``default_deadline_ms`` applies). A deadline already past is DEADLINE_EXCEEDED,
        before any stage runs; one inside the reply margin opens with no time for stages
        (every stage skips, so a fallback answer can still go out)."""
        if math.isinf(deadline_s):
            deadline_s = now_s + config.default_deadline_ms / 1e3
        if deadline_s <= now_s:
            raise DeadlineExceeded(f"the request's deadline passed {(now_s - deadline_s) * 1e3:.1f} ms before the cascade started; no stage ran")
        return cls(deadline_s=deadline_s, reply_by_s=deadline_s - config.reply_margin_ms / 1e3, started_s=now_s)

    def remaining_s(self, now_s: float) -> float:
        """Time left for stages at ``now_s`` (>= 0)."""
        return max(0.0, self.reply_by_s - now_s)


def stage_budget_s(shares: tuple[float, ...], stage: Stage, remaining_s: float) -> float:
    """Stage ``stage``'s budget out of ``remaining_s``: its share of the shares still to
    come (see the module docstring). Later stages all at share 0 leave it the rest."""
    tail = sum(shares[stage:])
    if tail <= 0:
        return 0.0
    return max(0.0, remaining_s) * shares[stage] / tail


def plan_stage(
    model: StageCostModel,
    stage: Stage,
    n_in: int,
    budget_s: float,
    now_s: float,
    *,
    min_n: int = 1,
    min_stage_s: float = 0.0,
    probe: bool = False,
) -> StageDecision:
    """RUN, SHRINK or SKIP ``stage`` on ``n_in`` candidates within ``budget_s``.

    ``min_n``: the fewest candidates worth scoring (a smaller fit is a SKIP). ``probe``:
    instead of a SKIP the model called for, run ``min_n`` candidates anyway (bounded by
    the stage deadline) so that a stale estimate gets a fresh measurement.
    """
    deadline_s = now_s + budget_s

    def decide(kind: DecisionKind, n_run: int, is_probe: bool = False) -> StageDecision:
        predicted = model.predict(n_run) if n_run > 0 else 0.0
        return StageDecision(stage, kind, n_in, n_run, budget_s, deadline_s, predicted, is_probe)

    if n_in <= 0:
        return decide(DecisionKind.RUN, 0)  # nothing to score: nothing missed either
    if budget_s <= 0.0 or budget_s < min_stage_s:
        return decide(DecisionKind.SKIP, 0)
    fits = model.max_fit(budget_s)
    if fits >= n_in:
        return decide(DecisionKind.RUN, n_in)
    n_fit = int(fits)
    # Float rounding in the inversion can land one off the boundary: settle it on
    # predict() itself, so "fits" means exactly predict(n) <= budget.
    if n_fit + 1 <= n_in and model.predict(n_fit + 1) <= budget_s:
        n_fit += 1
    elif n_fit > 0 and model.predict(n_fit) > budget_s:
        n_fit -= 1
    if n_fit >= n_in:
        return decide(DecisionKind.RUN, n_in)
    floor_n = min(max(min_n, 1), n_in)
    if n_fit >= floor_n:
        return decide(DecisionKind.SHRINK, n_fit)
    if probe:
        return decide(DecisionKind.SHRINK, floor_n, True) if floor_n < n_in else decide(DecisionKind.RUN, n_in, True)
    return decide(DecisionKind.SKIP, 0)


class StagePlanner:
    """Plans every stage of every request from one cost model per stage (shared by all
    requests of the process), and learns from what each stage measured.

    ``models`` are injectable (tests pass primed ones); by default each is built from
    ``config``'s priors. Not thread-safe: call it from the event loop.
    """

    def __init__(self, config: CascadeConfig, models: Mapping[Stage, StageCostModel] | None = None) -> None:
        self.config = config
        self.models: dict[Stage, StageCostModel] = {s: StageCostModel.from_config(config, s) for s in Stage}
        if models:
            self.models.update(models)
        # Consecutive budget skips the model called for, per stage (see probe_after_skips).
        self._skips = dict.fromkeys(Stage, 0)

    def open(self, deadline_s: float, now_s: float) -> RequestBudget:
        return RequestBudget.open(self.config, deadline_s, now_s)

    def full_service_s(self, sizes: StageSizes) -> float:
        """Seconds of budget (before the reply margin) that one call needs for every
        stage to run whole: stage i gets ``share[i] / sum(share[i:])`` of what remains,
        so with each earlier stage taking its predicted cost, that is the smallest
        total for which each stage's fitted cost fits its share. The door admits a
        queued call only with this much left after its wait: a call admitted with less
        answers degraded, and degraded calls are short, so the door's own measured
        call time would talk it into admitting more of them (bench faults, 3x burst)."""
        shares = self.config.budget_shares
        sizes_in = (sizes.l0, sizes.l0, sizes.l1, sizes.l2)  # candidates each stage takes in
        need, spent = 0.0, 0.0
        for stage in Stage:
            rest = sum(shares[stage:])
            # The point estimate (the fit, the prior before any measurement), not the
            # planner's margin-padded prediction: this admits calls expected to run whole,
            # and padding every stage's tail sheds ~1-2 % of calls at 70 % of the knee.
            cost = self.models[stage].fit(sizes_in[stage])
            if shares[stage] > 0:
                need = max(need, spent + cost * rest / shares[stage])
            spent += cost
        return max(need, spent)

    def plan(self, budget: RequestBudget, stage: Stage, n_in: int, now_s: float, *, min_n: int = 1) -> StageDecision:
        """The decision for ``stage`` on ``n_in`` candidates, starting at ``now_s``."""
        stage_s = stage_budget_s(self.config.budget_shares, stage, budget.remaining_s(now_s))
        after = self.config.probe_after_skips
        probe = after > 0 and self._skips[stage] >= after
        decision = plan_stage(
            self.models[stage], stage, n_in, stage_s, now_s, min_n=min_n, min_stage_s=self.config.min_stage_ms / 1e3, probe=probe
        )
        # Only a skip the model called for counts toward a probe: a budget under
        # min_stage_ms says nothing about whether the model is stale.
        if decision.kind is DecisionKind.SKIP and stage_s >= self.config.min_stage_ms / 1e3 and stage_s > 0:
            self._skips[stage] += 1
        return decision

    def observe(self, decision: StageDecision, elapsed_s: float) -> None:
        """Feed the stage's measured cost for ``decision.n_run`` candidates back into
        its model (a SKIP or an empty run teaches nothing)."""
        if decision.n_run > 0:
            self.models[decision.stage].observe(decision.n_run, elapsed_s)

    @staticmethod
    def teaches(decision: StageDecision, elapsed_s: float, scored: int, reason: DegradedReason) -> bool:
        """Whether a finished stage's elapsed time measures its cost for ``n_run``.

        A TIMEOUT measures it only when the stage was cut off at its deadline (then the
        elapsed time is a lower bound, which errs on the safe side); a failure before it
        (a refused connection, an open breaker) says nothing about cost, and learning
        from it would make the stage look cheap. Otherwise a stage that scored something,
        or ran but found its lookups missing, measured its cost; one that scored nothing
        (no user vector to search with) did not.
        """
        if decision.n_run <= 0:
            return False
        if reason is DegradedReason.TIMEOUT:
            return elapsed_s >= 0.9 * decision.budget_s
        return scored > 0 or reason is DegradedReason.LOOKUP_MISSING

    def finish(
        self,
        decision: StageDecision,
        elapsed_s: float,
        out_count: int,
        *,
        scored: int | None = None,
        reason: DegradedReason = DegradedReason.NONE,
        intended: int | None = None,
        observe: bool | None = None,
    ) -> StageReport:
        """Build the stage's report and learn from its cost.

        ``scored`` defaults to ``n_run`` (pass fewer when lookups missed); ``intended`` to
        ``n_in``. ``reason`` is what the runner saw (TIMEOUT, LOOKUP_MISSING,
        COLD_START); it wins over the plan's SHRUNK_INPUT / SKIPPED_BUDGET because it names
        a fault, while the coverage still shows the shrink. ``observe`` (default: the
        rule of :meth:`teaches`) says whether ``elapsed_s`` goes into the cost model.
        """
        n_scored = decision.n_run if scored is None else scored
        learn = self.teaches(decision, elapsed_s, n_scored, reason) if observe is None else observe
        if learn:
            self.observe(decision, elapsed_s)
        if decision.n_run > 0:
            # It ran (a probe included): counting skips toward the next probe starts over,
            # even when the run taught nothing (then the next probe is another
            # probe_after_skips skips away, not the next request).
            self._skips[decision.stage] = 0
        return StageReport(
            stage=decision.stage.name,
            budget_ms=decision.budget_ms,
            elapsed_ms=elapsed_s * 1e3,
            in_count=decision.n_in,
            out_count=out_count,
            intended=decision.n_in if intended is None else intended,
            scored=n_scored,
            degraded_reason=reason if reason is not DegradedReason.NONE else decision.reason,
        )
